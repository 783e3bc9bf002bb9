"""`mtq export` (docs/export.md): a completed job's adapter fused into its base on a worker, the
model directory downloaded; mlx_lm.load of it generates what base + adapter generates.

One stack and one worker for the module; models of its own (final_norm 16, so that greedy
decoding has clear winners and a short SFT job changes it): `tiny`, `tiny-q4` (its 4-bit
quantization, mlx_lm.convert's path) and `tiny-llama` (its shapes as a Llama: GGUF).
"""

import io
import json
import re
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT, TOKEN, Stack, running, wait_done, wait_for
from shared import routing, workers
from shared.export_specs import ExportJobCreate
from shared.kinds import KINDS
from shared.memory_estimate import GB

ALICE, BOB = "export-alice-token", "export-bob-token-0"
EXPORTS = KINDS["export"].prefix
SFT = KINDS["sft"].prefix
ROWS = [{"prompt": f"Tell me about {w}.", "completion": f"{w} is green and round and good"}
        for w in ("apples", "rivers", "stones", "clouds")]
SFT_CONFIG = {"iters": 8, "batch_size": 4, "learning_rate": 5e-3, "lora_layers": -1, "lora_rank": 8, "lora_alpha": 16.0,
              "steps_per_report": 4, "steps_per_eval": 100, "steps_per_save": 100}
PROMPT = "Tell me about apples."
TOKENS = 24


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from worker.runtime.make_model import make_model

    root = tmp_path_factory.mktemp("export-models")
    make_model(root / "tiny", final_norm=16.0)
    make_model(root / "tiny-q4", quantize=4, final_norm=16.0)
    make_llama(root / "tiny", root / "tiny-llama")
    return root


def make_llama(tiny, out):
    """tiny's shapes and tokenizer as a Llama (a family mlx_lm converts to GGUF), random weights."""
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_unflatten
    from mlx_lm.models import llama
    from mlx_lm.utils import save_config, save_model

    from worker.runtime.make_model import init_weights

    config = {**json.loads((tiny / "config.json").read_text()), "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.update(tree_unflatten(list(init_weights(model, 0, mx.float32).items())))
    save_model(out, model)
    save_config(config, out / "config.json")
    for f in [*tiny.glob("tokenizer*"), tiny / "special_tokens_map.json"]:
        shutil.copy(f, out)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, models):
    s = Stack(tmp_path_factory.mktemp("export"), models / "tiny")
    s.use_tokens([{"name": "alice", "token": ALICE, "role": "trainer"},
                  {"name": "bob", "token": BOB, "role": "trainer"}])
    yield from running(s)


@pytest.fixture(scope="module")
def sft_jobs(stack, worker):
    """Alice's completed SFT jobs: LoRA on tiny, LoRA on the quantized tiny-q4 (QLoRA as mlx_lm
    does it), a qlora job on tiny (a private copy quantized to 4 bits, its adapter_config.json says how),
    DoRA on tiny, and LoRA and qlora on tiny-llama."""
    specs = {"lora": ("tiny", {}), "q4": ("tiny-q4", {}), "qlora": ("tiny", {"fine_tune_type": "qlora"}),
             "dora": ("tiny", {"fine_tune_type": "dora"}),
             "llama": ("tiny-llama", {}), "llama-qlora": ("tiny-llama", {"fine_tune_type": "qlora"})}
    with stack.client(ALICE) as c:
        ids = {name: c.post(SFT, json={"model_id": model, "dataset": ROWS, "config": {**SFT_CONFIG, **cfg}}).json()["job_id"]
               for name, (model, cfg) in specs.items()}
    for job_id in ids.values():
        wait_done(stack, SFT, job_id, timeout=240)
    return ids


def mtq(stack, *args: str, token: str = ALICE) -> subprocess.CompletedProcess:
    env = {k: v for k, v in stack.env.items() if k not in ("REDIS_URL", "MTQ_API_PORT")}  # a client knows only the URL
    return subprocess.run([sys.executable, "-m", "cli.main", *args], cwd=ROOT, capture_output=True, text=True,
                          env=dict(env, MTQ_API_URL=stack.base_url, MTQ_API_TOKEN=token, COLUMNS="120"), timeout=240)


def download_adapter(stack, job_id: str, out, token: str = ALICE):
    with stack.client(token) as c:
        resp = c.get(f"{SFT}/{job_id}/adapter")
    assert resp.status_code == 200, resp.text
    with tarfile.open(fileobj=io.BytesIO(resp.content)) as tar:
        tar.extractall(out, filter="data")
    return out


def load(model_dir, adapter_dir=None, quantization: dict | None = None):
    """mlx_lm.load of the model, with the adapter's layers on it (mlx_lm's load_adapters);
    quantization: the model quantized first with quantize_model's arguments, as mlx_lm.convert does."""
    import mlx_lm
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import quantize_model

    model, tokenizer, config = mlx_lm.load(str(model_dir), return_config=True)
    if quantization:
        quantize_model(model, config, **quantization)
    if adapter_dir is not None:
        load_adapters(model, str(adapter_dir))
    return model, tokenizer


def greedy(loaded) -> list[int]:
    """TOKENS tokens of greedy decoding (mlx_lm.generate's default sampler: temperature 0)."""
    import mlx_lm

    return [r.token for r in mlx_lm.stream_generate(*loaded, PROMPT, max_tokens=TOKENS)]


def gap(a, b) -> float:
    """The largest difference of two loaded models' next-token logits, at every position of the prompt."""
    import mlx.core as mx

    tokens = mx.array([a[1].encode(PROMPT)])
    return mx.abs(a[0](tokens) - b[0](tokens)).max().item()


@pytest.mark.parametrize("name, model, flags, bits", [("lora", "tiny", [], None), ("q4", "tiny-q4", ["--dequantize"], None),
                                                      ("qlora", "tiny", ["--dequantize"], 4), ("dora", "tiny", [], None)])
def test_an_exported_model_generates_what_base_and_adapter_generate(stack, models, sft_jobs, tmp_path, name, model,
                                                                    flags, bits):
    job_id = sft_jobs[name]
    adapter = download_adapter(stack, job_id, tmp_path / "adapter")
    reference = load(models / model, adapter, bits and {"group_size": 64, "bits": bits, "mode": "affine"})
    expected = greedy(reference)
    assert expected != greedy(load(models / model)), "the adapter does not change greedy decoding: the test means nothing"

    out = tmp_path / "exported"
    source = f"ftjob-{job_id}" if name == "q4" else job_id  # as `mtq download` takes it
    done = mtq(stack, "export", source, str(out), *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    export_id = re.search(r"submitted export job ([0-9a-f]{32}) of job " + job_id, done.stdout).group(1)
    assert "completed" in done.stdout and str(out / "model.safetensors") in done.stdout, done.stdout

    exported = load(out)
    assert greedy(exported) == expected
    # The same function, to float rounding; a qlora job's on its base quantized as the job had it, not the base itself.
    assert gap(exported, reference) < 1e-3
    if bits:
        assert gap(exported, load(models / model, adapter)) > 1e-2
    assert "quantization" not in json.loads((out / "config.json").read_text())  # never quantized, or dequantized
    assert not (out / "adapters.safetensors").exists()  # the adapter is in the weights, not beside them
    with stack.client(ALICE) as c:
        job = c.get(f"{EXPORTS}/{export_id}").json()
    assert (job["status"], job["source"], job["model_id"], job["dequantize"]) == ("completed", job_id, model, bool(flags))
    event = [e for _, e in stack.events(export_id) if e["type"] == "exported"][0]
    assert event["fused_layers"] == 2 * 7  # every projection of both blocks had LoRA (lora_layers -1)

    # The memory estimate that routed it (shared/memory_estimate.py), from what the worker advertises
    # of the base: the base and the copy it wrote, within 2%.
    base = routing.served_models(workers.live_workers(stack.redis)[0])[model]
    need = routing.job_need_gb("export", routing.spec_summary(ExportJobCreate(
        **{k: job[k] for k in ("source", "model_id", "dequantize")})), base) * GB
    assert abs(need - (base["size_bytes"] + event["size_bytes"])) < 0.02 * need, (need, base["size_bytes"], event)


def test_the_quantized_base_stays_quantized_without_dequantize(stack, models, sft_jobs, tmp_path):
    out = tmp_path / "q4-exported"
    done = mtq(stack, "export", sft_jobs["q4"], str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"]["bits"] == 4
    assert greedy(load(out))  # mlx_lm loads it (its projections quantized again with the LoRA in them: not token-exact)
    import mlx.core as mx

    fused, base = (mx.load(str(d / "model.safetensors")) for d in (out, models / "tiny-q4"))
    assert fused.keys() == base.keys()  # quantized as the base is, layer for layer
    changed = [k for k in base if not mx.array_equal(fused[k], base[k]).item()]
    assert changed and all(".layers." in k for k in changed), changed  # the projections took the LoRA; nothing else moved


def test_gguf_holds_the_fused_weights(stack, models, sft_jobs, tmp_path):
    import mlx.core as mx

    out = tmp_path / "llama-gguf"
    done = mtq(stack, "export", sft_jobs["llama"], str(out), "--gguf")
    assert done.returncode == 0, done.stdout + done.stderr
    gguf, metadata = mx.load(str(out / "ggml-model-f16.gguf"), return_metadata=True)
    fused, base = (mx.load(str(d / "model.safetensors")) for d in (out, models / "tiny-llama"))
    assert metadata["general.architecture"] == "llama" and len(gguf) == len(fused)
    name, gguf_name = "model.layers.0.mlp.gate_proj.weight", "blk.0.ffn_gate.weight"  # not permuted (q and k are)
    assert mx.array_equal(gguf[gguf_name], fused[name]).item() and not mx.array_equal(fused[name], base[name]).item()


def test_gguf_mlx_lm_cannot_write_fails_the_export_saying_so(stack, sft_jobs, tmp_path):
    done = mtq(stack, "export", sft_jobs["lora"], str(tmp_path / "gguf"), "--gguf")
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("mlx_lm converts only llama, mixtral, mistral models to GGUF; 'tiny' is 'qwen3' (export it without "
            "gguf)") in " ".join(done.stdout.split()), done.stdout
    assert not (tmp_path / "gguf").exists()
    # A failed export resumes as any job (it has no steps to count) and runs again: failing again, here.
    export_id = re.search(r"submitted export job ([0-9a-f]{32})", done.stdout).group(1)
    with stack.client(ALICE) as c:
        resumed = c.post(f"{EXPORTS}/{export_id}/resume")
        assert resumed.status_code == 200 and resumed.json()["status"] == "queued", resumed.text
    assert "'tiny' is 'qwen3'" in wait_done(stack, EXPORTS, export_id, status="failed")["error"]
    done = mtq(stack, "export", sft_jobs["llama-qlora"], str(tmp_path / "gguf"), "--gguf")
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("mlx_lm converts only unquantized models to GGUF, and 'tiny-llama' was quantized by its QLoRA job "
            "(export with dequantize)") in " ".join(done.stdout.split()), done.stdout


def test_bad_sources_are_clear_4xx(stack, sft_jobs):
    with stack.client(ALICE) as alice, stack.client(BOB) as bob, stack.client(TOKEN) as admin:
        def export(client, source, **body):
            return client.post(EXPORTS, json={"source": source, **body})

        assert export(alice, "no-such-job").json() == {"detail": "source: Job not found: no-such-job"}
        assert export(alice, "ft:tiny:x:nope").status_code == 404
        assert export(alice, "mtq:job:x:events").status_code == 404  # never another key
        # Bob's token sees none of alice's jobs: the same answer as a job that is not there.
        resp = export(bob, sft_jobs["lora"])
        assert resp.status_code == 404 and resp.json()["detail"] == f"source: Job not found: {sft_jobs['lora']}"
        resp = export(alice, sft_jobs["lora"], model_id="tiny-q4")
        assert resp.status_code == 400 and "trained on 'tiny'" in resp.json()["detail"]

        # A full fine-tune stored a model, not an adapter.
        full = alice.post(SFT, json={"model_id": "tiny", "dataset": ROWS,
                                     "config": {**SFT_CONFIG, "iters": 1, "fine_tune_type": "full"}}).json()["job_id"]
        wait_done(stack, SFT, full)
        resp = export(alice, full)
        assert resp.status_code == 400 and "stored a whole model" in resp.json()["detail"], resp.text

        # A running job has no adapter yet.
        running_id = alice.post(SFT, json={"model_id": "tiny", "dataset": ROWS,
                                           "config": {**SFT_CONFIG, "iters": 100_000}}).json()["job_id"]
        wait_for(lambda: admin.get(f"{SFT}/{running_id}").json()["status"] == "running", 120, "running")
        resp = export(alice, running_id)
        assert resp.status_code == 409, resp.text
        assert resp.json()["detail"] == f"source: job {running_id} is running; only a completed job's adapter can be exported"
        admin.post(f"{SFT}/{running_id}/cancel")

