"""The REST API: `mtq api` serves `app` with uvicorn. OpenAPI docs at /docs.

This process only reads and writes Redis; training happens in `mtq worker`. It must never
import mlx (nor anything from worker/), so that it starts fast and runs anywhere.
"""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.deps import get_settings, get_tokens
from api.routes import files, grpo_jobs, health, logprob, reward_score
from api.routes.train_jobs import ROUTERS as TRAIN_JOB_ROUTERS

get_tokens()  # a broken MTQ_TOKENS_FILE stops the API at start, not at its first request

app = FastAPI(
    title="mlx-train-queue",
    version="0.1.0",
    summary="GRPO (LoRA) fine-tuning of MLX language models, run as jobs behind a Redis queue.",
    description="Every `/admin` route needs `Authorization: Bearer <token>` (MTQ_API_TOKEN, or a token of MTQ_TOKENS_FILE).",
    # Answered with 413 while the body is read (Content-Length, or counting a chunked body).
    max_body_size=get_settings().max_body_bytes,
)
app.include_router(health.router)
app.include_router(grpo_jobs.router)
app.include_router(logprob.router)
app.include_router(files.router)
app.include_router(reward_score.router)
for router in TRAIN_JOB_ROUTERS:
    app.include_router(router)


def _printable(text: str) -> str:
    # A message may quote the input, and the input may hold a lone surrogate: escape it.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@app.exception_handler(RequestValidationError)
async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    # The one place that answers invalid input (422 now). Only loc, msg and type are sent
    # back: FastAPI's default also echoes the input, which may not be encodable as JSON (NaN).
    errors = [{"loc": [_printable(str(p)) if isinstance(p, str) else p for p in e["loc"]],
               "msg": _printable(e["msg"]), "type": e["type"]} for e in exc.errors()]
    return JSONResponse(status_code=422, content={"detail": errors})


@app.exception_handler(RedisConnectionError)
@app.exception_handler(RedisTimeoutError)
async def redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # A Redis outage is the server's temporary state, not a bug: 503 (retry later), never 500.
    return JSONResponse(
        status_code=503, content={"detail": f"Redis is unavailable: {exc}"}, headers={"Retry-After": "5"}
    )
