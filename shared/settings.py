"""Settings, read from the environment (the same variables for `mtq up`, docker-compose and tests).

The limits bound what one token holder can make the service do; each is documented in
docs/security.md ("Limits") with its default.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from shared.report_specs import TRACKERS


@dataclass(frozen=True)
class Settings:
    redis_url: str
    api_token: str
    home: Path
    models_dir: Path
    api_host: str
    api_port: int
    reward_hosts: tuple[str, ...]
    # The job lifecycle (shared/lifecycle.py, worker/supervisor/).
    lease_ttl_s: float = 20.0  # a running job's lease; a dead worker's job is re-queued about this long after
    redis_retry_s: float = 600.0  # how long workers retry Redis calls before giving up
    job_retention_s: int = 30 * 86400  # finished jobs' keys expire after this long
    max_attempts_cap: int = 10  # server cap on a job's max_attempts
    max_stall_timeout_s: float = 3600.0  # server cap on a job's stall_timeout_s (MTQ_MAX_STALL_TIMEOUT_S)
    score_wait_s: float = 20.0  # how long POST .../logprob waits for the workers before answering 202
    # How long a worker's training process answers scoring and completion requests in one turn
    # (a busy one: between two optimizer steps, so this is what a request may add to a step).
    serve_turn_s: float = 2.0
    completion_wait_s: float = 600.0  # how long /v1/chat/completions waits for its answer (the SDK's own timeout)
    # Extra room before a job's first step: MLX compiles kernels on first use, which takes
    # minutes on a fresh machine (docs/performance.md, "The first step and the kernel cache").
    compile_grace_s: float = 600.0
    # Where the training process keeps the kernels MLX compiles (worker/supervisor/kernel_cache.py): shared by
    # the workers of one $MTQ_HOME, so only the first of them compiles (MTQ_KERNEL_CACHE).
    kernel_cache_dir: Path | None = None  # load_settings: $MTQ_HOME/kernel-cache
    # What a fleet's workers share of those kernels through Redis (worker/supervisor/kernel_share.py):
    # at most this many MB of Redis memory for all fleets together; 0: no sharing (MTQ_KERNEL_SHARE_MB).
    # This machine's whole test suite left 393 kernels, 6.2 MB: the default holds about 20 times that.
    kernel_share_mb: float = 128.0
    memory_gb: float | None = None  # a worker's memory for jobs (MTQ_MEMORY_GB, mtq worker --memory-gb); default: detected
    hub: bool = False  # a worker may download from the Hugging Face hub (MTQ_HUB, mtq worker --hub)
    # Gangs (docs/distributed.md): the address a worker's ranks listen on, as its peers reach it
    # (MTQ_GANG_HOST; MTQ_GANG_PORT 0: a free port, picked at start), and how long a gang's ranks
    # may take to form their group before the attempt is given up (MTQ_GANG_JOIN_S).
    gang_host: str = "127.0.0.1"
    gang_port: int = 0
    gang_join_s: float = 60.0
    # The backend a worker's gang ranks join (worker/runtime/gang_group.py): "auto" (nccl on a CUDA
    # GPU, else ring), ring, jaccl, jaccl-ring or nccl (MTQ_GANG_BACKEND); jaccl's RDMA device to
    # each peer worker, "peer=rdma_en3,..." (MTQ_GANG_RDMA); how a step's rows are shared:
    # "speed" (by each rank's measured seconds per row) or "even" (MTQ_GANG_SHARES).
    gang_backend: str = "auto"
    gang_rdma: tuple[str, ...] = ()
    gang_shares: str = "speed"
    # The API's Redis socket timeout: a Redis that stops answering is a quick 503, not a hung request.
    redis_timeout_s: float = 3.0
    # Who may do what (api/auth.py): a JSON or YAML file of named tokens with roles.
    tokens_file: Path | None = None
    # Operator allow-lists: python reward modules (prefixes) and directories models may be loaded from.
    reward_modules: tuple[str, ...] = ()
    tool_modules: tuple[str, ...] = ()  # modules whose functions GRPO jobs may give the model as tools (MTQ_TOOL_MODULES)
    # OpenAI's python graders (shared/grader_sandbox.py): code sent with a request, so off unless turned on.
    python_graders: bool = False
    python_grader_timeout_s: float = 10.0  # wall time per sample (CPU time too)
    model_roots: tuple[Path, ...] = ()
    data_roots: tuple[Path, ...] = ()  # directories whose datasets jobs may name by path (MTQ_DATA_ROOTS)
    # Limits, enforced at submission (API) or while calling a reward server (worker).
    max_body_bytes: int = 16 * 2**20
    max_json_values: int = 250_000  # values (objects, arrays, strings, numbers...) in one JSON body
    max_job_bytes: int = 8 * 2**20  # a job's stored spec (its JSON)
    max_list_bytes: int = 16 * 2**20  # a page of the full job list: past it the page ends (X-Has-More)
    max_prompts: int = 10_000
    max_prompt_chars: int = 32_768
    max_step_tokens: int = 262_144
    max_completion_tokens: int = 4096  # a chat or text completion's tokens: its max_tokens' default and bound
    max_regex_chars: int = 2_000
    max_reward_response_bytes: int = 4 * 2**20
    max_streams_per_token: int = 32
    max_file_bytes: int = 8 * 2**20  # an uploaded dataset file (POST /admin/api/fine-tune/files)
    max_files_bytes_per_token: int = 64 * 2**20  # a token's uploaded files together
    # Full fine-tuning stores every trained weight and twice that of optimizer state in one Redis
    # value each, and Redis refuses values over 512 MB (proto-max-bulk-len): weights up to this many GB.
    full_finetune_max_gb: float = 0.25
    # An export's fused model is stored in Redis the same way (all its files in one command, the
    # weights one value): fused weights up to this many GB (MTQ_EXPORT_MAX_GB).
    export_max_gb: float = 0.45
    # A GRPO job's `samples` events (every completion of a step) are the bulk of its event stream:
    # a run keeps only its last this many in Redis (every step's metrics stay).
    samples_events_kept: int = 200
    # An event stream with nothing to send carries a comment this often, so proxies keep it open.
    sse_keepalive_s: float = 15.0
    # A Tinker session's job (shared/session_specs.py) ends once its client has sent no heartbeat
    # and no call for this long (the SDK heartbeats every 10 s), freeing its worker.
    session_idle_timeout_s: float = 60.0
    # Experiment trackers (docs/trackers.md): those of a job whose config has no report_to
    # (MTQ_REPORT_TO, comma-separated), where MLflow's runs go (MTQ_MLFLOW_TRACKING_URI, else
    # MLFLOW_TRACKING_URI, else a file store under $MTQ_HOME) and in which experiment, wandb's
    # project, the wait for one call to a tracker's server, and how long a tracker may go on
    # after its job's run ended before it is killed.
    report_to: tuple[str, ...] = ()
    mlflow_tracking_uri: str = ""  # load_settings: file:$MTQ_HOME/mlruns
    mlflow_experiment: str = "mtq"
    wandb_project: str = "mtq"
    tracker_timeout_s: float = 10.0
    tracker_grace_s: float = 60.0

    @property
    def adapters_dir(self) -> Path:
        return self.home / "adapters"


def _int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if not value else int(value)


def _float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if not value else float(value)


def _list(name: str, default: str = "", sep: str = ",") -> tuple[str, ...]:
    return tuple(item.strip() for item in os.environ.get(name, default).split(sep) if item.strip())


def _trackers(name: str) -> tuple[str, ...]:
    chosen = _list(name)
    unknown = sorted(set(chosen) - set(TRACKERS))
    if unknown:
        raise ValueError(f"{name}: unknown trackers {', '.join(unknown)} (known: {', '.join(TRACKERS)})")
    return chosen


def load_settings() -> Settings:
    home = Path(os.environ.get("MTQ_HOME") or Path.home() / ".mtq").expanduser()
    models_dir = Path(os.environ.get("MTQ_MODELS_DIR") or home / "models").expanduser()
    tokens_file = os.environ.get("MTQ_TOKENS_FILE")
    return Settings(
        redis_url=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"),
        api_token=os.environ.get("MTQ_API_TOKEN", ""),
        home=home,
        models_dir=models_dir,
        api_host=os.environ.get("MTQ_API_HOST", "127.0.0.1"),
        api_port=int(os.environ.get("MTQ_API_PORT", "8000")),
        reward_hosts=_list("MTQ_REWARD_HOSTS"),
        lease_ttl_s=_float("MTQ_LEASE_TTL", Settings.lease_ttl_s),
        redis_retry_s=_float("MTQ_REDIS_RETRY_S", Settings.redis_retry_s),
        job_retention_s=int(_float("MTQ_JOB_RETENTION_S", Settings.job_retention_s)),
        max_attempts_cap=_int("MTQ_MAX_ATTEMPTS", Settings.max_attempts_cap),
        max_stall_timeout_s=_float("MTQ_MAX_STALL_TIMEOUT_S", Settings.max_stall_timeout_s),
        score_wait_s=_float("MTQ_SCORE_WAIT_S", Settings.score_wait_s),
        serve_turn_s=_float("MTQ_SERVE_TURN_S", Settings.serve_turn_s),
        completion_wait_s=_float("MTQ_COMPLETION_WAIT_S", Settings.completion_wait_s),
        compile_grace_s=_float("MTQ_COMPILE_GRACE_S", Settings.compile_grace_s),
        kernel_cache_dir=Path(os.environ.get("MTQ_KERNEL_CACHE") or home / "kernel-cache").expanduser(),
        kernel_share_mb=_float("MTQ_KERNEL_SHARE_MB", Settings.kernel_share_mb),
        memory_gb=_float("MTQ_MEMORY_GB", 0.0) or None,
        hub=os.environ.get("MTQ_HUB", "") not in ("", "0"),
        gang_host=os.environ.get("MTQ_GANG_HOST", Settings.gang_host),
        gang_port=_int("MTQ_GANG_PORT", Settings.gang_port),
        gang_join_s=_float("MTQ_GANG_JOIN_S", Settings.gang_join_s),
        gang_backend=os.environ.get("MTQ_GANG_BACKEND") or Settings.gang_backend,
        gang_rdma=_list("MTQ_GANG_RDMA"),
        gang_shares=os.environ.get("MTQ_GANG_SHARES") or Settings.gang_shares,
        redis_timeout_s=_float("MTQ_REDIS_TIMEOUT_S", Settings.redis_timeout_s),
        tokens_file=Path(tokens_file).expanduser() if tokens_file else None,
        reward_modules=_list("MTQ_REWARD_MODULES"),
        tool_modules=_list("MTQ_TOOL_MODULES"),
        python_graders=os.environ.get("MTQ_PYTHON_GRADERS") == "1",
        python_grader_timeout_s=_float("MTQ_PYTHON_GRADER_TIMEOUT_S", Settings.python_grader_timeout_s),
        model_roots=tuple(Path(p).expanduser().resolve() for p in _list("MTQ_MODEL_ROOTS", sep=os.pathsep)),
        data_roots=tuple(Path(p).expanduser().resolve() for p in _list("MTQ_DATA_ROOTS", sep=os.pathsep)),
        max_body_bytes=_int("MTQ_MAX_BODY_BYTES", Settings.max_body_bytes),
        max_json_values=_int("MTQ_MAX_JSON_VALUES", Settings.max_json_values),
        max_job_bytes=_int("MTQ_MAX_JOB_BYTES", Settings.max_job_bytes),
        max_list_bytes=_int("MTQ_MAX_LIST_BYTES", Settings.max_list_bytes),
        max_prompts=_int("MTQ_MAX_PROMPTS", Settings.max_prompts),
        max_prompt_chars=_int("MTQ_MAX_PROMPT_CHARS", Settings.max_prompt_chars),
        max_step_tokens=_int("MTQ_MAX_STEP_TOKENS", Settings.max_step_tokens),
        max_completion_tokens=_int("MTQ_MAX_COMPLETION_TOKENS", Settings.max_completion_tokens),
        max_regex_chars=_int("MTQ_MAX_REGEX_CHARS", Settings.max_regex_chars),
        max_reward_response_bytes=_int("MTQ_MAX_REWARD_RESPONSE_BYTES", Settings.max_reward_response_bytes),
        max_streams_per_token=_int("MTQ_MAX_STREAMS_PER_TOKEN", Settings.max_streams_per_token),
        max_file_bytes=_int("MTQ_MAX_FILE_BYTES", Settings.max_file_bytes),
        max_files_bytes_per_token=_int("MTQ_MAX_FILES_BYTES_PER_TOKEN", Settings.max_files_bytes_per_token),
        full_finetune_max_gb=_float("MTQ_FULL_FINETUNE_MAX_GB", Settings.full_finetune_max_gb),
        export_max_gb=_float("MTQ_EXPORT_MAX_GB", Settings.export_max_gb),
        samples_events_kept=max(1, _int("MTQ_SAMPLES_EVENTS_KEPT", Settings.samples_events_kept)),
        sse_keepalive_s=max(0.1, _float("MTQ_SSE_KEEPALIVE_S", Settings.sse_keepalive_s)),
        session_idle_timeout_s=max(5.0, _float("MTQ_SESSION_IDLE_TIMEOUT_S", Settings.session_idle_timeout_s)),
        report_to=_trackers("MTQ_REPORT_TO"),
        mlflow_tracking_uri=(os.environ.get("MTQ_MLFLOW_TRACKING_URI") or os.environ.get("MLFLOW_TRACKING_URI")
                             or (home / "mlruns").resolve().as_uri()),
        mlflow_experiment=os.environ.get("MTQ_MLFLOW_EXPERIMENT") or Settings.mlflow_experiment,
        wandb_project=os.environ.get("MTQ_WANDB_PROJECT") or Settings.wandb_project,
        tracker_timeout_s=max(0.1, _float("MTQ_TRACKER_TIMEOUT_S", Settings.tracker_timeout_s)),
        tracker_grace_s=max(0.0, _float("MTQ_TRACKER_GRACE_S", Settings.tracker_grace_s)),
    )
