"""`mtq mcp` (cli/mcp_server.py) driven by the official `mcp` SDK's client, on real processes:
`mtq mcp` spawned over stdio (and served over streamable HTTP), the API, a worker, Redis.

One SFT job serves the module: submitted with its dataset through the server, followed to
completion, its adapter downloaded and loaded by mlx_lm, its curves read as a resource.
"""

import asyncio
import io
import json
import sys
import tarfile
from pathlib import Path

import httpx
import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from cli.client import ApiClient
from conftest import ROOT, TOKEN, Stack, free_port, running, wait_for

VIEWER = "viewer-token-0123456789"
TOOLS = {"list_models", "list_kinds", "submit_job", "list_jobs", "show_job", "job_progress", "job_events",
         "cancel_job", "resume_job", "download_adapter", "export_adapter", "chat"}
ITERS = 3
SPEC = {"config": {"iters": ITERS, "batch_size": 2, "lora_layers": 2, "lora_rank": 4, "steps_per_report": 1}}
ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
JSONL = "".join(json.dumps(row) + "\n" for row in ROWS)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.use_tokens([{"name": "victor", "token": VIEWER, "role": "viewer"}])
    yield from running(s)


def stdio(stack, token: str, errlog=None) -> Client:
    """A client of `mtq mcp` spawned over stdio, as an MCP client configuration starts it;
    errlog: a file for the server's stderr (else the SDK's default, as docs/mcp.md shows it)."""
    env = {k: v for k, v in stack.env.items() if k not in ("REDIS_URL", "MTQ_API_PORT", "MTQ_API_TOKEN")}
    params = StdioServerParameters(command=sys.executable, args=["-m", "cli.main", "mcp"], cwd=str(ROOT),
                                   env=dict(env, MTQ_API_URL=stack.base_url, MTQ_API_TOKEN=token))
    return Client(stdio_client(params, errlog=errlog)) if errlog else Client(params)


def text(result) -> str:
    return "".join(part.text for part in result.content)


def data(result):
    """A tool's answer: a list as its structured content, an object as its one text part."""
    assert not result.is_error, text(result)
    return result.structured_content["result"] if result.structured_content else json.loads(text(result))


async def until(client: Client, job_id: str, statuses: tuple[str, ...], timeout: float = 240) -> list[dict]:
    """job_progress, polled until the job's status is one of `statuses`: every answer."""
    seen = [data(await client.call_tool("job_progress", {"job_id": job_id}))]
    for _ in range(int(timeout / 0.2)):
        if seen[-1]["status"] in statuses:
            return seen
        await asyncio.sleep(0.2)
        seen.append(data(await client.call_tool("job_progress", {"job_id": job_id})))
    raise TimeoutError(f"job {job_id}: {seen[-1]}")


@pytest.fixture(scope="module")
def sft_job(stack, worker, tmp_path_factory):
    """The SFT job, run through `mtq mcp` over stdio: what each step of the way answered."""
    out = tmp_path_factory.mktemp("mcp")

    async def run() -> dict:
        with open(out / "server.log", "w") as errlog:
            async with stdio(stack, TOKEN, errlog) as client:
                tools = {tool.name for tool in (await client.list_tools()).tools}
                models = data(await client.call_tool("list_models", {}))
                kinds = data(await client.call_tool("list_kinds", {}))
                job = data(await client.call_tool("submit_job", {
                    "kind": "sft", "spec": dict(SPEC, model_id=stack.tiny_model.name), "dataset_jsonl": JSONL}))
                seen = await until(client, job["job_id"], ("completed", "failed", "cancelled"))
                events = data(await client.call_tool("job_events", {"job_id": job["job_id"], "last": 3}))
                download = data(await client.call_tool("download_adapter", {"job_id": job["job_id"],
                                                                            "directory": str(out / "adapter")}))
                metrics = await client.read_resource(f"mtq://jobs/{job['job_id']}/metrics")
                answer = data(await client.call_tool("chat", {"model": job["job_id"], "max_tokens": 8, "messages": [
                    {"role": "user", "content": "Q0?"}]}))
                export = data(await client.call_tool("export_adapter", {"job_id": job["job_id"]}))
                await until(client, export["job_id"], ("completed", "failed", "cancelled"))
                fused = data(await client.call_tool("download_adapter", {"job_id": export["job_id"],
                                                                         "directory": str(out / "fused")}))
                return dict(tools=tools, models=models, kinds=kinds, job=job, seen=seen, events=events,
                            download=download, metrics=json.loads(metrics.contents[0].text), answer=answer, export=export,
                            fused=fused)

    return dict(asyncio.run(run()), out=out)


def test_an_sft_job_submitted_followed_and_downloaded_through_stdio(stack, sft_job):
    """Acceptance 5: the tools listed, an SFT job submitted with its uploaded dataset, followed to
    completion with job_progress, its adapter downloaded (the API's files, loaded by mlx_lm),
    its curves read; the token appears in no result and in nothing the server logged."""
    assert sft_job["tools"] == TOOLS
    assert stack.tiny_model.name in [m["model_id"] for m in sft_job["models"]]
    assert {k["name"] for k in sft_job["kinds"]} >= {"grpo", "sft", "dpo", "kto"}
    job_id = sft_job["job"]["job_id"]
    with stack.client() as c:
        job = c.get(f"/admin/api/jobs/{job_id}").json()
        # The dataset was uploaded as a file, its rows as given.
        assert c.get(f"/v1/files/{job['dataset']}/content").content == JSONL.encode()
        archive = c.get(f"/admin/api/fine-tune/jobs/{job_id}/adapter").content
    assert job["kind"] == "sft" and job["status"] == "completed", job.get("error")
    last = sft_job["seen"][-1]
    assert (last["status"], last["step"], last["total_steps"], last["metric"]) == ("completed", ITERS, ITERS, "loss")
    assert last["value"] == job["progress"]["loss"]
    assert [e["type"] for e in sft_job["events"]][-1] == "done" and len(sft_job["events"]) == 3

    # The files downloaded are the archive's, and mlx_lm loads them as an adapter.
    with tarfile.open(fileobj=io.BytesIO(archive)) as t:
        files = {Path(m.name).name: t.extractfile(m).read() for m in t.getmembers() if m.isfile()}
    out = sft_job["out"] / "adapter"
    assert sft_job["download"]["files"] == {name: len(b) for name, b in files.items()}
    assert {name: (out / name).read_bytes() for name in files} == files
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(stack.tiny_model), adapter_path=str(out))
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=2) is not None

    # The curves: every step's loss, as `mtq plot` reads them.
    client = ApiClient(stack.base_url, TOKEN)
    assert sft_job["metrics"] == client.step_metrics(job_id)
    client.close()
    assert [m["iter"] for m in sft_job["metrics"] if "loss" in m] == list(range(1, ITERS + 1))

    # The chat tool answers as /v1/chat/completions does with the job's adapter; the export's
    # model directory loads whole and generates what the base with the adapter generates.
    with stack.client() as c:
        direct = c.post("/v1/chat/completions", json={"model": job["model_id"], "adapter_name": job["adapter_name"],
                                                      "max_tokens": 8, "temperature": 0,
                                                      "messages": [{"role": "user", "content": "Q0?"}]}).json()
    assert sft_job["answer"]["content"] == direct["choices"][0]["message"]["content"]
    assert {"config.json", "adapter_config.json"} & set(sft_job["fused"]["files"]) == {"config.json"}
    fused_model, fused_tokenizer = mlx_lm.load(sft_job["fused"]["directory"])
    assert mlx_lm.generate(fused_model, fused_tokenizer, "hi", max_tokens=6) == mlx_lm.generate(
        model, tokenizer, "hi", max_tokens=6)
    assert TOKEN not in json.dumps(sft_job, default=str)
    assert TOKEN not in (sft_job["out"] / "server.log").read_text()


def test_bad_calls_are_tool_errors_with_the_apis_message(stack, sft_job, tmp_path):
    """An unknown job, an invalid spec, a dataset for a kind without one, a missing file, a path
    with a NUL, a viewer's submit and cancel: each a tool error that says why (the API's own
    message), and the server keeps answering."""
    async def run():
        with open(tmp_path / "server.log", "w") as errlog:
            async with stdio(stack, TOKEN, errlog) as admin, stdio(stack, VIEWER, errlog) as viewer:
                unknown = await admin.call_tool("show_job", {"job_id": "no-such-job"})
                invalid = await admin.call_tool("submit_job", {"kind": "sft", "spec": {
                    "model_id": stack.tiny_model.name, "config": {"iters": -1}}, "dataset_jsonl": JSONL})
                no_dataset = await admin.call_tool("submit_job", {"kind": "grpo", "spec": {}, "dataset_jsonl": JSONL})
                missing_file = await admin.call_tool("submit_job", {"kind": "sft", "spec": {},
                                                                    "dataset_path": str(tmp_path / "none.jsonl")})
                nul = await admin.call_tool("download_adapter", {"job_id": sft_job["job"]["job_id"], "directory": "a\0b"})
                with pytest.raises(MCPError, match="404"):
                    await admin.read_resource("mtq://jobs/no-such-job/metrics")
                denied = await viewer.call_tool("submit_job", {"kind": "sft", "spec": dict(
                    SPEC, model_id=stack.tiny_model.name), "dataset_jsonl": JSONL})
                cancel = await viewer.call_tool("cancel_job", {"job_id": sft_job["job"]["job_id"]})
                seen = data(await viewer.call_tool("show_job", {"job_id": sft_job["job"]["job_id"]}))
                return unknown, invalid, no_dataset, missing_file, nul, denied, cancel, seen

    unknown, invalid, no_dataset, missing_file, nul, denied, cancel, seen = asyncio.run(run())
    assert unknown.is_error and "HTTP 404" in text(unknown) and "no-such-job" in text(unknown)
    with stack.client() as c:  # the API's own answer to that spec
        answer = c.post("/admin/api/fine-tune/jobs", json={"model_id": stack.tiny_model.name, "config": {"iters": -1},
                                                          "dataset": ROWS})
    assert answer.status_code == 400 and "iters" in answer.json()["detail"]
    assert invalid.is_error and text(invalid).endswith(f"HTTP 400: {answer.json()['detail']}")
    assert no_dataset.is_error and "grpo jobs take no dataset" in text(no_dataset)
    assert missing_file.is_error and "none.jsonl: No such file or directory" in text(missing_file)
    assert nul.is_error and "no NUL characters" in text(nul)
    for result in (denied, cancel):
        assert result.is_error and "HTTP 403" in text(result) and "viewer role" in text(result)
    assert seen["status"] == "completed"  # ...while a viewer reads
    with stack.client() as c:  # the viewer's submit made no job, the invalid one neither
        jobs = [j["job_id"] for j in c.get("/admin/api/jobs").json()]
        assert jobs == [sft_job["export"]["job_id"], sft_job["job"]["job_id"]]


def test_cancel_and_resume_through_the_server(stack, sft_job):
    """A job cancelled with cancel_job, then resumed with resume_job and a config change,
    queues again with that change; resuming a completed job is the API's 409."""
    async def run():
        async with stdio(stack, TOKEN) as client:
            spec = dict(SPEC, model_id=stack.tiny_model.name, config=dict(SPEC["config"], iters=10_000))
            job_id = data(await client.call_tool("submit_job", {"kind": "sft", "spec": spec,
                                                                "dataset_jsonl": JSONL}))["job_id"]
            data(await client.call_tool("cancel_job", {"job_id": job_id}))
            cancelled = (await until(client, job_id, ("cancelled",), timeout=120))[-1]
            resumed = data(await client.call_tool("resume_job", {"job_id": job_id, "config": {"learning_rate": 5e-6}}))
            shown = data(await client.call_tool("show_job", {"job_id": job_id}))
            data(await client.call_tool("cancel_job", {"job_id": job_id}))  # the worker is the module's
            await until(client, job_id, ("cancelled",), timeout=120)
            completed = await client.call_tool("resume_job", {"job_id": sft_job["job"]["job_id"]})
            return cancelled, resumed, shown, completed

    cancelled, resumed, shown, completed = asyncio.run(run())
    assert cancelled["status"] == "cancelled"
    assert resumed["status"] in ("queued", "running") and shown["config"]["learning_rate"] == 5e-6
    assert completed.is_error and "HTTP 409" in text(completed) and "only failed or cancelled jobs resume" in text(completed)


def test_streamable_http_uses_each_requests_token_and_keeps_paths_in_its_dir(stack, sft_job, tmp_path):
    """Over streamable HTTP (loopback): the tools listed and called with the caller's bearer
    token; without one nothing is done, though the server's environment holds the admin
    token; local paths outside --files-dir are refused, inside it they work; a request under
    another Host or from a web page's Origin is refused."""
    port, files_dir = free_port(), tmp_path / "files"
    env = dict(stack.env, MTQ_API_URL=stack.base_url)  # MTQ_API_TOKEN: the admin's, which HTTP must not use
    proc = stack.spawn("mcp-http", "mcp", "--http", "--port", str(port), "--files-dir", str(files_dir), env=env)
    url = f"http://127.0.0.1:{port}/mcp"

    def up() -> bool:
        assert proc.poll() is None, stack.logs("mcp-http")
        try:
            return httpx.get(url, timeout=1).status_code < 500
        except httpx.HTTPError:
            return False

    wait_for(up, 30, "mtq mcp --http")
    job_id = sft_job["job"]["job_id"]

    def over_http(token: str | None) -> Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return Client(streamable_http_client(url, http_client=httpx2.AsyncClient(headers=headers, timeout=60)))

    async def run():
        async with over_http(TOKEN) as client:
            tools = {tool.name for tool in (await client.list_tools()).tools}
            jobs = data(await client.call_tool("list_jobs", {"status": "completed"}))
            outside = await client.call_tool("download_adapter", {"job_id": job_id, "directory": "../escaped"})
            (files_dir / "rows.jsonl").write_text(JSONL)
            sneaky = await client.call_tool("submit_job", {"kind": "sft", "spec": {}, "dataset_path": "/etc/passwd"})
            inside = data(await client.call_tool("download_adapter", {"job_id": job_id, "directory": "adapter"}))
        async with over_http(None) as anonymous:
            nobody = await anonymous.call_tool("list_jobs", {})
        async with over_http(VIEWER) as viewer:
            denied = await viewer.call_tool("cancel_job", {"job_id": job_id})
        return tools, jobs, outside, sneaky, inside, nobody, denied

    try:
        tools, jobs, outside, sneaky, inside, nobody, denied = asyncio.run(run())
        # A web page's request, through a name that resolves to loopback (DNS rebinding), is refused.
        rebound = httpx.post(url, headers={"Host": f"evil.example:{port}", "Authorization": f"Bearer {TOKEN}",
                                           "Accept": "application/json, text/event-stream"},
                             json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
        page = httpx.post(url, headers={"Origin": "http://evil.example", "Authorization": f"Bearer {TOKEN}",
                                        "Accept": "application/json, text/event-stream"},
                          json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    finally:
        stack.stop_proc(proc)
    assert (rebound.status_code, page.status_code) == (421, 403)
    assert tools == TOOLS
    assert job_id in [j["job_id"] for j in jobs] and {j["status"] for j in jobs} == {"completed"}
    for refused in (outside, sneaky):
        assert refused.is_error and f"must lie in {files_dir}" in text(refused)
    assert not (tmp_path / "escaped").exists()
    assert Path(inside["directory"]) == (files_dir / "adapter").resolve()
    assert sorted(p.name for p in (files_dir / "adapter").iterdir()) == sorted(inside["files"])
    assert nobody.is_error and "Authorization: Bearer" in text(nobody)
    assert denied.is_error and "viewer role" in text(denied)
    assert TOKEN not in stack.logs("mcp-http", tail=None)
