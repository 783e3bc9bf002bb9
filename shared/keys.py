"""Redis key layout. Everything the project stores lives under the `mtq:` prefix."""

import re

# Job ids are uuid4 hex; anything with a ':' would name another of the job's keys (mtq:job:<id>:events).
JOB_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

JOBS_INDEX = "mtq:jobs"  # sorted set: job_id -> created_at
ADAPTERS_INDEX = "mtq:adapters"  # hash: "<model_id>/<adapter_name>" -> job_id of the newest completed job


def job_key(job_id: str) -> str:
    """Hash: the job record (spec, status, times, progress, error, adapter_path...)."""
    return f"mtq:job:{job_id}"


EVENTS_MAXLEN = 10_000  # entries an event stream keeps (about: XADD MAXLEN ~)


def events_key(job_id: str) -> str:
    """Stream: one entry per step plus a terminal one; field `data` holds JSON; EVENTS_MAXLEN entries at most."""
    return f"mtq:job:{job_id}:events"


def adapter_name_key(ref: str) -> str:
    """Set: the jobs that use the adapter name "<model_id>/<adapter_name>" (one owner's: shared/adapters.py claim_name)."""
    return f"mtq:adapter-name:{ref}"


def adapter_key(job_id: str) -> str:
    """Hash: the finished adapter's files (file name -> bytes), readable by any machine."""
    return f"mtq:job:{job_id}:adapter"


def trackers_key(job_id: str) -> str:
    """Hash: its experiment trackers' states and TensorBoard event files (shared/trackers.py)."""
    return f"mtq:job:{job_id}:trackers"


def lease_key(job_id: str) -> str:
    """String with a TTL: '<worker>:<epoch>' while a live worker holds the job; its heartbeat renews it."""
    return f"mtq:job:{job_id}:lease"


def checkpoint_key(job_id: str) -> str:
    """Hash: the job's last good checkpoint (LoRA weights, optimizer state, step, metric history)."""
    return f"mtq:job:{job_id}:checkpoint"


RUNNING_JOBS = "mtq:running"  # set of job ids whose status is running (the reconciler checks their leases)
QUEUED_JOBS = "mtq:queued"  # set of job ids whose status is queued (the reconciler checks their rq jobs)


# Compiled kernels a fleet's workers share (worker/supervisor/kernel_share.py).
KERNELS_BYTES = "mtq:kernels:bytes"  # string: the bytes of every stored entry together, against MTQ_KERNEL_SHARE_MB


def kernels_index_key(fleet: str) -> str:
    """Hash: a fleet's kernels, kernel name -> the sha256 of its entry."""
    return f"mtq:kernels:index:{fleet}"


def kernel_entry_key(sha256: str) -> str:
    """String: one kernel's entry (its fleet, its files), addressed by its own sha256."""
    return f"mtq:kernels:entry:{sha256}"
