"""A sandbox's output (stdout and stderr together), kept on the host to its last ``cap`` bytes.

Whatever a tenant prints, the host's disk holds at most ``cap`` bytes of it per sandbox: the
writer keeps two segment files of ``cap/2`` bytes, each named by the offset of its first byte
in everything the sandbox wrote (``00000000000000000000.out``, ...), and deletes the older
one when it starts a third. The agent reads from an offset on (``read_segments``) and learns
from the first segment's name how much was dropped in between.

The process driver runs the writer as its own small process (``python -m
workers.drivers.output DIR CAP``, the sandbox's output on its stdin): it outlives an agent
restart as the sandbox does, and ends when the sandbox closes its output. Files are the
agent's (root, 0600) in its state directory, out of the tenant's reach.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

SUFFIX = ".out"
_NAME_DIGITS = 20
_READ = 65536


def cap_bytes() -> int:
    """``SANDBOX_OUTPUT_MAX_BYTES``: what the host keeps of one sandbox's output (10 MiB)."""
    raw = os.environ.get("SANDBOX_OUTPUT_MAX_BYTES", "")
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) >= 8192 else 10 * 2**20


@dataclass(frozen=True)
class OutputChunk:
    """Output from ``start`` (an offset into everything the sandbox wrote) on; ``total`` is how
    much it wrote so far. ``start`` beyond the offset asked for: the bytes between were dropped."""

    start: int
    data: bytes
    total: int

    @property
    def end(self) -> int:
        return self.start + len(self.data)


def _segments(directory: Path) -> list[tuple[int, Path]]:
    found = []
    with contextlib.suppress(FileNotFoundError):
        for path in directory.iterdir():
            if path.name.endswith(SUFFIX) and path.name[: -len(SUFFIX)].isdigit():
                found.append((int(path.name[: -len(SUFFIX)]), path))
    return sorted(found)


def read_segments(directory: Path, offset: int, limit: int) -> OutputChunk:
    """At most ``limit`` bytes from ``offset`` on (or from the oldest byte still kept)."""
    parts: list[bytes] = []
    start = total = offset
    segments = _segments(directory)
    for first, path in segments:
        try:
            with open(path, "rb") as segment:
                size = os.fstat(segment.fileno()).st_size
                total = max(total, first + size)
                begin = max(offset, first)
                if begin >= first + size or sum(map(len, parts)) >= limit:
                    continue
                if not parts:
                    start = begin
                elif begin != start + sum(map(len, parts)):
                    continue  # a hole (a segment deleted while we read): the next read resumes
                segment.seek(begin - first)
                parts.append(segment.read(limit - sum(map(len, parts))))
        except FileNotFoundError:  # rotated away while we read
            continue
    if not parts and segments:
        start = max(offset, segments[0][0])
        start = min(start, total)
    data = b"".join(parts)
    return OutputChunk(start=start, data=data, total=max(total, start + len(data)))


def write_capped(source: int, directory: Path, cap: int) -> None:
    """Copy ``source`` (a file descriptor) to capped segments in ``directory`` until EOF."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    half = max(_READ, cap // 2)
    offset, size = 0, 0
    current = _open(directory, offset)
    try:
        while data := os.read(source, _READ):
            view = memoryview(data)
            while view:
                written = os.write(current, view[: half - size])
                size += written
                view = view[written:]
                if size >= half:  # this segment is full: start the next, keep the last two
                    os.close(current)
                    offset, size = offset + size, 0
                    current = _open(directory, offset)
                    for _, old in _segments(directory)[:-2]:
                        old.unlink(missing_ok=True)
    finally:
        os.close(current)


def _open(directory: Path, offset: int) -> int:
    path = directory / f"{offset:0{_NAME_DIGITS}d}{SUFFIX}"
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m workers.drivers.output DIRECTORY CAP_BYTES", file=sys.stderr)
        return 2
    write_capped(sys.stdin.fileno(), Path(argv[0]), int(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
