"""OpenAI's chat and text completions under /v1 (the official SDK's `client.chat.completions`
and `client.completions`), on base models and trained adapters:

    POST /v1/chat/completions   {model, messages, tools?, max_tokens?, temperature?, top_p?, n?, stop?,
                                 seed?, stream?, stream_options?, logprobs?} -> chat.completion (or its chunks)
    POST /v1/completions        {model, prompt, ...the same}                  -> text_completion (or its chunks)

`model` is a base model a live worker offers, or a fine-tuned model's name (`ft:...`, a /v1
job's `fine_tuned_model`); a native job's adapter is `model` = its model_id with `adapter_name`
beside it (the SDK's extra_body), as the log-prob route takes them. Another owner's model reads
as missing (404), as everywhere.

The API never decodes: it queues the request on the model's scoring queue (shared/scoring.py),
in its owner's turn, and a warm worker's training process answers it, batched with other
requests for the same adapter, between the steps of a job it runs
(worker/runtime/completions.py). Without `stream` the route waits for the answer (up to
MTQ_COMPLETION_WAIT_S; then 504 and the request is dropped); with it, the route waits for the
first text or the answer (so an error is still an HTTP status), then sends chunks as server-sent
events as the worker decodes, and `data: [DONE]`. A client that goes away ends its request.
What is not served is a 400 naming it: other penalties than 0, top_logprobs, logprobs with
stream, response_format other than text, tool_choice other than auto / none.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.concurrency import run_in_threadpool

from api import sse
from api.auth import Principal
from api.deps import AsyncRedisDep, RedisDep, SettingsDep, WriterDep, require_token
from api.openai_errors import ERRORS, OpenAIError, OpenAIRoute
from api.routes.logprob import WAIT_SLICE_S, check_adapter, fine_tuned_adapter
from shared import scoring
from shared.datasets import messages_row_error
from shared.model_ids import model_id_error
from shared.routing import is_hub_id
from shared.schemas import check_json_values
from shared.settings import Settings

router = APIRouter(prefix="/v1", tags=["OpenAI: completions"], dependencies=[Depends(require_token)],
                   route_class=OpenAIRoute, responses=ERRORS)

MAX_CHOICES = 8
MAX_STOPS = 4  # OpenAI's bound
KEEPALIVE_S = 15.0  # a comment on a quiet stream (a request waiting behind a long step)


class _Sampling(BaseModel):
    """What both routes take. Unknown fields are ignored (the SDK sends some this service does
    not use, e.g. `user`, `store`, `metadata`); fields that would change the answer and are not
    served are refused (_not_served)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str = Field(..., min_length=1, max_length=512)
    adapter_name: str | None = Field(None, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                     description="A native job's adapter of `model` (not OpenAI's).")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(None, max_length=MAX_STOPS)
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)

    _json_values = model_validator(mode="before")(check_json_values)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) and self.stop else list(self.stop or [])


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] = Field(..., min_length=1)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ToolFunction(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class TextChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: dict | None = None


class TextCompletion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage


def _not_served(req: _Sampling, settings: Settings) -> None:
    """A 400 for what would change the answer and this service does not do."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(req, name):
            raise OpenAIError(400, f"{name} is not served (only 0)", name)
    if (req.limit() or 0) > settings.max_completion_tokens:
        raise OpenAIError(400, f"max_tokens is {req.limit()}; the limit is {settings.max_completion_tokens} "
                          "(MTQ_MAX_COMPLETION_TOKENS)", "max_tokens")
    if isinstance(req, ChatRequest):
        if req.top_logprobs:
            raise OpenAIError(400, "top_logprobs is not served (the sampled tokens' log-probs are: logprobs)", "top_logprobs")
        if req.logprobs and req.stream:
            raise OpenAIError(400, "logprobs are served without stream only", "logprobs")
        if req.response_format and req.response_format.get("type") != "text":
            raise OpenAIError(400, "response_format: only {\"type\": \"text\"} is served", "response_format")
        if req.tool_choice not in (None, "auto", "none"):
            raise OpenAIError(400, "tool_choice: only \"auto\" and \"none\" are served", "tool_choice")
    else:
        assert isinstance(req, CompletionRequest)
        if req.logprobs:
            raise OpenAIError(400, "logprobs is not served on /v1/completions (it is on /v1/chat/completions)", "logprobs")
        if req.echo or req.suffix or (req.best_of or 1) > 1:
            raise OpenAIError(400, "echo, suffix and best_of are not served", "echo" if req.echo else
                              "suffix" if req.suffix else "best_of")
        if isinstance(req.prompt, list) and len(req.prompt) != 1:
            raise OpenAIError(400, "prompt: one prompt a request (a list of one is taken)", "prompt")


def chat_messages(req: ChatRequest) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools as a chat template takes them: `developer` as `system`, content
    parts joined; checked as an SFT row's conversation (shared/datasets.py)."""
    messages = []
    for m in req.messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        if isinstance(m.get("content"), list):  # [{type: text, text}]: the text parts
            if any(not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str)
                   for p in m["content"]):
                raise OpenAIError(400, "messages: only text content parts are served", "messages")
            m["content"] = "".join(p["text"] for p in m["content"])
        if m.get("role") == "assistant" and m.get("content") is None and "tool_calls" not in m:
            m["content"] = ""
        messages.append(m)
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    row = {"messages": messages, **({"tools": tools} if tools else {})}
    if error := messages_row_error(row):
        raise OpenAIError(400, error.replace("'", ""), "messages" if error.startswith("'messages") else "tools")
    return messages, tools


async def resolve_model(ar, who: Principal, req: _Sampling, settings: Settings) -> tuple[str, str | None]:
    """(model_id, adapter_name) the request names; 404 for a model or adapter the token cannot use."""
    model_id, adapter_name = req.model, req.adapter_name
    if req.model.startswith("ft:") and req.adapter_name is None:
        found = await fine_tuned_adapter(ar, req.model)
        if found is None:
            raise model_not_found(req.model)
        model_id, adapter_name = found
    elif error := model_id_error(req.model, settings):
        raise OpenAIError(400, error, "model")
    if adapter_name:
        try:
            await check_adapter(ar, who, model_id, adapter_name)  # another owner's reads as missing
        except HTTPException:
            raise model_not_found(req.model if req.adapter_name is None else f"{model_id}/{adapter_name}") from None
    return model_id, adapter_name


def model_not_found(name: str, why: str = "") -> OpenAIError:
    return OpenAIError(404, f"The model {name[:200]} does not exist or you do not have access to it{why}.", "model",
                       "model_not_found")


async def submit(r, who: Principal, request: dict) -> str:
    queue = await run_in_threadpool(scoring.route, r, request["model_id"])
    if queue is None:
        hub = ", and none has hub access" if is_hub_id(request["model_id"]) else ""
        raise model_not_found(request["model_id"], f" (no live worker has it{hub})")
    return await run_in_threadpool(scoring.submit, r, queue, who.name, {**request, "tenant": who.tenant})


async def next_item(ar, request_id: str, deadline: float) -> tuple[str, Any] | None:
    """The next text delta ("text", {index, text}) or the answer ("done", record), whichever
    comes first (deltas are all pushed before the answer); None when the deadline passes."""
    while (left := deadline - time.monotonic()) > 0:
        item = await ar.blpop([scoring.stream_key(request_id), scoring.done_key(request_id)], timeout=min(left, WAIT_SLICE_S))
        if item is None:
            continue
        if item[0].decode() == scoring.stream_key(request_id):
            return "text", json.loads(item[1])
        return "done", scoring.decode_record(await ar.hgetall(scoring.score_key(request_id)))
    return None


async def drop(ar, request_id: str) -> None:
    """The client is gone or the wait is over: the worker ends the request at its next chunk."""
    await ar.hset(scoring.score_key(request_id), "cancelled", "1")


def failed(record: dict) -> OpenAIError:
    return OpenAIError(record["error_status"], record["error"])


def call_id(request_id: str, choice: int, call: int) -> str:
    return f"call_{request_id[:16]}{choice:x}{call:x}"


def chat_answer(request_id: str, model: str, created: int, result: dict) -> ChatCompletion:
    choices = []
    for i, c in enumerate(result["choices"]):
        calls = [ToolCall(id=call_id(request_id, i, j), function=ToolFunction(**call))
                 for j, call in enumerate(c.get("tool_calls") or [])]
        logprobs = None if "logprobs" not in c else ChoiceLogprobs(content=[
            TokenLogprob(token=t["token"], logprob=t["logprob"], bytes=list(t["token"].encode())) for t in c["logprobs"]])
        choices.append(ChatChoice(index=i, message=AssistantMessage(content=c["text"] if c["text"] or not calls else None,
                                                                    tool_calls=calls or None),
                                  finish_reason=c["finish_reason"], logprobs=logprobs))
    return ChatCompletion(id=f"chatcmpl-{request_id}", created=created, model=model, choices=choices, usage=usage(result))


def text_answer(request_id: str, model: str, created: int, result: dict) -> TextCompletion:
    return TextCompletion(id=f"cmpl-{request_id}", created=created, model=model, usage=usage(result), choices=[
        TextChoice(index=i, text=c["text"], finish_reason=c["finish_reason"]) for i, c in enumerate(result["choices"])])


def usage(result: dict) -> Usage:
    return Usage(prompt_tokens=result["prompt_tokens"], completion_tokens=result["completion_tokens"],
                 total_tokens=result["prompt_tokens"] + result["completion_tokens"])


def sse_data(value: Any) -> str:
    return f"data: {json.dumps(value, separators=(',', ':'))}\n\n"


async def chunks(request: Request, ar, request_id: str, chat: bool, model: str, created: int, n: int,
                 include_usage: bool, first: tuple[str, Any], deadline: float,
                 answered: asyncio.Event) -> AsyncIterator[str]:
    """The answer as OpenAI's stream: a chunk per text delta, then each choice's finish (a chat's
    tool calls in it), the usage if asked for, [DONE]. An error after the start is an error
    chunk (the SDK raises it). `answered` is set once the answer came (else the request is
    dropped when the response ends: the client went away, or the wait ran out)."""
    head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{request_id}", "object": "chat.completion.chunk" if chat
            else "text_completion", "created": created, "model": model}

    def chunk(index: int, text: str | None = None, finish: str | None = None, calls: list | None = None) -> str:
        if not chat:
            return sse_data({**head, "choices": [{"index": index, "text": text or "", "finish_reason": finish,
                                                  "logprobs": None}]})
        delta: dict[str, Any] = {} if text is None else {"content": text}
        if calls:
            delta["tool_calls"] = [{"index": j, "id": call_id(request_id, index, j), "type": "function",
                                    "function": call} for j, call in enumerate(calls)]
        return sse_data({**head, "choices": [{"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    if chat:
        for i in range(n):
            yield sse_data({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                 "finish_reason": None, "logprobs": None}]})
    item: tuple[str, Any] | None = first
    quiet_since = time.monotonic()
    while True:
        if item is None:
            if time.monotonic() >= deadline:
                yield sse_data({"error": {"message": "timed out waiting for a worker (MTQ_COMPLETION_WAIT_S)",
                                          "type": "server_error", "code": "timeout"}})
                break
            if await request.is_disconnected():
                return
            if time.monotonic() - quiet_since > KEEPALIVE_S:
                quiet_since = time.monotonic()
                yield ": keep-alive\n\n"
        elif item[0] == "text":
            quiet_since = time.monotonic()
            yield chunk(item[1]["index"], item[1]["text"])
        else:
            answered.set()
            record = item[1]
            if record["status"] == "failed":
                yield sse_data({"error": {"message": record["error"], "type": "server_error"
                                          if record["error_status"] >= 500 else "invalid_request_error"}})
                break
            result = record["result"]
            for i, c in enumerate(result["choices"]):
                yield chunk(i, None, c["finish_reason"], c.get("tool_calls"))
            if include_usage:
                yield sse_data({**head, "choices": [], "usage": usage(result).model_dump()})
            break
        item = await next_item(ar, request_id, min(deadline, time.monotonic() + WAIT_SLICE_S))
    yield "data: [DONE]\n\n"


async def complete(request: Request, r, ar, settings: Settings, who: Principal, req: _Sampling, body: dict,
                   chat: bool):
    _not_served(req, settings)
    model_id, adapter_name = await resolve_model(ar, who, req, settings)
    if len(json.dumps(body)) > settings.max_step_tokens:
        raise OpenAIError(400, f"the request holds more than {settings.max_step_tokens} characters "
                          "(MTQ_MAX_STEP_TOKENS)", "messages" if chat else "prompt")
    if req.stream and sse.open_streams[who.name] >= settings.max_streams_per_token:
        raise OpenAIError(429, f"token {who.name!r} has {settings.max_streams_per_token} streams open "
                          "(MTQ_MAX_STREAMS_PER_TOKEN)")
    request_id = await submit(r, who, {
        "type": "generate", "model_id": model_id, "adapter_name": adapter_name, **body,
        "max_tokens": req.limit(), "temperature": req.temperature, "top_p": req.top_p, "n": req.n, "stop": req.stops(),
        "seed": req.seed, "stream": req.stream})
    created, deadline = int(time.time()), time.monotonic() + settings.completion_wait_s
    first = await next_item(ar, request_id, deadline)
    if first is None:
        await drop(ar, request_id)
        raise OpenAIError(504, "timed out waiting for a worker (MTQ_COMPLETION_WAIT_S)")
    if first[0] == "done" and first[1]["status"] == "failed":
        raise failed(first[1])
    if not req.stream:  # no deltas are pushed for it: the first item is the answer
        return (chat_answer if chat else text_answer)(request_id, req.model, created, first[1]["result"])
    include_usage = bool((req.stream_options or {}).get("include_usage"))
    answered = asyncio.Event()

    async def on_close() -> None:
        if not answered.is_set():
            await drop(ar, request_id)

    return sse.CountedStream(chunks(request, ar, request_id, chat, req.model, created, req.n, include_usage, first,
                                    deadline, answered), who.name, on_close)


@router.post("/chat/completions", response_model=ChatCompletion,
             summary="A chat completion from a base model or a fine-tuned one (stream: server-sent chunks)")
async def chat_completions(request: Request, req: ChatRequest, r: RedisDep, ar: AsyncRedisDep, settings: SettingsDep,
                           who: WriterDep):
    messages, tools = chat_messages(req)
    body = {"messages": messages, **({"tools": tools} if tools else {}), "logprobs": req.logprobs}
    return await complete(request, r, ar, settings, who, req, body, chat=True)


@router.post("/completions", response_model=TextCompletion,
             summary="A text completion of a prompt from a base model or a fine-tuned one (stream: server-sent chunks)")
async def completions(request: Request, req: CompletionRequest, r: RedisDep, ar: AsyncRedisDep, settings: SettingsDep,
                      who: WriterDep):
    prompt = req.prompt if isinstance(req.prompt, str) else req.prompt[0] if req.prompt else ""
    return await complete(request, r, ar, settings, who, req, {"prompt": prompt}, chat=False)
