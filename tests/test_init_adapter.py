"""Training from an existing adapter (`init_adapter`), through the real stack: SFT, then DPO
from the SFT adapter (by its model and name), then GRPO from the DPO adapter (by job id), each
starting where the previous one ended; an uploaded mlx_lm adapter as a start; and the 400s of
a shape that does not fit and the 404s of an adapter this token may not see."""

import io
import tarfile

import pytest

from conftest import Stack, read_events, running, wait_for

API = "/admin/api/fine-tune"
SFT, DPO, KTO, GRPO, FILES, LOGPROB = (f"{API}/jobs", f"{API}/dpo/jobs", f"{API}/kto/jobs", f"{API}/grpo/jobs",
                                       f"{API}/files", f"{API}/logprob")
ALICE = "alice-trainer-token-0123"
SHAPE = {"lora_layers": -1, "lora_rank": 16, "lora_alpha": 4.0}
ROWS = [{"prompt": "Q0?", "completion": "red apple"}, {"prompt": "Q1?", "completion": "blue river"}]
PAIRS = [{"prompt": f"Say something about {a}.", "chosen": f" {b} is good", "rejected": f" {b} is {c}"}
         for a, b, c in (("sun", "moon", "road"), ("car", "tree", "fish"), ("bird", "star", "house"), ("sea", "cloud", "stone"))]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    s = Stack(tmp_path_factory.mktemp("stack"), tiny_model)
    s.use_tokens([{"name": "alice", "token": ALICE, "role": "trainer"}])
    for started in running(s):
        s.worker = s.start_worker()
        yield started


def ok(res) -> dict:
    assert res.status_code == 200, res.text
    return res.json()


def completed(stack, client, path: str, job_id: str) -> dict:
    job = wait_for(lambda: (j := ok(client.get(f"{path}/{job_id}")))["status"] in ("completed", "failed", "cancelled") and j,
                   180, f"job {job_id}", 0.2)
    assert job["status"] == "completed", job["error"] + stack.logs("worker")
    return job


def events(stack, job_id: str, kind: str) -> list[dict]:
    return [e for _, e in read_events(stack.redis, job_id, count=10_000) if e["type"] == kind]


def logprobs(client, items: list[tuple[str, str]], adapter_name: str | None) -> list[float]:
    body = {"model_id": "tiny", "items": [{"prompt": p, "completion": c} for p, c in items]}
    return [r["logprob"] for r in ok(client.post(LOGPROB, json={**body, **({"adapter_name": adapter_name} if adapter_name else {})}))["results"]]


def test_sft_then_dpo_then_grpo_each_start_where_the_previous_ended(stack, client, tiny_model):
    sft = ok(client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "adapter_name": "chain-sft", "config": {
        **SHAPE, "learning_rate": 1e-2, "batch_size": 2, "iters": 20, "mask_prompt": True}}))
    completed(stack, client, SFT, sft["job_id"])

    # DPO from the SFT adapter, by its name. Its first step's policy is the SFT adapter (its
    # reference, as always, the base): logps/chosen is the SFT adapter's log-prob of the chosen
    # completions (EOS included), rewards/chosen beta times that minus the base's.
    body = {"model_id": "tiny", "preference_pairs": PAIRS, "adapter_name": "chain-dpo",
            "config": {**SHAPE, "learning_rate": 1e-2, "batch_size": len(PAIRS), "iters": 3, "beta": 0.1}}
    dpo = ok(client.post(DPO, json={**body, "init_adapter": {"model_id": "tiny", "adapter_name": "chain-sft"}}))
    assert dpo["init_adapter"] == {"job_id": sft["job_id"], "model_id": "tiny", "adapter_name": "chain-sft", "file_id": None}
    fresh = ok(client.post(DPO, json={**body, "adapter_name": "fresh-dpo", "config": {**body["config"], "iters": 1}}))
    completed(stack, client, DPO, dpo["job_id"])
    completed(stack, client, DPO, fresh["job_id"])
    chosen = [(p["prompt"], p["chosen"] + "<|im_end|>") for p in PAIRS]
    tuned, base = logprobs(client, chosen, "chain-sft"), logprobs(client, chosen, None)
    first, control = events(stack, dpo["job_id"], "dpo_step")[0], events(stack, fresh["job_id"], "dpo_step")[0]
    print(f"\nDPO step 0 logps/chosen: from the SFT adapter {first['logps/chosen']:.4f} (its log-prob: "
          f"{sum(tuned) / 4:.4f}); fresh {control['logps/chosen']:.4f} (the base's: {sum(base) / 4:.4f})")
    assert first["logps/chosen"] == pytest.approx(sum(tuned) / len(tuned), abs=1e-3)
    assert control["logps/chosen"] == pytest.approx(sum(base) / len(base), abs=1e-3)
    assert abs(sum(tuned) - sum(base)) / len(base) > 0.5  # the SFT adapter moved them: the checks above are not alike
    assert first["rewards/chosen"] == pytest.approx(0.1 * (sum(tuned) - sum(base)) / len(base), abs=1e-3)
    assert events(stack, dpo["job_id"], "model_ready")[0]["init_adapter"]["job_id"] == sft["job_id"]

    # GRPO from the DPO adapter, by job id: its first step samples from the DPO adapter (the
    # samples' sampling log-probs are what the log-prob route answers with that adapter).
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(tiny_model))
    prompts = ["Say something about red.", "Say something about tree."]
    grpo = ok(client.post(GRPO, json={"model_id": "tiny", "prompts": prompts, "init_adapter": {"job_id": dpo["job_id"]},
                                      "config": {**SHAPE, "iters": 1, "group_size": 16, "batch_size": 2, "learning_rate": 0.0,
                                                 "max_completion_len": 6}}))
    completed(stack, client, GRPO, grpo["job_id"])
    [samples] = events(stack, grpo["job_id"], "samples")
    items = [(prompts[i], text) for i, group, counts in zip(samples["prompt_indices"], samples["completions"],
                                                             samples["token_counts"]) for text, n in zip(group, counts)
             if text and len(tokenizer.encode(text, add_special_tokens=False)) == n]  # texts that are their tokens
    sampled = [lp for i, group in enumerate(samples["completions"]) for text, n, lp in
               zip(group, samples["token_counts"][i], samples["logprobs"][i])
               if text and len(tokenizer.encode(text, add_special_tokens=False)) == n]
    assert len(items) >= 4, samples
    dpo_scored, base_scored = logprobs(client, items, "chain-dpo"), logprobs(client, items, None)
    assert sampled == pytest.approx(dpo_scored, abs=2e-3)
    assert max(abs(a - b) for a, b in zip(sampled, base_scored)) > 0.05
    assert ok(client.get(f"{GRPO}/{grpo['job_id']}"))["init_adapter"]["model_id"] == "tiny"


def test_an_uploaded_adapter_is_a_start_and_shapes_must_agree(stack, client):
    """After the chain test: its SFT adapter, downloaded and uploaded again."""
    archive = client.get(f"{API}/adapters/tiny/chain-sft/download").content
    upload = ok(client.post(FILES, content=archive, params={"filename": "chain-sft.tar.gz", "purpose": "adapter"}))
    assert upload["purpose"] == "adapter" and upload["adapter"]["rank"] == 16 and upload["adapter"]["layers"] == 2
    assert upload["adapter"]["config"]["lora_parameters"]["scale"] == 4.0
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        weights = tar.extractfile("adapters.safetensors").read()
    bare = ok(client.post(FILES, content=weights, params={"filename": "adapters.safetensors", "purpose": "adapter"}))
    assert bare["adapter"]["config"] is None and bare["adapter"]["dora"] is False

    rows = [{"prompt": p["prompt"], "completion": p["chosen"], "label": True} for p in PAIRS[:2]] + \
           [{"prompt": p["prompt"], "completion": p["rejected"], "label": False} for p in PAIRS[:2]]
    kto = ok(client.post(KTO, json={"model_id": "tiny", "dataset": rows, "init_adapter": {"file_id": upload["id"]},
                                    "config": {**SHAPE, "iters": 1, "learning_rate": 0.0}}))
    assert kto["init_adapter"]["file_id"] == upload["id"]
    completed(stack, client, KTO, kto["job_id"])
    assert events(stack, kto["job_id"], "model_ready")[0]["init_adapter"] == {"file_id": upload["id"]}
    assert events(stack, kto["job_id"], "kto_step")[0]["rewards/chosen"] != 0  # the policy is not the reference

    # Shapes that do not fit: 400, naming each field.
    res = client.post(DPO, json={"model_id": "tiny", "preference_pairs": PAIRS, "init_adapter": {"adapter_name": "chain-sft",
                                 "model_id": "tiny"}, "config": {"lora_rank": 8, "lora_alpha": 4.0, "lora_layers": 1}})
    sft_job = ok(client.get(f"{API}/adapters", params={"model_id": "tiny"}))
    sft_id = next(a["job_id"] for a in sft_job if a["adapter_name"] == "chain-sft")
    assert res.status_code == 400 and res.json()["detail"] == (
        f"init_adapter: job {sft_id}'s adapter does not fit this job: lora_rank: 8 here, 16 in the adapter; "
        "lora_layers: 1 here, -1 in the adapter")
    res = client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "init_adapter": {"file_id": bare["id"]},
                                 "config": {**SHAPE, "fine_tune_type": "dora"}})
    assert res.status_code == 400 and res.json()["detail"] == (
        f"init_adapter: file {bare['id']} does not fit this job: fine_tune_type: dora here, lora in the adapter")
    res = client.post(FILES, content=b'{"text": "a"}\n', params={"purpose": "adapter", "filename": "x.jsonl"})
    assert res.status_code == 400 and res.json()["detail"] == "x.jsonl: adapters.safetensors is not a safetensors file"
    dataset = ok(client.post(FILES, content=b'{"text": "a"}\n'))
    res = client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "init_adapter": {"file_id": dataset["id"]}})
    assert res.status_code == 400 and "is not an adapter" in res.json()["detail"]
    res = client.post(SFT, json={"model_id": "tiny", "dataset": {"file_id": upload["id"]}})
    assert res.status_code == 400 and "is an adapter (purpose adapter), not a dataset" in res.json()["detail"]
    res = client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "init_adapter": {"model_id": "tiny"}})
    assert res.status_code == 400 and res.json()["detail"] == "init_adapter: give both model_id and adapter_name"

    # What this token may not see, or what is not there: 404.
    with stack.client(ALICE) as alice:
        for init in ({"model_id": "tiny", "adapter_name": "chain-sft"}, {"job_id": sft_id}, {"file_id": upload["id"]}):
            res = alice.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "init_adapter": init, "config": SHAPE})
            assert res.status_code == 404, res.text
    res = client.post(SFT, json={"model_id": "tiny", "dataset": ROWS, "init_adapter": {"model_id": "tiny", "adapter_name": "nope"}})
    assert res.status_code == 404 and res.json()["detail"] == "init_adapter: Adapter not found: tiny/nope"
