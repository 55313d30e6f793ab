"""The MIG replay benchmark: deterministic for a seed, and its table says what it measured."""

from __future__ import annotations

from itertools import pairwise

from scheduler.research.bench_defrag import mig_replay_table, request_stream, run_mig_replay


def test_stream_is_seeded_and_ordered() -> None:
    stream = request_stream(200, gpus=4, load=0.9, mix={"1g.10gb": 1.0, "7g.80gb": 1.0}, seed=3)
    assert stream == request_stream(200, gpus=4, load=0.9, mix={"1g.10gb": 1.0, "7g.80gb": 1.0}, seed=3)
    assert all(a.arrival <= b.arrival for a, b in pairwise(stream))
    assert {r.profile for r in stream} == {"1g.10gb", "7g.80gb"}


def test_small_replay() -> None:
    figures = run_mig_replay(gpus=6, requests=400, load=1.1, seed=2)
    again = run_mig_replay(gpus=6, requests=400, load=1.1, seed=2)
    timing = "plan_ms_mean"
    assert {k: v for k, v in figures.items() if k != timing} == {
        k: v for k, v in again.items() if k != timing
    }
    assert 0 < figures["rejected_pct_plain"] <= 100
    assert 0 <= figures["rejected_pct_relayout"] <= 100
    assert figures["relayouts"] > 0 and figures["moves_per_admitted"] > 0
    table = mig_replay_table(figures)
    assert "| rejected with re-layout |" in table and "| 7g.80gb |" in table
