"""Settings, read from the environment (the same variables for `mtq up`, docker-compose and tests)."""

import os
from dataclasses import dataclass
from pathlib import Path

QUEUE_NAME = "grpo"


@dataclass(frozen=True)
class Settings:
    redis_url: str
    api_token: str
    home: Path
    models_dir: Path
    api_host: str
    api_port: int
    reward_hosts: tuple[str, ...]
    lease_ttl_s: float  # a running job's lease; a dead worker's job is re-queued about this long after
    redis_retry_s: float  # how long workers retry Redis calls before giving up
    job_retention_s: int  # finished jobs' keys expire after this long
    max_attempts_cap: int  # server cap on a job's max_attempts

    @property
    def adapters_dir(self) -> Path:
        return self.home / "adapters"


def load_settings() -> Settings:
    home = Path(os.environ.get("MTQ_HOME") or Path.home() / ".mtq").expanduser()
    models_dir = Path(os.environ.get("MTQ_MODELS_DIR") or home / "models").expanduser()
    hosts = os.environ.get("MTQ_REWARD_HOSTS", "127.0.0.1,localhost,::1")
    return Settings(
        redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        api_token=os.environ.get("MTQ_API_TOKEN", ""),
        home=home,
        models_dir=models_dir,
        api_host=os.environ.get("MTQ_API_HOST", "127.0.0.1"),
        api_port=int(os.environ.get("MTQ_API_PORT", "8000")),
        reward_hosts=tuple(h.strip() for h in hosts.split(",") if h.strip()),
        lease_ttl_s=float(os.environ.get("MTQ_LEASE_TTL", "20")),
        redis_retry_s=float(os.environ.get("MTQ_REDIS_RETRY_S", "600")),
        job_retention_s=int(float(os.environ.get("MTQ_JOB_RETENTION_S", str(30 * 86400)))),
        max_attempts_cap=int(os.environ.get("MTQ_MAX_ATTEMPTS", "10")),
    )
