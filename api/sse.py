"""A job's event stream (Redis stream) as server-sent events.

Wire format, one block per event:  `id: <stream id>\\ndata: <json>\\n\\n`.
Clients that reconnect send the last id back in `Last-Event-ID` and resume after it.
"""

import functools
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import jobstore
from shared.schemas import Job

TERMINAL_TYPES = ("done", "failed", "cancelled")
BLOCK_MS = 5_000  # one XREAD BLOCK; also how late we notice a client that went away
KEEPALIVE_S = 15.0  # a comment line after this much silence keeps proxies from closing the stream

# The blocking reads run in threads. They get their own limiter so that many open
# streams cannot use up the thread pool that the (sync) REST routes run in.
_reader_threads = anyio.CapacityLimiter(256)


async def _in_thread(func, *args, **kwargs):
    return await anyio.to_thread.run_sync(functools.partial(func, *args, **kwargs), limiter=_reader_threads)


def format_event(event: dict[str, Any], event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}data: {json.dumps(event)}\n\n"


def terminal_event_from_record(job: Job) -> dict[str, Any]:
    """The terminal event a finished job would have written (used when it is not in the stream)."""
    if job.status == "completed":
        event: dict[str, Any] = {"type": "done", "adapter_path": job.adapter_path}
    elif job.status == "failed":
        event = {"type": "failed", "error": job.error}
    else:
        event = {"type": "cancelled"}
    return {**event, "synthesized": True}


async def job_events(redis_url: str, job_id: str, after: str = "0-0") -> AsyncIterator[str]:
    """Replay the job's events after `after`, then follow new ones until a terminal event."""
    # Its own connection: a blocked XREAD holds a connection for up to BLOCK_MS.
    r = jobstore.connect(redis_url)
    try:
        last_sent = time.monotonic()
        last_type = None
        while True:
            # The status is read *before* the events: once the job is finished and nothing
            # is left to read, the stream ends. A terminal event seen while the job is not
            # finished is history (the job was resumed since), so we keep following. If the
            # stream's last event is not terminal (trimmed, or the job was finished without
            # one), we make one up from the record.
            status = await _in_thread(jobstore.get_status, r, job_id)
            if status is None:
                return  # deleted while we were streaming
            finished = jobstore.is_finished(status)
            events = await _in_thread(
                jobstore.read_events, r, job_id, after, block_ms=None if finished else BLOCK_MS
            )
            for event_id, event in events:
                yield format_event(event, event_id)
                after, last_type = event_id, event.get("type")
            if events:
                last_sent = time.monotonic()
            elif finished:
                job = await _in_thread(jobstore.get_job, r, job_id)
                if job is not None and last_type not in TERMINAL_TYPES:
                    yield format_event(terminal_event_from_record(job))
                return
            elif time.monotonic() - last_sent >= KEEPALIVE_S:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
    except (RedisConnectionError, RedisTimeoutError) as exc:
        # The 200 and headers are already sent, so a 503 is no longer possible: say so in
        # the stream and end it; the client can reconnect with Last-Event-ID.
        yield f"event: error\ndata: {json.dumps({'detail': f'Redis is unavailable: {exc}'})}\n\n"
    finally:
        r.close()
