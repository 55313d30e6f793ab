#!/usr/bin/env python
"""Django's command-line utility for administrative tasks."""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "portal.settings")
    from wire.env import ConfigError

    try:
        from wire.config import ensure_embedded_redis

        ensure_embedded_redis()
        from django.core.management import execute_from_command_line

        execute_from_command_line(sys.argv)
    except ConfigError as exc:
        sys.stderr.write(f"gpushare: configuration error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
