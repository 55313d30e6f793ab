"""Which images a host's agent may pull: those under a registry (or a namespace in one) an
admin approved (``ImageRegistry.allows``). Every other image in the catalog must have been built or
loaded on the hosts (scripts/build-*-image.sh, ``docker load``); the agent never pulls it.

References are compared in Docker's full form: ``pytorch/pytorch:2`` is
``docker.io/pytorch/pytorch:2``, ``python:3.11`` is ``docker.io/library/python:3.11``.
"""

from __future__ import annotations

import re

# A reference's first part names a registry when it has a dot or a port, or is localhost
# (Docker's own rule: anything else is a Docker Hub namespace).
_NAME = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_REGISTRY = re.compile(
    r"(?:localhost|[A-Za-z0-9.-]+\.[A-Za-z0-9.-]+|[A-Za-z0-9.-]+:[0-9]+|\[[0-9a-fA-F:]+\](?::[0-9]+)?)"
)


def registry_named(reference: str) -> str | None:
    """The registry ``reference`` names itself, if it names one."""
    first, _, rest = reference.partition("/")
    return first if rest and ("." in first or ":" in first or first == "localhost") else None


def full_reference(reference: str) -> str:
    """``reference`` with the registry and namespace Docker would assume spelled out."""
    if registry_named(reference):
        return reference
    return f"docker.io/{reference}" if "/" in reference else f"docker.io/library/{reference}"


def checked_prefix(prefix: str) -> str:
    """An approval's prefix in the form it is compared in (``host[:port]/`` and any
    namespaces, ending in ``/``); ValueError saying what is wrong with it."""
    cleaned = prefix.strip().rstrip("/")
    first, _, rest = cleaned.partition("/")
    if not first or not _REGISTRY.fullmatch(first):
        raise ValueError(
            "Start with the registry's host, with a dot or a port (registry.example.org, "
            "127.0.0.1:5000; docker.io for Docker Hub), then any namespace: registry.example.org/ml/."
        )
    for part in rest.split("/") if rest else []:
        if not _NAME.fullmatch(part):
            raise ValueError(f"{part!r} is not a repository namespace (lowercase letters, digits, . _ -).")
    return f"{cleaned}/"


def approved_by(reference: str, prefixes: list[str]) -> str | None:
    """The approved prefix ``reference`` falls under, if any."""
    full = full_reference(reference)
    return next((p for p in prefixes if full.startswith(p)), None)
