"""Redis key layout. Everything the project stores lives under the `mtq:` prefix."""

JOBS_INDEX = "mtq:jobs"  # sorted set: job_id -> created_at


def job_key(job_id: str) -> str:
    """Hash: the job record (spec, status, times, progress, error, adapter_path...)."""
    return f"mtq:job:{job_id}"


def events_key(job_id: str) -> str:
    """Stream: one entry per step plus a terminal one; field `data` holds JSON."""
    return f"mtq:job:{job_id}:events"


def adapter_key(job_id: str) -> str:
    """Hash: the finished adapter's files (file name -> bytes), readable by any machine."""
    return f"mtq:job:{job_id}:adapter"
