"""The client commands (`mtq submit/jobs/show/watch/logs/cancel/resume/download/plot`) and
/metrics, against a real stack: real HTTP, a real worker, `mtq` run as a process (`watch` in a
pseudo-terminal, as a person sees it), for GRPO jobs and a short job of every other kind.

One worker serves the module; its jobs run one after another on the tiny model.
"""

import json
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import ROOT, TOKEN, Stack, running, wait_for
from reward_server import closed_port_url, serving, slow_rewards
from shared.kinds import KINDS

CONFIG = {"group_size": 2, "batch_size": 1, "max_completion_len": 8, "lora_layers": 2, "lora_rank": 4,
          "lora_alpha": 8.0, "temperature": 1.0}
PROMPTS = ["What is 2+2?", "Say hello."]
KEEPALIVE_S = 0.3  # the API's keep-alive comments (MTQ_SSE_KEEPALIVE_S): quiet stretches are short here
FIRST_COLOUR, SECOND_COLOUR = [31, 119, 180], [255, 127, 14]  # matplotlib's first two line colours
# Short jobs of the other kinds, and the files their flags name (written by kind_files).
KIND_ITERS = 4
KIND_SETS = [f"iters={KIND_ITERS}", "batch_size=2", "lora_layers=2", "lora_rank=4", "steps_per_report=1"]
SFT_ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
PAIRS = [{"prompt": "Say something about sun.", "chosen": "moon is good", "rejected": "moon is road"},
         {"prompt": "Say something about car.", "chosen": "tree is good", "rejected": "tree is fish"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.env["MTQ_SSE_KEEPALIVE_S"] = str(KEEPALIVE_S)
    yield from running(s)


def mtq_env(stack) -> dict:
    env = {k: v for k, v in stack.env.items() if k not in ("REDIS_URL", "MTQ_API_PORT")}  # a client knows only the URL
    return dict(env, MTQ_API_URL=stack.base_url, MTQ_API_TOKEN=TOKEN, COLUMNS="120")


def mtq(stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=mtq_env(stack),
                          capture_output=True, text=True, timeout=timeout)


class InPty:
    """`mtq ARGS` with its stdout and stderr on a pseudo-terminal; collects what it draws."""

    def __init__(self, stack, *args: str):
        self.master, slave = pty.openpty()
        env = dict(mtq_env(stack), TERM="xterm-256color")
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", *args], cwd=ROOT, env=env,
                                     stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
        os.close(slave)
        self.raw = b""

    def read(self, timeout: float = 0.1) -> str:
        while select.select([self.master], [], [], timeout)[0]:
            try:
                chunk = os.read(self.master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            self.raw += chunk
            timeout = 0
        return self.text

    @property
    def text(self) -> str:
        return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", self.raw.decode(errors="replace"))

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.read(0.2)
        self.read(0.2)
        code = self.proc.wait(max(0.0, deadline - time.monotonic()))
        os.close(self.master)
        return code


def write_job(tmp_path: Path, stack, iters: int, **extra) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"model_id": stack.tiny_model.name, "prompts": PROMPTS,
                                "config": dict(CONFIG, iters=iters), **extra}))
    return path


def test_submit_watch_in_a_terminal_then_jobs_show_logs_plot(stack, worker, tmp_path):
    before = stack.metrics()
    job_file = write_job(tmp_path, stack, iters=6)
    term = InPty(stack, "submit", str(job_file), "--watch")
    assert term.wait(180) == 0, term.text
    out = term.text
    job_id = re.search(r"submitted job ([0-9a-f]{32})", out).group(1)
    assert "━" in out and "6/6" in out, out  # rich's bar, at the end all steps done
    assert re.search(r"reward \d", out) and "tok/s" in out, out
    assert "completed" in out.splitlines()[-1] or "completed: adapter" in out, out

    listed = mtq(stack, "jobs", "--status", "completed")
    assert listed.returncode == 0 and job_id in listed.stdout, listed.stderr
    shown = json.loads(mtq(stack, "show", job_id).stdout)
    assert shown["status"] == "completed" and shown["progress"]["iter"] == 6
    assert shown["phase"] is None  # a finished job is in no phase

    logs = mtq(stack, "logs", job_id)
    lines = logs.stdout.splitlines()
    assert len([line for line in lines if " grpo_step " in line]) == 6, logs.stdout
    assert lines[0].split()[1] == "started" and lines[-1].split()[1] == "done", logs.stdout

    png = tmp_path / "curves.png"
    plotted = mtq(stack, "plot", job_id, "--out", str(png))
    assert plotted.returncode == 0, plotted.stderr
    panels = panel_pixels(png, FIRST_COLOUR)
    # Each panel with data draws its curve: lines of that colour in at least 6 of the 8 panels.
    assert sum(n > 50 for n in panels) >= 6, panels

    # The adapter, through the API (no shared disk), into a fresh directory mlx_lm loads.
    out_dir = tmp_path / "downloaded"
    downloaded = mtq(stack, "download", job_id, str(out_dir))
    assert downloaded.returncode == 0, downloaded.stderr
    assert {p.name for p in out_dir.iterdir()} == {"adapters.safetensors", "adapter_config.json"}
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(stack.tiny_model), adapter_path=str(out_dir))
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=2) is not None

    # The workers' measurements reached /metrics through Redis: the counters moved.
    after = stack.metrics()
    assert after['mtq_step_seconds_count{}'] - before['mtq_step_seconds_count{}'] == 6
    assert after['mtq_tokens_per_second_count{}'] - before['mtq_tokens_per_second_count{}'] == 6
    assert after['mtq_scoring_seconds_count{}'] - before['mtq_scoring_seconds_count{}'] == 6
    assert after['mtq_step_seconds_sum{}'] > before['mtq_step_seconds_sum{}']
    assert after['mtq_jobs{"status": "completed"}'] == before['mtq_jobs{"status": "completed"}'] + 1
    assert after['mtq_workers{}'] == 1
    assert after['mtq_step_seconds_bucket{"le": "+Inf"}'] == after['mtq_step_seconds_count{}']


def panel_pixels(png: Path, colour: list[int]) -> list[int]:
    """Pixels of a line colour in each panel of `mtq plot`'s 2 x 4 grid: the colour, or its
    anti-aliased blend with the white background at half strength or more (a flat line falls
    between two pixel rows)."""
    import matplotlib.image

    pixels = matplotlib.image.imread(png)
    assert pixels.shape[:2] == (560, 1280)  # 16x7 inches at 80 dpi
    ink, line = 255 - (pixels[..., :3] * 255).round(), 255 - np.array(colour)
    strength = (ink * line).sum(axis=-1) / (line * line).sum()  # least squares: ink = strength * line
    hits = (strength > 0.5) & (np.abs(ink - strength[..., None] * line).sum(axis=-1) < 40)
    return [int(hits[r * 280:(r + 1) * 280, c * 320:(c + 1) * 320].sum()) for r in range(2) for c in range(4)]


def kind_files(tmp_path: Path, kind: str) -> list[str]:
    """`mtq submit` arguments of a short job of `kind` besides --kind, --model and --set:
    its rows in files (an uploaded dataset, pairs as JSON Lines or a JSON list)."""
    def write(name: str, text: str) -> str:
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    if kind == "sft":
        return [write("sft.json", json.dumps({"valid_dataset": SFT_ROWS})),  # FILE.json, changed by the flags
                "--dataset", write("train.jsonl", "\n".join(json.dumps(r) for r in SFT_ROWS))]
    if kind == "orpo":
        return ["--pairs", write("pairs.json", json.dumps(PAIRS))]
    if kind == "kto":  # the pairs unpaired: {prompt, completion, label}
        return ["--dataset", write("kto.jsonl", "\n".join(
            json.dumps({"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"})
            for p in PAIRS for side in ("chosen", "rejected")))]
    return ["--pairs", write("pairs.jsonl", "\n".join(json.dumps(r) for r in PAIRS))]


@pytest.mark.parametrize("kind", ["sft", "dpo", "orpo", "reward", "kto", "cpo"])
def test_every_kind_submits_watches_lists_downloads_and_plots_by_its_id(stack, worker, tmp_path, kind):
    """`mtq submit --kind K ... --watch` follows the job to completed (its kind's step events
    and headline metric), `mtq jobs` lists it with its kind, `mtq logs` prints its step events,
    `mtq download` yields an adapter mlx_lm loads, and `mtq plot` draws its kind's curves (SFT:
    with the validation loss)."""
    done = mtq(stack, "submit", "--kind", kind, *kind_files(tmp_path, kind), "--model", stack.tiny_model.name,
               "--set", *KIND_SETS, "--watch")
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = re.search(rf"submitted job ([0-9a-f]{{32}}) \({kind}, queued\)", done.stdout).group(1)
    assert f"{KIND_ITERS}/{KIND_ITERS}" in done.stdout and re.search(r"loss [+-]\d", done.stdout), done.stdout
    assert "completed: adapter" in done.stdout, done.stdout

    row = next(line for line in mtq(stack, "jobs").stdout.splitlines() if job_id in line)
    assert re.search(rf"{job_id} +{kind} +completed +{KIND_ITERS}/{KIND_ITERS} +loss \d", row), row
    logged = [line.split()[1] for line in mtq(stack, "logs", job_id).stdout.splitlines()]
    assert logged.count(f"{kind}_step") == KIND_ITERS and logged[-1] == "done", logged

    out_dir = tmp_path / "downloaded"
    assert mtq(stack, "download", job_id, str(out_dir)).returncode == 0
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(stack.tiny_model), adapter_path=str(out_dir))
    assert mlx_lm.generate(model, tokenizer, "hi", max_tokens=2) is not None

    if kind in ("sft", "dpo"):
        png = tmp_path / "curves.png"
        plotted = mtq(stack, "plot", job_id, "--out", str(png))
        assert plotted.returncode == 0 and f"({KIND_ITERS + (kind == 'sft')} points)" in plotted.stdout, plotted
        # Lines in every panel of the kind's charts (SFT 6, DPO 7; a validation curve may lie on
        # the training one), none in the grid's other panels.
        lines = [a + b for a, b in zip(panel_pixels(png, FIRST_COLOUR), panel_pixels(png, SECOND_COLOUR))]
        charts = len(KINDS[kind].charts)
        assert [n > 50 for n in lines] == [True] * charts + [False] * (8 - charts), lines
        if kind == "sft":  # val_loss (eval events: before the first step and at the last) beside the loss
            assert panel_pixels(png, SECOND_COLOUR)[0] > 20


def test_show_cancel_and_resume_a_job_of_another_kind_by_its_id(stack, worker, tmp_path):
    created = mtq(stack, "submit", "--kind", "kto", *kind_files(tmp_path, "kto"), "--model", stack.tiny_model.name,
                  "--set", "iters=100000", "batch_size=2", "lora_layers=1")
    job_id = re.search(r"submitted job ([0-9a-f]{32}) \(kto, queued\)", created.stdout).group(1)
    path = f"{KINDS['kto'].prefix}/{job_id}"
    with stack.client() as c:
        wait_for(lambda: c.get(path).json()["status"] == "running", 120, "running")
        assert mtq(stack, "cancel", job_id).returncode == 0
        wait_for(lambda: c.get(path).json()["status"] == "cancelled", 60, "cancelled")
        resumed = mtq(stack, "resume", job_id, "--set", "iters=2")
        assert resumed.returncode == 0, resumed.stderr
        wait_for(lambda: c.get(path).json()["status"] == "completed", 120, "completed")
    shown = json.loads(mtq(stack, "show", job_id).stdout)
    assert shown["kind"] == "kto" and shown["status"] == "completed" and shown["config"]["iters"] == 2
    wrong = mtq(stack, "submit", "--kind", "kto", "--pairs", str(tmp_path / "kto.jsonl"), "--model", "tiny")
    assert wrong.returncode == 1 and "--pairs: not for kto jobs (they take --dataset)" in wrong.stderr


def test_watch_exits_nonzero_when_the_job_fails(stack, worker):
    job = httpx.post(stack.base_url + "/admin/api/fine-tune/grpo/jobs", headers={"Authorization": f"Bearer {TOKEN}"},
                     json={"model_id": stack.tiny_model.name, "prompts": PROMPTS, "config": dict(CONFIG, iters=2),
                           "reward": [{"type": "python", "function": "tests.reward_fns:raises"}]}).json()
    term = InPty(stack, "watch", job["job_id"])
    assert term.wait(120) == 1, term.text
    assert "failed: " in term.text and "raises" in term.text, term.text


def test_watch_and_logs_follow_a_job_through_quiet_stretches(stack, worker, tmp_path):
    """A reward server slower than the keep-alive period after the first events (as a first
    step compiling kernels, or a slow reward function): the stream carries keep-alive comments
    between events, and `mtq watch` and `mtq logs --follow` skip them and follow to the end."""
    iters = 4
    with serving(slow_rewards(6 * KEEPALIVE_S)) as server:
        job_file = write_job(tmp_path, stack, iters=iters, reward=[{"type": "endpoint", "url": server.url}])
        job_id = re.search(r"submitted job ([0-9a-f]{32})", mtq(stack, "submit", str(job_file)).stdout).group(1)
        term = InPty(stack, "watch", job_id)
        follow = subprocess.Popen([sys.executable, "-m", "cli.main", "logs", job_id, "--follow"], cwd=ROOT,
                                  env=mtq_env(stack), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def drew_a_step():
            text = term.read()
            assert term.proc.poll() is None, f"mtq watch exited early:\n{term.text}"
            return re.search(rf" [1-9]/{iters}", text)

        wait_for(drew_a_step, 120, "watch to draw a step")
        # Without --follow: the events there are now; the first keep-alive means caught up.
        now = mtq(stack, "logs", job_id)
        assert now.returncode == 0 and " grpo_step " in now.stdout and " done " not in now.stdout, now
        with stack.client() as c:  # the stream as sent: keep-alive comments between the events
            with c.stream("GET", f"/admin/api/fine-tune/grpo/jobs/{job_id}/stream", timeout=120) as res:
                lines = list(res.iter_lines())
        assert term.wait(120) == 0, term.text
        out, err = follow.communicate(timeout=60)
        assert follow.returncode == 0, err
    first_step = next(i for i, line in enumerate(lines) if '"grpo_step"' in line)
    assert ": keep-alive" in lines[first_step:], lines
    assert f"{iters}/{iters}" in term.text and "completed" in term.text, term.text
    kinds = [line.split()[1] for line in out.splitlines()]
    assert kinds.count("grpo_step") == iters and kinds[0] == "started" and kinds[-1] == "done", out


def test_watch_and_logs_follow_across_an_api_restart(stack, worker, tmp_path):
    iters = 30
    with serving(slow_rewards(0.2)) as server:  # steps of 0.2 s: the API restart falls in the middle of the job
        job_file = write_job(tmp_path, stack, iters=iters, reward=[{"type": "endpoint", "url": server.url}])
        job_id = re.search(r"submitted job ([0-9a-f]{32})", mtq(stack, "submit", str(job_file)).stdout).group(1)
        term = InPty(stack, "watch", job_id)
        follow = subprocess.Popen([sys.executable, "-m", "cli.main", "logs", job_id, "--follow"], cwd=ROOT,
                                  env=mtq_env(stack), stdout=subprocess.PIPE, text=True)
        wait_for(lambda: re.search(rf" [1-9]\d*/{iters}", term.read()), 120, f"watch to draw a step:\n{term.text}")
        stack.stop_proc(stack.api)  # the streams drop; the clients reconnect with Last-Event-ID
        assert stack.redis.hget(f"mtq:job:{job_id}", "status") == b"running"
        stack.start_api()

        assert term.wait(180) == 0, term.text
        assert follow.wait(60) == 0
    assert f"{iters}/{iters}" in term.text, term.text
    out = follow.stdout.read()
    steps = [int(re.search(r" iter=(\d+)", line).group(1)) for line in out.splitlines() if " grpo_step " in line]
    assert steps == list(range(steps[0], steps[0] + iters)), out  # every step once: resumed after the last one seen
    assert out.splitlines()[-1].split()[1] == "done", out


def test_cancel_and_resume_with_a_changed_config(stack, worker, tmp_path):
    created = mtq(stack, "submit", str(write_job(tmp_path, stack, iters=500)))
    job_id = re.search(r"submitted job ([0-9a-f]{32})", created.stdout).group(1)
    with stack.client() as c:
        wait_for(lambda: c.get(f"/admin/api/fine-tune/grpo/jobs/{job_id}").json()["status"] == "running", 120, "running")
    cancelled = mtq(stack, "cancel", job_id)
    assert cancelled.returncode == 0 and job_id in cancelled.stdout, cancelled.stderr
    assert stack.wait_job(job_id)["status"] == "cancelled"

    resumed = mtq(stack, "resume", job_id, "--set", "learning_rate=2e-5", "iters=3")
    assert resumed.returncode == 0, resumed.stderr
    job = stack.wait_job(job_id, timeout=120)
    assert job["status"] == "completed" and job["config"]["learning_rate"] == 2e-5, job

    again = mtq(stack, "cancel", job_id)  # a finished job: a clear error, exit 1
    assert again.returncode == 1 and "404" in again.stderr and "not cancellable" in again.stderr


def test_metrics_need_the_token_unless_from_loopback_and_count_reward_calls(stack, worker):
    # Through a local proxy (X-Forwarded-For, trusted from 127.0.0.1 by uvicorn) the client is
    # remote: a token is needed.
    remote = {"X-Forwarded-For": "203.0.113.7"}
    assert httpx.get(stack.base_url + "/metrics", headers=remote).status_code == 401
    assert httpx.get(stack.base_url + "/metrics", headers={**remote, "Authorization": "Bearer wrong"}).status_code == 401
    before = stack.metrics(headers={**remote, "Authorization": f"Bearer {TOKEN}"})
    assert sum(v for k, v in before.items() if k.startswith("mtq_queue_depth{")) == 0

    jobs = "/admin/api/fine-tune/grpo/jobs"
    with serving(lambda body, k: {"rewards": [1.0] * len(body["completions"])}) as server, stack.client() as c:
        ok = c.post(jobs, json={"model_id": stack.tiny_model.name, "prompts": PROMPTS, "config": dict(CONFIG, iters=2),
                                "reward": [{"type": "endpoint", "url": server.url}]}).json()
        bad = c.post(jobs, json={"model_id": stack.tiny_model.name, "prompts": PROMPTS, "config": dict(CONFIG, iters=2),
                                 "reward": [{"type": "endpoint", "url": closed_port_url(), "retries": 1,
                                             "backoff_s": 0.01}]}).json()
        assert stack.wait_job(ok["job_id"])["status"] == "completed"
        assert stack.wait_job(bad["job_id"])["status"] == "failed"
        calls = len(server.requests)
    after = stack.metrics()
    assert after['mtq_reward_endpoint_errors_total{}'] - before['mtq_reward_endpoint_errors_total{}'] == 2
    # Each attempt is timed: the good job's calls and the bad job's two refused attempts.
    assert after['mtq_reward_endpoint_seconds_count{}'] - before['mtq_reward_endpoint_seconds_count{}'] == calls + 2
    assert after['mtq_jobs{"status": "failed"}'] == before['mtq_jobs{"status": "failed"}'] + 1


def test_adapter_archives_unpack_by_base_name_only(tmp_path):
    """`mtq download` unpacks the adapter route's zip or tar archive: regular files only, each
    by its base name, so that no name in the archive decides where a file is written."""
    import io
    import tarfile
    import zipfile

    from cli.client import ApiError, _unpack

    files = {"adapters.safetensors": b"weights", "adapter_config.json": b"{}"}
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("job/adapters.safetensors", files["adapters.safetensors"])
        z.writestr("../../adapter_config.json", files["adapter_config.json"])
    assert _unpack(zipped.getvalue()) == files
    tarred = io.BytesIO()
    with tarfile.open(fileobj=tarred, mode="w:gz") as t:
        for name, data in files.items():
            info = tarfile.TarInfo("/abs/" + name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("evil")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        t.addfile(link)
    assert _unpack(tarred.getvalue()) == files
    with pytest.raises(ApiError, match="lacks adapter_config.json"):
        only = io.BytesIO()
        with zipfile.ZipFile(only, "w") as z:
            z.writestr("adapters.safetensors", b"w")
        _unpack(only.getvalue())
    # A full fine-tune's archive is a model directory: its weights are model*.safetensors.
    model_dir = {"model.safetensors": b"w", "config.json": b"{}", "tokenizer.json": b"{}", "adapter_config.json": b"{}"}
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as z:
        for name, data in model_dir.items():
            z.writestr(name, data)
    assert _unpack(zipped.getvalue()) == model_dir
    no_weights = io.BytesIO()
    with zipfile.ZipFile(no_weights, "w") as z:
        z.writestr("adapter_config.json", b"{}")
    with pytest.raises(ApiError, match="lacks adapters.safetensors"):
        _unpack(no_weights.getvalue())
