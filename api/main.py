"""The REST API: `mtq api` serves `app` with uvicorn. OpenAPI docs at /docs.

This process only reads and writes Redis; training happens in `mtq worker`. It must never
import mlx (nor anything from worker/), so that it starts fast and runs anywhere.
"""

import logging
import re
from urllib.parse import unquote_plus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import OutOfMemoryError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.deps import get_settings, get_tokens, redis_trouble
from api.routes import (adapters, files, health, logprob, metrics, models, openai_chat, openai_files, openai_graders,
                        openai_jobs, openai_models, reward_score, tinker_futures, tinker_runs, tinker_sampling,
                        tinker_sessions, tinker_training, ui)
from api.routes.job_routes import ROUTERS as JOB_ROUTERS

get_tokens()  # a broken MTQ_TOKENS_FILE stops the API at start, not at its first request
# Query parameters whose values the access log never shows: api/deps.py query_token's (key,
# api_key) and whatever a client may have meant as one (KEY, access_token, Api-Key, ...), which
# the auth refuses but the log would keep.
SECRET_PARAM = re.compile(r"key|token|secret|passw|auth|sig", re.IGNORECASE)
REDACTED = "<redacted>"


def without_query_tokens(path: str, tokens: list[str]) -> str:
    """A request path as the access log may show it: the values of parameters that may hold a
    token (SECRET_PARAM, in any case and percent-encoding of the name) replaced, and any part
    of it (a parameter or its value, a path segment) that holds one of the API's `tokens`."""

    def holds_token(text: str) -> bool:
        decoded = unquote_plus(text)
        return any(token in decoded for token in tokens)

    def shown(part: str) -> str:
        name, eq, value = part.partition("=")
        if holds_token(name):
            return REDACTED
        if SECRET_PARAM.search(unquote_plus(name)) or holds_token(value):
            return f"{name}={REDACTED}"
        return REDACTED if holds_token(part) else part

    base, sep, query = path.partition("?")
    base = "/".join(REDACTED if holds_token(segment) else segment for segment in base.split("/"))
    return base + sep + "&".join(shown(part) for part in query.split("&")) if sep else base


class QueryTokensRedacted(logging.Filter):
    """uvicorn's access log writes every request's path with its query (a refused one too)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            tokens = [entry.token for entry in get_tokens()]
            record.args = tuple(without_query_tokens(a, tokens) if isinstance(a, str) else a for a in record.args)
        return True


logging.getLogger("uvicorn.access").addFilter(QueryTokensRedacted())

app = FastAPI(
    title="mlx-train-queue",
    version="0.1.0",
    summary="Fine-tuning of MLX language models (GRPO, SFT, DPO, ORPO, KTO, reward models), run as jobs behind a Redis queue.",
    description="Every `/admin` route needs `Authorization: Bearer <token>` (MTQ_API_TOKEN, or a token of MTQ_TOKENS_FILE).",
    # Answered with 413 while the body is read (Content-Length, or counting a chunked body).
    max_body_size=get_settings().max_body_bytes,
    # A path answers for itself: Starlette's slash redirect would send `jobs/<id>%2F` (an id
    # ending in '/') to job <id>, another job, with an undocumented 307.
    redirect_slashes=False,
)
app.include_router(health.router)
app.include_router(logprob.router)
app.include_router(models.router)
app.include_router(adapters.router)
app.include_router(metrics.router)
app.include_router(ui.router)
app.include_router(files.router)
app.include_router(reward_score.router)
# OpenAI's fine-tuning API under /v1 (docs/openai.md).
app.include_router(openai_files.router)
app.include_router(openai_jobs.router)
app.include_router(openai_graders.router)
# ...and its chat and text completions on base and fine-tuned models (docs/chat.md).
app.include_router(openai_chat.router)
app.include_router(openai_models.router)
# The Tinker API under /api/v1 (docs/sessions.md).
for router in (tinker_sessions.router, tinker_training.router, tinker_sampling.router, tinker_futures.router,
               tinker_runs.router):
    app.include_router(router)
# One per job kind (shared/kinds.py), last: SFT's /admin/api/fine-tune/jobs/{job_id} would take
# the fixed paths below it (e.g. /admin/api/fine-tune/jobs/models) for job ids.
for router in JOB_ROUTERS:
    app.include_router(router)


def _printable(text: str) -> str:
    # A message may quote the input, and the input may hold a lone surrogate: escape it.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def readable(error: dict) -> str:
    """One validation error in words, with the seed server's wording where it has one."""
    where, *path = error["loc"]
    field = ".".join(str(p) for p in path)
    msg = error["msg"].removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
    if where != "body":
        name = {"query": "query parameter ", "header": "header ", "path": "path parameter "}.get(str(where), "")
        return f"{name}{field}: {msg}"
    if path == ["model_id"] and error["type"] in ("missing", "string_too_short"):
        return "model_id is required"
    if path == ["prompts"] and error["type"] in ("missing", "too_short", "list_type"):
        return "prompts (non-empty list) required"
    if path[:1] in (["prompts"], ["validation_prompts"]) and len(path) > 1:  # one error per union branch: say it once
        return f"{path[0]}[{path[1]}] must be a string, a list of chat messages or an item {{prompt, ...}}"
    if path == ["preference_pairs"] and error["type"] in ("missing", "too_short", "list_type"):
        return "preference_pairs (non-empty list) required"
    if path[:1] == ["preference_pairs"] and len(path) > 1:
        return f"preference_pairs[{path[1]}] must have prompt/chosen/rejected ({'.'.join(map(str, path[2:])) or 'pair'}: {msg})"
    if path[:1] == ["config"]:
        if error["type"] == "extra_forbidden":
            return f"Invalid config: unknown field {path[-1]!r}"
        return f"Invalid config: {field.removeprefix('config').lstrip('.') + ': ' if len(path) > 1 else ''}{msg}"
    if not path:
        return "request body is required" if error["type"] == "missing" else msg
    return f"{field}: {msg}"


@app.exception_handler(RequestValidationError)
async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The one place that answers invalid input: 400 with the errors in words in `detail` (as
    # the seed server), and as a list under `errors`. Only loc, msg and type are sent back:
    # FastAPI's default also echoes the input, which may not be encodable as JSON (NaN).
    errors = [{"loc": [_printable(str(p)) if isinstance(p, str) else p for p in e["loc"]],
               "msg": _printable(e["msg"]), "type": e["type"]} for e in exc.errors()]
    detail = "; ".join(dict.fromkeys(readable(e) for e in errors))
    return JSONResponse(status_code=400, content={"detail": detail, "errors": errors})


_fastapi_openapi = app.openapi


def openapi() -> dict:
    """FastAPI's schema, saying what this API answers to invalid input: 400, not 422."""
    schema = _fastapi_openapi()
    for item in schema["paths"].values():
        for operation in item.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", {"description": "Invalid request: `detail` says why in words, "
                                             "`errors` lists the fields.", "content": {"application/json": {}}})
    return schema


app.openapi = openapi  # type: ignore[method-assign]


@app.exception_handler(RedisConnectionError)
@app.exception_handler(RedisTimeoutError)
@app.exception_handler(OutOfMemoryError)
async def redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # A Redis outage (down, not answering within MTQ_REDIS_TIMEOUT_S, or full: maxmemory) is the
    # server's temporary state, not a bug: 503 (retry later), never 500.
    return JSONResponse(
        status_code=503, content={"detail": f"Redis is unavailable: {redis_trouble(exc)}"}, headers={"Retry-After": "5"}
    )
