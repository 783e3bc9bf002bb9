"""Experiment trackers (docs/trackers.md) through the real stack: a job's metrics read back with
TensorBoard's own reader (EventAccumulator) and MLflow's client, step by step equal to the job's
history as its events give it (cli/client.py step_metrics); and an MLflow server that accepts
connections and never answers, which neither slows nor fails the job."""

import io
import json
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, TOKEN, Stack, read_events, running, wait_done, wait_for
from mlflow.tracking import MlflowClient
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from cli.client import ApiClient
from shared import lifecycle, trackers
from shared.keys import job_key, trackers_key
from shared.kinds import KINDS
from shared.settings import load_settings
from worker.supervisor.trackers import TRACKER_MAIN
from worker.trackers import tb_writer

SFT, GRPO = KINDS["sft"].prefix, KINDS["grpo"].prefix
ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
SFT_CONFIG = dict(lora_layers=2, lora_rank=4, learning_rate=1e-2, batch_size=2, iters=4, val_batches=-1,
                  steps_per_eval=2, steps_per_report=1)
GRPO_CONFIG = dict(group_size=2, batch_size=2, iters=60, max_completion_len=8, lora_layers=2, learning_rate=1e-3,
                   queue="hang")
NOT_METRICS = ("type", "worker", "iter", "total_iters")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """The stack and its worker, whose MLflow runs go to a file store under the test's directory."""
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.mlruns = s.workdir / "mlruns"
    s.env.update(MTQ_MLFLOW_TRACKING_URI=s.mlruns.as_uri(), MTQ_MLFLOW_EXPERIMENT="trackers-test",
                 MTQ_REPORT_TO="tensorboard")
    for started in running(s):
        s.worker = s.start_worker()
        yield started


@pytest.fixture(scope="module")
def client(stack):
    with stack.client() as c:
        yield c


def submit(client, path: str, spec: dict) -> str:
    res = client.post(path, json=spec)
    assert res.status_code == 200, res.text
    return res.json()["job_id"]


def trackers_ended(client, path: str, job_id: str, names: tuple[str, ...], timeout: float = 60) -> dict:
    """The job's trackers' states once none of `names` is running."""
    def ended():
        states = client.get(f"{path}/{job_id}/trackers").json()
        return states if all(states.get(n, {}).get("status") not in (None, "running") for n in names) else None
    return wait_for(ended, timeout, f"job {job_id}'s trackers {names} to end", interval=0.2)


def expected_scalars(stack, job_id: str) -> dict[str, list[tuple[int, float]]]:
    """The job's history (step_metrics: its step and eval events) as transformers' TensorBoard
    callback names it: {train/x or eval/x: [(global step, value)]}."""
    kind = KINDS[client_kind := ApiClient(stack.base_url, TOKEN).kind_of(job_id).name]
    scalars: dict[str, list[tuple[int, float]]] = {}
    for entry in ApiClient(stack.base_url, TOKEN).step_metrics(job_id):
        step = entry["iter"] - kind.first_step + 1
        for name, value in entry.items():
            if name in NOT_METRICS or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            tag = "eval/" + name[4:] if name.startswith("val_") else "train/" + name
            scalars.setdefault(tag, []).append((step, value))
    assert client_kind == kind.name
    return scalars


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the event files in logdir, read with TensorBoard's EventAccumulator."""
    assert all(p.name.startswith("events.out.tfevents.") for p in logdir.iterdir())
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_same(got: dict, expected: dict, rel: float) -> None:
    assert sorted(got) == sorted(expected)
    for tag, points in expected.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in points], rel=rel, abs=1e-7), tag


def wandb_history(path: Path) -> list[dict]:
    """The history rows of an offline wandb run's file (run-<id>.wandb): LevelDB's log format
    (32 KiB blocks of chunks: crc32, length, type; after a 7-byte file header) of wandb's
    protobuf Records."""
    data, pos, record, rows = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        _, length, chunk_type = struct.unpack("<IHB", data[pos:pos + 7])
        record += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if chunk_type in (1, 4):  # FULL, LAST
            parsed = wandb_internal_pb2.Record.FromString(record)
            if parsed.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in parsed.history.item})
            record = b""
    return rows


def test_an_sft_jobs_metrics_reach_tensorboard_mlflow_and_wandb_step_by_step(stack, client, tmp_path, monkeypatch):
    config = {**SFT_CONFIG, "report_to": ["tensorboard", "mlflow", "wandb"], "run_name": "sft tracked"}
    job_id = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "valid_dataset": ROWS, "config": config})
    wait_done(stack, SFT, job_id)
    states = trackers_ended(client, SFT, job_id, ("tensorboard", "mlflow", "wandb"))
    assert {n: (s["status"], s["step"]) for n, s in states.items()} == {
        "tensorboard": ("finished", 4), "mlflow": ("finished", 4), "wandb": ("finished", 4)}, states
    expected = expected_scalars(stack, job_id)
    # The loss every step; the validation loss as mlx_lm evaluates: before the first step, after it, every 2, the last.
    assert [s for s, _ in expected["train/loss"]] == [1, 2, 3, 4]
    assert [s for s, _ in expected["eval/loss"]] == [0, 1, 2, 4]
    assert {"train/learning_rate", "train/grad_norm", "eval/mean_token_accuracy"} <= set(expected)

    # TensorBoard keeps float32.
    res = client.get(f"{SFT}/{job_id}/tensorboard")
    assert res.status_code == 200, res.text
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        tar.extractall(tmp_path / "tb", filter="data")
    assert_same(tensorboard_scalars(tmp_path / "tb"), expected, rel=1e-6)

    # MLflow: transformers' MLflowCallback names (loss, eval_loss), the run named and tagged, its config as params.
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlflow = MlflowClient(tracking_uri=stack.mlruns.as_uri())
    run = mlflow.get_run(states["mlflow"]["run_id"])
    assert (run.info.status, run.info.run_name, run.data.tags["mtq.job_id"]) == ("FINISHED", "sft tracked", job_id)
    assert run.data.params["learning_rate"] == "0.01" and run.data.params["report_to"] == str(config["report_to"])
    assert mlflow.get_experiment(run.info.experiment_id).name == "trackers-test"
    logged = {("eval_" + t[5:] if t.startswith("eval/") else t[6:]): p for t, p in expected.items()}
    assert sorted(run.data.metrics) == sorted(logged)
    history = {name: [(m.step, m.value) for m in mlflow.get_metric_history(run.info.run_id, name)] for name in logged}
    assert_same(history, logged, rel=0)

    # wandb, offline (no WANDB_API_KEY): its run's file under $MTQ_HOME, WandbCallback's names against
    # train/global_step.
    run_file, = (stack.workdir / "home" / "trackers" / job_id / "wandb").glob(f"offline-run-*/run-{job_id}.wandb")
    rows = wandb_history(run_file)
    got: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if not name.startswith("_") and name != "train/global_step":
                got.setdefault(name, []).append((row["train/global_step"], value))
    assert_same(got, expected, rel=0)

    # A job that names no trackers gets the server's (MTQ_REPORT_TO); unknown names are a 400.
    default = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "config": {**SFT_CONFIG, "iters": 1}})
    wait_done(stack, SFT, default)
    assert trackers_ended(client, SFT, default, ("tensorboard",)) == {
        "tensorboard": {"status": "finished", "step": 1, "error": None, "run_id": None}}
    assert client.get(f"{SFT}/nope/trackers").status_code == 404
    unknown = client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "config": {"report_to": ["comet"]}})
    assert unknown.status_code == 400 and "report_to" in unknown.text


def test_an_unknown_server_default_tracker_is_refused(monkeypatch):
    monkeypatch.setenv("MTQ_REPORT_TO", "tensorboard,comet")
    with pytest.raises(ValueError, match="MTQ_REPORT_TO: unknown trackers comet"):
        load_settings()


def test_a_failing_tracker_says_so_in_its_state_and_an_event_never_after_the_job_ended(stack, client):
    """The tracker process itself, for a job in a lane no worker serves, made `running` by hand:
    an MLflow server that refuses connections fails it at once. Its state says `failed` with
    the error, and the running job's stream gets a `tracker_failed` event; once the job has
    ended, a failing tracker adds nothing to the stream (its terminal event stays the last), and
    its state expires with the job."""
    job_id = submit(client, SFT, {"model_id": "tiny", "dataset": ROWS, "config": {**SFT_CONFIG, "queue": "nowhere"}})
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    env = dict(stack.env, MTQ_MLFLOW_TRACKING_URI=f"http://127.0.0.1:{closed.getsockname()[1]}")

    def tracker() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", TRACKER_MAIN, job_id, "1", "mlflow"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    try:
        stack.redis.hset(job_key(job_id), mapping={"status": "running", "lease_epoch": 1})
        assert tracker().returncode == 1
        state = client.get(f"{SFT}/{job_id}/trackers").json()["mlflow"]
        assert state["status"] == "failed" and "Connection refused" in state["error"], state
        failed = [e for _, e in read_events(stack.redis, job_id) if e["type"] == "tracker_failed"]
        assert failed == [{"type": "tracker_failed", "tracker": "mlflow", "error": state["error"]}]

        stack.redis.hset(job_key(job_id), "status", "queued")
        assert lifecycle.cancel(stack.redis, job_id)
        assert tracker().returncode == 1
        assert read_events(stack.redis, job_id)[-1][1]["type"] == "cancelled"
        # Its state expires with the job's keys, and is gone with the job.
        assert 0 < stack.redis.pttl(trackers_key(job_id)) <= stack.redis.pttl(job_key(job_id)) + 1000
        assert client.delete(f"{SFT}/{job_id}").status_code == 200
        assert tracker().returncode == 0 and not stack.redis.exists(trackers_key(job_id))
    finally:
        closed.close()


@pytest.fixture
def hanging_server():
    """A TCP server that accepts connections and never answers: an MLflow server that hangs."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append((time.time(), server.accept()[0]))
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join(5)
    for _, conn in accepted:
        conn.close()
    server.close()


def run_time(client, path: str, job_id: str) -> float:
    job = client.get(f"{path}/{job_id}").json()
    return job["finished_at"] - job["started_at"]


def test_a_hanging_mlflow_server_neither_slows_nor_fails_the_job(stack, client, workers, hanging_server, tmp_path):
    """A worker whose MLflow server never answers, with a long call timeout (60 s: a tracker in the
    training process would wait that long) and a short grace: the GRPO job, long
    enough for the tracker to call the server while it runs, runs as fast as the same job without
    trackers and completes; TensorBoard still gets every step's
    reward; the MLflow tracker is killed after the grace, and its state says so."""
    port, accepted = hanging_server
    workers("--lanes", "hang", env=dict(stack.env, MTQ_MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}",
                                         MTQ_TRACKER_TIMEOUT_S="60", MTQ_TRACKER_GRACE_S="3"))
    spec = {"model_id": "tiny", "prompts": ["What is 2+2?", "Say hello."], "config": {**GRPO_CONFIG, "report_to": []}}
    plain = submit(client, GRPO, spec)
    wait_done(stack, GRPO, plain)  # first: it also compiles what the tracked job then reuses
    # [] : no tracker, not even the server's default; so no state and no event files.
    assert client.get(f"{GRPO}/{plain}/trackers").json() == {}
    assert client.get(f"{GRPO}/{plain}/tensorboard").status_code == 404
    tracked = submit(client, GRPO, {**spec, "config": {**GRPO_CONFIG, "report_to": ["mlflow", "tensorboard"]}})
    wait_done(stack, GRPO, tracked)
    assert client.get(f"{GRPO}/{tracked}").json()["error"] == ""
    print(f"\nGRPO job: {run_time(client, GRPO, plain):.1f} s without trackers, "
          f"{run_time(client, GRPO, tracked):.1f} s with a hanging MLflow server")
    # A tracker in the training process would hold a step for the 60 s of the call's timeout; the
    # tracker processes' start-up (importing MLflow) shares the machine's cores with the job.
    assert run_time(client, GRPO, tracked) < run_time(client, GRPO, plain) + 30

    started = time.monotonic()
    states = trackers_ended(client, GRPO, tracked, ("mlflow", "tensorboard"), timeout=30)
    assert states["tensorboard"]["status"] == "finished"
    assert states["mlflow"]["status"] == "killed" and "MTQ_TRACKER_GRACE_S" in states["mlflow"]["error"], states
    assert time.monotonic() - started < 20
    # The tracker called the server while the job ran, and waited on it.
    assert accepted and accepted[0][0] < client.get(f"{GRPO}/{tracked}").json()["finished_at"]
    expected = expected_scalars(stack, tracked)
    assert [s for s, _ in expected["train/reward"]] == list(range(1, 61))  # GRPO's step events count from 0
    # Downloaded as a user would: `mtq download ID DIR --tensorboard`.
    subprocess.run([sys.executable, "-m", "cli.main", "download", tracked, str(tmp_path / "tb"), "--tensorboard"],
                   env=stack.env, cwd=ROOT, check=True, timeout=60)
    assert_same(tensorboard_scalars(tmp_path / "tb"), expected, rel=1e-6)


def test_metric_names_are_transformers_callbacks_names():
    """A DPO step event (its seed aliases, the val_* metrics of its eval) and an eval event, as
    each tracker names them."""
    dpo = KINDS["dpo"]
    step = {"type": "dpo_step", "worker": "w", "iter": 0, "total_iters": 3, "loss": 0.5, "rewards/margins": 0.25,
            "reward_margin": 0.25, "acc_chosen": 1.0, "n_pairs": 2, "val_loss": 0.7, "done": True, "note": "x"}
    assert trackers.logs_of(dpo, step) == (1, {"loss": 0.5, "rewards/margins": 0.25})
    assert trackers.logs_of(dpo, {"type": "eval", "iter": 0, "val_loss": 0.7, "val_rewards/margins": 0.1}) == (
        0, {"eval_loss": 0.7, "eval_rewards/margins": 0.1})
    assert trackers.logs_of(dpo, {"type": "samples", "iter": 0}) is None
    logs = {"loss": 0.5, "rewards/margins(x)": 0.25, "eval_loss": 0.7}
    assert trackers.rewrite_logs(logs) == {"train/loss": 0.5, "train/rewards/margins(x)": 0.25, "eval/loss": 0.7}
    assert trackers.mlflow_names(logs) == {"loss": 0.5, "rewards/margins_x_": 0.25, "eval_loss": 0.7}


def test_a_resumed_run_replaces_the_steps_it_runs_again_in_tensorboard(stack, tmp_path):
    """A run that logged steps 1-4, then a run resumed from the checkpoint of step 2 (steps 3-5
    again): TensorBoard reads the later run's values for 3 and 4, once each."""
    job = SimpleNamespace(job_id="no-such-job", dir=tmp_path, epoch=1, r=stack.redis, state={})
    for epoch, steps, scale in ((1, range(1, 5), 1), (2, range(3, 6), 10)):
        job.epoch = epoch
        writer = tb_writer.Writer(job)
        for step in steps:
            writer.log(step, {"loss": step * scale})
        writer.close("queued")
        job.state = {"step": steps[-1]}
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"train/loss": [(1, 1), (2, 2), (3, 30), (4, 40), (5, 50)]}
