"""``{% sharing_terms mode %}``: a sharing mode's terms (``portal.catalog.sharing``) on any
page, so that no template words them itself.

``replicas`` and ``gpu_memory_mib`` make a time-slice replica's figures concrete (the GPU
it is on); ``brief`` gives the one sentence alone, for a table cell."""

from __future__ import annotations

from typing import Any

from django import template

from portal.catalog.sharing import terms

register = template.Library()


@register.inclusion_tag("catalog/_sharing_terms.html")
def sharing_terms(
    mode: str, replicas: int | None = None, gpu_memory_mib: int | None = None, brief: bool = False
) -> dict[str, Any]:
    return {"terms": terms(mode, replicas or None, gpu_memory_mib or None), "brief": brief}
