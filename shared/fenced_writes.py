"""Fenced writes: what the worker holding a running job writes without changing its status
(progress, events, the checkpoint and adapter copies), and its lease renewal. "Fenced": only
while its lease epoch is the job's current `lease_epoch` and the job is running, checked and
written in one Lua script, so a worker that lost the job (paused past its lease, then resumed)
changes nothing and gets LeaseLost. Status changes: shared/lifecycle.py."""

import json
from typing import Any

import redis

from shared.keys import EVENTS_MAXLEN, events_key, job_key, lease_key


class LeaseLost(Exception):
    """Another worker owns the job now (or it ended); this one must stop touching it."""


# KEYS: job, events, blobs (or ''). ARGV: epoch, event json ('' none), maxlen, nblobs, blob pairs..., field pairs...
_FENCED_WRITE = """
if redis.call('HGET', KEYS[1], 'lease_epoch') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'status') ~= 'running' then
  return 0
end
local n = tonumber(ARGV[4])
if n > 0 then
  redis.call('DEL', KEYS[3])
  for i = 5, 4 + 2 * n, 2 do redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 1]) end
end
for i = 5 + 2 * n, #ARGV, 2 do
  if ARGV[i + 1] == '' then redis.call('HDEL', KEYS[1], ARGV[i]) else redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
end
if ARGV[2] ~= '' then return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'data', ARGV[2]) end
return 1
"""

# KEYS: job, lease. ARGV: epoch, ttl_ms.
_RENEW = """
if redis.call('HGET', KEYS[1], 'lease_epoch') ~= ARGV[1] or redis.call('HGET', KEYS[1], 'status') ~= 'running' then
  return 0
end
redis.call('SET', KEYS[2], redis.call('HGET', KEYS[1], 'worker') .. ':' .. ARGV[1], 'PX', ARGV[2])
return 1
"""


def write(r: redis.Redis, job_id: str, epoch: int, event: dict | None = None, blobs_key: str | None = None,
          blobs: dict[str, bytes] | None = None, **fields: Any) -> str | None:
    """Set job fields, append an event, replace a blob hash (checkpoint, adapter): all or
    nothing, and only while `epoch` holds the job. Raises LeaseLost otherwise. Returns the
    event's stream id (None without an event)."""
    blobs = blobs or {}
    args: list = [epoch, json.dumps(event) if event else "", EVENTS_MAXLEN, len(blobs)]
    for name, blob in blobs.items():
        args += [name, blob]
    args += field_args(fields)
    keys = (job_key(job_id), events_key(job_id), blobs_key or job_key(job_id) + ":none")
    written = r.eval(_FENCED_WRITE, 3, *keys, *args)
    if written == 0:
        raise LeaseLost(f"job {job_id}: lease epoch {epoch} is no longer current")
    if isinstance(written, int):
        return None  # no event
    return written.decode() if isinstance(written, bytes) else written


def renew(r: redis.Redis, job_id: str, epoch: int, lease_ttl_s: float) -> bool:
    """Heartbeat: extend the lease. False once the job belongs to someone else (or ended)."""
    return r.eval(_RENEW, 2, job_key(job_id), lease_key(job_id), epoch, int(lease_ttl_s * 1000)) == 1


def field_args(fields: dict[str, Any]) -> list[str]:
    """Hash fields as the Lua script takes them: name, value, ...; '' means delete the field."""
    args: list[str] = []
    for name, value in fields.items():
        args += [name, "" if value is None else value if isinstance(value, str) else encode(value)]
    return args


def encode(value: Any) -> str:
    if hasattr(value, "model_dump_json"):
        return value.model_dump_json()
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)
