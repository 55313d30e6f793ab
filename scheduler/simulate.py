"""``python -m scheduler.simulate``: replay an openb trace (see scheduler/research/replay.py)."""

from scheduler.research.replay import main

if __name__ == "__main__":
    main()
