"""Log-prob scoring: POST /admin/api/fine-tune/logprob (the seed server's route and answers).

    {model_id, prompt, completion, adapter_name?}          -> {logprob, token_count, per_token}
    {model_id, messages, tools?, adapter_name?}            -> the same, over the assistant messages' tokens
    {model_id, adapter_name?, items: [{prompt, completion} or {messages, tools?}], temperature?}
                                                           -> {results: [{logprob, token_count, per_token}]}

The API never scores: it queues the request (shared/scoring.py) for the workers' training
processes, which keep models loaded and answer even while training (between optimizer
steps). It waits up to MTQ_SCORE_WAIT_S for the answer, then answers 202 with an id that
GET /admin/api/fine-tune/logprob/{id} resolves (for the token that asked, a viewer or an
admin). A model no live worker offers is a 404 at once: it never waits in a queue.
"""

import json
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator
from starlette.concurrency import run_in_threadpool

from api.auth import Principal
from api.deps import ADMIN_ERRORS, AsyncRedisDep, PrincipalDep, RedisDep, SettingsDep, WriterDep, require_token
from api.json_body import JSONBodyRoute
from api.openai_compat import jobs as openai_jobs
from shared import scoring
from shared.adapters import adapter_ref
from shared.datasets import sft_loss_error, sft_row_error
from shared.keys import ADAPTERS_INDEX, job_key
from shared.model_ids import job_id_of, model_id_error
from shared.routing import is_hub_id
from shared.schemas import ChatMessage, ErrorBody, check_json_values

router = APIRouter(
    prefix="/admin/api/fine-tune/logprob",
    tags=["Log-prob scoring"],
    dependencies=[Depends(require_token)],
    route_class=JSONBodyRoute,
    responses={
        400: {"model": ErrorBody, "description": "Invalid request (e.g. \"model_id is required\")."},
        403: {"model": ErrorBody, "description": "A viewer token cannot score."},
        404: {"model": ErrorBody, "description": "Model not found: <id> / Adapter not found: <model_id>/<adapter_name>."},
        500: {"model": ErrorBody, "description": "Scoring failed: <why>."},
        **ADMIN_ERRORS,
    },
)

MAX_ITEMS = 256
REQUEST_ID = re.compile(r"^[0-9a-f]{32}$")


class CompletionItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str | list[ChatMessage] = Field(..., min_length=1)
    completion: str

    def chars(self) -> int:
        return len(str(self.prompt)) + len(self.completion)


class ConversationItem(BaseModel):
    """A conversation scored at the tokens SFT's assistant_only_loss trains: its assistant
    messages of weight 1. Its messages and tools are checked as an SFT row's."""

    model_config = ConfigDict(extra="forbid")
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None

    @model_validator(mode="after")
    def _an_sft_row(self):
        row = self.model_dump(exclude_none=True)
        if error := sft_row_error(row) or sft_loss_error(row, True):
            raise ValueError(error)
        return self

    def chars(self) -> int:
        return len(str(self.messages)) + len(str(self.tools or ""))


FORMS = ("completion", "conversation")  # ScoreItem's tags, which pydantic puts in its errors' locations


def item_form(item: Any) -> str:
    return FORMS[1] if isinstance(item, dict) and "messages" in item else FORMS[0]


ScoreItem = Annotated[Annotated[CompletionItem, Tag(FORMS[0])] | Annotated[ConversationItem, Tag(FORMS[1])],
                      Discriminator(item_form)]


class ScoreRequest(BaseModel):
    """The batch form; the single form is one item at the top level."""

    model_config = ConfigDict(extra="forbid")
    model_id: str = Field(..., min_length=1, max_length=512)
    adapter_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
    items: list[ScoreItem] = Field(..., min_length=1, max_length=MAX_ITEMS)
    temperature: float | None = Field(None, gt=0.0, le=100.0, allow_inf_nan=False,
                                      description="Divide the logits by this (default: raw logits).")
    use_chat_template: bool = Field(False, description="Tokenise prompts as a GRPO job with use_chat_template does "
                                    "(conversations always are).")

    _json_values = model_validator(mode="before")(check_json_values)


class TokenScores(BaseModel):
    logprob: float = Field(description="Sum of the completion's (a conversation's: its assistant messages') "
                           "tokens' log-probabilities.")
    token_count: int
    per_token: list[float]


class BatchScores(BaseModel):
    results: list[TokenScores]
    model_id: str
    adapter_name: str | None = None


class Pending(BaseModel):
    id: str
    status: str
    detail: str


def parse_request(body: Any) -> tuple[ScoreRequest, bool]:
    """(the request in batch form, whether it came in the single form); 400s as the seed server's."""
    if not isinstance(body, dict):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "the body must be a JSON object")
    if not body.get("model_id"):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, "model_id is required")
    single = "items" not in body
    if single:
        if item_form(body) == "completion" and not body.get("completion"):
            raise HTTPException(status.HTTP_400_BAD_REQUEST, "completion is required")
        fields = ("prompt", "completion", "messages", "tools")
        body = {**{k: v for k, v in body.items() if k not in fields}, "items": [{k: body[k] for k in fields if k in body}]}
    try:
        return ScoreRequest.model_validate(body), single
    except ValidationError as e:
        first = e.errors()[0]
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"Invalid request: {where(first['loc'], single)}: "
                            f"{first['msg']}") from None


def where(loc: tuple, single: bool) -> str:
    """An error's location as the body names it: without the item's form, nor items.0 in the single form."""
    if loc[:1] == ("items",) and loc[2:3] and loc[2] in FORMS:
        loc = loc[:2] + loc[3:]
    return ".".join(str(p) for p in (loc[2:] if single and loc[:1] == ("items",) else loc)) or "body"


def check_chars(chars: int, settings) -> None:
    """A scoring request's text is bounded like a training step's (characters stand in for tokens)."""
    if chars > settings.max_step_tokens:
        raise HTTPException(status.HTTP_400_BAD_REQUEST, f"the request holds {chars} characters; the limit is "
                            f"{settings.max_step_tokens} (MTQ_MAX_STEP_TOKENS)")


async def stored_request(ar, request_id: str, who: Principal) -> dict[bytes, bytes]:
    """The record of a scoring request the token may read (a trainer: its own), or 404."""
    raw = await ar.hgetall(scoring.score_key(request_id)) if REQUEST_ID.fullmatch(request_id) else {}
    owner = raw.get(b"owner")
    if not raw or not who.sees(None if owner is None else owner.decode()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"scoring request not found: {request_id[:64]}")
    return raw


async def check_adapter(ar, who, model_id: str, adapter_name: str) -> str:
    """The id of the completed job that made this adapter; 404 unless there is one and the
    token may see it."""
    job_id = await ar.hget(ADAPTERS_INDEX, adapter_ref(model_id, adapter_name))
    owner = None if job_id is None else await ar.hget(job_key(job_id.decode()), "owner")
    if job_id is None or not who.sees(None if owner is None else owner.decode()):
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Adapter not found: {model_id}/{adapter_name}")
    return job_id.decode()


async def fine_tuned_adapter(ar, name: str) -> tuple[str, str] | None:
    """(model_id, adapter_name) a fine-tuned model's name (ft:...) stands for; None if it names none."""
    job_id = job_id_of(name)
    values = await ar.hmget(job_key(job_id), openai_jobs.NAME_FIELDS) if job_id and job_id.isalnum() else []
    return openai_jobs.adapter_of(name, dict(zip((f.encode() for f in openai_jobs.NAME_FIELDS), values)))


async def fine_tuned(ar, req: ScoreRequest) -> ScoreRequest:
    """The request with a fine-tuned model's name (ft:...) read as its base model and adapter."""
    found = await fine_tuned_adapter(ar, req.model_id)
    if found is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Model not found: {req.model_id[:200]}")
    return req.model_copy(update={"model_id": found[0], "adapter_name": found[1]})


WAIT_SLICE_S = 1.0  # one BLPOP of the wait for an answer: below the client's socket timeout (MTQ_REDIS_TIMEOUT_S)


async def submit_and_wait(r, ar, settings, who: Principal, request: dict) -> tuple[str, dict]:
    """Queue a scoring request of `who` for the workers and wait up to MTQ_SCORE_WAIT_S for its
    answer: (request id, record as scoring.decode_record gives it). 404 at once when no live
    worker can load its model (shared/scoring.py route)."""
    model_id = request["model_id"]
    # The sync client's calls in a thread: the event loop never waits on Redis.
    queue = await run_in_threadpool(scoring.route, r, model_id)
    if queue is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"Model not found: {model_id} (no live worker has it"
                            f"{', and none has hub access' if is_hub_id(model_id) else ''})")
    request_id = await run_in_threadpool(scoring.submit, r, queue, who.name, {**request, "tenant": who.tenant})
    deadline = time.monotonic() + settings.score_wait_s
    while (left := deadline - time.monotonic()) > 0:
        if await ar.blpop([scoring.done_key(request_id)], timeout=min(left, WAIT_SLICE_S)):
            break
    return request_id, scoring.decode_record(await ar.hgetall(scoring.score_key(request_id)))


def unfinished(record: dict, location: str) -> JSONResponse | None:
    """The error (raised) of a failed request, a 202 pointing at `location` for one still
    queued or running, None for one answered."""
    if record["status"] == "failed":
        raise HTTPException(record["error_status"], record["error"])
    if record["status"] != "done":
        return JSONResponse(status_code=202, headers={"Location": location}, content=Pending(
            id=location.rsplit("/", 1)[1], status=record["status"],
            detail=f"still scoring: GET {location} for the answer").model_dump())
    return None


def _answer(record: dict, request_id: str, single: bool) -> Any:
    if (waiting := unfinished(record, f"{router.prefix}/{request_id}")) is not None:
        return waiting
    result = record["result"]
    return {**result["results"][0], "model_id": result["model_id"], "adapter_name": result["adapter_name"]} \
        if single else BatchScores.model_validate(result)


@router.post("", summary="Log-probabilities of completions given prompts, or of conversations' assistant messages "
             "(teacher forcing), on the workers",
             responses={200: {"model": TokenScores | BatchScores}, 202: {"model": Pending}})
async def score(request: Request, r: RedisDep, ar: AsyncRedisDep, settings: SettingsDep, who: WriterDep):
    req, single = parse_request(await request.json())
    if req.model_id.startswith("ft:") and req.adapter_name is None:  # an OpenAI job's fine-tuned model (docs/openai.md)
        req = await fine_tuned(ar, req)
    if error := model_id_error(req.model_id, settings):
        raise HTTPException(status.HTTP_400_BAD_REQUEST, error)
    check_chars(sum(it.chars() for it in req.items), settings)
    if req.adapter_name:
        await check_adapter(ar, who, req.model_id, req.adapter_name)
    request_id, record = await submit_and_wait(r, ar, settings, who, {**req.model_dump(mode="json"), "single": single})
    return _answer(record, request_id, single)


@router.get("/{request_id}", summary="The answer to a scoring request that was still running (a trainer token: its own)",
            responses={200: {"model": TokenScores | BatchScores}, 202: {"model": Pending},
                       404: {"model": ErrorBody, "description": "No such request (or not one of this trainer token's)."}})
async def scoring_result(request_id: str, ar: AsyncRedisDep, who: PrincipalDep):
    raw = await stored_request(ar, request_id, who)
    return _answer(scoring.decode_record(raw), request_id, json.loads(raw[b"request"]).get("single", False))
