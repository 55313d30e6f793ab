"""Which GPU models a request may pick: its tier's menu, or every model of the fleet.

A mixed fleet (A100 + H100) is normal, and the model is what people reach for first
(KubeSpawner's profile menus, Open OnDemand's GRES widgets). A tier lists the models it
offers (``Tier.gpu_models``, set by an admin); one that lists none offers every model
reported by a host. "Any" (no pick) stays the default: the scheduler then takes whichever
of the tier's models has room.
"""

from __future__ import annotations

from portal.catalog.models import Tier
from portal.fleet.models import Gpu
from scheduler.gpus import MODELS


def fleet_models() -> list[str]:
    """The models the fleet's hosts report, sorted."""
    names = Gpu.objects.exclude(model="").values_list("model", flat=True).distinct()
    return sorted(set(names))


def offered_models(tier: Tier, fleet: list[str] | None = None) -> list[str]:
    """The models ``tier`` offers: its own list, else the fleet's (``fleet`` if read already).
    A CPU-only tier offers none."""
    if tier.cpu_only:
        return []
    if tier.gpu_models:
        return [str(name) for name in tier.gpu_models]
    return fleet_models() if fleet is None else fleet


def profile_refusal(tier: Tier, mig_profile: str) -> str | None:
    """Why ``mig_profile`` is not on ``tier``'s menu of MIG profiles, or None."""
    offered = [str(p) for p in tier.mig_profiles]
    if not offered or mig_profile in offered:
        return None
    return f"The tier {tier.name} offers MIG profiles {', '.join(offered)}."


def model_refusal(tier: Tier, model: str, mig_profile: str = "") -> str | None:
    """Why ``model`` cannot be asked for on ``tier`` (with ``mig_profile`` on a MIG tier),
    or None when it can."""
    if tier.cpu_only:
        return f"The tier {tier.name} runs on no GPU: leave the GPU model at any."
    offered = offered_models(tier)
    if model not in offered:
        menu = ", ".join(offered) if offered else "no GPU model yet (no host has reported one)"
        return f"The tier {tier.name} offers {menu}."
    known = MODELS.get(model)
    if mig_profile and known is not None and mig_profile not in {p.name for p in known.mig_profiles}:
        profiles = ", ".join(p.name for p in known.mig_profiles) or "none"
        return f"The {model} has no MIG profile {mig_profile}; its profiles: {profiles}."
    return None


def models_accepted(gpu_model: str, tier_models: list[str] | None) -> tuple[str, ...]:
    """The models a request accepts, as the scheduler reads them (() for any): the one it
    picked, else its tier's list (from a row's values: the queue reads no Tier)."""
    return (gpu_model,) if gpu_model else tuple(str(name) for name in tier_models or ())
