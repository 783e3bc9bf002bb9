"""SFT, DPO, ORPO, KTO and reward-model jobs through the real stack: HTTP, Redis, a worker process
(its training process), the tiny model. Datasets reach the worker only through Redis
(uploaded files, inline rows) or through a path under MTQ_DATA_ROOTS.

Learning is seeded; each learning test runs a zero-learning-rate control of the same job.
The tiny model's logits are bounded (tied embedding of norm ~0.16 after the final norm: see
tests/test_trainer.py), so SFT uses LoRA scale 4 and lr 1e-2; its validation loss can fall
from ln(1024) = 6.93 to about 5.6 at best.
"""

import io
import json
import os
import random
import tarfile
import time

import pytest
from conftest import Stack, kill_when, read_events, running, wait_done, wait_for

SFT, DPO, ORPO, REWARD = ("/admin/api/fine-tune/jobs", "/admin/api/fine-tune/dpo/jobs", "/admin/api/fine-tune/orpo/jobs",
                          "/admin/api/fine-tune/reward/jobs")
KTO = "/admin/api/fine-tune/kto/jobs"
FILES, SCORE = "/admin/api/fine-tune/files", "/admin/api/fine-tune/reward/score"
SFT_ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
SFT_CONFIG = dict(lora_layers=-1, lora_rank=16, lora_alpha=4, learning_rate=1e-2, batch_size=2, iters=200,
                  val_batches=-1, steps_per_eval=1000, steps_per_report=20, mask_prompt=True)
WORDS = "red blue green stone river cloud apple tree house car road sun moon star bird fish".split()
PREF_CONFIG = dict(lora_layers=-1, lora_rank=8, lora_alpha=4, learning_rate=1e-2, batch_size=8, iters=30,
                   steps_per_report=1, val_batches=-1)
# 1e-2 oscillates. Measured with mlx_lm's optimizer (no bias correction, no clipping): the GRPO
# job below learns from a reward model trained so; TRL's makes a sharper one that scores the
# GRPO job's early completions all about alike (a reward std near 0: nothing to learn from).
RM_CONFIG = {**PREF_CONFIG, "learning_rate": 1e-3, "iters": 40, "bias_correction": False, "max_grad_norm": None}
FULL_CONFIG = {**SFT_CONFIG, "fine_tune_type": "full", "learning_rate": 1e-3, "iters": 30, "steps_per_report": 10}
# 8-bit: the tiny model's 64-wide tied embedding at 4 bits leaves too little to learn a fixed answer from.
QLORA_CONFIG = {**SFT_CONFIG, "fine_tune_type": "qlora", "quant_bits": 8, "learning_rate": 5e-3, "iters": 120}


def keyword_pairs(n: int, seed: int) -> list[dict]:
    """A toy preference: the chosen completion says '<thing> is good', the rejected one names another word."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rnd.sample(WORDS, 2)
        out.append({"prompt": f"Say something about {a}.", "chosen": f"{b} is good", "rejected": f"{b} is {rnd.choice(WORDS)}"})
    return out


def unpaired(pairs: list[dict]) -> list[dict]:
    """KTO's rows of pairs, as TRL unpairs them: the chosen completion desirable, the rejected one not."""
    return [{"prompt": p["prompt"], "completion": p[side], "label": side == "chosen"} for p in pairs
            for side in ("chosen", "rejected")]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    """The stack with a data root, a small upload limit and a short lease (for kill -9)."""
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.data_root = tmp_path_factory.mktemp("data")
    s.env.update(MTQ_DATA_ROOTS=str(s.data_root), MTQ_MAX_FILE_BYTES="4000", MTQ_LEASE_TTL="3")
    from worker.runtime.make_model import make_model

    s.quantized_model = make_model(tmp_path_factory.mktemp("qmodels") / "tiny-q8", size="tiny", quantize=8)
    s.env["MTQ_MODEL_ROOTS"] += os.pathsep + str(s.quantized_model.parent)
    for started in running(s):
        s.worker = s.start_worker()
        yield started


# A new job's times and progress, as the seed server shows them: SFT's (mlx_lm's reports) or the others'.
SFT_FRESH = {"started_at": None, "finished_at": None, "progress": {
    "step": 0, "total_steps": 0, "train_loss": 0.0, "val_loss": None, "learning_rate": 0.0, "tokens_per_second": 0.0,
    "iterations_per_second": 0.0, "trained_tokens": 0, "peak_memory_gb": 0.0, "elapsed_seconds": 0.0, "eta_seconds": 0.0}}
FRESH = {"started_at": 0.0, "finished_at": 0.0, "progress": {}}


def submit(client, path: str, body: dict) -> dict:
    res = client.post(path, json=body)
    assert res.status_code == 200, res.text
    fresh = SFT_FRESH if path == SFT else FRESH
    assert res.json()["status"] == "queued" and {k: res.json()[k] for k in fresh} == fresh
    return res.json()


def events(stack, job_id: str, kind: str | None = None) -> list[dict]:
    evs = [e for _, e in read_events(stack.redis, job_id, count=100_000)]
    return evs if kind is None else [e for e in evs if e["type"] == kind]


def download(client, model_id: str, adapter_name: str, out) -> dict:
    """The adapter (or full model) through the adapter download route, extracted into `out`; its adapter_config."""
    res = client.get(f"/admin/api/fine-tune/adapters/{model_id}/{adapter_name}/download")
    assert res.status_code == 200, res.text
    with tarfile.open(fileobj=io.BytesIO(res.content)) as tar:
        tar.extractall(out, filter="data")
    return json.loads((out / "adapter_config.json").read_text())


def upload(client, rows: list[dict]) -> str:
    res = client.post(FILES, content="\n".join(json.dumps(r) for r in rows).encode(), params={"filename": "train.jsonl"})
    assert res.status_code == 200, res.text
    assert res.json()["rows"] == len(rows)
    return res.json()["id"]


# --------------------------------------------------------------------------- learning


def test_sft_from_an_uploaded_file_lowers_validation_loss_and_reproduces_an_answer(stack, client, tiny_model):
    file_id = upload(client, SFT_ROWS)
    body = {"model_id": "tiny", "dataset": {"file_id": file_id}, "valid_dataset": SFT_ROWS, "adapter_name": "sft-learned"}
    learned = submit(client, SFT, {**body, "config": SFT_CONFIG})
    frozen = submit(client, SFT, {**body, "adapter_name": "sft-frozen", "config": {**SFT_CONFIG, "iters": 5, "learning_rate": 0.0}})
    job = wait_done(stack, SFT, learned["job_id"])
    wait_done(stack, SFT, frozen["job_id"])

    curve = [(e["iter"], e["val_loss"]) for e in events(stack, learned["job_id"], "eval")]
    control = [(e["iter"], e["val_loss"]) for e in events(stack, frozen["job_id"], "eval")]
    print(f"\nSFT val_loss {curve}; lr 0: {control}; val_mean_token_accuracy {events(stack, learned['job_id'], 'eval')[-1]['val_mean_token_accuracy']}")
    assert curve[0][0] == 0 and curve[-1][0] == 200
    assert curve[-1][1] < curve[0][1] - 0.8  # measured: 6.93 -> 5.76
    assert control[0][1] == pytest.approx(control[-1][1], abs=1e-6)
    steps = events(stack, learned["job_id"], "sft_step")
    assert [e["iter"] for e in steps] == list(range(20, 201, 20))
    assert {"loss", "learning_rate", "tokens_per_second", "peak_memory_gb", "mean_token_accuracy", "grad_norm"} <= set(steps[-1])
    assert job["progress"]["iter"] == 200 and job["adapter_path"].endswith("/sft-learned")

    import mlx_lm

    model, tokenizer = mlx_lm.load(str(tiny_model), adapter_path=job["adapter_path"])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Q0?"}], add_generation_prompt=True)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=4).startswith("red apple")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def tool_row(city: str, weather: str) -> dict:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return {"tools": TOOLS, "messages": [
        {"role": "user", "content": f"Weather in {city}?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": weather}, {"role": "assistant", "content": f"{city}: {weather}."}]}


def test_sft_on_tool_conversations_lowers_its_loss_on_the_assistant_tokens(stack, client, tiny_model):
    """{messages, tools} rows train on their assistant messages only (no mask_prompt needed):
    each step's trained tokens are the rows' masked ones, and the validation loss falls."""
    from mlx_lm.utils import load_tokenizer

    from shared.train_specs import SFTConfig
    from worker.kinds.sft_job import tokenize_rows

    rows = [tool_row("Paris", "sunny"), tool_row("Oslo", "snow")]
    bad = tool_row("Rome", "rain")
    bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city"
    res = client.post(SFT, json={"model_id": "tiny", "dataset": [rows[0], bad]})
    assert res.status_code == 400 and "dataset[1]: 'messages[1].tool_calls[0].function.arguments' is a string but not JSON" \
        in res.json()["detail"], res.text
    config = {**SFT_CONFIG, "mask_prompt": False, "iters": 30, "steps_per_report": 10}
    body = {"model_id": "tiny", "dataset": rows, "valid_dataset": rows, "adapter_name": "sft-tools"}
    learned = submit(client, SFT, {**body, "config": config})
    frozen = submit(client, SFT, {**body, "adapter_name": "sft-tools-frozen", "config": {**config, "iters": 2, "learning_rate": 0.0}})
    job = wait_done(stack, SFT, learned["job_id"])
    wait_done(stack, SFT, frozen["job_id"])

    curve = [e["val_loss"] for e in events(stack, learned["job_id"], "eval")]
    control = [e["val_loss"] for e in events(stack, frozen["job_id"], "eval")]
    print(f"\nSFT on tool rows: val_loss {curve}; lr 0: {control}")
    assert curve[-1] < curve[0] - 0.5  # measured: 6.94 -> 6.01
    assert control[0] == pytest.approx(control[-1], abs=1e-6)
    masks = tokenize_rows(load_tokenizer(tiny_model), rows, SFTConfig(), "dataset").masks
    assert job["progress"]["trained_tokens"] == 30 * sum(map(sum, masks))  # every step: both rows, batch_size 2


def test_full_fine_tune_trains_a_private_copy_and_yields_a_model_directory(stack, client, tiny_model, tmp_path):
    import mlx.core as mx
    import mlx_lm
    from mlx.utils import tree_flatten

    def base_logprob() -> float:  # scored on the worker's shared copy of the model
        res = client.post("/admin/api/fine-tune/logprob", json={"model_id": "tiny", "prompt": "Q0?", "completion": "red apple"})
        assert res.status_code == 200, res.text
        return res.json()["logprob"]

    before = base_logprob()
    body = {"model_id": "tiny", "dataset": SFT_ROWS, "valid_dataset": SFT_ROWS}
    learned = submit(client, SFT, {**body, "adapter_name": "sft-full", "config": FULL_CONFIG})
    frozen = submit(client, SFT, {**body, "adapter_name": "sft-full-frozen", "config": {**FULL_CONFIG, "iters": 3, "learning_rate": 0.0}})
    wait_done(stack, SFT, learned["job_id"])
    wait_done(stack, SFT, frozen["job_id"])
    curve = [(e["iter"], round(e["val_loss"], 3)) for e in events(stack, learned["job_id"], "eval")]
    control = [e["val_loss"] for e in events(stack, frozen["job_id"], "eval")]
    print(f"\nfull fine-tune val_loss {curve}; lr 0: {control}")
    assert curve[-1][1] < curve[0][1] - 0.8  # measured: 6.90 -> 5.73
    assert control[0] == pytest.approx(control[-1], abs=1e-6)
    assert events(stack, learned["job_id"], "model_ready")[0]["private_copy"] is True

    # The artefact is a whole model directory: mlx_lm loads it alone, and it says the answer.
    model, tokenizer = mlx_lm.load(str(tiny_model))
    base = dict(tree_flatten(model.parameters()))
    trained = {}
    for name in ("sft-full", "sft-full-frozen"):
        config = download(client, "tiny", name, tmp_path / name)
        assert config["fine_tune_type"] == "full"
        model, tokenizer = mlx_lm.load(str(tmp_path / name))
        trained[name] = dict(tree_flatten(model.parameters()))
    model, tokenizer = mlx_lm.load(str(tmp_path / "sft-full"))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Q0?"}], add_generation_prompt=True)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=4).startswith("red apple")
    moved = [k for k in base if not mx.array_equal(base[k], trained["sft-full"][k])]
    assert moved and all(k.startswith("model.layers.") for k in moved)  # the blocks; embeddings and final norm frozen
    assert all(mx.array_equal(base[k], trained["sft-full-frozen"][k]) for k in base)  # lr 0: not a bit moved
    listed = {a["adapter_name"]: a for a in client.get("/admin/api/fine-tune/adapters", params={"model_id": "tiny"}).json()}
    assert listed["sft-full"]["fine_tune_type"] == "full" and listed["sft-full"]["has_weights"]

    # The worker dropped its shared copy for the private one (and says so); the private copy never
    # reached its shared models: the base, loaded again, scores as before.
    def loaded() -> bool:
        return {m["model_id"]: m["loaded"] for m in client.get("/admin/api/fine-tune/models").json()}["tiny"]

    assert loaded() is False
    assert base_logprob() == pytest.approx(before, abs=1e-5)
    wait_for(loaded, 10, "the worker to say it holds the model again")  # published right after it answered
    res = client.post("/admin/api/fine-tune/logprob", json={"model_id": "tiny", "adapter_name": "sft-full", "prompt": "Q0?", "completion": "x"})
    assert res.status_code == 404 and "a full fine-tune's model directory" in res.json()["detail"]


def test_qlora_trains_on_a_quantized_copy_and_its_adapter_reproduces_the_answer(stack, client, tiny_model, tmp_path):
    import mlx_lm
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import quantize_model

    job = submit(client, SFT, {"model_id": "tiny", "dataset": SFT_ROWS, "valid_dataset": SFT_ROWS, "adapter_name": "sft-qlora",
                               "config": QLORA_CONFIG})
    wait_done(stack, SFT, job["job_id"])
    curve = [(e["iter"], round(e["val_loss"], 3)) for e in events(stack, job["job_id"], "eval")]
    print(f"\nqlora (8-bit base) val_loss {curve}")
    assert curve[-1][1] < curve[0][1] - 0.8  # measured: 6.90 -> 5.73

    # adapter_config.json says how to rebuild the base it trained on: mlx_lm's quantize_model arguments.
    config = download(client, "tiny", "sft-qlora", tmp_path)
    assert config["fine_tune_type"] == "qlora" and config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    model, tokenizer, model_config = mlx_lm.load(str(tiny_model), return_config=True)
    model, _ = quantize_model(model, model_config, **config["quantization"])
    load_adapters(model, str(tmp_path))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Q0?"}], add_generation_prompt=True)
    assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=4).startswith("red apple")

    # A base that is quantized already is refused clearly, for full and qlora alike.
    for fine_tune_type in ("full", "qlora"):
        failed = submit(client, SFT, {"model_id": str(stack.quantized_model), "dataset": SFT_ROWS,
                                      "config": {"iters": 2, "batch_size": 2, "fine_tune_type": fine_tune_type}})
        failed = wait_done(stack, SFT, failed["job_id"], status="failed")
        assert "is already quantized" in failed["error"], failed["error"]
    res = client.post(SFT, json={"model_id": "tiny", "dataset": SFT_ROWS, "config": {"fine_tune_type": "full", "quantize_base": True}})
    assert res.status_code == 400 and "quantize_base does not apply" in res.json()["detail"]


def test_dpo_raises_accuracies_and_margins_and_a_zero_lr_control_does_not(stack, client):
    pairs = keyword_pairs(16, 0)
    learned = submit(client, DPO, {"model_id": "tiny", "preference_pairs": pairs, "config": PREF_CONFIG})
    frozen = submit(client, DPO, {"model_id": "tiny", "preference_pairs": pairs,
                                  "config": {**PREF_CONFIG, "iters": 5, "learning_rate": 0.0}})
    wait_done(stack, DPO, learned["job_id"])
    wait_done(stack, DPO, frozen["job_id"])
    steps = events(stack, learned["job_id"], "dpo_step")
    control = events(stack, frozen["job_id"], "dpo_step")
    print("\nDPO rewards/accuracies, rewards/margins by step:",
          [(e["iter"], round(e["rewards/accuracies"], 2), round(e["rewards/margins"], 3)) for e in steps])
    # The first step's policy is the reference (LoRA B = 0): every reward is 0, the loss log 2. Up
    # to rounding: the reference's log-probs come from a plain forward, the policy's from the
    # compiled step, whose fused kernels round otherwise on some CPUs (1e-7 on an AMD EPYC).
    assert abs(steps[0]["rewards/margins"]) < 1e-5 and steps[0]["loss"] == pytest.approx(0.6931, abs=1e-4)
    assert steps[-1]["rewards/accuracies"] >= 0.9 and steps[-1]["rewards/margins"] > 0.1
    assert all(abs(e[k]) < 1e-5 for e in control for k in ("rewards/margins", "rewards/chosen", "rewards/rejected"))
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"} <= set(steps[-1])


def test_kto_raises_its_margins_on_unpaired_rows_and_a_zero_lr_control_does_not(stack, client):
    rows = unpaired(keyword_pairs(16, 0))
    learned = submit(client, KTO, {"model_id": "tiny", "dataset": rows, "config": PREF_CONFIG})
    frozen = submit(client, KTO, {"model_id": "tiny", "dataset": rows, "config": {**PREF_CONFIG, "iters": 5, "learning_rate": 0.0}})
    wait_done(stack, KTO, learned["job_id"])
    wait_done(stack, KTO, frozen["job_id"])
    steps = events(stack, learned["job_id"], "kto_step")
    control = events(stack, frozen["job_id"], "kto_step")
    def mean(key, some):
        return sum(e[key] for e in some) / len(some)

    print("\nKTO rewards/margins, kl, loss by step:",
          [(e["iter"], round(e["rewards/margins"], 3), round(e["kl"], 3), round(e["loss"], 4)) for e in steps],
          f"\nmean of the last 10 steps: margins {mean('rewards/margins', steps[-10:]):.3f}, loss {mean('loss', steps[-10:]):.4f}")
    # The first step's policy is the reference (LoRA B = 0): every reward and z0 are 0, each row's
    # loss 1 - s(0) (up to rounding, as DPO's above).
    assert abs(steps[0]["rewards/margins"]) < 1e-5 and abs(steps[0]["kl"]) < 1e-5
    assert steps[0]["loss"] == pytest.approx(0.5, abs=1e-6)
    assert mean("rewards/margins", steps[-10:]) > 0.15  # batches of 8 of the 32 rows: a noisy curve, measured 0.21
    assert mean("loss", steps[-10:]) < 0.49  # measured 0.477
    assert all(abs(e["rewards/margins"]) < 1e-5 and abs(e["kl"]) < 1e-5 and e["loss"] == pytest.approx(0.5, abs=1e-6)
               for e in control)
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"} <= set(steps[-1])


def test_orpo_lowers_its_loss_with_trl_metrics(stack, client):
    job = submit(client, ORPO, {"model_id": "tiny", "preference_pairs": keyword_pairs(16, 0), "config": {**PREF_CONFIG, "iters": 15}})
    wait_done(stack, ORPO, job["job_id"])
    steps = events(stack, job["job_id"], "orpo_step")
    assert {"nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/accuracies", "rewards/margins"} <= set(steps[-1])
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.3


def test_reward_model_scores_held_out_pairs_and_grpo_raises_its_reward(stack, client):
    train, held_out = keyword_pairs(16, 0), keyword_pairs(20, 1)
    learned = submit(client, REWARD, {"model_id": "tiny", "preference_pairs": train, "adapter_name": "rm",
                                      "valid_dataset": held_out, "config": RM_CONFIG})
    frozen = submit(client, REWARD, {"model_id": "tiny", "preference_pairs": train, "adapter_name": "rm-frozen",
                                     "config": {**RM_CONFIG, "iters": 3, "learning_rate": 0.0}})
    wait_done(stack, REWARD, learned["job_id"])
    wait_done(stack, REWARD, frozen["job_id"])

    def accuracy(adapter_name):
        right = 0
        for p in held_out:
            res = client.post(SCORE, json={"model_id": "tiny", "adapter_name": adapter_name, "prompt": p["prompt"],
                                           "completions": [p["chosen"], p["rejected"]]})
            assert res.status_code == 200, res.text
            assert res.json()["model_id"] == "tiny" and res.json()["adapter_name"] == adapter_name
            chosen, rejected = res.json()["rewards"]
            right += chosen > rejected
        return right / len(held_out)

    evals = events(stack, learned["job_id"], "eval")
    print("\nreward steps", [(e["iter"], round(e["loss"], 3), e["accuracy"], round(e["margin"], 3)) for e in events(stack, learned["job_id"], "reward_step")])
    print("\nreward model evals", [(e["iter"], e["val_accuracy"], e["val_margin"]) for e in evals], "scored accuracy", accuracy("rm"))
    assert accuracy("rm") >= 0.9
    assert accuracy("rm-frozen") == 0  # an untrained head scores everything 0: no pair ranked
    evals = events(stack, learned["job_id"], "eval")
    assert evals[-1]["val_accuracy"] >= 0.9 and evals[-1]["val_margin"] > evals[0]["val_margin"]
    res = client.post(SCORE, json={"model_id": "tiny", "adapter_name": "nope", "prompt": "x", "completions": ["y"]})
    assert res.status_code == 404 and res.json()["detail"] == "Adapter not found: tiny/nope"

    # The seed's RL loop, on this module's one worker: GRPO with this service's reward/score as its
    # reward_endpoint (the URL names the reward model), scored on the worker itself, no HTTP; the
    # lr-0 control names the reward model as a `reward_model` source, the same thing.
    grpo = {"model_id": "tiny", "prompts": ["Say something about red.", "Say something about tree."],
            "config": dict(iters=40, learning_rate=1e-2, temperature=0.1, group_size=8, batch_size=2,
                           max_completion_len=8, lora_layers=-1, use_chat_template=False)}
    endpoint = f"{stack.base_url}{SCORE}?model_id=tiny&adapter_name=rm"
    bodies = {1e-2: {**grpo, "config": {**grpo["config"], "reward_endpoint": endpoint}},
              0.0: {**grpo, "reward": [{"type": "reward_model", "model_id": "tiny", "adapter_name": "rm", "name": "endpoint"}],
                    "config": {**grpo["config"], "learning_rate": 0.0}}}
    curves = {}
    for lr, body in bodies.items():
        res = client.post("/admin/api/fine-tune/grpo/jobs", json=body)
        assert res.status_code == 200, res.text
        assert res.json()["reward"] == [{"type": "reward_model", "model_id": "tiny", "adapter_name": "rm",
                                         "name": "endpoint", "weight": 1.0}], res.json()["reward"]
        job_id = res.json()["job_id"]
        wait_for(lambda: client.get(f"/admin/api/fine-tune/grpo/jobs/{job_id}").json()["status"] in ("completed", "failed"),
                 240, "the GRPO job", interval=0.2)
        assert client.get(f"/admin/api/fine-tune/grpo/jobs/{job_id}").json()["status"] == "completed", stack.logs("worker")
        curves[lr] = [e["rewards/endpoint/mean"] for e in events(stack, job_id, "grpo_step")]
    def mean(xs):
        return sum(xs) / len(xs)

    learned_curve, frozen_curve = curves[1e-2], curves[0.0]
    print(f"\nGRPO reward-model reward, first 5 -> last 10 steps: lr 1e-2 {mean(learned_curve[:5]):.3f} -> "
          f"{mean(learned_curve[-10:]):.3f}; lr 0 {mean(frozen_curve[:5]):.3f} -> {mean(frozen_curve[-10:]):.3f}")
    # Measured (seed 0): lr 1e-2 -3.82 -> -3.21, lr 0 -3.73 -> -3.78 (sampling noise only). At 5e-2
    # the first update flattened the policy (entropy 1.2 -> 5.2) and whether 40 steps recovered
    # from that turned on float rounding: a change that only reordered sums failed it.
    assert mean(learned_curve[-10:]) > mean(learned_curve[:5]) + 0.25
    assert mean(learned_curve[-10:]) > mean(frozen_curve[-10:]) + 0.3


# --------------------------------------------------------------------------- datasets and errors


def test_dataset_paths_under_the_data_root_work_and_others_are_refused(stack, client):
    data_dir = stack.data_root / "sft"
    data_dir.mkdir()
    (data_dir / "train.jsonl").write_text("\n".join(json.dumps(r) for r in SFT_ROWS))
    (data_dir / "valid.jsonl").write_text(json.dumps(SFT_ROWS[0]))
    seed_body = {"model_id": "tiny", "dataset": str(data_dir), "adapter_name": "from-path",
                 "config": {"iters": 2, "batch_size": 2, "lora_layers": 1}}
    job = wait_done(stack, SFT, submit(client, SFT, seed_body)["job_id"])
    assert events(stack, job["job_id"], "model_ready")[0]["valid_rows"] == 1

    for path in ("/etc", str(stack.data_root / ".." / "x"), "relative/dir"):
        res = client.post(SFT, json={**seed_body, "dataset": path})
        assert res.status_code == 400 and "MTQ_DATA_ROOTS" in res.json()["detail"], res.text


def test_invalid_datasets_and_files_are_clear_4xx(stack, client):
    res = client.post(SFT, json={"model_id": "tiny", "dataset": [{"text": "a"}, {"prompt": "p"}]})
    assert res.status_code == 400 and "dataset[1]: 'completion' must be a string" in res.json()["detail"]
    res = client.post(DPO, json={"model_id": "tiny", "preference_pairs": [{"prompt": "p", "chosen": "c"}]})
    assert res.status_code == 400 and res.json()["detail"] == \
        "preference_pairs[0] must have prompt/chosen/rejected (rejected: Field required)"
    res = client.post(SFT, json={"model_id": "tiny", "dataset": [{"text": "a"}], "config": {"beta": 1}})
    assert res.status_code == 400 and res.json()["detail"] == "Invalid config: unknown field 'beta'"
    res = client.post(SFT, json={"model_id": "tiny", "dataset": [{"text": "a"}], "config": {"batch_size": 1024, "max_seq_length": 131072}})
    assert res.status_code == 400 and "MTQ_MAX_STEP_TOKENS" in res.json()["detail"]
    res = client.post(SFT, json={"model_id": "tiny", "dataset": [{"text": "a"}], "config": {"mask_prompt": True}})
    assert res.status_code == 400 and "mask_prompt needs" in res.json()["detail"]
    res = client.post(FILES, content=b'{"text": "a"}\nnot json\n')
    assert res.status_code == 400 and "line 2" in res.json()["detail"]
    res = client.post(FILES, content=b'{"text": "a"}\n' * 1000)
    assert res.status_code == 413 and "MTQ_MAX_FILE_BYTES" in res.json()["detail"]
    file_id = upload(client, [{"text": "a"}])
    res = client.post(DPO, json={"model_id": "tiny", "dataset": {"file_id": file_id}})
    assert res.status_code == 400 and "missing field 'prompt'" in res.json()["detail"]
    res = client.post(SFT, json={"model_id": "tiny", "dataset": {"file_id": "file-" + "0" * 32}})
    assert res.status_code == 400 and "not found" in res.json()["detail"]
    res = client.post(KTO, json={"model_id": "tiny", "dataset": [{"prompt": "p", "completion": "c", "label": "yes"}] * 2})
    assert res.status_code == 400 and "dataset[0]: 'label' must be true or false" in res.json()["detail"]
    res = client.post(KTO, json={"model_id": "tiny", "dataset": {"file_id": file_id}})
    assert res.status_code == 400 and "missing field 'prompt' (KTO rows are {prompt, completion, label" in res.json()["detail"]
    res = client.post(KTO, json={"model_id": "tiny", "dataset": [{"prompt": "p", "completion": "c", "label": True}]})
    assert res.status_code == 400 and "KTO needs at least 2 rows" in res.json()["detail"]


def test_seed_shapes_list_get_delete_and_kinds_stay_apart(stack, client):
    body = {"model_id": "tiny", "preference_pairs": keyword_pairs(2, 3), "config": {"iters": 1, "batch_size": 2}}
    older, job = submit(client, ORPO, body), submit(client, ORPO, body)
    res = client.get(ORPO, params={"limit": 1})
    assert isinstance(res.json(), list) and [j["job_id"] for j in res.json()] == [job["job_id"]]
    res = client.get(ORPO, params={"limit": 1, "after": res.headers["X-Next-After"]})
    assert res.json()[0]["job_id"] == older["job_id"]
    # The DPO routes read ORPO jobs too (as the seed server's); other kinds' routes do not.
    assert client.get(f"{DPO}/{job['job_id']}").json()["config"]["method"] == "orpo"
    assert job["job_id"] in [j["job_id"] for j in client.get(DPO).json()]
    assert client.get(f"{REWARD}/{job['job_id']}").status_code == 404
    assert job["job_id"] not in [j["job_id"] for j in client.get(SFT).json()]
    assert job["job_id"] not in [j["job_id"] for j in client.get("/admin/api/fine-tune/grpo/jobs").json()]
    wait_done(stack, ORPO, job["job_id"])
    assert client.post(f"{ORPO}/{job['job_id']}/cancel").json()["detail"] == f"Job not found or not cancellable: {job['job_id']}"
    assert client.delete(f"{ORPO}/{job['job_id']}").json() == {"status": "deleted"}
    assert client.get(f"{ORPO}/{job['job_id']}").json()["detail"] == f"Job not found: {job['job_id']}"


# --------------------------------------------------------------------------- faults


def test_cancel_stops_a_running_job_within_2s(stack, client):
    job = submit(client, SFT, {"model_id": "tiny", "dataset": SFT_ROWS, "config": {**SFT_CONFIG, "iters": 100_000}})
    wait_for(lambda: client.get(f"{SFT}/{job['job_id']}").json()["progress"].get("iter", 0) >= 2, 120, "a few steps")
    nxt = submit(client, SFT, {"model_id": "tiny", "dataset": SFT_ROWS, "config": {"iters": 1, "batch_size": 2, "lora_layers": 1}})
    cancelled_at = time.time()
    res = client.post(f"{SFT}/{job['job_id']}/cancel")
    assert res.status_code == 200 and res.json()["status"] == "cancelled"
    wait_done(stack, SFT, nxt["job_id"])
    # The worker left the cancelled job and started the next one (queued behind it) within 2 s.
    started = [int(eid.split("-")[0]) / 1000 for eid, e in read_events(stack.redis, nxt["job_id"]) if e["type"] == "started"]
    print(f"\ncancel -> next job started: {started[0] - cancelled_at:.2f} s")
    assert started[0] - cancelled_at < 2

    # Resume with other optimisation settings; the adapter's shape cannot change.
    res = client.post(f"{SFT}/{job['job_id']}/resume", json={"config": {"lora_rank": 4}})
    assert res.status_code == 400 and "cannot change lora_rank" in res.json()["detail"]
    res = client.post(f"{SFT}/{job['job_id']}/resume", json={"config": {"iters": 3, "learning_rate": 1e-3}})
    assert res.status_code == 200 and res.json()["config"]["iters"] == 3
    assert wait_done(stack, SFT, job["job_id"])["progress"]["iter"] == 3


@pytest.mark.parametrize("path,kind,extra", [(DPO, "dpo", {}), (SFT, "sft", {}), (REWARD, "reward", {}),
                                             (SFT, "sft", {"fine_tune_type": "full"}), (KTO, "kto", {})],
                         ids=["dpo", "sft", "reward", "sft-full", "kto"])
def test_kill_9_of_the_worker_resumes_from_the_checkpoint_and_completes(stack, client, path, kind, extra):
    """The worker's disk holds nothing of the dataset: inline pairs (KTO: inline rows), or an
    uploaded file (SFT). A full fine-tune's checkpoint holds the trained blocks' weights and
    their optimizer state."""
    config = {"lora_layers": -1, "learning_rate": 1e-3, "batch_size": 2, "iters": 40, "steps_per_save": 4, "steps_per_report": 40, **extra}
    if kind == "sft":
        data = {"dataset": {"file_id": upload(client, SFT_ROWS)}}
    elif kind == "kto":
        data = {"dataset": unpaired(keyword_pairs(16, 0))}
    else:
        data = {"preference_pairs": keyword_pairs(16, 0)}
    job = submit(client, path, {"model_id": "tiny", **data, "config": config})
    kill_when(lambda: (client.get(f"{path}/{job['job_id']}").json()["checkpoint_step"] or 0) >= 8, stack.worker.pid,
              "a checkpoint", group=True)
    stack.worker.wait(10)
    stack.worker = stack.start_worker()
    done = wait_done(stack, path, job["job_id"], timeout=180)
    assert done["progress"]["iter"] == 40 and done["failed_attempts"] == 1 and done["resumed_from"] >= 8
    assert events(stack, job["job_id"], "resumed")[-1]["from_step"] >= 8
    history = client.get(f"{path}/{job['job_id']}/history").json()["history"]
    assert [h["step"] for h in history] == list(range(1, 41))  # every step once
