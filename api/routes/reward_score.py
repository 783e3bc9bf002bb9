"""Reward scoring: POST /admin/api/fine-tune/reward/score (the seed server's route).

    {model_id, adapter_name, prompt, completions: [str]}  ->  {rewards: [float], model_id, adapter_name}

`adapter_name` names a completed reward job's adapter (its LoRA + value head). Like log-prob
scoring (api/routes/logprob.py, whose queue and waiting it shares), the workers' training
processes answer, between training steps if they are busy; past MTQ_SCORE_WAIT_S the answer
is a 202 with an id that GET .../reward/score/{id} resolves.
"""


from fastapi import APIRouter, Depends, HTTPException, status
from pydantic import BaseModel, ConfigDict, Field, model_validator

from api.deps import ADMIN_ERRORS, AsyncRedisDep, PrincipalDep, RedisDep, SettingsDep, WriterDep, require_token
from api.routes.job_routes import SeedErrorsRoute
from api.routes.logprob import Pending, check_adapter, check_chars, stored_request, submit_and_wait, unfinished
from shared import scoring
from shared.model_ids import model_id_error
from shared.schemas import ErrorBody, check_json_values
from shared.train_specs import ADAPTER_NAME

router = APIRouter(
    prefix="/admin/api/fine-tune/reward/score",
    tags=["Reward scoring"],
    dependencies=[Depends(require_token)],
    route_class=SeedErrorsRoute,
    responses={
        400: {"model": ErrorBody, "description": "Invalid request: a readable reason."},
        403: {"model": ErrorBody, "description": "A viewer token cannot score."},
        404: {"model": ErrorBody, "description": "Model not found / Adapter not found: <model_id>/<adapter_name>."},
        413: {"model": ErrorBody, "description": "Body larger than MTQ_MAX_BODY_BYTES."},
        **ADMIN_ERRORS,
    },
)
MAX_COMPLETIONS = 256


class RewardScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(..., min_length=1, max_length=512)
    adapter_name: str = Field(..., pattern=ADAPTER_NAME)
    prompt: str
    completions: list[str] = Field(..., min_length=1, max_length=MAX_COMPLETIONS)

    _json_values = model_validator(mode="before")(check_json_values)


class RewardScores(BaseModel):
    rewards: list[float]
    model_id: str
    adapter_name: str


@router.post("", response_model=RewardScores, responses={202: {"model": Pending}},
             summary="Rewards of completions from a reward job's model, on the workers")
async def score(req: RewardScoreRequest, r: RedisDep, ar: AsyncRedisDep, settings: SettingsDep, who: WriterDep):
    if error := model_id_error(req.model_id, settings):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, error)
    check_chars(len(req.prompt) * len(req.completions) + sum(len(c) for c in req.completions), settings)
    await check_adapter(ar, who, req.model_id, req.adapter_name)
    request_id, record = await submit_and_wait(r, ar, settings, who, {**req.model_dump(), "type": "reward"})
    return unfinished(record, f"{router.prefix}/{request_id}") or record["result"]


@router.get("/{request_id}", response_model=RewardScores, responses={202: {"model": Pending}},
            summary="The answer to a reward scoring request that was still running (a trainer token: its own)")
async def scoring_result(request_id: str, ar: AsyncRedisDep, who: PrincipalDep):
    record = scoring.decode_record(await stored_request(ar, request_id, who))
    return unfinished(record, f"{router.prefix}/{request_id}") or record["result"]
