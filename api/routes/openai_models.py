"""OpenAI's models under /v1 (the official SDK's `client.models`): the models a request to
/v1/chat/completions or /v1/completions can name.

    GET /v1/models            the base models the live workers offer, and the fine-tuned models
                              (`ft:...`) of the token's succeeded /v1 jobs (an admin's or a
                              viewer's: everyone's), newest first after the base models
    GET /v1/models/{model}    one of them, or 404
"""

from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import BaseModel

from api.auth import Principal
from api.deps import PrincipalDep, RedisDep, require_token
from api.openai_compat import jobs as openai_jobs
from api.openai_errors import ERRORS, OpenAIRoute
from api.routes.openai_chat import model_not_found
from shared import workers
from shared.keys import JOBS_INDEX, job_key
from shared.model_ids import job_id_of

router = APIRouter(prefix="/v1/models", tags=["OpenAI: models"], dependencies=[Depends(require_token)],
                   route_class=OpenAIRoute, responses=ERRORS)

PAGE = 200  # job records read a pipeline at a time


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


def base_models(r) -> list[Model]:
    return [Model(id=m["model_id"], created=0, owned_by="system") for m in workers.model_list(r)]


def fine_tuned_models(r, who: Principal, job_ids: list[str]) -> list[Model]:
    """The fine-tuned models of these jobs that the token may use."""
    found = []
    for start in range(0, len(job_ids), PAGE):
        chunk = job_ids[start:start + PAGE]
        with r.pipeline() as p:
            for job_id in chunk:
                p.hmget(job_key(job_id), [*openai_jobs.NAME_FIELDS, "finished_at"])
            rows = p.execute()
        for job_id, values in zip(chunk, rows):
            rec = dict(zip((f.encode() for f in openai_jobs.NAME_FIELDS), values))
            owner = rec.get(b"owner")
            model = openai_jobs.fine_tuned_model(job_id, rec)
            if model is not None and who.sees(owner.decode() if owner else None):
                found.append(Model(id=model[0], created=int(float(values[-1] or 0)),
                                   owned_by=openai_jobs.organization(owner.decode() if owner else None)))
    return found


@router.get("", response_model=ModelList, summary="The base models and the token's fine-tuned models")
def list_models(r: RedisDep, who: PrincipalDep) -> ModelList:
    ids = [i.decode() for i in r.zrevrange(JOBS_INDEX, 0, -1)]
    return ModelList(data=base_models(r) + fine_tuned_models(r, who, ids))


@router.get("/{model:path}", response_model=Model, summary="One model (a base model or a fine-tuned one)")
def get_model(model: str, r: RedisDep, who: PrincipalDep) -> Model:
    job_id = job_id_of(model) if model.startswith("ft:") else None
    if job_id is not None and job_id.isalnum():
        found = [m for m in fine_tuned_models(r, who, [job_id]) if m.id == model]
    else:
        found = [m for m in base_models(r) if m.id == model]
    if not found:
        raise model_not_found(model)
    return found[0]
