"""The agent's systemd unit against real GPU hosts (review 3, new failure #1 and #4).

On systemd < 252 (Ubuntu 22.04 and DGX OS 6 ship 249) any ``DeviceAllow=``, including the
``char-rtc r`` that ``ProtectClock=yes`` implies, turns the unit's device cgroup into an
allow-list (systemd#18142, fixed in v252 by PR #25075): ``/dev/nvidiactl`` closes, NVML
cannot start and the agent never does. The unit is read as systemd reads it (key=value per
section, repeated keys kept); ``systemd-analyze verify`` runs on it in
tests/e2e/test_deployment.py.
"""

from __future__ import annotations

from pathlib import Path

UNIT = Path(__file__).parents[2] / "deploy" / "systemd" / "gpushare-agent.service"
# The character-device groups (/proc/devices) of every NVIDIA node a GPU sandbox needs:
# nvidia-frontend is /dev/nvidia<N> and /dev/nvidiactl, nvidia-uvm /dev/nvidia-uvm*,
# nvidia-caps the MIG capability nodes under /dev/nvidia-caps.
NVIDIA_GROUPS = ("char-nvidiactl", "char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps")
_TRUE = {"1", "yes", "true", "on"}


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values, in order; comments and blank lines skipped."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def allow_list_causes(service: dict[str, list[str]]) -> list[str]:
    """The settings that make systemd < 252 close every device not explicitly allowed."""
    causes = []
    for key in ("ProtectClock", "PrivateDevices"):
        if any(v.lower() in _TRUE for v in service.get(key, [])):
            causes.append(f"{key}=yes")
    if any(v in ("closed", "strict") for v in service.get("DevicePolicy", [])):
        causes.append("DevicePolicy=closed/strict")
    if any(service.get("DeviceAllow", [])):
        causes.append("DeviceAllow=")
    # Encrypted credentials imply DeviceAllow=char-tpm rw.
    causes += [k for k in ("LoadCredentialEncrypted", "SetCredentialEncrypted") if k in service]
    return causes


def nvidia_nodes_reachable(service: dict[str, list[str]]) -> list[str]:
    """What keeps the NVIDIA nodes closed to the unit; [] when they stay reachable."""
    causes = allow_list_causes(service)
    if not causes:
        return []
    allowed = {v.split()[0]: [*v.split(), ""][1] for v in service.get("DeviceAllow", []) if v}
    missing = [g for g in NVIDIA_GROUPS if "rw" not in allowed.get(g, "").replace("m", "")]
    if "/dev/nvidia-caps/*" not in allowed and "char-nvidia-caps" in missing:
        missing.append("/dev/nvidia-caps/*")
    return [f"{', '.join(causes)} without DeviceAllow= for {', '.join(missing)}"] if missing else []


def test_the_agent_unit_leaves_every_nvidia_node_open_on_systemd_249() -> None:
    service = unit_settings(UNIT.read_text())["Service"]
    assert nvidia_nodes_reachable(service) == []


def test_the_check_catches_protect_clock_without_an_nvidia_allow_list() -> None:
    """The old unit's line (ProtectClock=yes, no DeviceAllow=) is what closed the nodes; an
    explicit list for every NVIDIA group is what would reopen them."""
    assert nvidia_nodes_reachable({"ProtectClock": ["yes"]})
    assert nvidia_nodes_reachable({"ProtectClock": ["yes"], "DeviceAllow": ["char-nvidiactl rw"]})
    explicit = [f"{g} rw" for g in NVIDIA_GROUPS] + ["/dev/nvidia-caps/* r"]
    assert nvidia_nodes_reachable({"ProtectClock": ["yes"], "DeviceAllow": explicit}) == []
    assert nvidia_nodes_reachable({"PrivateDevices": ["yes"]})
    assert nvidia_nodes_reachable({"LoadCredentialEncrypted": ["x:/y"]})


def test_the_agent_unit_still_keeps_the_clocks_out_of_reach() -> None:
    """What ProtectClock= did besides the device rule stays: no capability that sets a clock,
    and the clock-setting system calls refused with EPERM, not by killing the caller."""
    service = unit_settings(UNIT.read_text())["Service"]
    dropped = " ".join(service["CapabilityBoundingSet"])
    assert dropped.startswith("~") and {"CAP_SYS_TIME", "CAP_WAKE_ALARM"} <= set(dropped[1:].split())
    assert "~@clock" in service["SystemCallFilter"]
    assert service["SystemCallErrorNumber"] == ["EPERM"]


def test_the_agent_starts_after_fabric_manager_without_requiring_it() -> None:
    """On HGX a GPU takes no CUDA work until Fabric Manager registers it; hosts without
    NVSwitch have no such unit, so it is ordering only."""
    unit = unit_settings(UNIT.read_text())["Unit"]
    assert "nvidia-fabricmanager.service" in " ".join(unit["After"]).split()
    assert "nvidia-fabricmanager.service" not in " ".join(unit.get("Wants", [])).split()
    assert "nvidia-fabricmanager.service" not in " ".join(unit.get("Requires", [])).split()
