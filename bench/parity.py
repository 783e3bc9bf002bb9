"""Parity of the kinds with the trainers users compare them to, measured in one run: DPO against
TRL's DPOTrainer, SFT against mlx_lm's own LoRA trainer (`mlx_lm lora`), RLOO against TRL's
RLOOTrainer, PPO against TRL's PPOTrainer, Online DPO and XPO against TRL's OnlineDPOTrainer,
GKD against TRL's GKDTrainer; and (`losses`) DPO's other loss types against DPOTrainer, CPO / SimPO
against TRL's CPOTrainer.

    python bench/parity.py --trl-python /path/to/trl-env/bin/python [--trl-ppo-path DIR] [--steps 40] [--json OUT.json]
                           [--only-rloo | --only-ppo]
    python bench/parity.py --trl-python /path/to/trl-env/bin/python --only-gkd [--gkd-beta 0.5] [--steps 40]
    python bench/parity.py --only-sft [--steps 40]       (mlx_lm only: no TRL interpreter needed)
    python bench/parity.py online --trl-python /path/to/trl-env/bin/python [--steps 24] [--json OUT.json]
    python bench/parity.py losses --trl-python /path/to/trl-env/bin/python [--steps 40] [--lr 2e-3] [--only NAME ...]

The last runs Online DPO and XPO against TRL's OnlineDPOTrainer (online_main below says how).

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

PPO: TRL 1.16 has no PPOTrainer (1.13 removed trl.experimental.ppo); `--trl-ppo-path DIR` names
a directory with TRL 1.12 (`pip install --no-deps --target DIR trl==1.12.0`), put first on the
TRL interpreter's path. PPO samples its own completions, so the two sides cannot sample alike:
this project's PPO trainer (worker/kinds/ppo.py) runs as a PPO job does, in this process, where
its samples can be read, and TRL's (`parity.py trl-ppo SPEC OUT`) replays each step: its
generation gives back this project's completion tokens (with the policy's logits on them), its
reward model their scores (a tenth of the length in characters). The same initial LoRA and value
head (a linear head, weight 0, on the policy's last hidden state with its gradient stopped:
TRL's value model is given exactly that), prompts of one token length, a pad token no row
holds, and the same hyperparameters: batch 4, 12 tokens, temperature 1, kl_coef 0.05 (k1),
cliprange 0.2, cliprange_value 0.2, vf_coef 0.1, gamma 1, lam 0.95, 4 PPO epochs of 1
minibatch, lr 1e-3 constant, TRL's AdamW, no gradient clipping (TRL's loop has none). Compared:
each step's loss (loss/policy_avg + vf_coef loss/value_avg, the mean over its updates), value
loss, policy loss and approxkl, over the steps before the first completion that ends before
max_completion_len: there TRL's code puts the score one position past the EOS and trains a value
there, this project at the EOS (docs/kinds.md#ppo); the run says where that step is and the
deviation over all steps. Seed 2's first such completion is at step 21. At lr 5e-3 (seed 0) the
two sides agree to 1e-5 for 8 steps and part at the ninth (approxkl 6% apart, every clip
decision the same), where two TRL runs (of 12 and of 20 steps) replaying the same rollouts part
from each other too (value loss 4.12 and 4.20 at step 10).
losses: DPO's model, initial LoRA, pairs, order and optimizer for each of DPO's other loss types
(DPO_LOSSES: TRL's label_smoothing where the type reads it; a loss_weights mix) and for CPO /
SimPO (CPO_LOSSES: TRL's CPOTrainer, reference-free, which tokenises prompt + completion together
and adds EOS, as DPOTrainer: its rows are checked against this project's tokens too), each a job
here (`trl-dpo` / `trl-cpo` train every config of their spec in one process). Each run's largest
relative per-step loss deviation is printed and must be within 2%. --lr sets every run's
learning rate: at 5e-3 (DPO_CONFIG's) the tiny model's loss oscillates, which amplifies float32
rounding: the sigmoid+bco_pair mix agrees to 4 decimals for 27 steps, then the two trajectories
part (7.9% by step 40), CPO's ipo reaches 1.8%; at 2e-3 none is 0.1% apart.
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
# TRL's PPO loop does not clip gradients: max_grad_norm null here. Seed 2: its first row to end before
# max_completion_len comes at step 21 (seed 0: 18, 1: 9, 3: 0); the PPO section of the docstring says why it matters.
PPO_CONFIG = {**LORA, "batch_size": 4, "max_completion_len": 12, "temperature": 1.0, "learning_rate": 1e-3, "seed": 2,
              "lr_scheduler": "constant", "max_grad_norm": None, "weight_decay": 0.0, "kl_coef": 0.05, "cliprange": 0.2,
              "cliprange_value": 0.2, "vf_coef": 0.1, "gamma": 1.0, "lam": 0.95, "num_ppo_epochs": 4, "num_mini_batches": 1}
PPO_REWARD = [{"type": "length", "weight": 0.1}]  # a tenth of the length in characters
PPO_COMPARED = ("loss", "loss/policy_avg", "loss/value_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/clipfrac_avg")
GKD_CONFIG = {**DPO_CONFIG, "lmbda": 0.0, "beta": 0.5}
# `losses`: DPO's other loss types (on top of DPO_CONFIG), and CPO's and SimPO's configs.
DPO_LOSSES = {
    **{t: {"loss_type": t} for t in ("hinge", "ipo", "nca_pair", "bco_pair", "sppo_hard", "apo_zero", "apo_down",
                                     "sigmoid_norm")},
    "robust": {"loss_type": "robust", "label_smoothing": 0.1},
    "exo_pair": {"loss_type": "exo_pair", "label_smoothing": 1e-3},
    "sigmoid+bco_pair": {"loss_type": ["sigmoid", "bco_pair"], "loss_weights": [0.8, 0.2]},
}
CPO_LOSSES = {
    "cpo-sigmoid": {"loss_type": "sigmoid", "cpo_alpha": 1.0},
    "cpo-hinge": {"loss_type": "hinge", "cpo_alpha": 1.0},
    "cpo-ipo": {"loss_type": "ipo", "cpo_alpha": 1.0},
    "simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 0.0},
    "cpo-simpo": {"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 0.5, "cpo_alpha": 1.0, "label_smoothing": 0.1},
}


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


def ours_pairs(client, kind: str, model_id: str, rows: list[dict], init_file: str, steps: int, config: dict) -> list[dict]:
    """A DPO or CPO job's per-step loss, margin and chosen log-probs."""
    events = run_job(client, f"/admin/api/fine-tune/{kind}/jobs", {
        "model_id": model_id, "preference_pairs": rows, "init_adapter": {"file_id": init_file},
        "config": {**config, "iters": steps}}, (f"{kind}_step",))
    return [{"loss": e["loss"], "margin": e["rewards/margins"], "logps_chosen": e["logps/chosen"]} for e in events[f"{kind}_step"]]


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


def one_length_prompts(model_dir: Path) -> list[str]:
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


# mlx_lm's optimizer and TRL's: (this project's config fields, mlx_lm's optimizer_config for adamw)
SFT_OPTIMIZERS = {
    "mlx_lm's (the seed server's)": ({"bias_correction": False, "weight_decay": 0.01, "max_grad_norm": None},
                                      {"bias_correction": False, "weight_decay": 0.01}),
    "TRL's (bias-corrected, no weight decay)": ({"max_grad_norm": None}, {"bias_correction": True, "weight_decay": 0.0}),
}


def sft_parity(client, work: Path, model_dir: Path, init_file: str, steps: int) -> dict[str, dict]:
    """Each optimizer's SFT run here and by `mlx_lm lora` (the data directory under work/data, which
    must be the stack's data root): every report's train loss on both sides, printed, and the
    largest relative deviation."""
    sft_data, length = sft_rows(model_dir, 4)
    data_dir = work / "data" / "sft"
    data_dir.mkdir(parents=True)
    for split in ("train", "valid"):
        (data_dir / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in sft_data) + "\n")
    sft_config = {**SFT_CONFIG, "iters": steps, "batch_size": len(sft_data), "max_seq_length": length}
    figures = {}
    for i, (name, (our_fields, mlx_fields)) in enumerate(SFT_OPTIMIZERS.items()):
        mine = ours_sft(client, model_dir.name, data_dir, init_file, {**sft_config, **our_fields})
        theirs = mlx_lm_sft(model_dir, data_dir, work / "init", sft_config, mlx_fields, work / f"mlx_lm-{i}")
        dev = {step: abs(mine[step] - theirs[step]) / theirs[step] for step in theirs}
        figures[name] = {"reports": {step: [mine[step], theirs[step]] for step in theirs}, "max_deviation": max(dev.values())}
        print(f"SFT with {name} optimizer: step  train_loss (this project, mlx_lm lora)")
        for step in theirs:
            print(f"  {step:>3}  {mine[step]:.4f} {theirs[step]:.3f}")
    return figures


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


def trl_args(config: dict, steps: int) -> dict:
    """TrainingArguments for this project's optimizer and data order (module docstring)."""
    return dict(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=config["batch_size"], max_steps=steps,
                learning_rate=config["learning_rate"], beta=config["beta"], lr_scheduler_type=config["lr_scheduler"],
                warmup_steps=0, max_grad_norm=config["max_grad_norm"], weight_decay=config["weight_decay"],
                adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
                train_sampling_strategy="sequential", dataloader_drop_last=False, max_length=1024)


def trl_pairs(spec_path: str, out_path: str, trainer_name: str) -> None:
    """TRL's DPOTrainer or CPOTrainer on the spec's model, initial LoRA and ordered rows, once per config
    of the spec (`configs`, or its one `config`): each run's per-step logs (`steps`: the first's), and
    the tokens (the rows are the same in every run)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    spec = json.loads(Path(spec_path).read_text())
    runs: list[list[dict]] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                runs[-1].append({"loss": logs["loss"], "margin": logs["rewards/margins"], "logps_chosen": logs["logps/chosen"]})

    for config in spec.get("configs") or [spec["config"]]:
        model, tokenizer = peft_model(spec)
        runs.append([])
        if trainer_name == "dpo":
            from trl import DPOConfig, DPOTrainer

            args = DPOConfig(**trl_args(config, spec["steps"]), loss_type=config.get("loss_type", "sigmoid"),
                             loss_weights=config.get("loss_weights"), label_smoothing=config.get("label_smoothing", 0.0))
            trainer = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(spec["rows"]),
                                 processing_class=tokenizer, callbacks=[Logs()])
            tokens = [{k: list(r[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for r in trainer.train_dataset]
        else:
            from trl.experimental.cpo import CPOConfig, CPOTrainer

            args = CPOConfig(**trl_args(config, spec["steps"]), loss_type=config["loss_type"], cpo_alpha=config["cpo_alpha"],
                             simpo_gamma=config.get("simpo_gamma", 0.5), label_smoothing=config.get("label_smoothing", 0.0))
            trainer = CPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(spec["rows"]),
                                 processing_class=tokenizer, callbacks=[Logs()])
            tokens = [cpo_tokens(r) for r in trainer.train_dataset]
        trainer.train()
    Path(out_path).write_text(json.dumps({"steps": runs[0], "runs": runs, "tokens": tokens}))


def cpo_tokens(row: dict) -> dict:
    """A CPOTrainer row (prompt + completion ids, labels -100 over the prompt) as DPOTrainer's three lists."""
    out = {}
    for side in ("chosen", "rejected"):
        ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
        start = next(i for i, label in enumerate(labels) if label != -100)
        out["prompt_ids"], out[f"{side}_ids"] = list(ids[:start]), list(ids[start:])
    return out


def trl_runs(trl_python: str, work: Path, trainer_name: str, spec: dict, model_dir: Path, ordered: list[dict]) -> list[list[dict]]:
    """Run `parity.py trl-<trainer> SPEC OUT` in the TRL interpreter; its runs, the tokens checked against ours."""
    spec_path, out = work / f"trl_{trainer_name}_spec.json", work / f"trl_{trainer_name}.json"
    spec_path.write_text(json.dumps(spec))
    res = subprocess.run([trl_python, __file__, f"trl-{trainer_name}", str(spec_path), str(out)],
                         capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-4000:]
    trl = json.loads(out.read_text())
    mismatched = [i for i, (a, b) in enumerate(zip(trl["tokens"], our_tokens(model_dir, ordered))) if a != b]
    assert not mismatched, f"TRL's {trainer_name} tokenises row {mismatched[0]} otherwise: {trl['tokens'][mismatched[0]]}"
    return trl["runs"]


def losses_main(argv: list[str]) -> int:
    """DPO's other loss types and CPO / SimPO against TRL (module docstring: `losses`)."""
    ap = argparse.ArgumentParser(prog="parity.py losses")
    ap.add_argument("--trl-python", required=True, help="an interpreter with torch, transformers, peft, datasets, trl")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3, help="every run's learning rate")
    ap.add_argument("--only", nargs="+", choices=[*DPO_LOSSES, *CPO_LOSSES], help="only these runs")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from bench.private_stack import private_stack
    from worker.runtime.make_model import make_model
    from worker.supervisor.openblas import reexec_with_openblas

    reexec_with_openblas()
    work = Path(tempfile.mkdtemp(prefix="mtq-parity-losses-"))
    model_dir = make_model(work / "models" / "tiny", size="tiny", seed=0)
    init_archive = initial_adapter(model_dir, work / "init")
    rows = pairs(args.pairs)
    ordered = [rows[i] for i in batch_order(len(rows), DPO_CONFIG["batch_size"], args.steps)]
    base, chosen = {**DPO_CONFIG, "learning_rate": args.lr}, args.only or [*DPO_LOSSES, *CPO_LOSSES]
    configs = {"dpo": {name: {**base, **c} for name, c in DPO_LOSSES.items() if name in chosen},
               "cpo": {name: {**base, **c} for name, c in CPO_LOSSES.items() if name in chosen}}
    common = {"model_dir": str(model_dir), "init_dir": str(work / "init"), "rows": ordered, "steps": args.steps}
    trl = {name: run for kind, some in configs.items() if some
           for name, run in zip(some, trl_runs(args.trl_python, work, kind, {**common, "configs": list(some.values())},
                                               model_dir, ordered))}
    with private_stack(model_dir) as (stack, client, log):
        wait_up(client, stack, log)
        init_file = upload(client, init_archive)
        ours = {name: ours_pairs(client, kind, model_dir.name, rows, init_file, args.steps, c)  # its own order is `ordered`
                for kind, some in configs.items() for name, c in some.items()}
    figures = {}
    for name, mine in ours.items():
        theirs = trl[name]
        figures[name] = {"steps": len(mine), "final_loss": [mine[-1]["loss"], theirs[-1]["loss"]],
                         "final_margin": [mine[-1]["margin"], theirs[-1]["margin"]],
                         "max_loss_deviation": max(abs(o["loss"] - t["loss"]) / abs(t["loss"])
                                                   for o, t in zip(mine, theirs, strict=True))}
        print(f"{name}, {args.steps} steps at lr {args.lr}: step  loss (this project, TRL)  rewards/margins (this project, TRL)")
        for k, (o, t) in enumerate(zip(mine, theirs)):
            print(f"  {k:>3}  {o['loss']:.4f} {t['loss']:.4f}  {o['margin']:+.4f} {t['margin']:+.4f}")
    for name, f in figures.items():
        print(f"{name}: largest per-step loss deviation {f['max_loss_deviation']:.3%}; final loss {f['final_loss'][0]:.4f} "
              f"vs TRL {f['final_loss'][1]:.4f}, margin {f['final_margin'][0]:+.4f} vs {f['final_margin'][1]:+.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = all(f["max_loss_deviation"] <= 0.02 for f in figures.values())
    print("parity: " + ("every loss within 2% of TRL's" if ok else "NOT within 2%"))
    return 0 if ok else 1


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
    prompts = one_length_prompts(model_dir)
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


# --------------------------------------------------------------------------- Online DPO and XPO


ONLINE_CONFIG = {**LORA, "learning_rate": 5e-3, "beta": 0.1, "batch_size": 4, "lr_scheduler": "constant",
                 "max_grad_norm": 1.0, "weight_decay": 0.0, "max_completion_len": 12, "temperature": 1.0}
XPO_ALPHA = 1e-2  # TRL's default 1e-5 would leave its term below the loss's printed digits


def ours_online(kind: str, model_dir: Path, init_dir: Path, prompts: list[str], steps: int) -> list[dict]:
    """This project's Online DPO / XPO trainer (worker/kinds/online_dpo.py), in this process, from
    the initial adapter, judged by the default reward (the completion's length in characters);
    each step's loss, metrics, prompts, completion tokens (a: the policy's; b: the policy's
    second, or XPO's reference's) and the judge's scores, for TRL to replay."""
    import mlx.core as mx
    import mlx_lm

    from shared.online_specs import OnlineDPOJobCreate, XPOJobCreate
    from worker.kinds.online_dpo import OnlineDPOTrainer
    from worker.rewards.scorer import build_scorer
    from worker.runtime.adapter_layers import attach_adapter
    from worker.runtime.train_core import TrainState

    model, tokenizer = mlx_lm.load(str(model_dir))
    xpo = kind == "xpo"
    spec = (XPOJobCreate if xpo else OnlineDPOJobCreate)(
        model_id="tiny", prompts=prompts, config={**ONLINE_CONFIG, "iters": steps, **({"alpha": XPO_ALPHA} if xpo else {})})
    attach_adapter(model, spec.config, init=init_dir)
    trainer = OnlineDPOTrainer(model, tokenizer, spec, build_scorer(spec, "parity"))
    rollouts = []

    def recorded(sample):
        def run(*args):
            rollouts.append(sample(*args))
            return rollouts[-1]
        return run

    trainer.rollout, trainer.reference_rollout = recorded(trainer.rollout), recorded(trainer.reference_rollout)
    scores = []
    score = trainer.score
    trainer.score = lambda *args: scores.append(score(*args)[0]) or (scores[-1], {})
    state, out = TrainState(), []
    for _ in range(steps):
        rollouts.clear()
        metrics, _ = trainer.step(state, lambda: False)
        rows = [[r.samples.tokens[i, :n].tolist() for i, n in enumerate(r.lengths)] for r in rollouts]
        a, b = (rows[0], rows[1]) if xpo else (rows[0][0::2], rows[0][1::2])
        out.append({"loss": metrics["loss"], "margin": metrics["rewards/margins"], "kl": metrics["objective/kl"],
                    "prompt_ids": rollouts[0].prompt_ids, "a": a, "b": b, "scores": scores[-1].tolist()})
    mx.clear_cache()
    return out


def trl_online(kind: str, spec_path: str, out_path: str) -> None:
    """TRL 1.16's OnlineDPOTrainer on the spec's model and initial LoRA, replaying this project's
    completions and judge scores step by step (its `_generate` and reward function answer from
    the record). XPO: TRL's XPOTrainer is no longer in TRL 1.16; its loss (trl/experimental/xpo/
    xpo_trainer.py `_compute_losses`, as TRL last shipped it) runs in the same trainer's training_step."""
    import torch
    import torch.nn.functional as F
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    model, tokenizer = peft_model(spec)
    config, record = spec["config"], spec["record"]

    def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        return ids, torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])

    class Replay(OnlineDPOTrainer):
        def _generate(self, model, prompts, images=None):
            step = record[self.state.global_step]
            prompt = torch.tensor(step["prompt_ids"]).repeat(2, 1)
            ids, mask = padded(step["a"] + step["b"])
            return prompt, torch.ones_like(prompt), ids, mask, None

        def training_step(self, model, inputs, num_items_in_batch=None):
            if kind != "xpo":
                return super().training_step(model, inputs, num_items_in_batch)
            model.train()
            step = record[self.state.global_step]
            prompt = torch.tensor(step["prompt_ids"])
            model_ids, model_mask = padded(step["a"])
            ref_ids, ref_mask = padded(step["b"])

            def logps(m, ids, mask):
                return self._forward(m, prompt, torch.ones_like(prompt), ids, mask).masked_fill(mask == 0, 0.0)

            model_logprobs_model_data, model_logprobs_ref_data = logps(model, model_ids, model_mask), logps(model, ref_ids, ref_mask)
            with torch.no_grad(), self.model.disable_adapter():
                ref_logprobs_model_data, ref_logprobs_ref_data = logps(model, model_ids, model_mask), logps(model, ref_ids, ref_mask)
            chosen_mask = torch.tensor([s[0] >= s[1] for s in step["scores"]])
            # XPOTrainer._compute_losses:
            model_logprobs_model_data_sum = model_logprobs_model_data.sum(1)
            model_logprobs_ref_data_sum = model_logprobs_ref_data.sum(1)
            ref_logprobs_ref_data_sum = ref_logprobs_ref_data.sum(1)
            ref_logprobs_model_data_sum = ref_logprobs_model_data.sum(1)
            chosen_model_logprobs = torch.where(chosen_mask, model_logprobs_model_data_sum, model_logprobs_ref_data_sum)
            chosen_ref_logprobs = torch.where(chosen_mask, ref_logprobs_model_data_sum, ref_logprobs_ref_data_sum)
            chosen_log_ratios = chosen_model_logprobs - chosen_ref_logprobs
            rejected_model_logprobs = torch.where(~chosen_mask, model_logprobs_model_data_sum, model_logprobs_ref_data_sum)
            rejected_ref_logprobs = torch.where(~chosen_mask, ref_logprobs_model_data_sum, ref_logprobs_ref_data_sum)
            rejected_log_ratios = rejected_model_logprobs - rejected_ref_logprobs
            logits = chosen_log_ratios - rejected_log_ratios
            dpo_losses = -F.logsigmoid(self.beta * logits)
            xpo_losses = config["alpha"] * model_logprobs_ref_data_sum
            loss = (dpo_losses + xpo_losses).mean()
            margin = self.beta * (chosen_log_ratios - rejected_log_ratios)
            kl = (model_logprobs_model_data - ref_logprobs_model_data).sum(1) + (model_logprobs_ref_data - ref_logprobs_ref_data).sum(1)
            logged = {"rewards/margins": margin.mean().item(), "objective/kl": kl.mean().item() / 2}
            for key, values in self.stats.items():  # every key once a step: the trainer averages them all
                values.append(logged.get(key, float("nan")))
            self.accelerator.backward(loss)
            return loss.detach()

    def judge(prompts, completions, trainer_state, **kwargs):  # the record's scores: first completions, then second
        scores = record[trainer_state.global_step]["scores"]
        return [s[0] for s in scores] + [s[1] for s in scores]

    args = OnlineDPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=config["batch_size"],
                           max_steps=len(record), learning_rate=config["learning_rate"], beta=config["beta"],
                           loss_type="sigmoid", lr_scheduler_type=config["lr_scheduler"], warmup_steps=0,
                           max_grad_norm=config["max_grad_norm"], weight_decay=config["weight_decay"], adam_beta1=0.9,
                           adam_beta2=0.999, adam_epsilon=1e-8, logging_steps=1, report_to=[], save_strategy="no",
                           use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
                           max_new_tokens=config["max_completion_len"], max_length=256)
    steps: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                steps.append({"loss": logs["loss"], "margin": logs["rewards/margins"], "kl": logs["objective/kl"]})

    prompts = [{"prompt": tokenizer.decode(p)} for s in record for p in s["prompt_ids"]]
    trainer = Replay(model=model, reward_funcs=judge, args=args, train_dataset=Dataset.from_list(prompts),
                     processing_class=tokenizer, callbacks=[Logs()])
    trainer.train()
    Path(out_path).write_text(json.dumps({"steps": steps}))


def online_main(argv: list[str]) -> int:
    """`parity.py online --trl-python PY`: Online DPO and XPO against TRL, on the same sampled completions."""
    ap = argparse.ArgumentParser(prog="parity.py online")
    ap.add_argument("--trl-python", required=True, help="an interpreter with torch, transformers, peft, datasets, trl")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from worker.runtime.make_model import make_model
    from worker.supervisor.openblas import reexec_with_openblas

    reexec_with_openblas()
    work = Path(tempfile.mkdtemp(prefix="mtq-parity-online-"))
    model_dir = make_model(work / "models" / "tiny", size="tiny", seed=0)
    initial_adapter(model_dir, work / "init")
    prompts = one_length_prompts(model_dir)
    figures = {}
    for kind in ("online_dpo", "xpo"):
        ours = ours_online(kind, model_dir, work / "init", prompts, args.steps)
        spec = work / f"{kind}_spec.json"
        config = {**ONLINE_CONFIG, "alpha": XPO_ALPHA}
        spec.write_text(json.dumps({"model_dir": str(model_dir), "init_dir": str(work / "init"), "config": config,
                                    "record": [{k: s[k] for k in ("prompt_ids", "a", "b", "scores")} for s in ours]}))
        res = subprocess.run([args.trl_python, __file__, "trl-online", kind, str(spec), str(work / f"{kind}_trl.json")],
                             capture_output=True, text=True, timeout=1800)
        assert res.returncode == 0, res.stderr[-4000:]
        trl = json.loads((work / f"{kind}_trl.json").read_text())["steps"]
        deviation = [abs(o["loss"] - t["loss"]) / abs(t["loss"]) for o, t in zip(ours, trl)]
        figures[kind] = {"steps": len(ours), "trl_steps": len(trl), "max_loss_deviation": max(deviation),
                         "final_loss": [ours[-1]["loss"], trl[-1]["loss"]], "final_margin": [ours[-1]["margin"], trl[-1]["margin"]],
                         "final_kl": [ours[-1]["kl"], trl[-1]["kl"]]}
        print(f"{kind}, {len(ours)} steps: step  loss (this project, TRL)  rewards/margins  objective/kl")
        for k, (o, t) in enumerate(zip(ours, trl)):
            print(f"  {k:>3}  {o['loss']:.4f} {t['loss']:.4f}  {o['margin']:+.4f} {t['margin']:+.4f}  {o['kl']:+.4f} {t['kl']:+.4f}")
        print(f"{kind}: largest per-step loss deviation {max(deviation):.2%}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = all(f["max_loss_deviation"] <= 0.02 and f["trl_steps"] == f["steps"] for f in figures.values())
    print("parity: " + ("within 2% (Online DPO and XPO loss)" if ok else "NOT within the bounds"))
    return 0 if ok else 1


# --------------------------------------------------------------------------- PPO (both sides)


def ours_ppo(model_dir: Path, init_dir: Path, head_dir: Path, prompts: list[str], steps: int) -> tuple[list[dict], list[dict]]:
    """This project's PPO trainer (worker/kinds/ppo.py) as a PPO job runs it (ppo.load: the initial
    adapter, a fresh value head, saved into head_dir for TRL), in this process so that its sampled
    tokens can be read: each step's metrics, and each step's prompt and completion token ids and
    scores, for TRL to replay."""
    import mlx.core as mx
    import mlx_lm

    from shared.ppo_specs import PPOJobCreate
    from worker.kinds.ppo import PPOTrainer
    from worker.kinds.reward_head import new_head, save_head
    from worker.rewards.scorer import build_scorer
    from worker.runtime.adapter_layers import attach_adapter
    from worker.runtime.train_core import TrainState

    model, tokenizer = mlx_lm.load(str(model_dir))
    spec = PPOJobCreate(model_id=model_dir.name, prompts=prompts, reward=PPO_REWARD, config={**PPO_CONFIG, "iters": steps})
    mx.random.seed(spec.config.seed)
    attach_adapter(model, spec.config, init=init_dir)
    head = new_head(model)
    head_dir.mkdir(parents=True)
    save_head(head, head_dir)
    replay: list[dict] = []
    with build_scorer(spec, "parity") as scorer:
        trainer = PPOTrainer(model, tokenizer, spec, scorer, head)
        rollout, score = trainer.rollout, trainer.score

        def recorded_rollout(step, should_stop):
            r = rollout(step, should_stop)
            tokens = r.samples.tokens.tolist()
            replay.append({"prompt_ids": r.prompt_ids, "completions": [row[:n] for row, n in zip(tokens, r.lengths)]})
            return r

        def recorded_score(r, step, should_stop):
            rewards, metrics = score(r, step, should_stop)
            replay[-1]["scores"] = rewards.reshape(-1).tolist()
            return rewards, metrics

        trainer.rollout, trainer.score = recorded_rollout, recorded_score
        state = TrainState()
        metrics = [trainer.step(state, lambda: False)[0] for _ in range(steps)]
    return [{k: m[k] for k in PPO_COMPARED} for m in metrics], replay


def trl_ppo(spec_path: str, out_path: str) -> None:
    """TRL's PPOTrainer (TRL 1.12's trl.experimental.ppo: TRL 1.13 removed it) from the spec's
    initial LoRA and value head, replaying this project's rollouts: its generation gives back
    this project's completion tokens (and the policy's logits on them), its reward model their
    scores. The value model is this project's: a linear head on the policy's last hidden state,
    its gradient stopped (worker/kinds/ppo.py). Its per-step logs."""
    from types import SimpleNamespace

    import torch
    from datasets import Dataset
    from safetensors.torch import load_file
    from transformers import TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer, ppo_trainer

    spec = json.loads(Path(spec_path).read_text())
    policy, tokenizer = peft_model(spec)
    config, replay = spec["config"], iter(spec["replay"])
    used = {t for step in spec["replay"] for row in step["prompt_ids"] + step["completions"] for t in row}
    tokenizer.pad_token_id = min(set(range(len(tokenizer))) - used)  # a pad token no row holds: nothing masked
    pad, length, temperature = tokenizer.pad_token_id, config["max_completion_len"], config["temperature"]

    class Trunk(torch.nn.Module):
        """The policy's last hidden states (after its final norm), detached."""

        def forward(self, **kwargs):
            return SimpleNamespace(hidden_states=(policy(**kwargs).hidden_states[-1].detach(),))

    class Critic(torch.nn.Module):
        base_model_prefix = "trunk"

        def __init__(self):
            super().__init__()
            self.trunk = Trunk()
            head = load_file(str(Path(spec["head_dir"]) / "value_head.safetensors"))
            self.score = torch.nn.Linear(head["weight"].shape[1], 1)
            with torch.no_grad():
                self.score.weight.copy_(head["weight"])
                self.score.bias.copy_(head["bias"])

    reward_model = torch.nn.Linear(1, 1)  # never run: its scores are replayed
    step_scores: list[torch.Tensor] = []

    @torch.no_grad()
    def replayed_generation(model, queries, batch_size, pad_token_id, generation_config):
        step = next(replay)
        rows = [p + c + [pad] * (length - len(c)) for p, c in zip(step["prompt_ids"], step["completions"])]
        query_responses = torch.tensor(rows)
        assert query_responses.shape[1] == queries.shape[1] + length
        step_scores.append(torch.tensor(step["scores"], dtype=torch.float32))
        logits = ppo_trainer.forward(model, query_responses, pad).logits[:, queries.shape[1] - 1:-1]
        return query_responses, logits / (temperature + 1e-7)

    def replayed_reward(model, query_responses, pad_token_id, context_length):
        if model is reward_model:
            return None, step_scores[-1], None
        return real_reward(model, query_responses, pad_token_id, context_length)

    real_reward = ppo_trainer.get_reward
    ppo_trainer.batch_generation, ppo_trainer.get_reward = replayed_generation, replayed_reward
    batch = config["batch_size"]
    args = PPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=batch, gradient_accumulation_steps=1,
                     num_mini_batches=config["num_mini_batches"], total_episodes=spec["steps"] * batch,
                     num_ppo_epochs=config["num_ppo_epochs"], learning_rate=config["learning_rate"],
                     lr_scheduler_type=config["lr_scheduler"], warmup_steps=0, weight_decay=config["weight_decay"],
                     adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, kl_coef=config["kl_coef"], kl_estimator="k1",
                     cliprange=config["cliprange"], cliprange_value=config["cliprange_value"], vf_coef=config["vf_coef"],
                     gamma=config["gamma"], lam=config["lam"], whiten_rewards=False, temperature=temperature,
                     response_length=length, stop_token=None, missing_eos_penalty=None, num_sample_generations=0,
                     local_rollout_forward_batch_size=batch, logging_steps=1, report_to=[], save_strategy="no",
                     use_cpu=True, bf16=False, fp16=False, seed=0)
    steps: list[dict] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss/policy_avg" in logs:
                steps.append({k: logs[k] for k in PPO_COMPARED if k != "loss"})

    prompts = Dataset.from_list([{"input_ids": ids} for ids in spec["prompt_ids"]])
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None, reward_model=reward_model,
                         train_dataset=prompts, value_model=Critic(), eval_dataset=prompts, callbacks=[Logs()])
    trainer.train()
    with torch.no_grad():  # the trunk is what the head reads: the hidden state the output head reads
        ids = torch.tensor(spec["prompt_ids"][:1])
        out = policy(input_ids=ids, output_hidden_states=True)
        assert torch.allclose(policy.get_output_embeddings()(out.hidden_states[-1]), out.logits, atol=1e-4)
    for s in steps:
        s["loss"] = s["loss/policy_avg"] + config["vf_coef"] * s["loss/value_avg"]
    Path(out_path).write_text(json.dumps({"steps": steps}))


def ppo_parity(trl_python: str, trl_ppo_path: str, work: Path, model_dir: Path, steps: int) -> dict:
    """TRL's PPOTrainer replaying this project's PPO rollouts from the same initial LoRA and head:
    the per-step losses on both sides and their largest relative deviations. trl_ppo_path: a
    directory holding TRL 1.12 (put first on the TRL interpreter's path), or "" when its own TRL has PPO."""
    import mlx_lm

    prompts = one_length_prompts(model_dir)
    ours, replay = ours_ppo(model_dir, work / "init", work / "ppo-head", prompts, steps)
    _, tokenizer = mlx_lm.load(str(model_dir))
    spec = work / "trl_ppo_spec.json"
    spec.write_text(json.dumps({"model_dir": str(model_dir), "init_dir": str(work / "init"), "head_dir": str(work / "ppo-head"),
                                "steps": steps, "config": PPO_CONFIG, "replay": replay,
                                "prompt_ids": [tokenizer.encode(p) for p in prompts]}))
    env = {**os.environ, "PYTHONPATH": trl_ppo_path, "TRL_EXPERIMENTAL_SILENCE": "1"}
    res = subprocess.run([trl_python, __file__, "trl-ppo", str(spec), str(work / "trl_ppo.json")],
                         capture_output=True, text=True, timeout=1800, env=env)
    assert res.returncode == 0, res.stderr[-4000:]
    trl = json.loads((work / "trl_ppo.json").read_text())["steps"]
    length = PPO_CONFIG["max_completion_len"]
    ended = sum(len(c) < length for step in replay for c in step["completions"])
    print(f"PPO, {len(ours)} steps: step  loss  loss/value_avg  loss/policy_avg (this project, TRL)")
    for k, (o, t) in enumerate(zip(ours, trl)):
        print(f"  {k:>3}  {o['loss']:.5f} {t['loss']:.5f}  {o['loss/value_avg']:.5f} {t['loss/value_avg']:.5f}  "
              f"{o['loss/policy_avg']:+.6f} {t['loss/policy_avg']:+.6f}")

    # The steps before the first row that ended early (there the two conventions part: the docstring).
    first_ended = next((k for k, step in enumerate(replay) if any(len(c) < length for c in step["completions"])), len(replay))
    compared = list(zip(ours, trl))

    def deviation(key, upto=first_ended):
        return max(abs(o[key] - t[key]) / abs(t[key]) for o, t in compared[:upto])

    return {"steps": len(ours), "trl_steps": len(trl), "rows_ended_early": ended, "first_step_with_an_ended_row": first_ended,
            "max_loss_deviation": deviation("loss"), "max_value_loss_deviation": deviation("loss/value_avg"),
            "max_policy_loss_difference": max(abs(o["loss/policy_avg"] - t["loss/policy_avg"]) for o, t in compared[:first_ended]),
            "max_approxkl_deviation": deviation("policy/approxkl_avg"),
            "max_loss_deviation_all_steps": deviation("loss", len(compared)), "steps_compared": [list(p) for p in compared]}


# --------------------------------------------------------------------------- GKD (both sides)


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


# --------------------------------------------------------------------------- the comparison


def main() -> int:
    if sys.argv[1:2] in (["trl-dpo"], ["trl-cpo"]):
        trl_pairs(*sys.argv[2:4], sys.argv[1].removeprefix("trl-"))
        return 0
    if sys.argv[1:2] == ["losses"]:
        return losses_main(sys.argv[2:])
    if sys.argv[1:2] == ["trl-rloo"]:
        trl_rloo(*sys.argv[2:4])
        return 0
    if sys.argv[1:2] == ["trl-online"]:
        trl_online(*sys.argv[2:5])
        return 0
    if sys.argv[1:2] == ["trl-ppo"]:
        trl_ppo(*sys.argv[2:4])
        return 0
    if sys.argv[1:2] == ["online"]:
        return online_main(sys.argv[2:])
    if sys.argv[1:2] == ["trl-gkd"]:
        trl_gkd(*sys.argv[2:4])
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", help="an interpreter with torch, transformers, peft, datasets, trl (all but --only-sft)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("--only-sft", action="store_true", help="only the SFT comparison (against mlx_lm lora)")
    ap.add_argument("--only-rloo", action="store_true", help="only the RLOO comparison")
    ap.add_argument("--trl-ppo-path", default="", help="a directory with TRL 1.12 (`pip install --no-deps --target DIR "
                    "trl==1.12.0`): TRL 1.13 removed PPOTrainer")
    ap.add_argument("--only-ppo", action="store_true", help="only the PPO comparison")
    ap.add_argument("--only-gkd", action="store_true", help="only the GKD comparison")
    ap.add_argument("--gkd-beta", type=float, default=GKD_CONFIG["beta"], help="GKD's beta")
    args = ap.parse_args()
    if not args.trl_python and not args.only_sft:
        ap.error("--trl-python is required (but for --only-sft)")

    sys.path.insert(0, str(ROOT))
    from bench.private_stack import private_stack
    from worker.runtime.make_model import make_model
    from worker.supervisor.openblas import reexec_with_openblas

    reexec_with_openblas()
    work = Path(tempfile.mkdtemp(prefix="mtq-parity-"))
    model_dir = make_model(work / "models" / "tiny", size="tiny", seed=0)
    init_archive = initial_adapter(model_dir, work / "init")
    (work / "data").mkdir()
    if args.only_sft:
        with private_stack(model_dir, MTQ_DATA_ROOTS=str(work / "data")) as (stack, client, log):
            wait_up(client, stack, log)
            sft = sft_parity(client, work, model_dir, upload(client, init_archive), args.steps)
        for name, f in sft.items():
            print(f"SFT ({name}): largest per-report train loss deviation from mlx_lm lora {f['max_deviation']:.3%}")
        if args.json:
            Path(args.json).write_text(json.dumps({"sft": sft}, indent=2))
        return 0 if all(f["max_deviation"] <= 0.01 for f in sft.values()) else 1
    if args.only_gkd:
        gkd = gkd_parity(args.trl_python, work, model_dir, init_archive, args.steps, args.gkd_beta)
        print(f"GKD: largest per-step loss deviation {gkd['max_loss_deviation']:.4%} over {gkd['steps']} steps")
        if args.json:
            Path(args.json).write_text(json.dumps({"gkd": gkd}, indent=2))
        return 0 if gkd["max_loss_deviation"] <= 0.02 else 1
    ppo = ppo_parity(args.trl_python, args.trl_ppo_path, work, model_dir, args.steps)
    ppo_line = (f"PPO: largest per-step loss deviation over its first {ppo['first_step_with_an_ended_row']} steps "
                f"{ppo['max_loss_deviation']:.2%} (value loss {ppo['max_value_loss_deviation']:.2%}, policy loss at most "
                f"{ppo['max_policy_loss_difference']:.1e} apart, approxkl {ppo['max_approxkl_deviation']:.2%}); over all "
                f"{ppo['steps']}, with {ppo['rows_ended_early']} rows ended before max_completion_len, "
                f"{ppo['max_loss_deviation_all_steps']:.2%}")
    if args.only_ppo:
        print(ppo_line)
        if args.json:
            Path(args.json).write_text(json.dumps({"ppo": ppo}, indent=2))
        return 0 if ppo["max_loss_deviation"] <= 0.02 else 1
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
    trl = {"steps": trl_runs(args.trl_python, work, "dpo", {"model_dir": str(model_dir), "init_dir": str(work / "init"),
                                                             "rows": ordered, "steps": args.steps, "config": DPO_CONFIG},
                             model_dir, ordered)[0]}

    with private_stack(model_dir, MTQ_DATA_ROOTS=str(work / "data")) as (stack, client, log):
        wait_up(client, stack, log)
        init_file = upload(client, init_archive)
        ours = ours_pairs(client, "dpo", model_dir.name, rows, init_file, args.steps, DPO_CONFIG)  # its own order is `ordered`
        sft = sft_parity(client, work, model_dir, init_file, args.steps)

    gkd = gkd_parity(args.trl_python, work, model_dir, init_archive, args.steps, args.gkd_beta)
    deviation = [abs(o["loss"] - t["loss"]) / abs(t["loss"]) for o, t in zip(ours, trl["steps"])]
    figures = {"dpo": {"steps": len(ours), "trl_steps": len(trl["steps"]),
                       "max_loss_deviation": max(deviation), "final_loss": [ours[-1]["loss"], trl["steps"][-1]["loss"]],
                       "final_margin": [ours[-1]["margin"], trl["steps"][-1]["margin"]],
                       "final_margin_deviation": abs(ours[-1]["margin"] - trl["steps"][-1]["margin"]) / abs(trl["steps"][-1]["margin"]),
                       "first_logps_chosen": [ours[0]["logps_chosen"], trl["steps"][0]["logps_chosen"]]},
               "sft": sft, "rloo": rloo, "ppo": ppo, "gkd": gkd}
    print(f"DPO, {args.steps} steps: step  loss (this project, TRL)  rewards/margins (this project, TRL)")
    for k, (o, t) in enumerate(zip(ours, trl["steps"])):
        print(f"  {k:>3}  {o['loss']:.4f} {t['loss']:.4f}  {o['margin']:+.4f} {t['margin']:+.4f}")
    d = figures["dpo"]
    print(f"DPO: largest per-step loss deviation {d['max_loss_deviation']:.2%}; final margin {d['final_margin'][0]:.4f} "
          f"vs TRL {d['final_margin'][1]:.4f} ({d['final_margin_deviation']:.2%}); final loss {d['final_loss'][0]:.4f} "
          f"vs {d['final_loss'][1]:.4f}")
    for name, f in figures["sft"].items():
        print(f"SFT ({name}): largest per-report train loss deviation from mlx_lm lora {f['max_deviation']:.3%}")
    print(rloo_line)
    print(ppo_line)
    print(f"GKD: largest per-step loss deviation {gkd['max_loss_deviation']:.4%}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = d["max_loss_deviation"] <= 0.02 and d["final_margin_deviation"] <= 0.05 and \
        all(f["max_deviation"] <= 0.01 for f in figures["sft"].values()) and rloo["max_loss_deviation"] <= 0.02 and \
        ppo["max_loss_deviation"] <= 0.02 and gkd["max_loss_deviation"] <= 0.02
    print("parity: " + ("within 2% (DPO, RLOO, PPO and GKD loss), 5% (DPO margin), 1% (SFT loss)" if ok else
                        "NOT within the bounds"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
