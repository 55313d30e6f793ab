"""Pure-Python scheduling core: dataclasses in, decisions out. Imports nothing from Django or Celery."""
