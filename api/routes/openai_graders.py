"""OpenAI's grader tools under /v1 (the official SDK's `client.fine_tuning.alpha.graders`):

    POST /v1/fine_tuning/alpha/graders/run        {grader, model_sample, item?} -> {reward, metadata, sub_rewards, ...}
    POST /v1/fine_tuning/alpha/graders/validate   {grader} -> {grader}

The same graders and scores as a reinforcement job's rewards (shared/graders.py); python
graders run in their sandbox (shared/grader_sandbox.py) only where MTQ_PYTHON_GRADERS=1; a
score_model grader's reward model answers on the workers, as reward scoring does
(api/routes/reward_score.py).
"""

import time
from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from api.deps import AsyncRedisDep, PrincipalDep, RedisDep, SettingsDep, require_token
from api.openai_errors import ERRORS, OpenAIError, OpenAIRoute
from api.routes.logprob import check_adapter, check_chars, submit_and_wait
from api.routes.reward_score import check_reward_model
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


def _python_allowed(grader, settings) -> None:
    if graders.uses_python(grader) and not settings.python_graders:
        raise OpenAIError(400, "python graders are off on this server (the operator sets MTQ_PYTHON_GRADERS=1)", "grader")


async def reward_model_scores(r, ar, settings, who, grader, sample_text: str, item: dict) -> dict:
    """The scores its score_model graders' reward models give the sample, asked of the workers
    as POST /admin/api/fine-tune/reward/score asks them: {(model_id, adapter_name, prompt): score}."""
    answers = {}
    for g in graders.parts(grader):
        if not isinstance(g, graders.ScoreModelGrader):
            continue
        try:
            prompt = graders.judge_prompt(g, graders.sample_namespace(sample_text), item)
        except graders.GraderError:
            continue  # scored as the grader's error
        if who.role == "viewer":
            raise OpenAIError(403, f"token {who.name!r} has the viewer role: it cannot ask for a reward model's score")
        model_id, adapter_name = g.adapter
        check_chars(len(prompt) + len(sample_text), settings)
        await check_reward_model(ar, await check_adapter(ar, who, model_id, adapter_name))
        _, record = await submit_and_wait(r, ar, settings, who, {"type": "reward", "model_id": model_id,
                                                                 "adapter_name": adapter_name, "prompt": prompt,
                                                                 "completions": [sample_text]})
        if record["status"] == "failed":
            raise OpenAIError(record["error_status"], record["error"], "grader")
        if record["status"] != "done":
            raise OpenAIError(503, "the reward model has not answered yet (MTQ_SCORE_WAIT_S); try again")
        answers[model_id, adapter_name, prompt] = record["result"]["rewards"][0]
    return answers


@router.post("/run", response_model=RunResponse, summary="Score one sample with a grader")
async def run(body: RunRequest, r: RedisDep, ar: AsyncRedisDep, settings: SettingsDep, who: PrincipalDep) -> RunResponse:
    _python_allowed(body.grader, settings)
    judged = await reward_model_scores(r, ar, settings, who, body.grader, body.model_sample, body.item or {})
    # a python grader's subprocess: off the event loop
    return await run_in_threadpool(grade, body, judged, settings.python_grader_timeout_s)


def grade(body: RunRequest, judged: dict, python_timeout_s: float) -> RunResponse:
    errors: dict[str, Any] = {flag: False for flag in ERROR_FLAGS}
    failures: list[str] = []

    def run_python(source: str, sample: dict, item: dict) -> float:
        value, why = grader_sandbox.run_grader(source, sample, item, python_timeout_s)
        if why is not None:
            failures.append(why)
        return value

    started = time.monotonic()
    try:
        reward, subs = graders.score(body.grader, body.model_sample, body.item or {}, run_python,
                                     lambda model_id, adapter_name, prompt, _: judged[model_id, adapter_name, prompt])
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
def validate(body: ValidateRequest, settings: SettingsDep, who: PrincipalDep) -> dict:
    _python_allowed(body.grader, settings)
    return {"grader": body.grader.model_dump(exclude_none=True)}
