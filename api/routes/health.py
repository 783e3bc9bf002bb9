"""GET /healthz: is the API up, and can it use Redis: reach it and write to it? (No auth: for
load balancers.) A Redis at its maxmemory answers reads but refuses writes: unavailable too."""

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError

from api.deps import RedisDep, redis_trouble

router = APIRouter(tags=["health"])
PROBE_KEY = "mtq:healthz"  # written on every check, expires at once


class Health(BaseModel):
    status: str
    redis: bool
    detail: str | None = None


@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health, "description": "Redis is unreachable, not answering, or out of memory."}},
)
def healthz(r: RedisDep):
    try:
        r.set(PROBE_KEY, b"1", px=1000)
    except RedisError as exc:
        body = Health(status="unavailable", redis=False, detail=f"Redis is unavailable: {redis_trouble(exc)}")
        return JSONResponse(status_code=503, content=body.model_dump())
    return Health(status="ok", redis=True)
