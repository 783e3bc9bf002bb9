"""A client of the seed server's SFT, DPO, ORPO and reward-model API, written only from its
contract (../shared/reference/anchors.md, "The seed server's other kinds, exactly") and the
seed's README bodies: it knows nothing of this project's code.

    python tests/seed_kinds_client.py BASE_URL KEY MODEL_ID DATA_DIR

DATA_DIR: an mlx_lm data directory (train.jsonl, valid.jsonl) on the server's machine, named
by path as the seed's SFT body does. It trains an SFT job from it, a DPO job, an ORPO job
(created on /orpo/jobs, followed under /dpo/jobs) and a reward model, follows each one's
`data:` events to its end, checks the finished jobs, scores two completions with the reward
model, and prints one JSON line: {sft, dpo, orpo, reward: {job_id, events: [types], progress},
rewards}. Exit code 0 on success.
"""

import json
import sys

import httpx

PAIRS = [{"prompt": "What is MLX?", "chosen": " MLX is Apple's array framework.", "rejected": " idk"},
         {"prompt": "What is LoRA?", "chosen": " Low-rank adaptation.", "rejected": " a fruit"}]
SMALL = {"lora_layers": 2, "lora_rank": 4, "learning_rate": 1e-4}


def follow(api: httpx.Client, path: str) -> list[dict]:
    """The job's events, from its stream, until the server ends it."""
    events = []
    with api.stream("GET", f"{path}/stream", timeout=None) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    return events


def sft(api: httpx.Client, model_id: str, data_dir: str) -> dict:
    # The seed README's body, with a data directory and a short run (curl -d: no JSON content type).
    body = {"model_id": model_id, "dataset": data_dir, "adapter_name": "seed-sft",
            "config": {"fine_tune_type": "lora", "lora_alpha": 16.0, "batch_size": 2, "iters": 4, "steps_per_report": 2,
                       "steps_per_eval": 2, "max_seq_length": 2048, **SMALL}}
    job = api.post("/jobs", content=json.dumps(body), headers={"Content-Type": "application/x-www-form-urlencoded"})
    job = job.raise_for_status().json()
    assert job["status"] == "queued" and job["started_at"] is None and job["finished_at"] is None, job
    assert job["dataset"] == data_dir and job["adapter_path"].endswith("/seed-sft") and job["error"] == ""
    assert job["progress"] == {"step": 0, "total_steps": 0, "train_loss": 0.0, "val_loss": None, "learning_rate": 0.0,
                               "tokens_per_second": 0.0, "iterations_per_second": 0.0, "trained_tokens": 0,
                               "peak_memory_gb": 0.0, "elapsed_seconds": 0.0, "eta_seconds": 0.0}, job["progress"]
    config = job["config"]
    assert config["lora_rank"] == 4 and config["optimizer"] == "adamw" and config["quantize_base"] is False
    assert config["quant_bits"] == 4 and config["mxfp8"] is False and config["lr_schedule"] is None
    assert config["mask_prompt"] is False and config["val_batches"] == 25 and config["steps_per_save"] == 100

    events = follow(api, f"/jobs/{job['job_id']}")
    train = [e for e in events if e["type"] == "train_loss"]
    assert [e["step"] for e in train] == [2, 4], train
    for e in train:
        assert {"total_steps", "train_loss", "val_loss", "learning_rate", "tokens_per_second", "it_sec", "trained_tokens",
                "peak_memory_gb", "elapsed_seconds", "eta_seconds"} <= e.keys() and e["total_steps"] == 4, e
    vals = [e for e in events if e["type"] == "val_loss"]
    assert vals and all({"step", "val_loss", "val_time"} <= e.keys() for e in vals), vals
    completed = [e for e in events if e["type"] == "completed"]
    assert completed and completed[0]["adapter_path"] == job["adapter_path"], completed
    assert completed[0]["adapter_file"] == job["adapter_path"] + "/adapters.safetensors"

    done = api.get(f"/jobs/{job['job_id']}").raise_for_status().json()
    assert done["status"] == "completed" and done["finished_at"] >= done["started_at"] > 0
    assert done["progress"]["step"] == done["progress"]["total_steps"] == 4 and done["progress"]["val_loss"] is not None
    assert job["job_id"] in [j["job_id"] for j in api.get("/jobs").raise_for_status().json()]
    return {"job_id": job["job_id"], "events": [e["type"] for e in events], "progress": done["progress"]}


def preference(api: httpx.Client, model_id: str, route: str, read: str, config: dict, step_event: str) -> dict:
    """A DPO / ORPO / reward job created on `route`, read and followed under `read`."""
    job = api.post(route, json={"model_id": model_id, "preference_pairs": PAIRS, "config": {**config, **SMALL}})
    job = job.raise_for_status().json()
    assert job["status"] == "queued" and job["started_at"] == 0.0 and job["finished_at"] == 0.0, job
    assert job["progress"] == {} and job["error"] == "" and job["preference_pairs"] == PAIRS
    assert job["config"]["batch_size"] == 2 and job["config"]["max_seq_length"] == 1024 and job["config"]["seed"] == 0

    events = follow(api, f"{read}/{job['job_id']}")
    steps = [e for e in events if e["type"] == step_event]
    assert [e["iter"] for e in steps] == list(range(config["iters"])), steps
    for e in steps:
        assert e["total_iters"] == config["iters"] and e["n_pairs"] == 2, e
        assert all(isinstance(e[k], float) for k in ("loss", "reward_margin", "acc_chosen")), e
    assert events[-1] == {"type": "done", "adapter_path": job["adapter_path"]}, events[-1]

    done = api.get(f"{read}/{job['job_id']}").raise_for_status().json()
    progress = done["progress"]
    assert done["status"] == "completed" and progress["iter"] == progress["total_iters"] == config["iters"]
    assert {"loss", "reward_margin", "acc_chosen"} <= progress.keys(), progress
    assert job["job_id"] in [j["job_id"] for j in api.get(read).raise_for_status().json()]
    return {"job_id": job["job_id"], "events": [e["type"] for e in events], "progress": progress, "job": done}


def run(base_url: str, key: str, model_id: str, data_dir: str) -> dict:
    api = httpx.Client(base_url=base_url + "/admin/api/fine-tune", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    out = {"sft": sft(api, model_id, data_dir)}
    dpo = preference(api, model_id, "/dpo/jobs", "/dpo/jobs", {"iters": 3, "beta": 0.1}, "dpo_step")
    assert dpo["job"]["config"]["method"] == "dpo" and dpo["job"]["config"]["lambda_odds"] == 1.0
    orpo = preference(api, model_id, "/orpo/jobs", "/dpo/jobs", {"iters": 2, "lambda_odds": 0.5}, "orpo_step")
    assert orpo["job"]["config"]["method"] == "orpo" and orpo["job"]["config"]["lambda_odds"] == 0.5
    reward = preference(api, model_id, "/reward/jobs", "/reward/jobs", {"iters": 2}, "reward_step")
    name = reward["job"]["adapter_name"]

    scored = api.post("/reward/score", json={"model_id": model_id, "adapter_name": name, "prompt": "What is MLX?",
                                              "completions": ["An array framework.", "idk"]}).raise_for_status().json()
    assert scored["model_id"] == model_id and scored["adapter_name"] == name and len(scored["rewards"]) == 2, scored
    not_rm = api.post("/reward/score", json={"model_id": model_id, "adapter_name": dpo["job"]["adapter_name"],
                                              "prompt": "x", "completions": ["y"]})
    assert not_rm.status_code == 400 and not_rm.json()["detail"] == (
        f"adapter {dpo['job']['adapter_path']} is not a reward model (adapter_config.json missing reward_model=true)")
    missing = api.post("/reward/score", json={"model_id": model_id, "prompt": "x", "completions": ["y"]})
    assert missing.status_code == 400 and missing.json()["detail"] == "adapter_name is required", missing.text
    for kind in (dpo, orpo, reward):
        del kind["job"]
    return {**out, "dpo": dpo, "orpo": orpo, "reward": reward, "rewards": scored["rewards"]}


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:5])))
