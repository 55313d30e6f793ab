"""A batch sandbox's output, kept for its owner: what the agents send (workers/host/batch_output.py)
stored as chunks, trimmed to the newest ``BATCH_OUTPUT_MAX_BYTES``, read back by the page, the
download and the API."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from django.conf import settings
from django.db import transaction
from django.db.models import Max, Min

from portal.sandboxes.models import OutputChunk, Sandbox

log = logging.getLogger(__name__)


@transaction.atomic
def do_store_output(allocation_key: str, start: int, data: bytes, total: int) -> int:
    """Keep a piece of output; returns the bytes stored. Idempotent: a redelivered piece, or
    one overlapping what is kept (an agent restarted and read again), adds only what is new.
    Lock: the sandbox row, so that two pieces of one sandbox trim in turn."""
    sandbox = Sandbox.objects.select_for_update().filter(allocation_key=allocation_key).first()
    if sandbox is None:  # an earlier attempt's last words, sent as it was stopped: kept as its own
        sandbox = Sandbox.objects.select_for_update().filter(attempts__allocation_key=allocation_key).first()
    if sandbox is None:
        log.info("output for unknown allocation %s dropped (the sandbox moved on)", allocation_key)
        return 0
    kept = OutputChunk.objects.filter(allocation_key=allocation_key)
    end = kept.aggregate(end=Max("end"))["end"] or 0
    if start < end:  # overlap: keep only the bytes beyond what is stored
        data, start = data[end - start :], end
    if data:
        OutputChunk.objects.create(
            sandbox=sandbox, allocation_key=allocation_key, start=start, end=start + len(data), data=data
        )
    newest = max(end, start + len(data), total)
    kept.filter(end__lte=newest - settings.BATCH_OUTPUT_MAX_BYTES).delete()
    return len(data)


@dataclass(frozen=True)
class OutputView:
    start: int  # offset of ``data``'s first byte
    end: int
    kept_from: int  # the oldest byte kept: everything before it is gone
    total: int  # everything the sandbox is known to have printed
    data: bytes
    missing: int  # bytes between ``start`` and ``end`` the host did not keep (gaps)

    @property
    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


def read_output(
    sandbox: Sandbox, offset: int | None = None, limit: int = 256 * 1024, allocation_key: str | None = None
) -> OutputView:
    """At most ``limit`` bytes of the sandbox's current allocation's output (or of the earlier
    attempt's ``allocation_key``): from ``offset`` on, or (None) its last ``limit`` bytes.
    Gaps the host dropped are left out, counted."""
    key = sandbox.allocation_key if allocation_key is None else allocation_key
    chunks = OutputChunk.objects.filter(sandbox=sandbox, allocation_key=key)
    bounds = chunks.aggregate(first=Min("start"), last=Max("end"))
    kept_from, total = bounds["first"] or 0, bounds["last"] or 0
    if offset is None:
        offset = max(kept_from, total - limit)
    wanted = chunks.filter(end__gt=offset).order_by("start")
    parts: list[bytes] = []
    begin = position = None
    missing = 0
    for chunk in wanted.iterator():
        piece = bytes(chunk.data)[max(0, offset - chunk.start) :]
        first = max(chunk.start, offset)
        if begin is None:
            begin = position = first
        elif first > position:  # type: ignore[operator]
            missing += first - position  # type: ignore[operator]
        room = limit - sum(map(len, parts))
        if room <= 0:
            break
        parts.append(piece[:room])
        position = first + len(piece[:room])
    data = b"".join(parts)
    begin = offset if begin is None else begin
    return OutputView(
        start=begin,
        end=position if position is not None else begin,
        kept_from=kept_from,
        total=total,
        data=data,
        missing=missing,
    )
