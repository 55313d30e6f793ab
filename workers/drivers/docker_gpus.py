"""How this host's Docker engine can hand a container its GPUs, and the request that does it.

Docker has two ways, and which one works depends on how the host was set up (review 3, #3
and §4):

* **CDI.** With CDI on (Docker 25+ ``features.cdi``, on by default from 28), ``docker info``
  lists its spec directories (``CDISpecDirs``: /etc/cdi, /var/run/cdi) and the engine's
  ``cdi`` device driver takes fully qualified names, ``nvidia.com/gpu=<name>`` (moby
  ``daemon/cdi.go``; ``docker run --device nvidia.com/gpu=...``). The NVIDIA spec, made by
  ``nvidia-ctk cdi generate``, names each GPU by index and by UUID, MIG devices by
  ``<gpu>:<mig>`` and by MIG UUID. The devices land in the OCI spec, so a ``systemctl
  daemon-reload`` cannot take them from a running container (toolkit#48). Used for every
  launch whose devices the spec names by UUID.
* **The legacy hook.** moby registers its ``nvidia`` driver for capability ``gpu`` only when
  ``nvidia-container-runtime-hook`` is on dockerd's PATH (``daemon/nvidia_linux.go``); the
  request ``DeviceRequest(device_ids=[uuid...], capabilities=[["gpu"]])`` (``--gpus``) then
  adds that hook, which runs only while the toolkit's mode (``mode`` in
  /etc/nvidia-container-runtime/config.toml) resolves to ``legacy``: ``auto``, the default,
  does, for the hook; ``cdi``/``jit-cdi``/``csv`` make it refuse, "invoking the NVIDIA
  Container Runtime Hook directly (e.g. specifying the docker --gpus flag) is not
  supported" (toolkit ``cmd/nvidia-container-runtime-hook/hook_config.go``
  ``assertModeIsLegacy``), unless ``skip-mode-detection`` is set for the hook or Docker's
  default runtime is the toolkit's ``nvidia`` runtime, which in those modes takes the
  request's ``NVIDIA_VISIBLE_DEVICES`` itself and removes the hook.

Neither: every GPU launch would fail ("could not select device driver "" with
capabilities: [[gpu]]"), so the agent refuses to start (``problem``), naming what to
install. ``GpuPaths`` reads the facts (the engine's once, the files at each launch, since
an operator may regenerate the spec after a MIG change); tests give ``HostGpuFacts``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import tomllib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker.types
import yaml

from workers.drivers.base import DriverError
from workers.drivers.unavailable import install_command

log = logging.getLogger(__name__)

CDI_KIND = "nvidia.com/gpu"
HOOK = "nvidia-container-runtime-hook"
TOOLKIT_CONFIG = Path("/etc/nvidia-container-runtime/config.toml")
# The directories the hook may be found in under dockerd, beyond the agent's own PATH
# (systemd gives both the same default PATH; a package may put it in /usr/local/bin).
_HOOK_DIRS = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Toolkit modes in which its hook runs when Docker's --gpus adds it ("auto" resolves to
# legacy for the hook: info.WithDefaultMode(info.LegacyRuntimeMode)).
_HOOK_MODES = ("legacy", "auto")
SPEC_REMEDY = (
    "generate the CDI spec, naming each GPU and MIG device by UUID: nvidia-ctk cdi generate "
    "--output=/etc/cdi/nvidia.yaml (again after each MIG change), with CDI on in Docker "
    "(Docker 25 or later: nvidia-ctk runtime configure --runtime=docker --cdi.enabled; "
    "systemctl restart docker)"
)


@dataclass(frozen=True)
class HostGpuFacts:
    """What the host offers Docker for GPUs."""

    cdi_spec_dirs: tuple[Path, ...] = ()  # Docker's (docker info CDISpecDirs); () = CDI off
    # Device name as the spec gives it (a UUID, an index, "all") -> its qualified CDI name.
    cdi_devices: dict[str, str] = field(default_factory=dict)
    hook: str | None = None  # where nvidia-container-runtime-hook is; None: not installed
    toolkit_mode: str = "auto"  # config.toml's nvidia-container-runtime.mode (default auto)
    skip_mode_detection: bool = False  # config.toml's nvidia-container-runtime-hook setting
    default_runtime: str = ""  # docker info DefaultRuntime
    toolkit_config: Path = TOOLKIT_CONFIG

    @property
    def legacy_works(self) -> bool:
        """Whether ``--gpus`` (the legacy device request) reaches a hook that will run."""
        if self.hook is None:
            return False
        return (
            self.toolkit_mode in _HOOK_MODES or self.skip_mode_detection or self.default_runtime == "nvidia"
        )

    @property
    def cdi_gpus(self) -> list[str]:
        """The GPU and MIG UUIDs the CDI spec names (the only names gpushare asks by)."""
        return sorted(n for n in self.cdi_devices if n.startswith(("GPU-", "MIG-")))

    def describe(self) -> str:
        """One line: what was found."""
        cdi = (
            f"CDI on ({', '.join(map(str, self.cdi_spec_dirs))}; {len(self.cdi_gpus)} {CDI_KIND} "
            "device(s) by UUID)"
            if self.cdi_spec_dirs
            else "CDI off in Docker"
        )
        hook = f"{HOOK} at {self.hook}" if self.hook else f"no {HOOK}"
        return f"{cdi}; {hook}; toolkit mode {self.toolkit_mode!r}"

    def problem(self) -> tuple[str, str] | None:
        """(what is missing, how to fix it) when no GPU can be handed out at all; None when
        some path works."""
        if self.cdi_gpus or self.legacy_works:
            return None
        if self.hook is not None:  # the toolkit is there, in a mode its hook refuses
            return (
                f"the NVIDIA Container Toolkit's mode is {self.toolkit_mode!r} ({self.toolkit_config}), in "
                f"which its hook refuses Docker's GPU requests, and Docker offers no CDI spec naming "
                f"the GPUs ({self.describe()})",
                f'{SPEC_REMEDY}; or set mode = "auto" under [nvidia-container-runtime] in '
                f"{self.toolkit_config}",
            )
        return (
            f"Docker has no way to hand out NVIDIA GPUs: {HOOK} is not installed and no CDI spec "
            f"names a GPU ({self.describe()})",
            f"install the NVIDIA Container Toolkit ({install_command('nvidia-container-toolkit')}, "
            f"from NVIDIA's repository) and restart Docker; or {SPEC_REMEDY}",
        )

    def device_request(self, uuids: Sequence[str]) -> docker.types.DeviceRequest:
        """The request that gives a container exactly ``uuids``: by CDI name when the spec
        names every one of them, else the legacy request where the hook runs. DriverError
        saying what is missing otherwise."""
        if self.cdi_spec_dirs and all(u in self.cdi_devices for u in uuids):
            return docker.types.DeviceRequest(driver="cdi", device_ids=[self.cdi_devices[u] for u in uuids])
        if self.legacy_works:
            return docker.types.DeviceRequest(device_ids=list(uuids), capabilities=[["gpu"]])
        missing = [u for u in uuids if u not in self.cdi_devices]
        if self.cdi_gpus:  # CDI works, but the spec predates these devices (a MIG change)
            raise DriverError(
                f"the CDI spec in {', '.join(map(str, self.cdi_spec_dirs))} does not name "
                f"{', '.join(missing)}, and Docker's GPU hook cannot be used ({self.describe()}): "
                f"{SPEC_REMEDY}"
            )
        reason, remedy = self.problem() or ("no GPU path", SPEC_REMEDY)  # always a problem here
        raise DriverError(f"{reason}: {remedy}")


# --- reading the facts -------------------------------------------------------------------------


def cdi_devices(spec_dirs: Iterable[Path]) -> dict[str, str]:
    """Every ``nvidia.com/gpu`` device in the CDI spec files (YAML or JSON) of ``spec_dirs``:
    name -> qualified name. Unreadable files are skipped, as Docker's CDI cache skips them."""
    found: dict[str, str] = {}
    for folder in spec_dirs:
        with contextlib.suppress(OSError):
            for path in sorted(folder.iterdir()):
                if path.suffix not in (".yaml", ".yml", ".json"):
                    continue
                try:
                    text = path.read_text()
                    spec: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
                except (OSError, ValueError, yaml.YAMLError) as exc:
                    log.warning("CDI spec %s unreadable: %s", path, exc)
                    continue
                if not isinstance(spec, dict) or spec.get("kind") != CDI_KIND:
                    continue
                for device in spec.get("devices") or []:
                    name = device.get("name") if isinstance(device, dict) else None
                    if isinstance(name, str) and name:
                        found.setdefault(name, f"{CDI_KIND}={name}")
    return found


def toolkit_settings(path: Path = TOOLKIT_CONFIG) -> tuple[str, bool]:
    """(mode, skip-mode-detection) from the toolkit's config.toml; ("auto", False), its
    defaults, when the file is absent or unreadable."""
    try:
        config = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return "auto", False
    runtime = config.get("nvidia-container-runtime") or {}
    hook = config.get("nvidia-container-runtime-hook") or {}
    mode = runtime.get("mode") if isinstance(runtime, dict) else None
    skip = hook.get("skip-mode-detection") if isinstance(hook, dict) else None
    return (mode if isinstance(mode, str) and mode else "auto"), skip is True


def find_hook() -> str | None:
    return shutil.which(HOOK) or shutil.which(HOOK, path=_HOOK_DIRS)


class GpuPaths:
    """The facts of this host, the engine's asked once (``engine_info``: ``docker info``),
    the files read again at each call."""

    def __init__(
        self,
        engine_info: Callable[[], dict[str, Any]],
        toolkit_config: Path = TOOLKIT_CONFIG,
        hook: Callable[[], str | None] = find_hook,
    ) -> None:
        self._engine_info = engine_info
        self._info: dict[str, Any] | None = None
        self.toolkit_config = toolkit_config
        self._hook = hook

    def facts(self) -> HostGpuFacts:
        if self._info is None:
            self._info = self._engine_info()
        dirs = tuple(Path(d) for d in self._info.get("CDISpecDirs") or ())
        mode, skip = toolkit_settings(self.toolkit_config)
        return HostGpuFacts(
            cdi_spec_dirs=dirs,
            cdi_devices=cdi_devices(dirs),
            hook=self._hook(),
            toolkit_mode=mode,
            skip_mode_detection=skip,
            default_runtime=str(self._info.get("DefaultRuntime") or ""),
            toolkit_config=self.toolkit_config,
        )
