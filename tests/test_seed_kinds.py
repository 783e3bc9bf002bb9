"""The seed server's SFT, DPO, ORPO and reward-model contract (../shared/reference/anchors.md,
"The seed server's other kinds, exactly"), against the real API, a real redis-server and a
real worker: the seed's own request bodies (its README's and its tests'), its messages and
status codes, and the macOS client's decoding of every job object the API answers.

The macOS app (fusion-mlx apps/fusion-mac/Sources/Net/DTO/FineTuneDTO.swift) decodes SFT job
objects with Swift's Codable: every non-optional key must be there, with its type (a JSON
integer for an Int; an Int or a fraction for a Double). FINE_TUNE_JOB_DTO is that struct as a
table, applied to every SFT answer: create, get, list and cancel, of jobs queued, running,
completed and failed. The app has no DTO of the other kinds; SEED_PAIR_JOB is the seed
server's DPO / ORPO / reward job object (its DPOJob.to_dict / RewardJob.to_dict) as a table of
the same kind, applied to theirs.
"""

import json
import subprocess
import sys

import pytest

from conftest import ROOT, TOKEN, Stack, running, wait_for

API = "/admin/api/fine-tune"
SFT, DPO, ORPO, REWARD, SCORE = (f"{API}/jobs", f"{API}/dpo/jobs", f"{API}/orpo/jobs", f"{API}/reward/jobs",
                                 f"{API}/reward/score")
PAIRS = [{"prompt": "Q?", "chosen": "good", "rejected": "bad"}, {"prompt": "Q2?", "chosen": "better", "rejected": "worse"}]
ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
QUICK = {"iters": 2, "batch_size": 2, "lora_layers": 1, "lora_rank": 4}

# --- the decoders -------------------------------------------------------------------------------

FINE_TUNE_CONFIG_DTO = {
    "lora_layers": "Int", "lora_rank": "Int", "lora_alpha": "Double", "lora_dropout": "Double",
    "fine_tune_type": "String", "optimizer": "String", "learning_rate": "Double", "batch_size": "Int", "iters": "Int",
    "val_batches": "Int", "steps_per_report": "Int", "steps_per_eval": "Int", "steps_per_save": "Int",
    "max_seq_length": "Int", "gradient_checkpointing": "Bool", "grad_accumulation_steps": "Int", "seed": "Int",
    "mask_prompt": "Bool",
}
FINE_TUNE_PROGRESS_DTO = {
    "step": "Int", "total_steps": "Int", "train_loss": "Double", "val_loss": "Double?", "learning_rate": "Double",
    "tokens_per_second": "Double", "iterations_per_second": "Double", "trained_tokens": "Int", "peak_memory_gb": "Double",
    "elapsed_seconds": "Double", "eta_seconds": "Double",
}
FINE_TUNE_JOB_DTO = {
    "job_id": "String", "model_id": "String", "dataset": "String", "config": FINE_TUNE_CONFIG_DTO, "status": "String",
    "progress": FINE_TUNE_PROGRESS_DTO, "created_at": "Double", "started_at": "Double?", "finished_at": "Double?",
    "adapter_path": "String", "adapter_name": "String", "error": "String",
}
PAIR = {"prompt": "String", "chosen": "String", "rejected": "String"}
PAIR_CONFIG = {"iters": "Int", "batch_size": "Int", "learning_rate": "Double", "lora_layers": "Int", "lora_rank": "Int",
               "lora_alpha": "Double", "lora_dropout": "Double", "max_seq_length": "Int", "seed": "Int"}
PAIR_PROGRESS = {"iter": "Int", "total_iters": "Int", "loss": "Double", "reward_margin": "Double", "acc_chosen": "Double"}
SEED_PAIR_JOB = {
    "job_id": "String", "model_id": "String", "preference_pairs": [PAIR], "config": PAIR_CONFIG, "adapter_name": "String",
    "adapter_path": "String", "status": "String", "created_at": "Double", "started_at": "Double", "finished_at": "Double",
    "error": "String", "progress": "Object",
}
METHOD_CONFIG = {**PAIR_CONFIG, "method": "String", "beta": "Double", "lambda_odds": "Double"}


def decode(value, schema, where="job"):
    """Swift's JSONDecoder on a Codable struct of this schema: raises AssertionError naming the key."""
    if isinstance(schema, dict):
        assert isinstance(value, dict), f"{where}: expected an object, got {value!r:.80}"
        for key, sub in schema.items():
            optional = isinstance(sub, str) and sub.endswith("?")
            if optional and value.get(key) is None:
                continue
            assert key in value, f"{where}: key {key!r} missing"
            decode(value[key], sub.rstrip("?") if optional else sub, f"{where}.{key}")
    elif isinstance(schema, list):
        assert isinstance(value, list), f"{where}: expected an array"
        for i, item in enumerate(value):
            decode(item, schema[0], f"{where}[{i}]")
    else:
        ok = {"String": lambda v: isinstance(v, str), "Bool": lambda v: isinstance(v, bool),
              "Int": lambda v: isinstance(v, int) and not isinstance(v, bool),
              "Double": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
              "Object": lambda v: isinstance(v, dict)}[schema]
        assert ok(value), f"{where}: {value!r:.80} is not a {schema}"


def decode_pair_job(job: dict, config_schema: dict = METHOD_CONFIG) -> None:
    decode(job, {**SEED_PAIR_JOB, "config": config_schema})
    if job["progress"]:  # {} until the first step, as the seed's
        decode(job["progress"], PAIR_PROGRESS, "job.progress")


def test_the_decoders_refuse_what_swift_refuses():
    """The decoder is not a no-op: a missing key, a fraction for an Int, null for a String fail."""
    good = {"step": 1, "total_steps": 2, "train_loss": 1, "learning_rate": 0.1, "tokens_per_second": 1.5,
            "iterations_per_second": 2.0, "trained_tokens": 7, "peak_memory_gb": 0.0, "elapsed_seconds": 1.0, "eta_seconds": 0}
    decode(good, FINE_TUNE_PROGRESS_DTO)  # val_loss may be missing or null; an Int where a Double goes is fine
    for bad in ({**good, "step": 1.0}, {k: v for k, v in good.items() if k != "eta_seconds"}, {**good, "trained_tokens": True}):
        with pytest.raises(AssertionError):
            decode(bad, FINE_TUNE_PROGRESS_DTO)
    with pytest.raises(AssertionError, match="dataset"):
        decode({"job_id": "x", "model_id": "m", "dataset": [{"text": "a"}]}, FINE_TUNE_JOB_DTO)


# --- the stack -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.data_root = tmp_path_factory.mktemp("data")
    s.env.update(MTQ_DATA_ROOTS=str(s.data_root))
    yield from running(s)


def ok(res) -> dict:
    assert res.status_code == 200, res.text
    return res.json()


# --- without a worker: bodies, messages, queued jobs -----------------------------------------------


@pytest.mark.parametrize("path,body,detail", [
    (SFT, {"dataset": "/tmp/data"}, "model_id is required"),
    (SFT, {"model_id": "", "dataset": "/tmp/data"}, "model_id is required"),
    (SFT, {"model_id": "qwen3"}, "dataset is required"),
    (SFT, {"model_id": "qwen3", "dataset": ROWS, "config": {"no_such_knob": 1}}, "Invalid config: unknown field 'no_such_knob'"),
    (DPO, {"preference_pairs": PAIRS}, "model_id is required"),
    (DPO, {"model_id": "m1"}, "preference_pairs (non-empty list) required"),
    (DPO, {"model_id": "m1", "preference_pairs": []}, "preference_pairs (non-empty list) required"),
    (DPO, {"model_id": "m1", "preference_pairs": [{"prompt": "x"}]},
     "preference_pairs[0] must have prompt/chosen/rejected (chosen: Field required); "
     "preference_pairs[0] must have prompt/chosen/rejected (rejected: Field required)"),
    (DPO, {"model_id": "m1", "preference_pairs": PAIRS, "config": {"unknown_field": 1}}, "Invalid config: unknown field 'unknown_field'"),
    (ORPO, {"model_id": "m1", "preference_pairs": "x"}, "preference_pairs (non-empty list) required"),
    (REWARD, {"preference_pairs": [{"prompt": "p", "chosen": "c", "rejected": "r"}]}, "model_id is required"),
    (REWARD, {"model_id": "m1"}, "preference_pairs (non-empty list) required"),
    (REWARD, {"model_id": "m1", "preference_pairs": [{"prompt": "p", "chosen": "c"}]},
     "preference_pairs[0] must have prompt/chosen/rejected (rejected: Field required)"),
    (REWARD, {"model_id": "m1", "preference_pairs": [{"prompt": "p", "chosen": "c", "rejected": "r"}],
              "config": {"unknown_field": 1}}, "Invalid config: unknown field 'unknown_field'"),
    (REWARD, {"model_id": "m1", "preference_pairs": PAIRS, "config": {"beta": 0.1}}, "Invalid config: unknown field 'beta'"),
    (SCORE, {"adapter_name": "rm-1", "prompt": "x", "completions": ["a"]}, "model_id is required"),
    (SCORE, {"model_id": "qwen3", "prompt": "x", "completions": ["a"]}, "adapter_name is required"),
    (SCORE, {"model_id": "qwen3", "adapter_name": "rm-1", "prompt": "x", "completions": []}, "completions (non-empty list) required"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("/") else None)
def test_invalid_bodies_are_400_with_the_seeds_messages(client, path, body, detail):
    res = client.post(path, json=body)
    assert res.status_code == 400, res.text
    assert res.json()["detail"] == detail


def test_a_missing_or_wrong_key_is_the_seeds_401(stack):
    with stack.client(None) as anonymous, stack.client("wrong-token-0123456789") as wrong:
        for c in (anonymous, wrong):
            for method, path in (("GET", SFT), ("POST", DPO), ("GET", f"{REWARD}/x"), ("POST", SCORE)):
                res = c.request(method, path, json={})
                assert res.status_code == 401 and res.json() == {"detail": "Admin authentication required"}, (method, path)


def test_the_seeds_own_test_bodies_and_a_form_content_type(client):
    """tests/unit/test_issue_399_dpo_orpo.py's and test_reward_route.py's creates, verbatim; a
    JSON body sent as curl -d sends it (a form content type) is read as JSON, as the seed reads it."""
    dpo = ok(client.post(DPO, json={"model_id": "m1", "preference_pairs": PAIRS, "config": {"iters": 1}}))
    assert dpo["model_id"] == "m1" and dpo["preference_pairs"] == PAIRS
    assert dpo["config"]["method"] == "dpo" and dpo["config"]["iters"] == 1
    orpo = ok(client.post(ORPO, json={"model_id": "m1", "preference_pairs": PAIRS, "config": {"iters": 1, "lambda_odds": 0.5}}))
    assert orpo["config"]["method"] == "orpo" and orpo["config"]["lambda_odds"] == 0.5
    forced = ok(client.post(ORPO, json={"model_id": "m1", "preference_pairs": PAIRS, "config": {"method": "dpo"}}))
    assert forced["config"]["method"] == "orpo"  # the route sets it, whatever the body says
    rm = ok(client.post(REWARD, content=json.dumps({"model_id": "m1", "preference_pairs": [
        {"prompt": "p", "chosen": "good", "rejected": "bad"}], "config": {"iters": 1, "batch_size": 1}}),
        headers={"Content-Type": "application/x-www-form-urlencoded"}))
    assert rm["preference_pairs"][0]["chosen"] == "good" and rm["config"]["iters"] == 1 and rm["status"] == "queued"
    # The seed's defaults, and its fresh job: times 0.0, progress {}, error "", the adapter's path already set.
    defaults = ok(client.post(DPO, json={"model_id": "m1", "preference_pairs": [{**PAIRS[0], "id": 7}]}))
    assert {k: defaults["config"][k] for k in ("method", "iters", "batch_size", "learning_rate", "lora_layers", "lora_rank",
                                               "lora_alpha", "lora_dropout", "beta", "lambda_odds", "max_seq_length", "seed")} == {
        "method": "dpo", "iters": 50, "batch_size": 2, "learning_rate": 1e-5, "lora_layers": 16, "lora_rank": 8,
        "lora_alpha": 16.0, "lora_dropout": 0.0, "beta": 0.1, "lambda_odds": 1.0, "max_seq_length": 1024, "seed": 0}
    assert defaults["preference_pairs"] == [{**PAIRS[0], "id": 7}]  # other columns kept, as the seed keeps them
    assert {k: ok(client.post(REWARD, json={"model_id": "m1", "preference_pairs": PAIRS}))["config"][k]
            for k in ("iters", "batch_size", "max_seq_length", "learning_rate")} == {
        "iters": 50, "batch_size": 2, "max_seq_length": 1024, "learning_rate": 1e-5}
    for job in (dpo, orpo, rm, defaults):
        decode_pair_job(job, PAIR_CONFIG if job is rm else METHOD_CONFIG)
        assert job["started_at"] == 0.0 and job["finished_at"] == 0.0 and job["progress"] == {} and job["error"] == ""
        assert job["adapter_path"].endswith(f"/m1/{job['adapter_name']}")

    # ORPO jobs are read, listed, cancelled and deleted under /dpo/jobs too.
    listed = ok(client.get(DPO))
    assert {dpo["job_id"], orpo["job_id"]} <= {j["job_id"] for j in listed} and rm["job_id"] not in {j["job_id"] for j in listed}
    for job in listed:
        decode_pair_job(job)
    cancelled = ok(client.post(f"{DPO}/{orpo['job_id']}/cancel"))
    assert cancelled["status"] == "cancelled" and cancelled["config"]["method"] == "orpo"
    decode_pair_job(cancelled)
    assert ok(client.delete(f"{DPO}/{orpo['job_id']}")) == {"status": "deleted"}
    assert ok(client.post(f"{REWARD}/{rm['job_id']}/cancel"))["status"] == "cancelled"
    assert ok(client.delete(f"{REWARD}/{rm['job_id']}")) == {"status": "deleted"}
    for path in (DPO, REWARD, SFT):
        assert client.get(f"{path}/nonexistent").json() == {"detail": "Job not found: nonexistent"}
        assert client.post(f"{path}/nope/cancel").json() == {"detail": "Job not found or not cancellable: nope"}
        assert client.delete(f"{path}/nope").json() == {"detail": "Job not found or currently running: nope"}


def test_a_queued_and_a_cancelled_sft_job_decode_in_the_macos_app(stack, client):
    data_dir = stack.data_root / "queued"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    job = ok(client.post(SFT, json={"model_id": "qwen3", "dataset": str(data_dir), "config": {"lora_rank": 16}}))
    decode(job, FINE_TUNE_JOB_DTO)
    assert job["status"] == "queued" and job["started_at"] is None and job["dataset"] == str(data_dir)
    assert job["progress"]["val_loss"] is None and job["progress"]["step"] == 0
    assert job["config"]["mxfp8"] is False and job["config"]["lr_schedule"] is None and job["config"]["quant_bits"] == 4
    decode(ok(client.get(f"{SFT}/{job['job_id']}")), FINE_TUNE_JOB_DTO)
    inline = ok(client.post(SFT, json={"model_id": "qwen3", "dataset": ROWS}))
    assert inline["dataset"] == "inline" and inline["dataset_rows"] == ROWS
    for listed in ok(client.get(SFT)):
        decode(listed, FINE_TUNE_JOB_DTO)
    for queued in (job, inline):
        cancelled = ok(client.post(f"{SFT}/{queued['job_id']}/cancel"))
        decode(cancelled, FINE_TUNE_JOB_DTO)
        assert cancelled["status"] == "cancelled"


def test_this_services_reward_score_as_a_reward_endpoint_is_its_reward_model(stack, client):
    """The seed's RL loop names .../reward/score as a GRPO job's reward_endpoint: here the URL
    names the reward model, and the job scores with it on its worker (no HTTP to itself: the
    loop runs on one worker, tests/test_train_kinds.py). So the URL is checked as a reward
    model is (one of the token's own; none is here), not as an endpoint; a reward/score of
    another server is an endpoint like any."""
    grpo, url = f"{API}/grpo/jobs", f"{stack.base_url}{SCORE}"
    body = {"model_id": "tiny", "prompts": ["hi"]}
    missing = "reward_model: Adapter not found: tiny/rm"
    res = client.post(grpo, json={**body, "config": {"reward_endpoint": f"{url}?model_id=tiny&adapter_name=rm"}})
    assert res.status_code == 400 and res.json()["detail"] == missing, res.text
    mine = f"http://localhost:{stack.api_port}{SCORE}?adapter_name=rm&model_id=tiny"
    res = client.post(grpo, json={**body, "reward": [{"type": "endpoint", "url": mine, "weight": 2.0, "name": "judge"},
                                                     {"type": "length"}]})
    assert res.status_code == 400 and res.json()["detail"] == missing, res.text
    res = client.post(grpo, json={**body, "config": {"reward_endpoint": url}})
    assert res.status_code == 400 and res.json()["detail"] == (
        f"reward endpoint {url}: this service's reward/score route as a reward endpoint needs "
        "?model_id=...&adapter_name=... (the reward model to score with)")
    other = f"http://127.0.0.1:{stack.api_port + 1}{SCORE}?model_id=tiny&adapter_name=rm"  # checked as egress
    res = client.post(grpo, json={**body, "config": {"reward_endpoint": other}})
    assert res.status_code == 400 and f"reward endpoint 127.0.0.1:{stack.api_port + 1} is not allowed" in res.json()["detail"]


# --- with the module's worker -------------------------------------------------------------------------


def test_running_completed_and_failed_jobs_decode(stack, client, worker):
    """Every answer (create, get, list, cancel) while running, after completing and after failing."""
    long = {**QUICK, "iters": 100_000, "steps_per_report": 1}
    sft = ok(client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "config": long}))
    running_job = wait_for(lambda: (j := ok(client.get(f"{SFT}/{sft['job_id']}")))["progress"].get("iter") and j,
                           120, "the SFT job's first step", 0.1)
    decode(running_job, FINE_TUNE_JOB_DTO)
    assert running_job["status"] == "running" and running_job["started_at"] > 0 and running_job["finished_at"] is None
    assert running_job["progress"]["step"] >= 1 and running_job["progress"]["total_steps"] == 100_000
    for listed in ok(client.get(SFT)):
        decode(listed, FINE_TUNE_JOB_DTO)
    decode(ok(client.post(f"{SFT}/{sft['job_id']}/cancel")), FINE_TUNE_JOB_DTO)

    dpo = ok(client.post(DPO, json={"model_id": "tiny", "preference_pairs": PAIRS, "config": long}))
    running_job = wait_for(lambda: (j := ok(client.get(f"{DPO}/{dpo['job_id']}")))["progress"] and j, 120, "a DPO step", 0.1)
    decode_pair_job(running_job)
    assert running_job["status"] == "running" and running_job["progress"]["iter"] >= 1
    decode_pair_job(ok(client.post(f"{DPO}/{dpo['job_id']}/cancel")))

    # Completed, and failed (a dataset path the worker does not have).
    done = ok(client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "config": QUICK}))
    missing = str(stack.data_root / "not-there")
    failed = ok(client.post(SFT, json={"model_id": "tiny", "dataset": missing, "config": QUICK}))
    rm = ok(client.post(REWARD, json={"model_id": "tiny", "preference_pairs": PAIRS, "config": QUICK}))
    rm_failed = ok(client.post(REWARD, json={"model_id": "tiny", "dataset": missing, "config": QUICK}))
    for job_id, path in ((done["job_id"], SFT), (failed["job_id"], SFT), (rm["job_id"], REWARD), (rm_failed["job_id"], REWARD)):
        wait_for(lambda: ok(client.get(f"{path}/{job_id}"))["status"] in ("completed", "failed"), 120, "a job's end", 0.2)
    finished = {name: ok(client.get(f"{path}/{job['job_id']}")) for name, path, job in (
        ("done", SFT, done), ("failed", SFT, failed), ("rm", REWARD, rm), ("rm_failed", REWARD, rm_failed))}
    assert finished["done"]["status"] == "completed" and finished["rm"]["status"] == "completed", finished
    assert finished["failed"]["status"] == "failed" and "does not exist" in finished["failed"]["error"]
    assert finished["rm_failed"]["status"] == "failed" and "does not exist" in finished["rm_failed"]["error"]
    for name in ("done", "failed"):
        decode(finished[name], FINE_TUNE_JOB_DTO)
        assert finished[name]["finished_at"] >= finished[name]["started_at"] > 0
    for name in ("rm", "rm_failed"):
        decode_pair_job(finished[name], PAIR_CONFIG)
    assert finished["done"]["progress"]["step"] == 2 and finished["failed"]["progress"]["step"] == 0
    for listed in ok(client.get(SFT)):
        decode(listed, FINE_TUNE_JOB_DTO)
    for path in (DPO, REWARD):
        for listed in ok(client.get(path)):
            decode_pair_job(listed, PAIR_CONFIG if path == REWARD else METHOD_CONFIG)
    # The seed's reward-model mark in the adapter's config.
    files = client.get(f"{REWARD}/{rm['job_id']}/adapter")
    import io
    import tarfile
    with tarfile.open(fileobj=io.BytesIO(files.content)) as tar:
        assert json.load(tar.extractfile("adapter_config.json"))["reward_model"] is True


def test_a_client_written_from_the_contract_trains_every_kind(stack, worker):
    """tests/seed_kinds_client.py: SFT from a data directory by path, DPO, ORPO (followed under
    /dpo/jobs), a reward model and reward/score, each job's answers decoded on the way."""
    data_dir = stack.data_root / "seed-sft"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    (data_dir / "valid.jsonl").write_text(json.dumps(ROWS[0]))
    res = subprocess.run([sys.executable, str(ROOT / "tests" / "seed_kinds_client.py"), stack.base_url, TOKEN, "tiny",
                          str(data_dir)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:] + stack.logs("worker")
    report = json.loads(res.stdout)
    assert report["sft"]["events"][-2:] == ["completed", "done"]
    assert report["dpo"]["events"][-1] == "done" and report["orpo"]["events"].count("orpo_step") == 2
    assert len(report["rewards"]) == 2 and report["rewards"][0] != report["rewards"][1]
