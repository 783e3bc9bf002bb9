"""Reward scoring: POST /admin/api/fine-tune/reward/score (the seed server's route, answers and messages).

    {model_id, adapter_name, prompt, completions: [str]}  ->  {rewards: [float], model_id, adapter_name}

`adapter_name` names a completed reward job's adapter (its LoRA + value head; its
adapter_config.json says `reward_model: true`). Like log-prob scoring (api/routes/logprob.py,
whose queue and waiting it shares), the workers' training processes answer, between training
steps if they are busy; past MTQ_SCORE_WAIT_S the answer is a 202 with an id that GET
.../reward/score/{id} resolves.

As a GRPO job's reward endpoint (the seed's {prompt, completions} body, which names no reward
model) the URL names it: `.../reward/score?model_id=M&adapter_name=A`. A job whose reward
endpoint is this service's own route is scored on its worker itself (api/submission.py
own_reward_model): no HTTP, so no worker ever waits on a request that only it could answer.
Other fields of the body (a GRPO job's `job_id` and `step`) are ignored, as the seed ignores them.
"""

import json
from typing import Annotated

from fastapi import APIRouter, Depends, HTTPException, Query, Request, status
from pydantic import BaseModel, Field, ValidationError

from api.deps import ADMIN_ERRORS, AsyncRedisDep, PrincipalDep, RedisDep, SettingsDep, WriterDep, require_token
from api.json_body import JSONBodyRoute
from api.routes.logprob import Pending, check_adapter, check_chars, stored_request, submit_and_wait, unfinished
from shared import scoring
from shared.adapters import CONFIG_FILE
from shared.keys import adapter_key, job_key
from shared.model_ids import model_id_error
from shared.schemas import ErrorBody, json_value_error
from shared.train_specs import ADAPTER_NAME

router = APIRouter(
    prefix="/admin/api/fine-tune/reward/score",
    tags=["Reward scoring"],
    dependencies=[Depends(require_token)],
    route_class=JSONBodyRoute,
    responses={
        400: {"model": ErrorBody, "description": "model_id is required / adapter_name is required / completions "
              "(non-empty list) required / adapter <path> is not a reward model (...) / Invalid request: ..."},
        403: {"model": ErrorBody, "description": "A viewer token cannot score."},
        404: {"model": ErrorBody, "description": "Model not found / Adapter not found: <model_id>/<adapter_name>."},
        413: {"model": ErrorBody, "description": "Body larger than MTQ_MAX_BODY_BYTES."},
        **ADMIN_ERRORS,
    },
)
MAX_COMPLETIONS = 256


class RewardScoreRequest(BaseModel):
    model_id: str = Field(..., min_length=1, max_length=512)
    adapter_name: str = Field(..., pattern=ADAPTER_NAME)
    prompt: str = ""
    completions: list[str] = Field(..., min_length=1, max_length=MAX_COMPLETIONS)


class RewardScores(BaseModel):
    rewards: list[float]
    model_id: str
    adapter_name: str


def parse_request(body, model_id: str | None, adapter_name: str | None) -> RewardScoreRequest:
    """The request, with model_id / adapter_name from the query when the body has none; the
    seed server's 400s."""
    if not isinstance(body, dict):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "the body must be a JSON object")
    if error := json_value_error(body):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, error)
    body = {**body, "model_id": body.get("model_id") or model_id, "adapter_name": body.get("adapter_name") or adapter_name}
    if not body["model_id"]:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "model_id is required")
    if not body["adapter_name"]:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "adapter_name is required")
    if not isinstance(body.get("completions"), list) or not body["completions"]:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "completions (non-empty list) required")
    try:
        return RewardScoreRequest.model_validate({k: body.get(k) for k in RewardScoreRequest.model_fields if k in body})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"Invalid request: {where}: {first['msg']}") from None


async def check_reward_model(ar, job_id: str) -> None:
    """400 unless the adapter's adapter_config.json says reward_model: true (the seed's check)."""
    raw = await ar.hget(adapter_key(job_id), CONFIG_FILE)
    try:
        is_reward_model = raw is not None and json.loads(raw).get("reward_model") is True
    except (ValueError, AttributeError):
        is_reward_model = False
    if not is_reward_model:
        path = (await ar.hget(job_key(job_id), "adapter_path") or b"").decode()
        raise HTTPException(status.HTTP_400_BAD_REQUEST,
                            f"adapter {path} is not a reward model (adapter_config.json missing reward_model=true)")


ModelQuery = Annotated[str | None, Query(max_length=512, description="The reward model's model_id, when the body has none.")]
AdapterQuery = Annotated[str | None, Query(max_length=128, description="Its adapter_name, when the body has none.")]


@router.post("", response_model=RewardScores, responses={202: {"model": Pending}},
             summary="Rewards of completions from a reward job's model, on the workers")
async def score(request: Request, r: RedisDep, ar: AsyncRedisDep, settings: SettingsDep, who: WriterDep,
                model_id: ModelQuery = None, adapter_name: AdapterQuery = None):
    req = parse_request(await request.json(), model_id, adapter_name)
    if error := model_id_error(req.model_id, settings):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, error)
    check_chars(len(req.prompt) * len(req.completions) + sum(len(c) for c in req.completions), settings)
    job_id = await check_adapter(ar, who, req.model_id, req.adapter_name)
    await check_reward_model(ar, job_id)
    request_id, record = await submit_and_wait(r, ar, settings, who, {**req.model_dump(), "type": "reward"})
    return unfinished(record, f"{router.prefix}/{request_id}") or record["result"]


@router.get("/{request_id}", response_model=RewardScores, responses={202: {"model": Pending}},
            summary="The answer to a reward scoring request that was still running (a trainer token: its own)")
async def scoring_result(request_id: str, ar: AsyncRedisDep, who: PrincipalDep):
    record = scoring.decode_record(await stored_request(ar, request_id, who))
    return unfinished(record, f"{router.prefix}/{request_id}") or record["result"]
