"""The REST API: `mtq api` serves `app` with uvicorn. OpenAPI docs at /docs.

This process only reads and writes Redis; training happens in `mtq worker`. It must never
import mlx (nor anything from worker/), so that it starts fast and runs anywhere.
"""

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from api.routes import grpo_jobs, health

app = FastAPI(
    title="mlx-train-queue",
    version="0.1.0",
    summary="GRPO (LoRA) fine-tuning of MLX language models, run as jobs behind a Redis queue.",
    description="Every `/admin` route needs `Authorization: Bearer $MTQ_API_TOKEN`.",
)
app.include_router(health.router)
app.include_router(grpo_jobs.router)


@app.exception_handler(RedisConnectionError)
@app.exception_handler(RedisTimeoutError)
async def redis_unavailable(request: Request, exc: Exception) -> JSONResponse:
    # A Redis outage is the server's temporary state, not a bug: 503 (retry later), never 500.
    return JSONResponse(
        status_code=503, content={"detail": f"Redis is unavailable: {exc}"}, headers={"Retry-After": "5"}
    )
