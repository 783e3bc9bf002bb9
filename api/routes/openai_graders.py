"""OpenAI's grader tools under /v1 (the official SDK's `client.fine_tuning.alpha.graders`):

    POST /v1/fine_tuning/alpha/graders/run        {grader, model_sample, item?} -> {reward, metadata, sub_rewards, ...}
    POST /v1/fine_tuning/alpha/graders/validate   {grader} -> {grader}

The same graders and scores as a reinforcement job's rewards (shared/graders.py); python
graders run in their sandbox (shared/grader_sandbox.py) only where MTQ_PYTHON_GRADERS=1.
"""

import time
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from api.deps import PrincipalDep, require_token
from api.openai_errors import ERRORS, OpenAIError, OpenAIRoute
from shared import grader_sandbox, graders
from shared.graders import Grader

router = APIRouter(prefix="/v1/fine_tuning/alpha/graders", tags=["OpenAI: graders"],
                   dependencies=[Depends(require_token)], route_class=OpenAIRoute, responses=ERRORS)

ERROR_FLAGS = ("formula_parse_error", "invalid_variable_error", "model_grader_parse_error", "model_grader_refusal_error",
               "model_grader_server_error", "other_error", "python_grader_runtime_error", "python_grader_server_error",
               "sample_parse_error", "truncated_observation_error", "unresponsive_reward_error")


class RunRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: Grader
    model_sample: str = Field(..., max_length=graders.MAX_TEXT)
    item: dict[str, Any] | None = None


class ValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    grader: Grader


class RunMetadata(BaseModel):
    errors: dict[str, Any]
    execution_time: float
    name: str
    sampled_model_name: str | None = None
    scores: dict[str, Any]
    token_usage: int | None = None
    type: str


class RunResponse(BaseModel):
    metadata: RunMetadata
    model_grader_token_usage_per_model: dict[str, Any] = Field(default_factory=dict)
    reward: float
    sub_rewards: dict[str, Any]


def _python_allowed(grader) -> None:
    if graders.uses_python(grader) and not grader_sandbox.enabled():
        raise OpenAIError(400, "python graders are off on this server (the operator sets MTQ_PYTHON_GRADERS=1)", "grader")


@router.post("/run", response_model=RunResponse, summary="Score one sample with a grader")
def run(body: RunRequest, who: PrincipalDep) -> RunResponse:
    _python_allowed(body.grader)
    errors: dict[str, Any] = {flag: False for flag in ERROR_FLAGS}
    failures: list[str] = []

    def run_python(source: str, sample: dict, item: dict) -> float:
        value, why = grader_sandbox.run_grader(source, sample, item)
        if why is not None:
            failures.append(why)
        return value

    started = time.monotonic()
    try:
        reward, subs = graders.score(body.grader, body.model_sample, body.item or {}, run_python)
    except graders.GraderError as e:
        reward, subs = 0.0, {}
        errors[e.kind] = True
        failures.append(str(e))
    if failures and not any(errors[k] for k in ERROR_FLAGS if k != "python_grader_runtime_error"):
        errors["python_grader_runtime_error"] = True
        errors["python_grader_runtime_error_details"] = failures[0]
    elapsed = time.monotonic() - started
    return RunResponse(reward=reward, sub_rewards=subs, metadata=RunMetadata(
        errors=errors, execution_time=elapsed, name=body.grader.name, type=body.grader.type,
        scores={**subs, body.grader.name: reward}))


@router.post("/validate", summary="Check a grader")
def validate(body: ValidateRequest, who: PrincipalDep) -> dict:
    _python_allowed(body.grader)
    return {"grader": body.grader.model_dump(exclude_none=True)}
