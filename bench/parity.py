"""Parity of the kinds with the trainers users compare them to, measured in one run: DPO against
TRL's DPOTrainer, SFT against mlx_lm's own LoRA trainer (`mlx_lm lora`), RLOO against TRL's
RLOOTrainer, GKD against TRL's GKDTrainer.

    python bench/parity.py --trl-python /path/to/trl-env/bin/python [--steps 40] [--json OUT.json] [--only-rloo]
    python bench/parity.py --trl-python /path/to/trl-env/bin/python --only-gkd [--gkd-beta 0.5] [--steps 40]

The TRL side needs torch, transformers, peft, datasets and trl (TRL 1.16 measured), which are
not this project's dependencies: install them into an environment of their own and name its
interpreter; this script runs its TRL part there (`parity.py trl-dpo SPEC OUT`). This
project's side runs through a private stack (bench/private_stack.py: the API, Redis and a
worker), its jobs submitted over HTTP as any client's.

DPO: a tiny random model (`mtq make-model --size tiny`, float32: transformers loads it too),
one initial LoRA (r 8, scale 2 = PEFT's lora_alpha 16, every linear layer of every block, B = 0)
drawn here and given to both: to this project as an uploaded `init_adapter`, to PEFT as its
weights (A and B transposed). The same pairs in the same order: TRL gets the rows of this
project's batches (worker/runtime/train_core.py batch_rows) one after another, sampled sequentially.
The same hyperparameters: beta 0.1, sigmoid loss, lr 5e-3 constant, AdamW (bias-corrected,
betas 0.9/0.999, eps 1e-8, no weight decay), gradients clipped to norm 1, batch 4. The
reference is the base model in both (LoRA off here; PEFT's adapters disabled in TRL), and both
sum the completion tokens' log-probs (EOS included). The tokens must agree: it checks that
TRL's tokenised prompt / chosen / rejected rows are this project's (worker/runtime/logprobs.py).
Printed: each step's loss and rewards/margins on both sides, the largest relative loss
deviation, and the last step's margin on both sides.

RLOO: TRL's RLOOTrainer samples its own completions, so no run of it can sample what this
project's does. This project's RLOO trainer (worker/kinds/rloo.py) runs as its job does (the
initial adapter, the default reward: length in characters) in this process, where its sampled
tokens can be read; TRL's (`parity.py trl-rloo SPEC OUT`), from the same initial LoRA, replays each
step: its prompts in order (prompts of one token length: no left padding), its completion
tokens (EOS included) as TRL's generation, its rewards as TRL's reward function. The same
hyperparameters: group 4, batch 2, beta 0.05, epsilon 0.2, lr 5e-3 constant, TRL's AdamW,
clipping at 1, temperature 1, num_iterations 2 (an on-policy update's loss is 0 on both sides;
the second update's is compared: this project reports a step's last update). TRL's reference is
a copy of the initial adapter, here the base model: the same, as a fresh LoRA's B is 0. Printed:
each step's loss and kl on both sides and the largest relative deviations; TRL's tokenised
prompts are checked to be this project's.

GKD: the tiny model as the student (DPO's initial LoRA) and the tiny model made with seed 1 as
the teacher (the same tokenizer), lmbda 0 (every step on the rows' completions: TRL samples
with torch's generator, which no other sampler reproduces), beta 0.5 (the generalized JSD;
`--gkd-beta`), DPO's optimizer and batch, the pairs' chosen completions as the rows, in this
project's order. TRL (`parity.py trl-gkd SPEC OUT`) gets this project's tokens (prompt,
completion + EOS) through a collator of this script's, so both see the same rows; it pads on
the right where this project pads prompts on the left (RoPE: the same attention). Compared:
each step's loss.

SFT: an mlx_lm data directory (train.jsonl and valid.jsonl, text rows) trained by an SFT job that
names it by path and by `mlx_lm lora --data DIR` from the same initial adapter (init_adapter /
--resume-adapter-file), one batch of all rows per step (so the order cannot differ), twice:
with mlx_lm's optimizer (`adamw`: no bias correction, weight decay 0.01; here bias_correction
false, weight_decay 0.01, max_grad_norm null: the seed server's semantics), and with TRL's
(mlx_lm given `bias_correction: true, weight_decay: 0` in its config; here the defaults with
max_grad_norm null, as mlx_lm does not clip), at lr 1e-3 (at 5e-3 mlx_lm's optimizer, whose first
updates are about 3x larger, makes the loss oscillate: both runs agree for two reports, then
part, 3.3% apart at the last). Compared: every report's train loss (mlx_lm prints 3
decimals). The rows are all of one token length and max_seq_length is that length:
mlx_lm 0.32's default_loss counts one target past each row's end (the padding after it:
`steps <= lengths`), which this project does not; without padding there is none to count.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORDS = "red blue green stone river cloud apple tree house car road sun moon star bird fish".split()
LORA = {"lora_layers": -1, "lora_rank": 8, "lora_alpha": 2.0}
DPO_CONFIG = {**LORA, "learning_rate": 5e-3, "beta": 0.1, "batch_size": 4, "lr_scheduler": "constant",
              "max_grad_norm": 1.0, "weight_decay": 0.0, "steps_per_report": 1}
SFT_CONFIG = {**LORA, "learning_rate": 1e-3, "steps_per_report": 5, "steps_per_eval": 1000, "val_batches": 1}
# num_iterations 2: an on-policy RLOO update's loss is 0 (a group's leave-one-out advantages sum to 0),
# the second update's on the same completions is not.
RLOO_CONFIG = {**LORA, "group_size": 4, "batch_size": 2, "num_iterations": 2, "beta": 0.05, "learning_rate": 5e-3,
               "lr_scheduler": "constant", "max_grad_norm": 1.0, "weight_decay": 0.0, "max_completion_len": 16,
               "temperature": 1.0, "clip_ratio": 0.2, "seed": 0}
GKD_CONFIG = {**DPO_CONFIG, "lmbda": 0.0, "beta": 0.5}


def pairs(n: int) -> list[dict]:
    """A toy preference; completions start with a space, so that a prompt and its completion
    tokenise the same apart (this project) and joined (TRL)."""
    import random

    rnd = random.Random(0)
    out = []
    for _ in range(n):
        a, b = rnd.sample(WORDS, 2)
        out.append({"prompt": f"Say something about {a}.", "chosen": f" {b} is good", "rejected": f" {b} is {rnd.choice(WORDS)}"})
    return out


# --------------------------------------------------------------------------- this project's side


def initial_adapter(model_dir: Path, out: Path, seed: int = 0) -> Path:
    """A fresh LoRA as a job draws it (mlx_lm's LoRALinear: A uniform, B = 0), as an uploadable
    .tar.gz (adapters.safetensors + adapter_config.json); its directory is `out`."""
    import mlx.core as mx
    import mlx_lm

    from shared.adapters import tar_gz
    from shared.train_specs import TrainConfig
    from worker.runtime.adapter_layers import adapter_config, attach_adapter, save_adapter

    model, _ = mlx_lm.load(str(model_dir))
    cfg = TrainConfig(**LORA)
    mx.random.seed(seed)
    attach_adapter(model, cfg)
    save_adapter(model, out, adapter_config(cfg))
    archive = out.with_suffix(".tar.gz")
    archive.write_bytes(tar_gz({f.name: f.read_bytes() for f in out.iterdir()}))
    return archive


def run_job(client, path: str, body: dict, kinds: tuple[str, ...]) -> dict[str, list[dict]]:
    """Submit a job, follow its stream to the end; its events of these types."""
    res = client.post(path, json=body)
    assert res.status_code == 200, res.text
    job_id = res.json()["job_id"]
    events: dict[str, list[dict]] = {k: [] for k in kinds}
    with client.stream("GET", f"{path}/{job_id}/stream", timeout=None) as stream:
        for line in stream.iter_lines():
            if line.startswith("data:"):
                event = json.loads(line[5:])
                events.setdefault(event["type"], []).append(event)
    assert "done" in events, (events.get("failed"), client.get(f"{path}/{job_id}").json()["error"])
    return events


def wait_up(client, stack, log: Path) -> None:
    """Until the private stack's API answers and its worker has joined."""
    import httpx

    deadline = time.monotonic() + 120
    while True:
        try:
            if client.get("/admin/api/workers").json():
                return
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline and stack.poll() is None, log.read_text()[-3000:]
        time.sleep(0.5)


def upload(client, archive: Path) -> str:
    res = client.post("/admin/api/fine-tune/files", content=archive.read_bytes(),
                      params={"filename": archive.name, "purpose": "adapter"})
    assert res.status_code == 200, res.text
    return res.json()["id"]


def ours_dpo(client, model_id: str, rows: list[dict], init_file: str, steps: int) -> list[dict]:
    events = run_job(client, "/admin/api/fine-tune/dpo/jobs", {
        "model_id": model_id, "preference_pairs": rows, "init_adapter": {"file_id": init_file},
        "config": {**DPO_CONFIG, "iters": steps}}, ("dpo_step",))
    return [{"loss": e["loss"], "margin": e["rewards/margins"], "logps_chosen": e["logps/chosen"]} for e in events["dpo_step"]]


def batch_order(n_rows: int, batch_size: int, steps: int) -> list[int]:
    """The rows of this project's DPO steps, one step after another (its seeded shuffle)."""
    from worker.runtime.train_core import batch_rows

    return [i for step in range(steps) for i in batch_rows(n_rows, batch_size, step, 1, 0)[0]]


def our_tokens(model_dir: Path, rows: list[dict]) -> list[dict]:
    import mlx_lm

    from worker.runtime.logprobs import pair_tokens

    _, tokenizer = mlx_lm.load(str(model_dir))
    out = []
    for r in rows:
        chosen, start = pair_tokens(tokenizer, r["prompt"], r["chosen"])
        rejected, _ = pair_tokens(tokenizer, r["prompt"], r["rejected"])
        out.append({"prompt_ids": chosen[:start], "chosen_ids": chosen[start:], "rejected_ids": rejected[start:]})
    return out


def rloo_prompts(model_dir: Path) -> list[str]:
    """Prompts of one token length: no left padding, whose positions the two sides would count otherwise."""
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(model_dir))
    by_length: dict[int, list[str]] = {}
    for word in WORDS:
        prompt = f"Say something about {word}."
        by_length.setdefault(len(tokenizer.encode(prompt)), []).append(prompt)
    return max(by_length.values(), key=len)


def ours_rloo(model_dir: Path, init_dir: Path, prompts: list[str], steps: int) -> tuple[list[dict], list[dict]]:
    """This project's RLOO trainer (worker/kinds/rloo.py) as an RLOO job runs it (grpo_job.load: the
    initial adapter, the job's reward sources: here the default, length in characters), in this
    process so that its sampled tokens can be read: each step's metrics, and what it sampled and
    scored (prompt indices, prompt and completion token ids, rewards) for TRL to replay."""
    import mlx.core as mx
    import mlx_lm

    from shared.reinforce_specs import RLOOJobCreate
    from worker.kinds.rloo import RLOOTrainer
    from worker.rewards.scorer import build_scorer
    from worker.runtime.adapter_layers import attach_adapter
    from worker.runtime.train_core import TrainState

    model, tokenizer = mlx_lm.load(str(model_dir))
    spec = RLOOJobCreate(model_id=model_dir.name, prompts=prompts, config={**RLOO_CONFIG, "iters": steps})
    mx.random.seed(spec.config.seed)
    attach_adapter(model, spec.config, init=init_dir)
    replay: list[dict] = []
    with build_scorer(spec, "parity") as scorer:
        trainer = RLOOTrainer(model, tokenizer, spec, scorer)
        rollout, score = trainer.rollout, trainer.score

        def recorded_rollout(step, should_stop):
            r = rollout(step, should_stop)
            tokens = r.samples.tokens.tolist()
            replay.append({"prompt_indices": r.indices, "prompt_ids": r.prompt_ids,
                           "completions": [row[:n] for row, n in zip(tokens, r.lengths)]})
            return r

        def recorded_score(r, step, should_stop):
            rewards, metrics = score(r, step, should_stop)
            replay[-1]["rewards"] = rewards.tolist()
            return rewards, metrics

        trainer.rollout, trainer.score = recorded_rollout, recorded_score
        state = TrainState()
        metrics = [trainer.step(state, lambda: False)[0] for _ in range(steps)]
    return [{"loss": m["loss"], "kl": m["kl"]} for m in metrics], replay


def sft_rows(model_dir: Path, n: int) -> tuple[list[dict], int]:
    """n text rows of one token length (EOS included, as mlx_lm's TextDataset adds it), and that length."""
    import random

    import mlx_lm

    _, tokenizer = mlx_lm.load(str(model_dir))
    rnd = random.Random(1)
    by_length: dict[int, list[dict]] = {}
    while True:
        text = " ".join(rnd.choice(WORDS) for _ in range(6)) + "."
        length = len(tokenizer.encode(text)) + 1
        by_length.setdefault(length, []).append({"text": text})
        if len(by_length[length]) == n:
            return by_length[length], length


def ours_sft(client, model_id: str, data_dir: Path, init_file: str, config: dict) -> dict[int, float]:
    events = run_job(client, "/admin/api/fine-tune/jobs", {
        "model_id": model_id, "dataset": str(data_dir), "init_adapter": {"file_id": init_file}, "config": config},
        ("train_loss",))
    return {e["step"]: e["train_loss"] for e in events["train_loss"]}


def mlx_lm_sft(model_dir: Path, data_dir: Path, init: Path, config: dict, optimizer_config: dict, out: Path) -> dict[int, float]:
    """`mlx_lm lora` on the data directory; its printed per-report train losses."""
    import yaml

    conf = out / "config.yaml"
    out.mkdir(parents=True)
    conf.write_text(yaml.safe_dump({"lora_parameters": {"rank": LORA["lora_rank"], "scale": LORA["lora_alpha"], "dropout": 0.0},
                                    "optimizer_config": {"adamw": optimizer_config}}))
    cmd = [sys.executable, "-m", "mlx_lm", "lora", "--model", str(model_dir), "--train", "--data", str(data_dir),
           "--fine-tune-type", "lora", "--optimizer", "adamw", "--num-layers", str(LORA["lora_layers"]),
           "--batch-size", str(config["batch_size"]), "--iters", str(config["iters"]),
           "--learning-rate", str(config["learning_rate"]), "--steps-per-report", str(config["steps_per_report"]),
           "--steps-per-eval", str(config["steps_per_eval"]), "--val-batches", "1",
           "--max-seq-length", str(config["max_seq_length"]), "--seed", "0", "--adapter-path", str(out / "adapter"),
           "--resume-adapter-file", str(init / "adapters.safetensors"), "-c", str(conf)]
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    text = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout)  # rich's colours
    losses = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"^\s*(\d+)\s+(\d+\.\d+) [▼▲]", text, re.M)}
    assert len(losses) == config["iters"] // config["steps_per_report"], res.stdout[-2000:]
    return losses


# --------------------------------------------------------------------------- TRL's side (run by --trl-python)


def peft_model(spec: dict):
    """The spec's model in float32 with PEFT's LoRA holding this project's initial adapter, and its tokenizer."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    lora = LoraConfig(r=LORA["lora_rank"], lora_alpha=LORA["lora_alpha"] * LORA["lora_rank"], lora_dropout=0.0,
                      target_modules=list(PROJECTIONS), task_type="CAUSAL_LM")
    model = get_peft_model(model, lora)
    # mlx_lm's x @ lora_a @ lora_b * scale is PEFT's lora_B(lora_A(x)) * alpha / r: A and B transposed.
    ours = load_file(str(Path(spec["init_dir"]) / "adapters.safetensors"))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in ours.items():
            base, leaf = name.rsplit(".", 1)
            target = f"base_model.model.{base}.lora_{leaf[-1].upper()}.default.weight"
            params.pop(target).copy_(value.T)
    assert not [n for n in params if "lora_" in n], "PEFT LoRA weights without a counterpart"
    return model, tokenizer


def trl_dpo(spec_path: str, out_path: str) -> None:
    """TRL's DPOTrainer on the spec's model, initial LoRA and ordered rows; its per-step logs and tokens."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = peft_model(spec)
    config = spec["config"]
    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=config["batch_size"],
                     max_steps=spec["steps"], learning_rate=config["learning_rate"], beta=config["beta"],
                     loss_type=["sigmoid"], lr_scheduler_type=config["lr_scheduler"], warmup_steps=0,
                     max_grad_norm=config["max_grad_norm"], weight_decay=config["weight_decay"], adam_beta1=0.9,
                     adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
                     train_sampling_strategy="sequential", dataloader_drop_last=False, max_length=1024)
    steps: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"loss": logs["loss"], "margin": logs["rewards/margins"], "logps_chosen": logs["logps/chosen"]})

    trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(spec["rows"]), processing_class=tokenizer,
                         callbacks=[Logs()])
    tokens = [{k: list(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in trainer.train_dataset]
    trainer.train()
    Path(out_path).write_text(json.dumps({"steps": steps, "tokens": tokens}))


def trl_rloo(spec_path: str, out_path: str) -> None:
    """TRL's RLOOTrainer from the spec's initial LoRA, generating nothing: each generation replays
    this project's step (its prompts in order, its sampled completion tokens, EOS included, and
    their rewards). Its per-step logs and its tokenised prompts."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import RLOOConfig, RLOOTrainer

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = peft_model(spec)
    config, replay = spec["config"], spec["replay"]
    rows = [{"prompt": spec["prompts"][i]} for step in replay for i in step["prompt_indices"]]
    calls = {"generate": 0, "reward": 0}
    prompt_ids: list[list[list[int]]] = []

    def replayed_rewards(prompts, completions, **kwargs):
        step = replay[calls["reward"]]
        calls["reward"] += 1
        return [r for group in step["rewards"] for r in group]

    class Replayed(RLOOTrainer):
        def _generate_single_turn(self, ids, images, multimodal_fields):
            prompt_ids.append([list(p) for p in ids])
            step = replay[calls["generate"]]
            calls["generate"] += 1
            return [list(c) for c in step["completions"]]

    G, mu = config["group_size"], config["num_iterations"]
    args = RLOOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=config["batch_size"] * G,
                      num_generations=G, num_iterations=mu, beta=config["beta"], epsilon=config["clip_ratio"],
                      normalize_advantages=False, max_steps=len(replay) * mu, learning_rate=config["learning_rate"],
                      lr_scheduler_type=config["lr_scheduler"], warmup_steps=0, max_grad_norm=config["max_grad_norm"],
                      weight_decay=config["weight_decay"], adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                      max_completion_length=config["max_completion_len"], temperature=config["temperature"], top_p=1.0,
                      top_k=0, shuffle_dataset=False, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                      bf16=False, fp16=False, gradient_checkpointing=False, seed=0)
    steps: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"loss": logs["loss"], "kl": logs.get("kl")})

    trainer = Replayed(model=model, reward_funcs=replayed_rewards, args=args, train_dataset=Dataset.from_list(rows),
                       processing_class=tokenizer, callbacks=[Logs()])
    trainer.train()
    Path(out_path).write_text(json.dumps({"steps": steps, "prompt_ids": prompt_ids}))


def rloo_parity(trl_python: str, work: Path, model_dir: Path, steps: int) -> dict:
    """RLOO against TRL's RLOOTrainer on this project's sampled completions, replayed (above)."""
    prompts = rloo_prompts(model_dir)
    ours, replay = ours_rloo(model_dir, work / "init", prompts, steps)
    spec = work / "trl_rloo_spec.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "init_dir": str(work / "init"), "prompts": prompts,
                                "replay": replay, "config": RLOO_CONFIG}))
    res = subprocess.run([trl_python, __file__, "trl-rloo", str(spec), str(work / "trl_rloo.json")],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    trl = json.loads((work / "trl_rloo.json").read_text())
    for k, step in enumerate(replay):
        ids = [p for p in step["prompt_ids"] for _ in range(RLOO_CONFIG["group_size"])]
        assert sorted(trl["prompt_ids"][k]) == sorted(ids), f"TRL tokenises step {k}'s prompts otherwise"
    mu = RLOO_CONFIG["num_iterations"]
    # This project reports a step's last update; TRL logs every update, the KL at a step's first.
    theirs = [{"loss": trl["steps"][k * mu + mu - 1]["loss"], "kl": trl["steps"][k * mu]["kl"]} for k in range(len(ours))]
    first_updates = [trl["steps"][k * mu]["loss"] for k in range(len(ours))]
    deviation = [abs(o["loss"] - t["loss"]) / abs(t["loss"]) for o, t in zip(ours, theirs)]
    kl_deviation = [abs(o["kl"] - t["kl"]) / abs(t["kl"]) for o, t in zip(ours[1:], theirs[1:])]  # step 0's is ~0
    print(f"RLOO, {steps} steps of {mu} updates: step  loss of the last update (this project, TRL)  kl (this project, TRL)")
    for k, (o, t) in enumerate(zip(ours, theirs)):
        print(f"  {k:>3}  {o['loss']:+.6f} {t['loss']:+.6f}  {o['kl']:+.6f} {t['kl']:+.6f}")
    return {"steps": len(ours), "trl_updates": len(trl["steps"]), "max_loss_deviation": max(deviation),
            "max_kl_deviation": max(kl_deviation), "largest_first_update_loss": max(abs(x) for x in first_updates),
            "losses": [[o["loss"], t["loss"]] for o, t in zip(ours, theirs)]}


# --------------------------------------------------------------------------- the comparison


def trl_gkd(spec_path: str, out_path: str) -> None:
    """TRL's GKDTrainer on the spec's student (its initial LoRA), teacher and ordered token rows; its per-step losses."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl.experimental.gkd import GKDConfig, GKDTrainer

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = peft_model(spec)
    teacher = AutoModelForCausalLM.from_pretrained(spec["teacher_dir"], dtype=torch.float32)

    def collate(rows: list[dict]) -> dict:
        """This project's tokens, right-padded; labels -100 but on the completion (EOS included)."""
        width = max(len(r["prompt_ids"]) + len(r["completion_ids"]) for r in rows)
        ids, attention, labels = [], [], []
        for r in rows:
            pad = width - len(r["prompt_ids"]) - len(r["completion_ids"])
            ids.append(r["prompt_ids"] + r["completion_ids"] + [tokenizer.pad_token_id] * pad)
            attention.append([1] * (width - pad) + [0] * pad)
            labels.append([-100] * len(r["prompt_ids"]) + r["completion_ids"] + [-100] * pad)
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(attention), "labels": torch.tensor(labels)}

    config = spec["config"]
    args = GKDConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=config["batch_size"],
                     max_steps=spec["steps"], learning_rate=config["learning_rate"], lmbda=config["lmbda"],
                     beta=config["beta"], lr_scheduler_type=config["lr_scheduler"], warmup_steps=0,
                     max_grad_norm=config["max_grad_norm"], weight_decay=config["weight_decay"], adam_beta1=0.9,
                     adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
                     train_sampling_strategy="sequential", dataloader_drop_last=False, max_length=1024)
    steps: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"loss": logs["loss"]})

    trainer = GKDTrainer(model=model, teacher_model=teacher, args=args, data_collator=collate,
                         train_dataset=Dataset.from_list(spec["rows"]), processing_class=tokenizer, callbacks=[Logs()])
    trainer.train()
    Path(out_path).write_text(json.dumps({"steps": steps}))


def gkd_parity(trl_python: str, work: Path, model_dir: Path, init_archive: Path, steps: int, beta: float) -> dict:
    """GKD (lmbda 0) through a private stack and through TRL's GKDTrainer, the teacher the tiny
    model of seed 1; each step's loss on both sides and the largest relative deviation."""
    from bench.private_stack import private_stack
    from worker.runtime.make_model import make_model

    teacher = make_model(model_dir.parent / "teacher", size="tiny", seed=1)
    config = {**GKD_CONFIG, "beta": beta, "iters": steps}
    rows = pairs(16)  # their chosen completions
    ordered = our_tokens(model_dir, [rows[i] for i in batch_order(len(rows), config["batch_size"], steps)])
    spec = work / "trl_gkd_spec.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "init_dir": str(work / "init"), "teacher_dir": str(teacher),
                                "steps": steps, "config": config,
                                "rows": [{"prompt_ids": r["prompt_ids"], "completion_ids": r["chosen_ids"]} for r in ordered]}))
    res = subprocess.run([trl_python, __file__, "trl-gkd", str(spec), str(work / "trl_gkd.json")],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    trl = json.loads((work / "trl_gkd.json").read_text())["steps"]
    with private_stack(model_dir) as (stack, client, log):
        wait_up(client, stack, log)
        events = run_job(client, "/admin/api/fine-tune/gkd/jobs", {
            "model_id": model_dir.name, "teacher_model_id": teacher.name, "init_adapter": {"file_id": upload(client, init_archive)},
            "dataset": [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows], "config": config}, ("gkd_step",))
    ours = [e["loss"] for e in events["gkd_step"]]
    print(f"GKD, beta {beta}, {steps} steps: step  loss (this project, TRL)")
    for k, (o, t) in enumerate(zip(ours, trl)):
        print(f"  {k:>3}  {o:.6f} {t['loss']:.6f}")
    deviation = [abs(o - t["loss"]) / abs(t["loss"]) for o, t in zip(ours, trl)]
    return {"steps": len(ours), "trl_steps": len(trl), "beta": beta, "max_loss_deviation": max(deviation),
            "first_loss": [ours[0], trl[0]["loss"]], "final_loss": [ours[-1], trl[-1]["loss"]]}


def main() -> int:
    if sys.argv[1:2] == ["trl-dpo"]:
        trl_dpo(*sys.argv[2:4])
        return 0
    if sys.argv[1:2] == ["trl-rloo"]:
        trl_rloo(*sys.argv[2:4])
        return 0
    if sys.argv[1:2] == ["trl-gkd"]:
        trl_gkd(*sys.argv[2:4])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", required=True, help="an interpreter with torch, transformers, peft, datasets, trl")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--only-rloo", action="store_true", help="only the RLOO comparison")
    ap.add_argument("--only-gkd", action="store_true", help="only the GKD comparison")
    ap.add_argument("--gkd-beta", type=float, default=GKD_CONFIG["beta"], help="GKD's beta")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from bench.private_stack import private_stack
    from worker.runtime.make_model import make_model
    from worker.supervisor.openblas import reexec_with_openblas

    reexec_with_openblas()
    work = Path(tempfile.mkdtemp(prefix="mtq-parity-"))
    model_dir = make_model(work / "models" / "tiny", size="tiny", seed=0)
    init_archive = initial_adapter(model_dir, work / "init")
    if args.only_gkd:
        gkd = gkd_parity(args.trl_python, work, model_dir, init_archive, args.steps, args.gkd_beta)
        print(f"GKD: largest per-step loss deviation {gkd['max_loss_deviation']:.4%} over {gkd['steps']} steps")
        if args.json:
            Path(args.json).write_text(json.dumps({"gkd": gkd}, indent=2))
        return 0 if gkd["max_loss_deviation"] <= 0.02 else 1
    rloo = rloo_parity(args.trl_python, work, model_dir, args.steps)
    rloo_line = (f"RLOO: largest per-step loss deviation {rloo['max_loss_deviation']:.2%} (kl {rloo['max_kl_deviation']:.2%}); "
                 f"first updates' losses at most {rloo['largest_first_update_loss']:.1e} (on-policy: 0)")
    if args.only_rloo:
        print(rloo_line)
        if args.json:
            Path(args.json).write_text(json.dumps({"rloo": rloo}, indent=2))
        return 0 if rloo["max_loss_deviation"] <= 0.02 else 1
    rows = pairs(args.pairs)
    ordered = [rows[i] for i in batch_order(len(rows), DPO_CONFIG["batch_size"], args.steps)]

    # TRL first (its own interpreter), then this project through its stack.
    spec = work / "trl_spec.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "init_dir": str(work / "init"), "rows": ordered,
                                "steps": args.steps, "config": DPO_CONFIG}))
    res = subprocess.run([args.trl_python, __file__, "trl-dpo", str(spec), str(work / "trl.json")],
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stderr[-4000:]
    trl = json.loads((work / "trl.json").read_text())
    mismatched = [i for i, (a, b) in enumerate(zip(trl["tokens"], our_tokens(model_dir, ordered))) if a != b]
    assert not mismatched, f"TRL tokenises row {mismatched[0]} otherwise: {trl['tokens'][mismatched[0]]}"

    sft_data, length = sft_rows(model_dir, 4)
    data_dir = work / "data" / "sft"
    data_dir.mkdir(parents=True)
    for split in ("train", "valid"):
        (data_dir / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in sft_data) + "\n")
    sft_config = {**SFT_CONFIG, "iters": args.steps, "batch_size": len(sft_data), "max_seq_length": length}
    optimizers = {
        "mlx_lm's (the seed server's)": ({"bias_correction": False, "weight_decay": 0.01, "max_grad_norm": None},
                                          {"bias_correction": False, "weight_decay": 0.01}),
        "TRL's (bias-corrected, no weight decay)": ({"max_grad_norm": None}, {"bias_correction": True, "weight_decay": 0.0}),
    }
    with private_stack(model_dir, MTQ_DATA_ROOTS=str(work / "data")) as (stack, client, log):
        wait_up(client, stack, log)
        init_file = upload(client, init_archive)
        ours = ours_dpo(client, model_dir.name, rows, init_file, args.steps)  # its own order is `ordered`
        sft = {}
        for i, (name, (our_fields, mlx_fields)) in enumerate(optimizers.items()):
            sft[name] = (ours_sft(client, model_dir.name, data_dir, init_file, {**sft_config, **our_fields}),
                         mlx_lm_sft(model_dir, data_dir, work / "init", sft_config, mlx_fields, work / f"mlx_lm-{i}"))

    gkd = gkd_parity(args.trl_python, work, model_dir, init_archive, args.steps, args.gkd_beta)
    deviation = [abs(o["loss"] - t["loss"]) / abs(t["loss"]) for o, t in zip(ours, trl["steps"])]
    figures = {"dpo": {"steps": len(ours), "trl_steps": len(trl["steps"]),
                       "max_loss_deviation": max(deviation), "final_loss": [ours[-1]["loss"], trl["steps"][-1]["loss"]],
                       "final_margin": [ours[-1]["margin"], trl["steps"][-1]["margin"]],
                       "final_margin_deviation": abs(ours[-1]["margin"] - trl["steps"][-1]["margin"]) / abs(trl["steps"][-1]["margin"]),
                       "first_logps_chosen": [ours[0]["logps_chosen"], trl["steps"][0]["logps_chosen"]]},
               "sft": {}, "rloo": rloo, "gkd": gkd}
    print(f"DPO, {args.steps} steps: step  loss (this project, TRL)  rewards/margins (this project, TRL)")
    for k, (o, t) in enumerate(zip(ours, trl["steps"])):
        print(f"  {k:>3}  {o['loss']:.4f} {t['loss']:.4f}  {o['margin']:+.4f} {t['margin']:+.4f}")
    for name, (mine, theirs) in sft.items():
        dev = {step: abs(mine[step] - theirs[step]) / theirs[step] for step in theirs}
        figures["sft"][name] = {"reports": {step: [mine[step], theirs[step]] for step in theirs}, "max_deviation": max(dev.values())}
        print(f"SFT with {name} optimizer: step  train_loss (this project, mlx_lm lora)")
        for step in theirs:
            print(f"  {step:>3}  {mine[step]:.4f} {theirs[step]:.3f}")
    d = figures["dpo"]
    print(f"DPO: largest per-step loss deviation {d['max_loss_deviation']:.2%}; final margin {d['final_margin'][0]:.4f} "
          f"vs TRL {d['final_margin'][1]:.4f} ({d['final_margin_deviation']:.2%}); final loss {d['final_loss'][0]:.4f} "
          f"vs {d['final_loss'][1]:.4f}")
    for name, f in figures["sft"].items():
        print(f"SFT ({name}): largest per-report train loss deviation from mlx_lm lora {f['max_deviation']:.3%}")
    print(rloo_line)
    print(f"GKD: largest per-step loss deviation {gkd['max_loss_deviation']:.4%}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = d["max_loss_deviation"] <= 0.02 and d["final_margin_deviation"] <= 0.05 and \
        all(f["max_deviation"] <= 0.01 for f in figures["sft"].values()) and rloo["max_loss_deviation"] <= 0.02 and \
        gkd["max_loss_deviation"] <= 0.02
    print("parity: " + ("within 2% (DPO, RLOO and GKD loss), 5% (DPO margin), 1% (SFT loss)" if ok else "NOT within the bounds"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
