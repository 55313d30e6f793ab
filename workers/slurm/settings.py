"""What a Slurm gateway takes from its environment (README, "Configuration"; docs/slurm.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from wire.env import ConfigError, env_bool, env_int, env_list, env_str
from workers.slurm.rest import GivenToken, MintedTokens, SlurmRest

RUN_AS_OWNER = "owner"  # each sandbox's job runs as its owner's own Unix user
ACCOUNT_PROJECT = "project"  # each job is charged to the Slurm account named as its project


@dataclass(frozen=True)
class SlurmSettings:
    url: str  # GPUSHARE_SLURM_URL: slurmrestd, http://host:6820
    rest_user: str = "slurm"  # GPUSHARE_SLURM_USER: the gateway's own Slurm user (an operator)
    jwt_key_file: Path | None = None  # GPUSHARE_SLURM_JWT_KEY_FILE: mint tokens with the cluster's key
    token_file: Path | None = None  # GPUSHARE_SLURM_TOKEN_FILE: or use this one
    run_as: str = RUN_AS_OWNER  # GPUSHARE_SLURM_RUN_AS: "owner", or one user for every job
    account: str = ACCOUNT_PROJECT  # GPUSHARE_SLURM_ACCOUNT: "project", or one account for all
    partition: str = ""  # GPUSHARE_SLURM_PARTITION: "" for the cluster's default
    output_dir: Path = Path("/var/lib/gpushare/slurm-output")  # GPUSHARE_SLURM_OUTPUT_DIR
    poll_s: float = 2.0  # GPUSHARE_SLURM_POLL_S: how often nodes and jobs are read
    start_wait_s: float = 60.0  # GPUSHARE_SLURM_START_WAIT_S: a launch's wait for RUNNING
    # GPUSHARE_SLURM_SIMULATED_GPUS: the cluster's GPU GRES are fake device files (a test
    # cluster): the pages badge them simulated, as they do simulated hosts.
    simulated_gpus: bool = False
    # GPUSHARE_SLURM_GPU_MODELS: gpushare's model for each gpu GRES type, "h100=H100-80GB,a100=A100-80GB"
    gpu_models: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_env(cls) -> SlurmSettings:
        key = env_str("GPUSHARE_SLURM_JWT_KEY_FILE", "")
        token = env_str("GPUSHARE_SLURM_TOKEN_FILE", "")
        if bool(key) == bool(token):
            raise ConfigError(
                "a Slurm gateway needs exactly one of GPUSHARE_SLURM_JWT_KEY_FILE (the cluster's "
                "JWT key: it mints its tokens) and GPUSHARE_SLURM_TOKEN_FILE (a token from scontrol token)"
            )
        return cls(
            url=env_str("GPUSHARE_SLURM_URL"),
            rest_user=env_str("GPUSHARE_SLURM_USER", "slurm"),
            jwt_key_file=Path(key) if key else None,
            token_file=Path(token) if token else None,
            run_as=env_str("GPUSHARE_SLURM_RUN_AS", RUN_AS_OWNER),
            account=env_str("GPUSHARE_SLURM_ACCOUNT", ACCOUNT_PROJECT),
            partition=env_str("GPUSHARE_SLURM_PARTITION", ""),
            output_dir=Path(env_str("GPUSHARE_SLURM_OUTPUT_DIR", "/var/lib/gpushare/slurm-output")),
            poll_s=env_int("GPUSHARE_SLURM_POLL_MS", 2000, minimum=100) / 1000,
            start_wait_s=float(env_int("GPUSHARE_SLURM_START_WAIT_S", 60, minimum=1)),
            simulated_gpus=env_bool("GPUSHARE_SLURM_SIMULATED_GPUS", False),
            gpu_models=tuple(_pair(item) for item in env_list("GPUSHARE_SLURM_GPU_MODELS", ())),
        )

    def client(self) -> SlurmRest:
        """slurmrestd as the gateway's user; ConfigError when its key or token is unreadable."""
        try:
            if self.jwt_key_file is not None:
                return SlurmRest(self.url, self.rest_user, MintedTokens.from_file(self.jwt_key_file))
            assert self.token_file is not None  # noqa: S101 - from_env requires one of the two
            return SlurmRest(self.url, self.rest_user, GivenToken(self.token_file.read_text().strip()))
        except OSError as exc:
            raise ConfigError(f"the Slurm gateway's key or token: {exc}") from exc

    def user_for(self, owner: str) -> str:
        return owner if self.run_as == RUN_AS_OWNER else self.run_as

    def account_for(self, project: str) -> str:
        return project if self.account == ACCOUNT_PROJECT else self.account


def _pair(item: str) -> tuple[str, str]:
    gres_type, _, model = item.partition("=")
    if not gres_type.strip() or not model.strip():
        raise ConfigError(f"GPUSHARE_SLURM_GPU_MODELS: {item!r} is not <gres type>=<model> (h100=H100-80GB)")
    return gres_type.strip(), model.strip()
