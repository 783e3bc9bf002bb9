"""Tinker sessions in Redis (docs/sessions.md): the sessions, the calls their clients make and
the futures that answer them, the training runs (one per Tinker model id), their checkpoints,
and the sampling sessions. The API writes sessions, calls, runs and samplers
(api/routes/tinker_*.py); a session's job on a worker (worker/kinds/session_job.py) takes the
calls in order, answers them, and writes the checkpoints.

    mtq:tinker:session:<sid>           hash: owner, tenant?, created_at, seen_at (last heartbeat or call),
                                       finished_at?, tags, user_metadata, display_name
    mtq:tinker:session:<sid>:jobs      hash: base model -> the session's job on it (shared/session_specs.py)
    mtq:tinker:session:<sid>:runs      sorted set: the session's training runs (model ids) by creation
    mtq:tinker:session:<sid>:samplers  sorted set: its sampling sessions by creation
    mtq:tinker:sessions                sorted set: sid -> created_at
    mtq:tinker:calls:<job_id>          list: the ids of the calls waiting for the job, oldest first
    mtq:tinker:future:<id>             hash: call (JSON: type, model_id, ...), body (bytes: a forward_backward's
                                       protobuf), job_id, owner, status (pending|done|failed), and then result
                                       (bytes) + content_type, or error + category (Tinker's: user|server)
    mtq:tinker:future:<id>:done        list: one element once answered (the API's long poll waits on it)
    mtq:tinker:run:<model_id>          hash: the training run: owner, session_id, job_id, base_model,
                                       lora (JSON: Tinker's LoraConfig), created_at, last_request_at, user_metadata
    mtq:tinker:runs                    sorted set: model_id -> created_at
    mtq:tinker:run:<model_id>:ckpts    hash: checkpoint id ("weights/<name>" | "sampler_weights/<name>") -> JSON
                                       {time, size_bytes, expires_at?, user_metadata?}
    mtq:tinker:ckpt:<model_id>:<checkpoint id>   hash: file name -> bytes (TTL: its ttl_seconds, if any)
    mtq:tinker:sampler:<sampler_id>    hash: owner, session_id, job_id, base_model, model_path ("" for the base
                                       model), adapter (the checkpoint whose weights it samples with, or "")

A Tinker model id is `<sid>:train:<n>` and a sampler id `<sid>:sample:<n>` (the SDK builds them
from the session id and its own counters); a checkpoint's path is
`tinker://<model_id>/<checkpoint id>`. Futures expire FUTURE_TTL_S after their call; sessions
and runs SESSION_TTL_S after their last use; checkpoints live until deleted (or their ttl_seconds).
"""

import json
import time
import uuid
from typing import Any

import redis

FUTURE_TTL_S = 3600
SESSION_TTL_S = 7 * 86_400
SESSIONS = "mtq:tinker:sessions"
RUNS = "mtq:tinker:runs"
TINKER_SCHEME = "tinker://"
SEGMENTS = ("weights", "sampler_weights")  # of a checkpoint id: a training state, a sampler's weights


def session_key(sid: str) -> str:
    return f"mtq:tinker:session:{sid}"


def calls_key(job_id: str) -> str:
    return f"mtq:tinker:calls:{job_id}"


def future_key(request_id: str) -> str:
    return f"mtq:tinker:future:{request_id}"


def run_key(model_id: str) -> str:
    return f"mtq:tinker:run:{model_id}"


def checkpoint_key(model_id: str, checkpoint_id: str) -> str:
    return f"mtq:tinker:ckpt:{model_id}:{checkpoint_id}"


def sampler_key(sampler_id: str) -> str:
    return f"mtq:tinker:sampler:{sampler_id}"


def _decoded(h: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in h.items()}


# --------------------------------------------------------------------------- sessions


def create_session(r: redis.Redis, owner: str, tenant: str | None, tags: list[str], user_metadata: dict[str, str],
                   display_name: str | None) -> str:
    sid = uuid.uuid4().hex
    now = repr(time.time())
    fields = {"owner": owner, "created_at": now, "seen_at": now, "tags": json.dumps(tags),
              "user_metadata": json.dumps(user_metadata), "display_name": display_name or "",
              **({"tenant": tenant} if tenant else {})}
    with r.pipeline() as p:
        p.hset(session_key(sid), mapping=fields)
        p.expire(session_key(sid), SESSION_TTL_S)
        p.zadd(SESSIONS, {sid: float(now)})
        p.execute()
    return sid


def get_session(r: redis.Redis, sid: str) -> dict[str, str] | None:
    h = r.hgetall(session_key(sid))
    return _decoded(h) if h else None


def seen(r: redis.Redis, sid: str) -> None:
    """A heartbeat or a call: the session is in use (its jobs end after idle_timeout_s without one)."""
    with r.pipeline() as p:
        p.hset(session_key(sid), "seen_at", repr(time.time()))
        p.expire(session_key(sid), SESSION_TTL_S)
        p.execute()


def finish_session(r: redis.Redis, sid: str) -> None:
    """The client is done: the session's jobs end once the calls before this are answered."""
    r.hsetnx(session_key(sid), "finished_at", repr(time.time()))


def session_ended(r: redis.Redis, sid: str, idle_timeout_s: float) -> str | None:
    """Why the session's jobs should end now (finished, idle, gone), or None."""
    finished_at, seen_at = r.hmget(session_key(sid), "finished_at", "seen_at")
    if seen_at is None:
        return "the session is gone"
    if finished_at is not None:
        return "the client finished the session"
    idle = time.time() - float(seen_at)
    return f"no heartbeat or call for {idle:.0f} s (idle_timeout_s)" if idle > idle_timeout_s else None


def list_sessions(r: redis.Redis, owner: str | None, offset: int, limit: int) -> list[str]:
    """Session ids, newest first (an owner's only, when given)."""
    out, start = [], 0
    while len(out) < offset + limit:
        page = r.zrevrange(SESSIONS, start, start + 499)
        if not page:
            break
        start += len(page)
        owners = [r.hget(session_key(s.decode()), "owner") for s in page] if owner is not None else []
        out += [s.decode() for i, s in enumerate(page) if owner is None or (owners[i] or b"").decode() == owner]
    return out[offset:offset + limit]


def session_members(r: redis.Redis, sid: str, what: str) -> list[str]:
    """The session's "runs" or "samplers", oldest first."""
    return [m.decode() for m in r.zrange(f"{session_key(sid)}:{what}", 0, -1)]


def _add_member(p, sid: str, what: str, member: str, now: float) -> None:
    p.zadd(f"{session_key(sid)}:{what}", {member: now})
    p.expire(f"{session_key(sid)}:{what}", SESSION_TTL_S)


def session_jobs(r: redis.Redis, sid: str) -> dict[str, str]:
    """base model -> the session's job on it."""
    return _decoded(r.hgetall(f"{session_key(sid)}:jobs"))


def set_session_job(r: redis.Redis, sid: str, base_model: str, job_id: str) -> None:
    with r.pipeline() as p:
        p.hset(f"{session_key(sid)}:jobs", base_model, job_id)
        p.expire(f"{session_key(sid)}:jobs", SESSION_TTL_S)
        p.execute()


# --------------------------------------------------------------------------- calls and futures


def submit_call(r: redis.Redis, job_id: str, owner: str, call: dict[str, Any], body: bytes = b"") -> str:
    """Queue a call for the session's job; the id of its future."""
    request_id = uuid.uuid4().hex
    with r.pipeline() as p:  # MULTI/EXEC: never a queued id without its record
        p.hset(future_key(request_id), mapping={"call": json.dumps(call), "body": body, "job_id": job_id,
                                                "owner": owner, "status": "pending", "created_at": repr(time.time())})
        p.expire(future_key(request_id), FUTURE_TTL_S)
        p.rpush(calls_key(job_id), request_id)
        p.expire(calls_key(job_id), FUTURE_TTL_S)
        p.execute()
    return request_id


def next_call(r: redis.Redis, job_id: str, wait_s: float) -> tuple[str, dict[str, Any], bytes] | None:
    """The job's oldest waiting call (waiting up to wait_s for one): (id, call, body), or None."""
    while True:
        item = r.blpop([calls_key(job_id)], timeout=max(wait_s, 0.01))
        if item is None:
            return None
        request_id = item[1].decode()
        call, body = r.hmget(future_key(request_id), "call", "body")
        if call is not None:  # else it expired while queued: the next one
            return request_id, json.loads(call), body or b""
        wait_s = 0.01


def answer(r: redis.Redis, request_id: str, result: bytes, content_type: str = "application/json") -> None:
    _settle(r, request_id, {"status": "done", "result": result, "content_type": content_type})


def fail(r: redis.Redis, request_id: str, error: str, category: str = "user") -> None:
    """Tinker's categories: `user` (the request was wrong; retrying will not help), `server`."""
    _settle(r, request_id, {"status": "failed", "error": error, "category": category})


def _settle(r: redis.Redis, request_id: str, fields: dict[str, Any]) -> None:
    with r.pipeline() as p:
        p.hset(future_key(request_id), mapping={**fields, "body": b""})  # the request's bytes are spent
        p.rpush(done_key(request_id), 1)
        p.expire(done_key(request_id), FUTURE_TTL_S)
        p.execute()


def unqueue(r: redis.Redis, job_id: str, request_id: str) -> bool:
    """Take a call off its job's queue, if the job has not taken it yet."""
    return bool(r.lrem(calls_key(job_id), 0, request_id))


def fail_waiting(r: redis.Redis, job_id: str, error: str) -> int:
    """Fail every call still queued for the job (it ended); how many."""
    failed = 0
    while (item := r.lpop(calls_key(job_id))) is not None:
        if r.exists(future_key(item.decode())):
            fail(r, item.decode(), error, "server")
            failed += 1
    return failed


def get_future(r: redis.Redis, request_id: str) -> dict[str, Any] | None:
    return future_record(r.hgetall(future_key(request_id)))


def future_record(h: dict[bytes, bytes]) -> dict[str, Any] | None:
    """A future's hash as read (an async client's too): status, owner, job_id, call, and result
    (bytes) + content_type or error + category; None if unknown or expired."""
    if not h:
        return None
    rec: dict[str, Any] = {k.decode(): v.decode() for k, v in h.items() if k not in (b"body", b"result")}
    rec["call"] = json.loads(rec["call"])
    if b"result" in h:
        rec["result"] = h[b"result"]
    return rec


def done_key(request_id: str) -> str:
    return f"{future_key(request_id)}:done"


# --------------------------------------------------------------------------- training runs and checkpoints


def create_run(r: redis.Redis, model_id: str, owner: str, session_id: str, job_id: str, base_model: str,
               lora: dict[str, Any], user_metadata: dict[str, str]) -> None:
    now = repr(time.time())
    with r.pipeline() as p:
        p.hset(run_key(model_id), mapping={"owner": owner, "session_id": session_id, "job_id": job_id,
                                           "base_model": base_model, "lora": json.dumps(lora), "created_at": now,
                                           "last_request_at": now, "user_metadata": json.dumps(user_metadata)})
        p.expire(run_key(model_id), SESSION_TTL_S)
        p.zadd(RUNS, {model_id: float(now)})
        _add_member(p, session_id, "runs", model_id, float(now))
        p.execute()


def get_run(r: redis.Redis, model_id: str) -> dict[str, Any] | None:
    h = r.hgetall(run_key(model_id))
    if not h:
        return None
    run: dict[str, Any] = _decoded(h)
    run["lora"], run["user_metadata"] = json.loads(run["lora"]), json.loads(run["user_metadata"])
    return run


def touch_run(r: redis.Redis, model_id: str) -> None:
    with r.pipeline() as p:
        p.hset(run_key(model_id), "last_request_at", repr(time.time()))
        p.expire(run_key(model_id), SESSION_TTL_S)
        p.execute()


def list_runs(r: redis.Redis, owner: str | None, offset: int, limit: int) -> tuple[list[str], int]:
    """Training runs' model ids, newest first, and how many there are (an owner's only, when given)."""
    ids = [m.decode() for m in r.zrevrange(RUNS, 0, -1)]
    if owner is not None:
        ids = [m for m in ids if (r.hget(run_key(m), "owner") or b"").decode() == owner]
    return ids[offset:offset + limit], len(ids)


def tinker_path(model_id: str, checkpoint_id: str) -> str:
    return f"{TINKER_SCHEME}{model_id}/{checkpoint_id}"


def parse_path(path: str) -> tuple[str, str]:
    """(model_id, checkpoint_id) of `tinker://<model_id>/<segment>/<name>`; ValueError naming what is wrong."""
    parts = path.removeprefix(TINKER_SCHEME).split("/") if path.startswith(TINKER_SCHEME) else []
    if len(parts) != 3 or not all(parts) or parts[1] not in SEGMENTS:
        raise ValueError(f"not a checkpoint path of this server: {path!r} (tinker://<model id>/weights|sampler_weights/<name>)")
    return parts[0], f"{parts[1]}/{parts[2]}"


def save_checkpoint(r: redis.Redis, model_id: str, checkpoint_id: str, files: dict[str, bytes],
                    ttl_seconds: int | None, user_metadata: dict[str, str] | None) -> dict[str, Any]:
    """Store a checkpoint's files (replacing one of the same id) and list it on its run; its metadata."""
    meta = {"time": time.time(), "size_bytes": sum(len(b) for b in files.values()),
            "expires_at": time.time() + ttl_seconds if ttl_seconds else None, "user_metadata": user_metadata}
    key = checkpoint_key(model_id, checkpoint_id)
    with r.pipeline() as p:
        p.delete(key)
        p.hset(key, mapping=files)
        if ttl_seconds:
            p.expire(key, ttl_seconds)
        p.hset(f"{run_key(model_id)}:ckpts", checkpoint_id, json.dumps(meta))
        p.execute()
    return meta


def checkpoints(r: redis.Redis, model_id: str) -> dict[str, dict[str, Any]]:
    """checkpoint id -> metadata, of the run's checkpoints that still exist."""
    listed = {k.decode(): json.loads(v) for k, v in r.hgetall(f"{run_key(model_id)}:ckpts").items()}
    gone = [c for c in listed if not r.exists(checkpoint_key(model_id, c))]
    if gone:  # expired (ttl_seconds): forget them
        r.hdel(f"{run_key(model_id)}:ckpts", *gone)
    return {c: m for c, m in listed.items() if c not in gone}


def checkpoint_files(r: redis.Redis, model_id: str, checkpoint_id: str) -> dict[str, bytes]:
    return {k.decode(): v for k, v in r.hgetall(checkpoint_key(model_id, checkpoint_id)).items()}


def delete_checkpoint(r: redis.Redis, model_id: str, checkpoint_id: str) -> bool:
    with r.pipeline() as p:
        p.delete(checkpoint_key(model_id, checkpoint_id))
        p.hdel(f"{run_key(model_id)}:ckpts", checkpoint_id)
        deleted, _ = p.execute()
    return bool(deleted)


# --------------------------------------------------------------------------- sampling sessions


def create_sampler(r: redis.Redis, sampler_id: str, owner: str, session_id: str, job_id: str, base_model: str,
                   model_path: str = "", adapter: str = "") -> None:
    """A sampling session: the base model's weights, or those of a checkpoint (model_path, and
    `adapter` its model_id/checkpoint id)."""
    with r.pipeline() as p:
        p.hset(sampler_key(sampler_id), mapping={"owner": owner, "session_id": session_id, "job_id": job_id,
                                                 "base_model": base_model, "model_path": model_path, "adapter": adapter})
        p.expire(sampler_key(sampler_id), SESSION_TTL_S)
        _add_member(p, session_id, "samplers", sampler_id, time.time())
        p.execute()


def get_sampler(r: redis.Redis, sampler_id: str) -> dict[str, str] | None:
    h = r.hgetall(sampler_key(sampler_id))
    return _decoded(h) if h else None
