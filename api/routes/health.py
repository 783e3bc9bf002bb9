"""GET /healthz: is the API up, and can it reach Redis? (No auth: for load balancers.)"""

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError

from api.deps import RedisDep

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str
    redis: bool
    detail: str | None = None


@router.get(
    "/healthz",
    response_model=Health,
    response_model_exclude_none=True,
    responses={503: {"model": Health, "description": "Redis is unreachable."}},
)
def healthz(r: RedisDep):
    try:
        r.ping()
    except RedisError as exc:
        body = Health(status="unavailable", redis=False, detail=f"Redis is unavailable: {exc}")
        return JSONResponse(status_code=503, content=body.model_dump())
    return Health(status="ok", redis=True)
