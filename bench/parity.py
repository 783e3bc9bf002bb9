"""Parity of the supervised kinds with the trainers users compare them to, measured in one run:
DPO against TRL's DPOTrainer, SFT against mlx_lm's own LoRA trainer (`mlx_lm lora`); with
--losses also DPO's other loss types (and a loss_weights mix) against DPOTrainer and CPO /
SimPO against TRL's CPOTrainer.

    python bench/parity.py --trl-python /path/to/trl-env/bin/python [--steps 40] [--losses] [--json OUT.json]

The TRL side needs torch, transformers, peft, datasets and trl (TRL 1.16 measured), which are
not this project's dependencies: install them into an environment of their own and name its
interpreter; this script runs its TRL part there (`parity.py trl-dpo SPEC OUT`, `trl-cpo`: each
trains every config of the spec, one after another, in one process). This
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

--losses: the same model, initial LoRA, pairs, order and optimizer for each of DPO's other loss
types (DPO_LOSSES: TRL's label_smoothing where the type reads it) and for CPO / SimPO
(CPO_LOSSES: TRL's CPOTrainer, reference-free, which tokenises prompt + completion together
and adds EOS, as DPOTrainer: its rows are checked against this project's tokens too). Each
run's largest relative per-step loss deviation is printed and must be within 2%. --lr sets the
learning rate of every DPO and CPO run: at 5e-3 (DPO_CONFIG's) the tiny model's loss
oscillates, which amplifies float32 rounding: the sigmoid+bco_pair mix agrees to 4 decimals for
27 steps, then the two trajectories part (7.9% by step 40); --lr 2e-3 does not oscillate.

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
# DPO's other loss types: the config each runs with (on top of DPO_CONFIG); CPO's and SimPO's.
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
SFT_CONFIG = {**LORA, "learning_rate": 1e-3, "steps_per_report": 5, "steps_per_eval": 1000, "val_batches": 1}


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
    """The spec's model with PEFT's LoRA holding this project's initial adapter, and its tokenizer."""
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


def trl_train(spec_path: str, out_path: str, trainer_name: str) -> None:
    """TRL's DPOTrainer or CPOTrainer on the spec's model, initial LoRA and ordered rows, once per config
    of the spec; each run's per-step logs, and the tokens of the last (the rows are the same in all)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    spec = json.loads(Path(spec_path).read_text())
    runs: list[list[dict]] = []

    class Logs(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                runs[-1].append({"loss": logs["loss"], "margin": logs["rewards/margins"], "logps_chosen": logs["logps/chosen"]})

    for config in spec["configs"]:
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
    Path(out_path).write_text(json.dumps({"runs": runs, "tokens": tokens}))


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


def deviation(ours: list[dict], theirs: list[dict]) -> float:
    """The largest relative per-step loss deviation from TRL's."""
    return max(abs(o["loss"] - t["loss"]) / abs(t["loss"]) for o, t in zip(ours, theirs, strict=True))


# --------------------------------------------------------------------------- the comparison


def main() -> int:
    if sys.argv[1] in ("trl-dpo", "trl-cpo"):
        trl_train(*sys.argv[2:4], sys.argv[1].removeprefix("trl-"))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--trl-python", required=True, help="an interpreter with torch, transformers, peft, datasets, trl")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--losses", action="store_true", help="DPO's other loss types and CPO / SimPO too")
    ap.add_argument("--only", nargs="+", choices=[*DPO_LOSSES, *CPO_LOSSES], help="of those, only these")
    ap.add_argument("--lr", type=float, default=DPO_CONFIG["learning_rate"], help="the DPO and CPO runs' learning rate")
    ap.add_argument("--no-sft", action="store_true", help="leave out the SFT comparison")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from bench.private_stack import private_stack
    from worker.runtime.make_model import make_model
    from worker.supervisor.openblas import reexec_with_openblas

    reexec_with_openblas()
    work = Path(tempfile.mkdtemp(prefix="mtq-parity-"))
    model_dir = make_model(work / "models" / "tiny", size="tiny", seed=0)
    init_archive = initial_adapter(model_dir, work / "init")
    rows = pairs(args.pairs)
    ordered = [rows[i] for i in batch_order(len(rows), DPO_CONFIG["batch_size"], args.steps)]

    # TRL first (its own interpreter), then this project through its stack.
    base = {**DPO_CONFIG, "learning_rate": args.lr}
    chosen = (args.only or [*DPO_LOSSES, *CPO_LOSSES]) if args.losses else []
    dpo_configs = {"sigmoid": base, **{name: {**base, **c} for name, c in DPO_LOSSES.items() if name in chosen}}
    cpo_configs = {name: {**base, **c} for name, c in CPO_LOSSES.items() if name in chosen}
    common = {"model_dir": str(model_dir), "init_dir": str(work / "init"), "rows": ordered, "steps": args.steps}
    trl = dict(zip(dpo_configs, trl_runs(args.trl_python, work, "dpo", {**common, "configs": list(dpo_configs.values())},
                                         model_dir, ordered)))
    if cpo_configs:
        trl.update(zip(cpo_configs, trl_runs(args.trl_python, work, "cpo", {**common, "configs": list(cpo_configs.values())},
                                             model_dir, ordered)))

    sft_data, length = sft_rows(model_dir, 4)
    data_dir = work / "data" / "sft"
    data_dir.mkdir(parents=True)
    for split in ("train", "valid"):
        (data_dir / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in sft_data) + "\n")
    sft_config = {**SFT_CONFIG, "iters": args.steps, "batch_size": len(sft_data), "max_seq_length": length}
    optimizers = {} if args.no_sft else {
        "mlx_lm's (the seed server's)": ({"bias_correction": False, "weight_decay": 0.01, "max_grad_norm": None},
                                          {"bias_correction": False, "weight_decay": 0.01}),
        "TRL's (bias-corrected, no weight decay)": ({"max_grad_norm": None}, {"bias_correction": True, "weight_decay": 0.0}),
    }
    with private_stack(model_dir, MTQ_DATA_ROOTS=str(work / "data")) as (stack, client, log):
        wait_up(client, stack, log)
        init_file = upload(client, init_archive)
        # Its own order is `ordered`.
        mine = {name: ours_pairs(client, "dpo", model_dir.name, rows, init_file, args.steps, c) for name, c in dpo_configs.items()}
        mine.update({name: ours_pairs(client, "cpo", model_dir.name, rows, init_file, args.steps, c)
                     for name, c in cpo_configs.items()})
        sft = {}
        for i, (name, (our_fields, mlx_fields)) in enumerate(optimizers.items()):
            sft[name] = (ours_sft(client, model_dir.name, data_dir, init_file, {**sft_config, **our_fields}),
                         mlx_lm_sft(model_dir, data_dir, work / "init", sft_config, mlx_fields, work / f"mlx_lm-{i}"))

    ours, theirs = mine["sigmoid"], trl["sigmoid"]
    figures = {"dpo": {"steps": len(ours), "trl_steps": len(theirs),
                       "max_loss_deviation": deviation(ours, theirs), "final_loss": [ours[-1]["loss"], theirs[-1]["loss"]],
                       "final_margin": [ours[-1]["margin"], theirs[-1]["margin"]],
                       "final_margin_deviation": abs(ours[-1]["margin"] - theirs[-1]["margin"]) / abs(theirs[-1]["margin"]),
                       "first_logps_chosen": [ours[0]["logps_chosen"], theirs[0]["logps_chosen"]]},
               "losses": {name: {"steps": len(mine[name]), "max_loss_deviation": deviation(mine[name], trl[name]),
                                 "final_loss": [mine[name][-1]["loss"], trl[name][-1]["loss"]],
                                 "final_margin": [mine[name][-1]["margin"], trl[name][-1]["margin"]]}
                          for name in mine if name != "sigmoid"},
               "sft": {}}
    for name in mine:
        print(f"{'DPO ' if name in dpo_configs else ''}{name}, {args.steps} steps: step  loss (this project, TRL)  "
              "rewards/margins (this project, TRL)")
        for k, (o, t) in enumerate(zip(mine[name], trl[name])):
            print(f"  {k:>3}  {o['loss']:.4f} {t['loss']:.4f}  {o['margin']:+.4f} {t['margin']:+.4f}")
    for name, (mine_sft, theirs_sft) in sft.items():
        dev = {step: abs(mine_sft[step] - theirs_sft[step]) / theirs_sft[step] for step in theirs_sft}
        figures["sft"][name] = {"reports": {step: [mine_sft[step], theirs_sft[step]] for step in theirs_sft},
                                "max_deviation": max(dev.values())}
        print(f"SFT with {name} optimizer: step  train_loss (this project, mlx_lm lora)")
        for step in theirs_sft:
            print(f"  {step:>3}  {mine_sft[step]:.4f} {theirs_sft[step]:.3f}")
    d = figures["dpo"]
    print(f"DPO: largest per-step loss deviation {d['max_loss_deviation']:.2%}; final margin {d['final_margin'][0]:.4f} "
          f"vs TRL {d['final_margin'][1]:.4f} ({d['final_margin_deviation']:.2%}); final loss {d['final_loss'][0]:.4f} "
          f"vs {d['final_loss'][1]:.4f}")
    for name, f in figures["losses"].items():
        print(f"{'DPO ' if name in dpo_configs else ''}{name}: largest per-step loss deviation {f['max_loss_deviation']:.3%}; "
              f"final loss {f['final_loss'][0]:.4f} vs TRL {f['final_loss'][1]:.4f}, margin {f['final_margin'][0]:+.4f} "
              f"vs {f['final_margin'][1]:+.4f}")
    for name, f in figures["sft"].items():
        print(f"SFT ({name}): largest per-report train loss deviation from mlx_lm lora {f['max_deviation']:.3%}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = d["max_loss_deviation"] <= 0.02 and d["final_margin_deviation"] <= 0.05 and \
        all(f["max_loss_deviation"] <= 0.02 for f in figures["losses"].values()) and \
        all(f["max_deviation"] <= 0.01 for f in figures["sft"].values())
    print("parity: " + ("within 2% (DPO and CPO losses), 5% (DPO margin), 1% (SFT loss)" if ok else "NOT within the bounds"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
