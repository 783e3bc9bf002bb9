"""Log-prob scoring requests: the API queues them, the workers' training processes answer.

Why not rq jobs: a request takes milliseconds, and a worker busy with a training job must
answer it between two optimizer steps, on the model it already holds (worker/scoring.py).
rq runs one job per worker at a time, so scoring gets its own queue, a Redis list:

    mtq:scoring               list of "<model_id>\\t<request id>", oldest first
    mtq:score:<id>            hash: request (JSON), model_id, status (queued|running|done|failed),
                              result (JSON) or error + error_status (the HTTP status to answer)
    mtq:score:<id>:done       list: one element once the request is answered (the API waits on it)

An idle training process takes any request (BLPOP, loading the model if it must); a busy one
takes only requests for the model it trains (LRANGE, then LREM claims one: if two workers
race for it, one LREM removes it and the other gets 0). Everything expires after SCORE_TTL_S.
"""

import json
import time
import uuid
from typing import Any

import redis

SCORING_QUEUE = "mtq:scoring"
SCORE_TTL_S = 3600
SCAN = 100  # how far down the queue a busy worker looks for requests for its model


def score_key(request_id: str) -> str:
    return f"mtq:score:{request_id}"


def done_key(request_id: str) -> str:
    return f"mtq:score:{request_id}:done"


def submit(r: redis.Redis, model_id: str, request: dict[str, Any]) -> str:
    """Queue a request (atomically with its record). Returns its id."""
    request_id = uuid.uuid4().hex
    with r.pipeline() as p:  # MULTI/EXEC: never a queued id without its record
        p.hset(score_key(request_id), mapping={"request": json.dumps(request), "model_id": model_id,
                                               "status": "queued", "created_at": repr(time.time())})
        p.expire(score_key(request_id), SCORE_TTL_S)
        p.rpush(SCORING_QUEUE, f"{model_id}\t{request_id}")
        p.execute()
    return request_id


def _take(r: redis.Redis, item: bytes | str) -> tuple[str, dict] | None:
    request_id = (item.decode() if isinstance(item, bytes) else item).split("\t", 1)[1]
    raw = r.hget(score_key(request_id), "request")
    if raw is None:  # expired while queued
        return None
    r.hset(score_key(request_id), "status", "running")
    return request_id, json.loads(raw)


def claim_any(r: redis.Redis, wait_s: float = 0.0) -> tuple[str, dict] | None:
    """The oldest request for any model, waiting up to wait_s (0: not at all): (id, request) or None."""
    if wait_s > 0:
        item = r.blpop([SCORING_QUEUE], timeout=wait_s)
        item = None if item is None else item[1]
    else:
        item = r.lpop(SCORING_QUEUE)
    return None if item is None else _take(r, item)


def claim_for_model(r: redis.Redis, model_id: str) -> tuple[str, dict] | None:
    """The oldest request for `model_id` near the head of the queue, or None (no waiting)."""
    prefix = f"{model_id}\t".encode()
    for item in r.lrange(SCORING_QUEUE, 0, SCAN - 1):
        if item.startswith(prefix) and r.lrem(SCORING_QUEUE, 1, item) == 1:
            return _take(r, item)
    return None


def answer(r: redis.Redis, request_id: str, result: dict | None = None, error: str | None = None,
           error_status: int = 500) -> None:
    """Record the result (or the error, with the HTTP status the API should answer) and wake the waiter."""
    fields = {"status": "done", "result": json.dumps(result)} if error is None else {
        "status": "failed", "error": error, "error_status": error_status}
    with r.pipeline() as p:
        p.hset(score_key(request_id), mapping=fields)
        p.rpush(done_key(request_id), 1)
        p.expire(done_key(request_id), SCORE_TTL_S)
        p.execute()


def decode_record(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The record as the API reports it: status, and result or error + error_status."""
    rec = {k.decode(): v.decode() for k, v in raw.items()}
    out: dict[str, Any] = {"status": rec.get("status", "queued")}
    if "result" in rec:
        out["result"] = json.loads(rec["result"])
    if "error" in rec:
        out["error"], out["error_status"] = rec["error"], int(rec.get("error_status", 500))
    return out
