"""Models and workers, from what the live workers advertise (shared/workers.py).

GET /admin/api/fine-tune/models (and the seed's other path for it, .../jobs/models): the
models jobs can name, one entry per model_id; GET /admin/api/workers: the live workers.
"""

from typing import Any, Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel, Field

from api.deps import ADMIN_ERRORS, RedisDep, require_token
from shared import workers

router = APIRouter(
    tags=["models and workers"],
    dependencies=[Depends(require_token)],
    responses=ADMIN_ERRORS,
)


class Model(BaseModel):
    model_id: str = Field(description="What a job's model_id names.")
    model_type: Literal["llm", "vlm"] | None
    model_path: str = Field(description="Its directory on the (first) worker that has it.")
    loaded: bool = Field(description="A worker's training process holds it loaded now.")


class Worker(BaseModel):
    name: str
    host: str
    pid: int
    queues: list[str]
    version: str
    started_at: float
    models_dir: str
    models: list[dict[str, Any]]
    loaded: list[str] = Field(description="Model ids its training process holds loaded.")


@router.get("/admin/api/fine-tune/models", response_model=list[Model], summary="Models the live workers offer")
@router.get("/admin/api/fine-tune/jobs/models", response_model=list[Model], summary="The same (the seed server's other path)")
def list_models(r: RedisDep) -> list[dict]:
    return workers.model_list(r)


@router.get("/admin/api/workers", response_model=list[Worker], summary="Live workers and what they advertise")
def list_workers(r: RedisDep) -> list[dict]:
    return workers.live_workers(r)
