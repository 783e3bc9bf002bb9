"""A job's event stream (shared.keys.events_key): entries whose field `data` holds one event's
JSON, capped at EVENTS_MAXLEN. The lifecycle and the fenced writes append to it; the API's
event stream (api/sse.py) reads it."""

import json
from typing import Any

from shared.keys import EVENTS_MAXLEN, events_key


def append_event(r, job_id: str, event: dict[str, Any]) -> None:
    """Append an event (r: a Redis client, or a pipeline the caller executes)."""
    r.xadd(events_key(job_id), {"data": json.dumps(event)}, maxlen=EVENTS_MAXLEN, approximate=True)


def decode_events(xread_result: list) -> list[tuple[str, dict[str, Any]]]:
    """(id, event) pairs from XREAD's answer for one stream."""
    if not xread_result:
        return []
    return [(eid.decode(), json.loads(fields[b"data"])) for eid, fields in xread_result[0][1]]
