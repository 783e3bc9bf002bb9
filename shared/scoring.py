"""Scoring requests (log-probs, reward-model rewards): the API queues them, the workers'
training processes answer.

Why not rq jobs: a request takes milliseconds, and a worker busy with a training job must answer
it between two optimizer steps, on the model it already holds
(worker/runtime/score_requests.py). rq runs one job per worker at a time, so scoring has queues
of its own, one per model, and within a queue one list per owner, served in turn (round robin):
one token's requests, however many or large, never make another's wait behind all of them.

    mtq:scoring:<queue>             list: the owners with requests waiting, in turn order (each once)
    mtq:scoring:<queue>:owners      set: the same owners
    mtq:scoring:<queue>:by:<owner>  list: that owner's request ids, oldest first
    mtq:scoring:<queue>:ready       list: one entry per request pushed; an idle worker waits on the
                                    ready lists of its models (BLPOP), a busy one takes one with its claim
    mtq:score:<id>                  hash: request (JSON), model_id, owner, queue, status (queued|running|
                                    done|failed), result (JSON) or error + error_status (the HTTP status)
    mtq:score:<id>:parts            list: the results of the rows answered so far (a request answered in parts)
    mtq:score:<id>:done             list: one element once the request is answered (the API waits on it)
    mtq:score:<id>:stream           list: a streamed completion's text deltas, {index, text} JSON, in order;
                                    all pushed before the answer (the API pops them first: BLPOP's key order)

A completion (type "generate": worker/runtime/completions.py) waits on the same queues, in the
same turns, and its record may say `cancelled` (its stream's client went away: the worker ends it).

<queue> is the model's key (shared/routing.py model_key) when a live worker offers the model
(or no worker is live at all: the request waits for the first), HUB for a Hugging Face id no
live worker has while one with --hub is live; otherwise `route` says None and the API answers
404 at once, so requests for models nobody has never wait in anyone's way. A worker serves a
request for at most a slice of time per turn; what is left goes back to the head of its
owner's list (worker/runtime/score_requests.py). Everything expires after SCORE_TTL_S.
"""

import json
import time
import uuid
from typing import Any

import redis

from shared import routing, workers

SCORE_TTL_S = 3600
HUB = "@hub"  # the queue of Hugging Face ids no live worker has (no model key starts with '@')


def queue_key(queue: str) -> str:
    return f"mtq:scoring:{queue}"


def score_key(request_id: str) -> str:
    return f"mtq:score:{request_id}"


def parts_key(request_id: str) -> str:
    return f"mtq:score:{request_id}:parts"


def done_key(request_id: str) -> str:
    return f"mtq:score:{request_id}:done"


def stream_key(request_id: str) -> str:
    return f"mtq:score:{request_id}:stream"


def ready_key(queue: str) -> str:
    return f"{queue_key(queue)}:ready"


# KEYS: the turn list, the owners set, the owner's list, the ready list. ARGV: owner, request id,
# "head" or "tail" (where in the owner's list), TTL.
PUSH = """
if ARGV[3] == 'head' then redis.call('LPUSH', KEYS[3], ARGV[2]) else redis.call('RPUSH', KEYS[3], ARGV[2]) end
if redis.call('SADD', KEYS[2], ARGV[1]) == 1 then redis.call('RPUSH', KEYS[1], ARGV[1]) end
redis.call('RPUSH', KEYS[4], 1)
for i = 1, 4 do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
"""

# KEYS: the turn list, the owners set, the ready list. ARGV: the owners' lists' key prefix, "1" to
# take one ready entry too (a busy worker's claim; an idle worker took one with BLPOP). The first
# owner in turn gives its oldest request and goes to the end of the turn if it has more.
CLAIM = """
if ARGV[2] == '1' then redis.call('LPOP', KEYS[3]) end
local owner = redis.call('LPOP', KEYS[1])
while owner do
  local id = redis.call('LPOP', ARGV[1] .. owner)
  if redis.call('LLEN', ARGV[1] .. owner) > 0 then redis.call('RPUSH', KEYS[1], owner)
  else redis.call('SREM', KEYS[2], owner) end
  if id then return id end
  owner = redis.call('LPOP', KEYS[1])
end
return false
"""


def route(r: redis.Redis, model_id: str) -> str | None:
    """The queue a request for `model_id` waits on, or None when no live worker can answer it
    (the API says 404: Model not found)."""
    live = workers.live_workers(r)
    key = routing.model_key(model_id)
    if not live or any(key in routing.served_models(w) for w in live):
        return key
    if routing.is_hub_id(model_id) and any(w.get("hub") for w in live):
        return HUB
    return None


def _push_keys(queue: str, owner: str) -> list[str]:
    return [queue_key(queue), f"{queue_key(queue)}:owners", f"{queue_key(queue)}:by:{owner}", ready_key(queue)]


def submit(r: redis.Redis, queue: str, owner: str, request: dict[str, Any]) -> str:
    """Queue a request of `owner` (a token's name) on `queue` (atomically with its record). Its id."""
    request_id = uuid.uuid4().hex
    with r.pipeline() as p:  # MULTI/EXEC: never a queued id without its record
        p.hset(score_key(request_id), mapping={"request": json.dumps(request), "model_id": request["model_id"],
                                               "owner": owner, "queue": queue, "status": "queued",
                                               "created_at": repr(time.time())})
        p.expire(score_key(request_id), SCORE_TTL_S)
        p.eval(PUSH, 4, *_push_keys(queue, owner), owner, request_id, "tail", SCORE_TTL_S)
        p.execute()
    return request_id


def put_back(r: redis.Redis, request_id: str) -> None:
    """A request answered in part goes back to the head of its owner's list (its owner's turn
    comes after the others')."""
    queue, owner = r.hmget(score_key(request_id), "queue", "owner")
    r.eval(PUSH, 4, *_push_keys(queue.decode(), owner.decode()), owner.decode(), request_id, "head", SCORE_TTL_S)


def claim(r: redis.Redis, queue: str, woken: bool = False) -> tuple[str, dict, list[dict]] | None:
    """The next request of `queue` in turn: (id, request, results of the rows answered so far),
    or None. woken: the caller took the queue's ready entry already (wait_for_ready)."""
    while True:
        item = r.eval(CLAIM, 3, queue_key(queue), f"{queue_key(queue)}:owners", ready_key(queue),
                      f"{queue_key(queue)}:by:", "0" if woken else "1")
        if item is None:
            return None
        request_id = item.decode()
        raw = r.hget(score_key(request_id), "request")
        if raw is not None:  # else it expired while queued: the next one
            r.hset(score_key(request_id), "status", "running")
            return request_id, json.loads(raw), [json.loads(x) for x in r.lrange(parts_key(request_id), 0, -1)]
        woken = False


def wait_for_ready(r: redis.Redis, queues: list[str], wait_s: float) -> str | None:
    """Wait up to wait_s (at least 10 ms: BLPOP's 0 would wait for ever) for a request on any of
    the queues; the queue that has one, or None."""
    if not queues:
        time.sleep(wait_s)
        return None
    item = r.blpop([ready_key(q) for q in queues], timeout=max(wait_s, 0.01))
    return None if item is None else item[0].decode().removeprefix(queue_key("")).removesuffix(":ready")


def add_part(r: redis.Redis, request_id: str, results: list[dict]) -> None:
    """Keep the results of rows answered so far (the rest comes at a later turn)."""
    with r.pipeline() as p:
        p.rpush(parts_key(request_id), *(json.dumps(x) for x in results))
        p.expire(parts_key(request_id), SCORE_TTL_S)
        p.execute()


def answer(r: redis.Redis, request_id: str, result: dict | None = None, error: str | None = None,
           error_status: int = 500) -> None:
    """Record the result (or the error, with the HTTP status the API should answer) and wake the waiter."""
    fields = {"status": "done", "result": json.dumps(result)} if error is None else {
        "status": "failed", "error": error, "error_status": error_status}
    with r.pipeline() as p:
        p.hset(score_key(request_id), mapping=fields)
        p.delete(parts_key(request_id))
        p.rpush(done_key(request_id), 1)
        p.expire(done_key(request_id), SCORE_TTL_S)
        p.execute()


def decode_record(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The record as the API reports it: status, owner, and result or error + error_status."""
    rec = {k.decode(): v.decode() for k, v in raw.items()}
    out: dict[str, Any] = {"status": rec.get("status", "queued"), "owner": rec.get("owner")}
    if "result" in rec:
        out["result"] = json.loads(rec["result"])
    if "error" in rec:
        out["error"], out["error_status"] = rec["error"], int(rec.get("error_status", 500))
    return out
