"""Adapters: /admin/api/fine-tune/adapters (list, delete and download; shapes as in the seed server).

An adapter is the one of the newest completed job with that (model_id, adapter_name); its
files are served from the job's copy in Redis (shared/adapters.py), so a client needs no
access to any worker's disk. A trainer token sees, downloads and deletes only the adapters
of its own jobs.
"""

from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Response, status
from pydantic import BaseModel, Field

from api.auth import Principal
from api.deps import ADMIN_ERRORS, PrincipalDep, RedisDep, WriterDep, require_token
from api.json_body import JSONBodyRoute
from api.openai_compat import jobs as openai_jobs
from shared import adapters
from shared.keys import job_key
from shared.schemas import Deleted, ErrorBody

router = APIRouter(
    prefix="/admin/api/fine-tune/adapters",
    tags=["adapters"],
    dependencies=[Depends(require_token)],
    route_class=JSONBodyRoute,
    responses={400: {"model": ErrorBody, "description": "Invalid request (`detail` says why)."}, **ADMIN_ERRORS},
)

NOT_FOUND = {404: {"model": ErrorBody, "description": "No such adapter (or not one of this trainer token's)."}}


class Adapter(BaseModel):
    model_id: str
    adapter_name: str
    adapter_path: str = Field(description="Where its worker wrote it (that worker's disk); download it to get the files.")
    has_weights: bool
    has_config: bool
    lora_layers: int | None
    lora_rank: int | None
    fine_tune_type: str | None
    job_id: str = Field(description="The completed job that made it (the newest of that name).")
    size: int = Field(description="Bytes of the weights (adapters.safetensors; a full fine-tune: model.safetensors) + adapter_config.json.")
    created_at: float | None = Field(description="When that job completed (epoch seconds).")


class AdapterRef(BaseModel):
    # Both optional here so that a missing one is the seed's 400 "model_id and adapter_name required".
    model_id: str | None = Field(None, max_length=512)
    adapter_name: str | None = Field(None, max_length=128)


def _owner(who: Principal) -> str | None:
    return who.name if who.role == "trainer" else None


def _job_id_or_404(r, model_id: str, adapter_name: str, who: Principal) -> str:
    job_id = adapters.find(r, model_id, adapter_name)
    owner = _owner(who)
    if job_id is None or (owner is not None and r.hget(job_key(job_id), "owner") != owner.encode()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, "Adapter not found")
    return job_id


def archive_response(stored: dict[str, bytes], adapter_name: str) -> Response:
    """An adapter's files as a .tar.gz download (also GET .../grpo/jobs/{id}/adapter)."""
    return Response(adapters.tar_gz(stored), media_type="application/gzip",
                    headers={"Content-Disposition": f'attachment; filename="{adapter_name}.tar.gz"'})


@router.get("", response_model=list[Adapter], summary="List adapters (a trainer token: its own jobs')")
def list_adapters(
    r: RedisDep, who: PrincipalDep,
    model_id: Annotated[str | None, Query(max_length=512, description="Only this model's adapters.")] = None,
) -> list[dict]:
    return adapters.list_adapters(r, model_id=model_id, owner=_owner(who))


@router.delete("", response_model=Deleted,
               responses={**NOT_FOUND, 403: {"model": ErrorBody, "description": "A viewer token cannot delete."}},
               summary="Delete an adapter: its index entry and its copy in Redis")
def delete_adapter(r: RedisDep, who: WriterDep, body: AdapterRef | None = None) -> Deleted:
    if body is None or not body.model_id or not body.adapter_name:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "model_id and adapter_name required")
    _job_id_or_404(r, body.model_id, body.adapter_name, who)
    if not adapters.delete(r, body.model_id, body.adapter_name):
        raise HTTPException(status.HTTP_404_NOT_FOUND, "Adapter not found")
    return Deleted()


@router.get("/{name}/download", response_class=Response,
            responses={200: {"content": {"application/gzip": {}}, "description": "As below."}, **NOT_FOUND},
            summary="Download an OpenAI job's adapter by its fine-tuned model's name (ft:..., docs/openai.md)")
def download_fine_tuned(name: str, r: RedisDep, who: PrincipalDep) -> Response:
    found = openai_jobs.fine_tuned_adapter(r, name)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, "Adapter not found")
    return download_adapter(*found, r, who)


@router.get("/{model_id:path}/{adapter_name}/download", response_class=Response,
            responses={200: {"content": {"application/gzip": {}},
                             "description": "A .tar.gz of adapters.safetensors + adapter_config.json: extract it into "
                             "a directory and pass that to mlx_lm.load(..., adapter_path=...)."}, **NOT_FOUND},
            summary="Download an adapter (model ids may contain '/')")
def download_adapter(model_id: str, adapter_name: str, r: RedisDep, who: PrincipalDep) -> Response:
    job_id = _job_id_or_404(r, model_id, adapter_name, who)
    stored = adapters.files(r, job_id)
    if not stored:  # deleted since
        raise HTTPException(status.HTTP_404_NOT_FOUND, "Adapter not found")
    return archive_response(stored, adapter_name)
