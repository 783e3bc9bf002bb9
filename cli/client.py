"""The REST API as the client commands see it: httpx, MTQ_API_URL and MTQ_API_TOKEN.

Never imports the worker (or mlx): `mtq submit`, `mtq watch`... run on any machine that
reaches the API. A job is named by its id alone: its kind, read once from the routes of every
kind (GET /admin/api/jobs/{id}), gives its routes from the kind registry (shared/kinds.py).
Accepts the list route's answer as a plain JSON array or as `{data: [...]}`.
"""

import io
import os
import re
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from httpx_sse import connect_sse

from shared.kinds import KINDS, Kind
from shared.model_ids import job_id_of

JOBS = "/admin/api/jobs"  # jobs of every kind, read-only
FILES = "/admin/api/fine-tune/files"
TERMINAL_EVENTS = ("done", "failed", "cancelled")
RECONNECT_DELAYS_S = (0.5, 1, 2, 4, 8)  # then every 8 s
RECONNECT_GIVE_UP_S = 300.0  # a stream down this long (API gone) ends the command
NEW_JOB_ID = re.compile(r"^[0-9a-f]{32}$")  # the ids the service gives jobs (uuid4 hex), not a model id
CONFIG_FILE = "adapter_config.json"  # with adapters.safetensors, or a full fine-tune's model*.safetensors
MODEL_CONFIG_FILE = "config.json"  # an export's model directory (docs/export.md) has no adapter_config.json


class ApiError(Exception):
    def __init__(self, status: int, detail: Any):
        self.status, self.detail = status, detail
        super().__init__(f"HTTP {status}: {detail if isinstance(detail, str) else repr(detail)}")


def default_api_url() -> str:
    return os.environ.get("MTQ_API_URL") or f"http://127.0.0.1:{os.environ.get('MTQ_API_PORT') or 8000}"


class ApiClient:
    def __init__(self, base_url: str, token: str, timeout: float = 30.0):
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)
        self.job_kinds: dict[str, Kind] = {}  # job id -> its kind (it never changes)

    @classmethod
    def from_env(cls) -> "ApiClient":
        return cls(default_api_url(), os.environ.get("MTQ_API_TOKEN", ""))

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One request; a GET is tried again after a connection error (the API restarting,
        or a pooled connection it closed)."""
        for delay in (*RECONNECT_DELAYS_S, None) if method == "GET" else (None,):
            try:
                response = self.http.request(method, path, **kwargs)
                break
            except httpx.TransportError:
                if delay is None:
                    raise
                time.sleep(delay)
        if response.is_error:
            raise ApiError(response.status_code, _detail(response))
        return response

    # ------------------------------------------------------------------ jobs

    def list_jobs(self, status: str | None = None, limit: int = 50) -> list[dict]:
        # The summary: a job's prompts may be megabytes, and `mtq jobs` shows none of them.
        params = {"limit": limit, "view": "summary", **({"status": status} if status else {})}
        body = self.request("GET", JOBS, params=params).json()
        return body if isinstance(body, list) else body["data"]

    def job(self, job_id: str) -> dict:
        return self.request("GET", f"{JOBS}/{job_id}").json()

    def kind_of(self, job_id: str) -> Kind:
        """The job's kind, asked once per job (GET /admin/api/jobs/{id})."""
        if job_id not in self.job_kinds:
            job = self.job(job_id)
            if job.get("status") == "unreadable":
                raise ApiError(0, f"job {job_id}: {job.get('error')}")
            if job.get("kind") not in KINDS:
                raise ApiError(0, f"job {job_id} is of kind {job.get('kind')!r}, which this client does not know")
            self.job_kinds[job_id] = KINDS[job["kind"]]
        return self.job_kinds[job_id]

    def job_path(self, job_id: str) -> str:
        """The job's routes: its kind's prefix and its id."""
        return f"{self.kind_of(job_id).prefix}/{job_id}"

    def submit(self, kind: Kind, spec: dict) -> dict:
        return self.request("POST", kind.prefix, json=spec).json()

    def upload(self, path: Path) -> str:
        """A JSON Lines dataset file, uploaded (POST /admin/api/fine-tune/files); its file id."""
        return self.upload_bytes(path.read_bytes(), path.name)

    def upload_bytes(self, data: bytes, filename: str) -> str:
        return self.request("POST", FILES, content=data, params={"filename": filename[:200]}).json()["id"]

    def cancel(self, job_id: str) -> dict:
        return self.request("POST", f"{self.job_path(job_id)}/cancel").json()

    def resume(self, job_id: str, config: dict) -> dict:
        return self.request("POST", f"{self.job_path(job_id)}/resume", json={"config": config}).json()

    def events(self, job_id: str, follow: bool = True, after: str | None = None) -> Iterator[tuple[str | None, dict]]:
        """(event id, event) of the job's stream, from the start (or after `after`).

        follow: until the stream ends (the job finished), reconnecting with Last-Event-ID
        after a dropped connection or an API restart; keep-alive comments are skipped.
        Otherwise only the events there are now: it stops at the first keep-alive or once
        the server has sent nothing for a moment.
        """
        last_id, last_type, failures, down_since = after, None, 0, None
        path = f"{self.job_path(job_id)}/stream"
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            # follow: no read timeout (the server sends a keep-alive comment while the job is quiet).
            timeout = httpx.Timeout(10.0, read=None if follow else 2.0)
            try:
                with connect_sse(self.http, "GET", path, headers=headers,
                                 timeout=timeout) as source:
                    if source.response.is_error:
                        source.response.read()
                        raise ApiError(source.response.status_code, _detail(source.response))
                    for sse in source.iter_sse():
                        if sse.event == "error":  # the server lost Redis mid-stream: reconnect
                            raise httpx.RemoteProtocolError(sse.data)
                        failures, down_since = 0, None
                        if sse.id:
                            last_id = sse.id
                        if not sse.data:
                            # A keep-alive comment: the job is quiet (httpx-sse hands the comment
                            # on as an event without data, with the previous id).
                            if not follow:
                                return  # caught up
                            continue
                        event = sse.json()
                        last_type = event.get("type")
                        yield last_id, event
                # The server ends a stream after the finished job's terminal event; an end
                # without one is a server going away (a restart): reconnect.
                if last_type in TERMINAL_EVENTS or not follow:
                    return
            except httpx.ReadTimeout:  # only without follow: caught up
                return
            except (httpx.TransportError, ApiError) as e:
                if isinstance(e, ApiError) and e.status not in (502, 503, 504):
                    raise
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > RECONNECT_GIVE_UP_S:
                    raise
            time.sleep(RECONNECT_DELAYS_S[min(failures, len(RECONNECT_DELAYS_S) - 1)])
            failures += 1

    def step_metrics(self, job_id: str) -> list[dict]:
        """Every step's metrics so far, by their step's `iter`: the kind's step events, with
        the val_* metrics of the `eval` events (whose `iter` counts completed steps; an eval
        before the first step is a point of its own). A step run twice, after a lost worker,
        counts once: its latest run."""
        kind = self.kind_of(job_id)
        steps: dict[int, dict] = {}
        for _, event in self.events(job_id, follow=False):
            if event.get("type") in (kind.step_event, "eval"):
                i = event["iter"] if event["type"] == kind.step_event else event["iter"] - 1 + kind.first_step
                steps[i] = {**steps.get(i, {}), **event, "iter": i}
        return [steps[i] for i in sorted(steps)]

    def download_adapter(self, job_id: str, out_dir: Path) -> list[Path]:
        """The finished job's adapter, or a full fine-tune's or an export's model directory (GET .../adapter:
        a zip or tar archive of its files), unpacked into out_dir as mlx_lm loads it. job_id
        may also be an OpenAI job's id (ftjob-...) or its fine-tuned model's name (ft:...)."""
        job_id = job_id_of(job_id) or job_id
        return _write(_unpack(self.request("GET", f"{self.job_path(job_id)}/adapter", timeout=300).content), out_dir)

    def download_tensorboard(self, job_id: str, out_dir: Path) -> list[Path]:
        """The job's TensorBoard event files (GET .../tensorboard: docs/trackers.md) into out_dir,
        for `tensorboard --logdir out_dir`."""
        return _write(_archive_files(self.request("GET", f"{self.job_path(job_id)}/tensorboard", timeout=300).content),
                      out_dir)

    # ------------------------------------------------------------------ chat

    def chat_model(self, name: str) -> tuple[str, str | None]:
        """(model, adapter_name) for /v1/chat/completions from what `mtq chat` takes: a
        fine-tuned model (ft:...), an OpenAI job (ftjob-...: its fine-tuned model), a job id
        (its base model and adapter) or a base model id."""
        if name.startswith("ftjob-"):
            job = self.request("GET", f"/v1/fine_tuning/jobs/{name}").json()
            if not job.get("fine_tuned_model"):
                raise ApiError(0, f"job {name} has no fine-tuned model (it is {job.get('status')})")
            return job["fine_tuned_model"], None
        if NEW_JOB_ID.fullmatch(name):
            job = self.job(name)
            if job.get("status") != "completed" or not job.get("adapter_name"):
                raise ApiError(0, f"job {name} has no adapter to chat with (it is {job.get('status')})")
            return job["model_id"], job["adapter_name"]
        return name, None

    def chat(self, model: str, messages: list[dict], adapter_name: str | None = None, **params) -> Iterator[str]:
        """The reply's text as it is decoded (POST /v1/chat/completions, stream)."""
        body = {"model": model, "messages": messages, "stream": True, **params,
                **({"adapter_name": adapter_name} if adapter_name else {})}
        with connect_sse(self.http, "POST", "/v1/chat/completions", json=body,
                         timeout=httpx.Timeout(10.0, read=None)) as source:
            if source.response.is_error:
                source.response.read()
                raise ApiError(source.response.status_code, _openai_detail(source.response))
            for sse in source.iter_sse():
                if not sse.data or sse.data == "[DONE]":
                    continue
                chunk = sse.json()
                if "error" in chunk:
                    raise ApiError(0, chunk["error"].get("message"))
                for choice in chunk.get("choices", []):
                    if choice.get("delta", {}).get("content"):
                        yield choice["delta"]["content"]


def _openai_detail(response: httpx.Response) -> Any:
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:500]


def _detail(response: httpx.Response) -> Any:
    try:
        return response.json().get("detail", response.text)
    except ValueError:
        return response.text[:500]


def _write(files: dict[str, bytes], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in files.items():
        path = out_dir / name
        path.write_bytes(data)
        written.append(path)
    return written


def _unpack(archive: bytes) -> dict[str, bytes]:
    """An adapter's files (_archive_files), which must be there."""
    files = _archive_files(archive)
    missing = [] if any(name.endswith(".safetensors") for name in files) else ["adapters.safetensors"]
    missing += [] if CONFIG_FILE in files or MODEL_CONFIG_FILE in files else [CONFIG_FILE]
    if missing:
        raise ApiError(200, f"the adapter archive lacks {', '.join(missing)}")
    return files


def _archive_files(archive: bytes) -> dict[str, bytes]:
    """The regular files of a zip or tar(.gz) archive, by base name: nothing from the archive
    decides where a file is written."""
    files: dict[str, bytes] = {}
    if zipfile.is_zipfile(io.BytesIO(archive)):
        with zipfile.ZipFile(io.BytesIO(archive)) as z:
            for info in z.infolist():
                if not info.is_dir():
                    files[Path(info.filename).name] = z.read(info)
    else:
        with tarfile.open(fileobj=io.BytesIO(archive)) as t:
            for member in t.getmembers():
                if member.isfile():
                    files[Path(member.name).name] = t.extractfile(member).read()
    return {name: data for name, data in files.items() if name and not name.startswith(".")}
