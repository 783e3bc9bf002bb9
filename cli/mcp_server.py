"""`mtq mcp`: an MCP server (the official `mcp` SDK's MCPServer) over the REST API, for a model
that runs fine-tuning jobs: it lists models and kinds, submits jobs (uploading their dataset),
follows, cancels and resumes them, reads their events and curves, downloads their adapters.

A thin layer over cli/client.py's ApiClient, as the caller: over stdio the process's own
MTQ_API_URL and MTQ_API_TOKEN (the person who configured the MCP client started it); over
streamable HTTP, each request's own `Authorization: Bearer` token, never the server's, so that
whoever reaches the port can do no more than their token lets them. The token is never logged
nor part of a result. An error from the API is a tool error carrying its message.

Local paths (a dataset file, the adapter's directory) are anywhere over stdio; over HTTP the
server's files are not the caller's, so they must lie in the directory it was started with.
Never imports MLX.
"""

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import httpx
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ResourceError, ToolError
from mcp.types import ToolAnnotations
from pydantic import Field

from cli.client import ApiClient, ApiError, default_api_url
from shared.kinds import KINDS

# The kinds a job can be posted of (the Tinker API makes sessions' jobs: docs/sessions.md).
POSTED_KINDS = Literal[tuple(name for name, kind in KINDS.items() if kind.family != "session")]
STATUSES = Literal["queued", "running", "completed", "failed", "cancelled"]
READ_ONLY = ToolAnnotations(read_only_hint=True)
INSTRUCTIONS = """Fine-tuning of MLX language models as queued jobs (mlx-train-queue).
Start with list_models and list_kinds; submit_job posts a job of a kind (sft needs a dataset:
give its JSON Lines rows as dataset_jsonl); follow it with job_progress until its status is
completed, failed or cancelled; then download_adapter. A job's curves: the resource
mtq://jobs/{job_id}/metrics."""


def bearer(headers) -> str:
    """The token of an HTTP request's `Authorization: Bearer` header ("" without one)."""
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def inside(files_dir: Path | None, text: str) -> Path:
    """A path the caller named: anywhere when files_dir is None, else only inside files_dir
    (relative to it; symbolic links resolved, so none leads out)."""
    if "\0" in text:
        raise ToolError("a path has no NUL characters")
    path = Path(text).expanduser()
    if files_dir is None:
        return path
    resolved = (files_dir / path).resolve()
    if not resolved.is_relative_to(files_dir.resolve()):
        raise ToolError(f"{text}: over HTTP, paths must lie in {files_dir} (the server's --files-dir)")
    return resolved


def progress_of(job: dict) -> dict:
    """A job's status, phase, step and headline metric (GRPO's reward, the others' loss)."""
    p, kind = job.get("progress") or {}, KINDS.get(job.get("kind"))
    headline = kind.headline if kind else None
    return {"job_id": job.get("job_id"), "kind": job.get("kind"), "status": job.get("status"),
            "phase": job.get("phase"), "step": p.get("iter", 0), "total_steps": p.get("total_iters"),
            "metric": headline, "value": p.get(headline) if headline else None, "error": job.get("error")}


def make_server(token: str | None, files_dir: Path | None = None) -> MCPServer:
    """The server: token, the caller's (stdio), or None: each request's own (HTTP);
    files_dir: where local paths must lie (None: anywhere)."""
    server = MCPServer("mtq", instructions=INSTRUCTIONS)
    api_url = default_api_url()

    @contextmanager
    def api(ctx: Context, error: type[Exception] = ToolError) -> Iterator[ApiClient]:
        """The REST API as the caller; its errors (and the API out of reach) become `error`s."""
        caller = bearer(ctx.headers or {}) if token is None else token
        if not caller and token is None:
            raise error("send your mtq API token with each request: `Authorization: Bearer <token>`")
        client = ApiClient(api_url, caller)
        try:
            yield client
        except ApiError as e:
            raise error(e.detail if e.status == 0 else str(e)) from None
        except httpx.HTTPError as e:
            raise error(f"the API at {api_url}: {type(e).__name__} {e}") from None
        except OSError as e:  # a local file
            raise error(f"{e.filename}: {e.strerror}" if e.filename else str(e)) from None
        finally:
            client.close()

    @server.tool(annotations=READ_ONLY)
    def list_models(ctx: Context) -> list[dict]:
        """The models jobs can train (their model_id), as the live workers offer them."""
        with api(ctx) as client:
            return client.request("GET", "/admin/api/fine-tune/models").json()

    @server.tool(annotations=READ_ONLY)
    def list_kinds(ctx: Context) -> list[dict]:
        """The job kinds (grpo, sft, dpo, orpo, kto, reward...): each one's routes, step event,
        headline metric and curves."""
        with api(ctx) as client:
            return client.request("GET", "/admin/api/kinds").json()

    @server.tool()
    def submit_job(
        ctx: Context,
        kind: Annotated[POSTED_KINDS, Field(description="The job's kind (list_kinds).")],
        spec: Annotated[dict[str, Any], Field(description=(
            "The job, as the body of its kind's POST route: {\"model_id\": ..., \"config\": {\"iters\": 20, ...}, "
            "...}: GRPO takes prompts and reward, DPO/ORPO/reward take preference_pairs, SFT/KTO a dataset "
            "(give it below)."))],
        dataset_jsonl: Annotated[str | None, Field(description=(
            "Training rows as JSON Lines text (SFT: {\"prompt\", \"completion\"} or {\"messages\"} per line): "
            "uploaded, then the job's dataset."))] = None,
        dataset_path: Annotated[str | None, Field(description="Or a local JSON Lines file to upload.")] = None,
    ) -> dict:
        """Submit a fine-tuning job of any kind; its dataset, if given, is uploaded first.
        Returns the job (job_id, status: queued)."""
        if dataset_jsonl is not None and dataset_path is not None:
            raise ToolError("give the dataset as dataset_jsonl or as dataset_path, not both")
        if (dataset_jsonl is not None or dataset_path is not None) and "dataset" not in KINDS[kind].spec_model.model_fields:
            raise ToolError(f"{kind} jobs take no dataset (see their spec)")
        with api(ctx) as client:
            if dataset_jsonl is not None:
                spec = {**spec, "dataset": {"file_id": client.upload_bytes(dataset_jsonl.encode(), "dataset.jsonl")}}
            elif dataset_path is not None:
                spec = {**spec, "dataset": {"file_id": client.upload(inside(files_dir, dataset_path))}}
            return client.submit(KINDS[kind], spec)

    @server.tool(annotations=READ_ONLY)
    def list_jobs(
        ctx: Context,
        status: Annotated[STATUSES | None, Field(description="Only the jobs in this status.")] = None,
        limit: Annotated[int, Field(ge=1, le=200)] = 20,
    ) -> list[dict]:
        """Jobs of every kind, newest first (a summary of each: kind, status, phase, progress, model)."""
        with api(ctx) as client:
            return client.list_jobs(status=status, limit=limit)

    @server.tool(annotations=READ_ONLY)
    def show_job(ctx: Context, job_id: str) -> dict:
        """A job whole: its spec, config, status, progress, error, times."""
        with api(ctx) as client:
            return client.job(job_id)

    @server.tool(annotations=READ_ONLY)
    def job_progress(ctx: Context, job_id: str) -> dict:
        """Where a job is: status (queued, running, completed, failed, cancelled), phase, step of
        total_steps, its headline metric (GRPO: reward; the others: loss) and error if it failed."""
        with api(ctx) as client:
            return progress_of(client.job(job_id))

    @server.tool(annotations=READ_ONLY)
    def job_events(ctx: Context, job_id: str, last: Annotated[int, Field(ge=1, le=1000)] = 20) -> list[dict]:
        """The job's last events (queued, started, phase, each step's metrics, eval, checkpoint,
        done, failed...), oldest first, each with its time (unix seconds)."""
        with api(ctx) as client:
            events = list(client.events(job_id, follow=False))[-last:]
        return [{"time": int(event_id.split("-")[0]) / 1000 if event_id else None, **event} for event_id, event in events]

    @server.tool()
    def cancel_job(ctx: Context, job_id: str) -> dict:
        """Cancel a queued or running job (a running one stops at its next step). Returns its progress."""
        with api(ctx) as client:
            return progress_of(client.cancel(job_id))

    @server.tool()
    def resume_job(
        ctx: Context, job_id: str,
        config: Annotated[dict[str, Any] | None, Field(description="Config changes, e.g. {\"learning_rate\": 5e-6}.")] = None,
    ) -> dict:
        """Re-queue a failed or cancelled job from its last checkpoint, with config changes.
        Returns its progress."""
        with api(ctx) as client:
            return progress_of(client.resume(job_id, config or {}))

    @server.tool()
    def download_adapter(
        ctx: Context, job_id: str,
        directory: Annotated[str, Field(description="A local directory to write the files into (made if missing).")],
    ) -> dict:
        """Download a completed job's adapter (adapters.safetensors, adapter_config.json; a full
        fine-tune's model files) into a directory, ready for mlx_lm.load(model, adapter_path=directory)."""
        with api(ctx) as client:
            out = inside(files_dir, directory)
            files = client.download_adapter(job_id, out)
        return {"directory": str(out), "files": {path.name: path.stat().st_size for path in files}}

    @server.tool()
    def export_adapter(
        ctx: Context, job_id: str,
        dequantize: Annotated[bool, Field(description="Write a quantized base's fused model unquantized.")] = False,
        gguf: Annotated[bool, Field(description="Also write a GGUF file (llama, mistral, mixtral only).")] = False,
        quantize: Annotated[bool, Field(description="Quantize the fused model to the bits the job trained with QAT "
                                                    "(docs/quantization.md).")] = False,
    ) -> dict:
        """Fuse a completed job's adapter into its base model, on a worker (docs/export.md): starts an
        export job and returns it; follow it with job_progress, then download_adapter of the export
        job's id gives the model directory, which mlx_lm.load(directory) loads."""
        with api(ctx) as client:
            return client.submit(KINDS["export"], {"source": job_id, "dequantize": dequantize, "gguf": gguf,
                                                   "quantize": quantize})

    @server.tool()
    def chat(
        ctx: Context,
        model: Annotated[str, Field(description="A job id, an OpenAI job id (ftjob-...), a fine-tuned model (ft:...) "
                                                "or a base model id.")],
        messages: Annotated[list[dict[str, Any]], Field(description="The conversation: [{\"role\": \"user\", "
                                                                    "\"content\": ...}, ...].")],
        max_tokens: Annotated[int, Field(ge=1, le=4096)] = 256,
        temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 0.0,
    ) -> dict:
        """Ask a trained model (or a base model): its answer to the conversation (docs/chat.md)."""
        with api(ctx) as client:
            model_name, adapter = client.chat_model(model)
            body = {"model": model_name, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                    **({"adapter_name": adapter} if adapter else {})}
            answer = client.request("POST", "/v1/chat/completions", json=body, timeout=600).json()
        choice = answer["choices"][0]
        return {"content": choice["message"]["content"], "finish_reason": choice["finish_reason"], "usage": answer["usage"]}

    @server.resource("mtq://jobs/{job_id}/metrics", mime_type="application/json")
    def job_metrics(ctx: Context, job_id: str) -> str:
        """A job's curves: every step's metrics (loss, reward, KL, learning rate...; validation
        metrics as val_*) by step, as `mtq plot` draws them."""
        with api(ctx, ResourceError) as client:
            return json.dumps(client.step_metrics(job_id))

    return server


def serve(http: bool, host: str, port: int, files_dir: Path) -> int:
    """stdio (the caller's MTQ_API_TOKEN), or streamable HTTP on host:port/mcp (each request's token)."""
    if http:
        files_dir.mkdir(parents=True, exist_ok=True)
        make_server(None, files_dir).run("streamable-http", host=host, port=port)
    else:
        make_server(os.environ.get("MTQ_API_TOKEN", "")).run()
    return 0
