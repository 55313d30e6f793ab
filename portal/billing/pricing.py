"""Pricing arithmetic, pure Python: the ledger and the host agents' running cost share it."""

from __future__ import annotations

MICROS_PER_UNIT = 1_000_000


def format_money(micros: int | None, currency: str) -> str:
    """An amount as bills show it: to the cent, thousands grouped ("1,234.56 EUR")."""
    return f"{(micros or 0) / MICROS_PER_UNIT:,.2f} {currency}"


def cost_micros(price_per_gpu_hour_micros: int, milli_gpu: int, duration_us: int) -> int:
    """price/GPU-h x share x duration, in integer micro-units, rounded half up.

    Integers throughout (no float), so the ledger, the running cost on the live charts and
    the agents' per-sample cost agree to the micro-unit. Arguments are never negative (a
    price is checked by the database, a duration clamped by the ledger), so "half up" is
    unambiguous. Each usage interval is rounded once, when it closes: a bill sums rounded
    intervals, each within half a micro-unit of its exact value.
    """
    numerator = price_per_gpu_hour_micros * milli_gpu * duration_us
    denominator = 1000 * 3600 * MICROS_PER_UNIT
    return (numerator + denominator // 2) // denominator
