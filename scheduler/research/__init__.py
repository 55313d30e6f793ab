"""The research harness: trace replays, the FGD paper's baselines, and every benchmark
with ``make bench``'s entry (``python -m scheduler.research.bench``).

Research imports the product (``scheduler``), never the reverse (``tests/test_architecture.py``).
"""
