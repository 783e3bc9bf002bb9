"""A client of the seed server's GRPO API, written only from its contract
(../shared/reference/anchors.md, "Its exact contract, route by route") and the adapter download
route: it knows nothing of this project's code.

    python tests/seed_client.py BASE_URL KEY MODEL_ID OUT_DIR

creates a GRPO job, follows its `data:` events to `done`, checks the finished job, downloads
the adapter into OUT_DIR (a fresh directory: no access to the worker's disk) and prints one
JSON line: {job_id, adapter_name, steps: [iter...], progress, files}. Exit code 0 on success.
"""

import io
import json
import sys
import tarfile
from pathlib import Path

import httpx


def run(base_url: str, key: str, model_id: str, out_dir: Path) -> dict:
    api = httpx.Client(base_url=base_url + "/admin/api/fine-tune", headers={"Authorization": f"Bearer {key}"}, timeout=60)
    body = {"model_id": model_id, "prompts": ["What is 2+2?", "Say hello."], "adapter_name": "seed_client",
            "config": {"group_size": 2, "iters": 3, "batch_size": 1, "max_completion_len": 8, "lora_layers": 2,
                       "lora_rank": 4, "lora_alpha": 8.0, "temperature": 0.8}}
    job = api.post("/grpo/jobs", json=body).raise_for_status().json()
    assert job["status"] == "queued" and job["progress"] == {} and job["error"] == "", job
    assert job["started_at"] == 0.0 and job["finished_at"] == 0.0 and job["adapter_path"].endswith("/seed_client")

    steps, last = [], None
    with api.stream("GET", f"/grpo/jobs/{job['job_id']}/stream", timeout=None) as res:
        res.raise_for_status()
        for line in res.iter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, `id:` lines, `: keepalive` comments
            event = json.loads(line[len("data:"):])
            if event["type"] == "grpo_step":
                assert {"iter", "total_iters", "loss", "mean_reward", "mean_ratio", "n_samples"} <= event.keys(), event
                steps.append(event["iter"])
            last = event
    assert last is not None and last["type"] == "done", last
    assert last["adapter_path"] == job["adapter_path"], (last, job["adapter_path"])

    done = api.get(f"/grpo/jobs/{job['job_id']}").raise_for_status().json()
    assert done["status"] == "completed" and done["error"] == "" and done["finished_at"] >= done["started_at"] > 0
    assert done["progress"]["iter"] == done["progress"]["total_iters"] == 3, done["progress"]
    assert job["job_id"] in [j["job_id"] for j in api.get("/grpo/jobs").raise_for_status().json()]
    assert any(a["adapter_name"] == "seed_client" and a["has_weights"] and a["has_config"]
               for a in api.get("/adapters", params={"model_id": model_id}).raise_for_status().json())

    archive = api.get(f"/adapters/{model_id}/seed_client/download").raise_for_status().content
    out_dir.mkdir(parents=True, exist_ok=False)
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        tar.extractall(out_dir, filter="data")
    return {"job_id": job["job_id"], "adapter_name": "seed_client", "steps": steps, "progress": done["progress"],
            "files": sorted(p.name for p in out_dir.iterdir())}


if __name__ == "__main__":
    base_url, key, model_id, out = sys.argv[1:5]
    print(json.dumps(run(base_url, key, model_id, Path(out))))
