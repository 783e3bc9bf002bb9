"""Models and workers, from what the live workers advertise (shared/workers.py).

GET /admin/api/fine-tune/models (and the seed's other path for it, .../jobs/models): the
models jobs can name, one entry per model_id; GET /admin/api/workers: the live workers,
GET /admin/api/workers/{name}: one of them.
"""

from typing import Literal

from fastapi import APIRouter, Depends, HTTPException
from pydantic import BaseModel, Field

from api.deps import ADMIN_ERRORS, RedisDep, require_token
from shared import workers
from shared.routing import WORKER_NAME
from shared.schemas import ErrorBody

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


class WorkerModel(BaseModel):
    model_id: str
    model_type: Literal["llm", "vlm"] | None
    model_path: str
    size_bytes: int | None = Field(None, description="Its weights (safetensors files), for the memory estimate.")
    shape: dict[str, int] | None = Field(None, description="From its config.json, for the memory estimate.")


class Worker(BaseModel):
    name: str
    host: str
    pid: int
    version: str
    started_at: float
    models_dir: str
    models: list[WorkerModel] = Field(description="The models it has on disk: MTQ_MODELS_DIR, MTQ_MODEL_ROOTS, the "
                                      "Hugging Face cache.")
    declared: list[str] = Field([], description="Model ids it offers besides (mtq worker --models).")
    loaded: list[str] = Field(description="Model ids its training process holds loaded.")
    queues: list[str] = Field(description="The rq queues it listens to, in order (shared/routing.py).")
    lanes: list[str] = Field([], description="Job lanes (config.queue) it serves, in order.")
    hub: bool = Field(False, description="It takes jobs for Hugging Face ids no live worker holds (mtq worker --hub).")
    device: str | None = Field(None, description="MLX's device: gpu or cpu (null until its training process started).")
    device_name: str | None = None
    memory_total_gb: float | None = Field(None, description="The device's memory (RAM on a CPU, unified memory on a Mac).")
    memory_gb: float | None = Field(None, description="What jobs may use: as declared (--memory-gb), else Metal's "
                                    "recommended working set, 90% of a GPU's memory, or 75% of RAM.")
    memory_declared: bool = False
    current_job: str | None = Field(None, description="The job it runs now.")
    gang_address: str | None = Field(None, description="host:port its gang ranks listen on (docs/distributed.md); null "
                                     "where it cannot join its backend.")
    gang_backend: str | None = Field(None, description="The backend its gang ranks join (MTQ_GANG_BACKEND).")
    gang_error: str | None = Field(None, description="Why it cannot join gangs of that backend here.")
    models_free_bytes: int | None = Field(None, description="Free disk for models a gang's leader stages to it.")


@router.get("/admin/api/fine-tune/models", response_model=list[Model], summary="Models the live workers offer")
@router.get("/admin/api/fine-tune/jobs/models", response_model=list[Model], summary="The same (the seed server's other path)")
def list_models(r: RedisDep) -> list[dict]:
    return workers.model_list(r)


@router.get("/admin/api/workers", response_model=list[Worker], summary="Live workers and what they advertise")
def list_workers(r: RedisDep) -> list[dict]:
    return workers.live_workers(r)


@router.get("/admin/api/workers/{name}", response_model=Worker, summary="One live worker",
            responses={404: {"model": ErrorBody, "description": "Worker not found: <name>"}})
def get_worker(name: str, r: RedisDep) -> dict:
    worker = workers.get_worker(r, name) if WORKER_NAME.fullmatch(name) else None
    if worker is None:
        raise HTTPException(404, f"Worker not found: {name[:100]}")
    return worker
