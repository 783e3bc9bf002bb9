"""Re-queue the jobs of dead workers.

Every worker's heartbeat thread runs `Reaper.scan` every few seconds. A running job whose
lease key has been missing for longer than a grace period (so that a live owner gets a
chance to renew after, say, a Redis restart) is fenced (its lease epoch bumped, so the old
owner can write nothing more) and put back on the queue, or marked cancelled if a cancel
was requested; the next worker resumes it from its last checkpoint.
"""

import logging
import time

import redis

from shared.jobstore import EVENTS_MAXLEN, enqueue
from shared.keys import RUNNING_JOBS, events_key, job_key, lease_key
from worker.lease import retention_s

log = logging.getLogger(__name__)

# KEYS: job, lease, running, events. ARGV: job_id, now, maxlen, retention_s.
# Returns 0: nothing to do, -1: marked cancelled, n >= 1: re-queued as attempt n.
_REQUEUE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('SREM', KEYS[3], ARGV[1])
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return 0 end
redis.call('HINCRBY', KEYS[1], 'lease_epoch', 1)
local lost = redis.call('HGET', KEYS[1], 'worker') or ''
local step = tonumber(redis.call('HGET', KEYS[1], 'checkpoint_step') or '0')
if redis.call('HGET', KEYS[1], 'cancel_requested') == '1' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[2])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'data', cjson.encode({type = 'cancelled'}))
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[4], ARGV[4])
  return -1
end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'status', 'queued')
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[3], '*', 'data', cjson.encode(
  {type = 'requeued', reason = 'worker lost', lost_worker = lost, checkpoint_step = step, attempt = attempt}))
return attempt
"""


class Reaper:
    def __init__(self, r: redis.Redis, grace_s: float):
        self.r, self.grace_s = r, grace_s
        self.missing_since: dict[str, float] = {}

    def scan(self) -> list[str]:
        """Re-queue (or cancel) jobs whose lease has been gone for grace_s. Returns their ids."""
        running = [j.decode() for j in self.r.smembers(RUNNING_JOBS)]
        with self.r.pipeline() as p:
            for job_id in running:
                p.exists(lease_key(job_id))
            alive = p.execute()
        now = time.monotonic()
        self.missing_since = {j: self.missing_since.get(j, now) for j, a in zip(running, alive) if not a}
        reaped = []
        for job_id, since in list(self.missing_since.items()):
            if now - since < self.grace_s:
                continue
            keys = (job_key(job_id), lease_key(job_id), RUNNING_JOBS, events_key(job_id))
            result = self.r.eval(_REQUEUE, 4, *keys, job_id, repr(time.time()), EVENTS_MAXLEN, retention_s())
            del self.missing_since[job_id]
            if result >= 1:
                enqueue(self.r, job_id, attempt=int(result))
                log.warning("job %s: its worker is gone; re-queued (attempt %d)", job_id, result)
            if result != 0:
                reaped.append(job_id)
        return reaped
