"""A job's event stream (Redis stream) as server-sent events, served on the event loop.

Wire format, one block per event:  `id: <stream id>\\ndata: <json>\\n\\n`.
Clients that reconnect send the last id back in `Last-Event-ID` and resume after it.

Each open stream is a coroutine waiting in XREAD BLOCK on a connection of the async Redis
client's pool: no thread per stream. Open streams are counted per token
(MTQ_MAX_STREAMS_PER_TOKEN).
"""

import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import redis.asyncio
from fastapi.responses import StreamingResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import lifecycle
from shared.events import decode_events
from shared.keys import events_key, job_key

TERMINAL_TYPES = ("done", "failed", "cancelled")
BLOCK_MS = 5_000  # one XREAD BLOCK at most; also how late we notice a client that went away
# A Redis stream id: <ms>-<seq>, each an unsigned 64-bit number.
STREAM_ID = re.compile(r"^(\d{1,20})(?:-(\d{1,20}))?$")

open_streams: Counter[str] = Counter()  # token name -> streams open now (one event loop: no lock)


class CountedStream(StreamingResponse):
    """An event stream counted in open_streams[token_name] from its creation until the
    response ends, however it ends (finished, client gone, error)."""

    def __init__(self, body: AsyncIterator[str], token_name: str, on_close: Callable[[], Awaitable[None]] | None = None):
        # no-cache / no buffering: proxies (nginx) must pass each event on at once.
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.token_name, self.on_close = token_name, on_close
        open_streams[token_name] += 1

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            open_streams[self.token_name] -= 1
            if open_streams[self.token_name] <= 0:
                del open_streams[self.token_name]
            if self.on_close is not None:  # also when the client went away: the body is then left unfinished
                await self.on_close()


def valid_stream_id(text: str) -> bool:
    m = STREAM_ID.fullmatch(text)
    return bool(m) and all(int(part) < 2**64 for part in m.groups() if part is not None)


def format_event(event: dict[str, Any], event_id: str | None = None) -> str:
    head = f"id: {event_id}\n" if event_id else ""
    return f"{head}data: {json.dumps(event)}\n\n"


def terminal_event(status: str, error: str | None, adapter_path: str | None) -> dict[str, Any]:
    """The terminal event a finished job would have written (used when it is not in the stream)."""
    if status == "completed":
        event: dict[str, Any] = {"type": "done", "adapter_path": adapter_path}
    elif status == "failed":
        event = {"type": "failed", "error": error}
    else:
        event = {"type": "cancelled"}
    return {**event, "synthesized": True}


def _s(value: bytes | None) -> str | None:
    return None if value is None else value.decode(errors="replace")


async def status_and_owner(r: redis.asyncio.Redis, job_id: str) -> tuple[str | None, str | None]:
    status, owner = await r.hmget(job_key(job_id), "status", "owner")
    return _s(status), _s(owner)


async def job_events(r: redis.asyncio.Redis, job_id: str, after: str, keepalive_s: float) -> AsyncIterator[str]:
    """Replay the job's events after `after`, then follow new ones until a terminal event.
    After keepalive_s (MTQ_SSE_KEEPALIVE_S) without an event, a comment (`: keep-alive`) keeps
    proxies from closing the stream; clients must skip it (it carries no data)."""
    block_ms = min(BLOCK_MS, max(1, int(keepalive_s * 1000)))
    try:
        last_sent = time.monotonic()
        last_type = None
        while True:
            # The status is read *before* the events: once the job is finished and nothing
            # is left to read, the stream ends. A terminal event seen while the job is not
            # finished is history (the job was resumed since), so we keep following. If the
            # stream's last event is not terminal (trimmed, or the job was finished without
            # one), we make one up from the record.
            status = _s(await r.hget(job_key(job_id), "status"))
            if status is None:
                return  # deleted while we were streaming
            finished = status in lifecycle.FINISHED
            events = decode_events(
                await r.xread({events_key(job_id): after}, count=100, block=None if finished else block_ms)
            )
            for event_id, event in events:
                yield format_event(event, event_id)
                after, last_type = event_id, event.get("type")
            if events:
                last_sent = time.monotonic()
            elif finished:
                status, error, adapter_path = map(_s, await r.hmget(job_key(job_id), "status", "error", "adapter_path"))
                if status is not None and last_type not in TERMINAL_TYPES:
                    yield format_event(terminal_event(status, error, adapter_path))
                return
            elif time.monotonic() - last_sent >= keepalive_s:
                yield ": keep-alive\n\n"
                last_sent = time.monotonic()
    except (RedisConnectionError, RedisTimeoutError) as exc:
        # The 200 and headers are already sent, so a 503 is no longer possible: say so in
        # the stream and end it; the client can reconnect with Last-Event-ID.
        yield f"event: error\ndata: {json.dumps({'detail': f'Redis is unavailable: {exc}'})}\n\n"
