"""Decode speed of the GRPO sampler (worker/decode/) beside mlx_lm's own decoders, in one run.

    python3 bench/decode.py MODEL_DIR --rows 8 32 64 --tokens 128 [--group-size 8] [--prompt-len 24]
                            [--reps 3] [--queries 1 2] [--lora-layers N]
                            [--count-only] [--ours-only] [--dense] [--kernel on off] [--eos-every N]
                            [--undo made embed quantized] [--json OUT]

For each row count R, one after the other in this process (B = R / group size prompts of
slightly different lengths, so rows are left-padded; temperature 1; EOS off everywhere, so
every row decodes --tokens tokens, unless --eos-every N: then every N-th token id ends one of
ours' rows, which end at different steps as a GRPO step's do, and its finished rows are
dropped once half have finished):

  ours      sample() of this tree's decoder (worker/decode/sampling.py); with --queries 1 2, once
            with each number of queries per row make_decode_step can be given (see fused_queries);
            with --kernel on off, with and without the decode's CUDA kernels (attention, LoRA,
            quantized matmul, residual add and norm: worker/decode/*_kernel.py); with --undo,
            once more with each of these kernel paths left out (the default variant's
            figures beside it, each round's ratio printed): `made` the kernel after o making
            o's LoRA x @ A (Handoff.made_from), `embed` the quantized embedding lookup
            (embed_kernel.available), `quantized` the quantized matmuls of at most 8 rows
            (quantized_kernel.available: MLX's own instead).
            Every variant after the first draws what the first does and prints how far they
            agree: the rows whose tokens are all the same, the tokens before each row's first
            different one, and the largest log-prob difference there (agreement)
  batch     mlx_lm's batch_generate of the same R rows (completion and prefill batch = R)
  single    mlx_lm's generate_step of one row (its own single-sequence decode)

  ms/pos    wall time to generate --tokens tokens for all rows, divided by --tokens (prompt
            prefill included, as in a GRPO step): the median of --reps rounds (in brackets the
            fastest and slowest), after one warm-up run of each decoder; a round runs every
            decoder once, in turn, the order reversed every other round
  host      ours only: the part of ms/pos the host spends in the decode steps' calls and in
            mx.async_eval (building the graph, encoding its kernels); near ms/pos: host-bound
  prims     MLX primitives in one decode step's graph (mx.export_to_dot of the step's outputs
            with its inputs evaluated; views such as Reshape and Transpose included): what
            the device evaluates per decode position. Ours: the compiled step's graph
            (after mx.compile's simplification and fusion); mlx_lm: its uncompiled step
  gpu       on CPU only: the same step's graph as a CUDA GPU builds it: the fused ops (RMSNorm,
            LayerNorm, RoPE, a dequantize, and attention where MLX's CUDA backend has a fused
            kernel for it: no array mask and at most 3 queries, or cuDNN with at least 2
            queries) counted as the single primitive they are there, and ours with the
            decode's own CUDA kernels where they would run, each one stand-in primitive
            (kernels: how many). MLX's CPU backend expands the fused ops into a dozen primitives
            each, so the CPU's own count says little about a GPU's; this one is the H200's
            (317 for the qwen3-0.6b shape at 4 bits, 8 rows, LoRA on 16 blocks, on both, before
            the sampler's ops were trimmed; its 28 blocks at hidden size 64 count the same)

--lora-layers N: every decoder runs the model with LoRA on all projections of its last N
blocks, rank 8, scale 16 (a GRPO job's defaults: lora_layers 16), as GRPO samples with it.

Ratios: ours / batch and ours / single, a ratio a round: their median, min and max.
--ours-only skips mlx_lm's decoders (e.g. to compare MLX settings such as MLX_USE_CUDA_GRAPHS
between runs). --count-only skips the timings (e.g. the 28-layer model on a CPU). On Linux CPU
the process re-executes itself with the system OpenBLAS (worker/supervisor/openblas.py, standard
library only). From this repository it imports the decoder (worker/decode/) and what it takes
from worker/runtime/ (projection_groups, logprobs, backend).
"""

import argparse
import collections
import contextlib
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from worker.decode import attention_kernel, embed_kernel, lora_kernel, norm_kernel, quantized_kernel, swiglu_kernel  # noqa: E402
from worker.decode.graph_patches import Handoff  # noqa: E402
from worker.decode.draw import SamplingParams  # noqa: E402
from worker.decode.sampling import make_decode_step, sample  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402


def primitives(*outputs) -> collections.Counter:
    """Primitive nodes in the graph of the (unevaluated) outputs, by primitive name."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', Path(f.name).read_text()))


# ------------------------------------------------------------------ counting as a CUDA GPU runs it

def _single(x, *inputs):
    """One primitive standing for a fused op: x's shape and dtype, depending on all inputs.
    (A CumSum, plus a Depends node that the count leaves out.)"""
    y = mx.cumsum(x, axis=-1)
    deps = [a for a in inputs if isinstance(a, mx.array)]
    return mx.depends([y], deps)[0] if deps else y


@contextlib.contextmanager
def fused_as_on_cuda():
    """mx.fast's ops as MLX's CUDA backend builds them (mlx/backend/cuda/scaled_dot_product_attention.cpp,
    0.32): RMSNorm, LayerNorm and RoPE are one primitive each, and so is mx.dequantize (the CPU
    unpacks the bits with a dozen ops: a quantized embedding's lookup); attention is fused by the vector
    kernel (head dim 64/96/128, fewer than 4 queries, no array mask) or by cuDNN (at least 2
    queries, head dim a multiple of 8 up to 128, half precision; an array mask is allowed, a
    boolean one first turned additive), and otherwise falls back to plain ops."""
    fast = mx.fast
    saved = fast.rms_norm, fast.layer_norm, fast.rope, fast.scaled_dot_product_attention, mx.dequantize
    sdpa = saved[3]

    def attention(q, k, v, *, scale, mask=None, sinks=None):
        array_mask = isinstance(mask, mx.array)
        d, n_q = q.shape[-1], q.shape[2]
        vector = not array_mask and n_q < 4 and d == v.shape[-1] and d in (64, 96, 128)
        cudnn = n_q > 1 and d % 8 == 0 and d <= 128 and v.shape[-1] <= 128 and q.dtype in (mx.float16, mx.bfloat16)
        if not (vector or cudnn):
            return sdpa(q, k, v, scale=scale, mask=mask, sinks=sinks)
        if array_mask and mask.dtype == mx.bool_:
            mask = mx.where(mask, mx.array(0, q.dtype), mx.array(-mx.inf, q.dtype))
        return _single(q, k, v, mask if array_mask else None, sinks)

    def dequantize(w, scales, biases=None, group_size=64, bits=4, mode="affine", **_):
        made = mx.array(np.zeros((*w.shape[:-1], w.shape[-1] * 32 // bits), np.float32), scales.dtype)
        return _single(made, w, scales, biases)

    fast.rms_norm = lambda x, weight, eps: _single(x, weight)
    fast.layer_norm = lambda x, weight, bias, eps: _single(x, weight, bias)
    fast.rope = lambda x, dims, *, traditional, base, scale, offset, freqs=None: _single(x, offset, freqs)
    fast.scaled_dot_product_attention = attention
    mx.dequantize = dequantize
    try:
        yield
    finally:
        fast.rms_norm, fast.layer_norm, fast.rope, fast.scaled_dot_product_attention, mx.dequantize = saved


@contextlib.contextmanager
def kernels_as_on_cuda(calls: list | None = None):
    """The decode's own CUDA kernels (worker/decode/*_kernel.py) taken where a CUDA GPU takes
    them, each call one stand-in primitive: its first output a CumMax of a constant, depending
    on all its inputs, any further output a CumMin depending on the first (count() leaves those
    out: a custom kernel is one primitive whatever its outputs). mx.fast.cuda_kernel itself
    raises without CUDA. calls: each call's kernel, as custom_kernel.kernel was asked for it
    (a dict of its arguments), and the call's own arguments are appended to it
    (bench/cuda_compile.py compiles them)."""
    modules = (attention_kernel, embed_kernel, lora_kernel, norm_kernel, quantized_kernel, swiglu_kernel)
    saved = [(m, m.cuda, m.kernel) for m in modules]

    def stand_in(name, input_names, output_names, source, contiguous=True, header=""):
        def call(*, inputs, output_shapes, output_dtypes, **kwargs):
            if calls is not None:
                calls.append((dict(name=name, input_names=input_names, output_names=output_names, source=source,
                                   header=header), dict(inputs=inputs, output_dtypes=output_dtypes, **kwargs)))
            made = [mx.array(np.zeros(shape, np.float32), dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
            first = mx.depends([mx.cummax(made[0], axis=-1)], [a for a in inputs if isinstance(a, mx.array)])[0]
            return [first] + [mx.depends([mx.cummin(m, axis=-1)], [first])[0] for m in made[1:]]
        return call

    for m in modules:
        m.cuda, m.kernel = (lambda: True), stand_in
    try:
        yield
    finally:
        for m, cuda, kernel in saved:
            m.cuda, m.kernel = cuda, kernel


def count(counter: collections.Counter) -> int:
    return sum(counter.values()) - counter["Depends"] - counter["CumMin"]


# ------------------------------------------------------------------ the three decoders

class _Counted(Exception):
    pass


# A kernel path: the test that takes it, and the answer that declines it.
UNDO = {"made": (Handoff, "made_from", None), "embed": (embed_kernel, "available", False),
        "quantized": (quantized_kernel, "available", False)}


@contextlib.contextmanager
def undone(name: str | None):
    """The decode without one of its kernel paths (UNDO): its test declines, so the step takes the
    path it took before that kernel was written."""
    if name is None:
        yield
        return
    owner, attr, declined = UNDO[name]
    saved = owner.__dict__[attr]
    setattr(owner, attr, lambda *a: declined)
    try:
        yield
    finally:
        setattr(owner, attr, saved)


def make_step(model, p, variant, eos=()):
    """variant: make_decode_step's keyword arguments (queries, dense, kernel) chosen on the command
    line, and undo (a kernel path left out, applied where the step is traced and run)."""
    return make_decode_step(model, p, list(eos), 0, **{k: v for k, v in variant.items() if k != "undo"})


def ours_counts(model, prompts, group_size, variant) -> collections.Counter:
    """The graph of our second decode step (the first one's inputs still hold the prefill)."""
    p = SamplingParams(max_tokens=4, temperature=1.0)  # the step's graph does not depend on the length
    step = make_step(model, p, variant)
    calls = []

    def counted(*args):
        calls.append(args)
        if len(calls) < 2:
            return step(*args)
        mx.eval(args)
        raise _Counted(primitives(*[a for _, a in tree_flatten(list(step(*args)))]))

    try:
        with undone(variant.get("undo")):
            sample(model, counted, prompts, group_size, p, [], mx.random.key(0))
    except _Counted as counted_step:
        return counted_step.args[0]
    raise RuntimeError("sample() made fewer than two decode steps")


def ours_run(model, prompts, group_size, variant, tokens, eos=()):
    """run(i): one sample() with random key i, timed: its wall time, the host's share of it (the
    seconds spent in the decode steps' calls, mx.compile's replay building the step's graph,
    and in handing them to the device, mx.async_eval, which encodes every kernel; close to the
    wall time: host-bound) and its samples (every variant draws with the same keys)."""
    p = SamplingParams(max_tokens=tokens, temperature=1.0)
    step = make_step(model, p, variant, eos)
    host = [0.0]

    def timed(*args):
        t0 = time.perf_counter()
        out = step(*args)
        mx.async_eval(out)  # sample() then async_evals a part of it: already scheduled, no-op
        host[0] += time.perf_counter() - t0
        return out

    def run(i):
        host[0] = 0.0
        with undone(variant.get("undo")):
            t0 = time.perf_counter()
            samples = sample(model, timed, prompts, group_size, p, list(eos), mx.random.key(i))
            wall = time.perf_counter() - t0
        assert eos or samples.steps == tokens
        return wall, host[0], samples
    return run


def agreement(samples, first) -> dict:
    """How far two variants' samples of the same draws agree: the rows whose tokens are all the
    same, the share of tokens before each row's first different one, and the largest log-prob
    difference there (after a different token the rows' contexts differ)."""
    a, b = np.array(samples.tokens), np.array(first.tokens)
    differs = a != b
    before = np.where(differs.any(axis=1), differs.argmax(axis=1), a.shape[1])
    keep = np.arange(a.shape[1])[None, :] < before[:, None]
    dlogp = np.abs(np.array(samples.logprobs) - np.array(first.logprobs))
    return {"rows_as_first": float((before == a.shape[1]).mean()), "tokens_before_difference": float(keep.mean()),
            "max_logprob_diff_before": float(np.where(keep, dlogp, 0).max())}


def left_padded(rows):
    width = max(len(r) for r in rows)
    return mx.array([[0] * (width - len(r)) + r for r in rows]), [width - len(r) for r in rows]


def batch_counts(model, rows) -> collections.Counter:
    """One step of mlx_lm's GenerationBatch._step on a left-padded BatchKVCache."""
    x, pad = left_padded(rows)
    cache = [BatchKVCache(pad) for _ in model.layers]
    model(x, cache=cache)
    mx.eval([c.state for c in cache], mx.random.state)  # the sampler splits the global key
    logits = model(x[:, -1:], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return primitives(make_sampler(temp=1.0)(logprobs), logprobs)


def batch_run(model, tokenizer, rows, tokens):
    """run(i): the wall time of one mlx_lm batch_generate of the rows."""
    sampler = make_sampler(temp=1.0)

    def run(i):
        t0 = time.perf_counter()
        out = mlx_lm.batch_generate(model, tokenizer, rows, max_tokens=tokens, sampler=sampler,
                                    completion_batch_size=len(rows), prefill_batch_size=len(rows))
        wall = time.perf_counter() - t0
        assert out.stats.generation_tokens == tokens * len(rows)
        return wall, None, None
    return run


def single_counts(model, row) -> collections.Counter:
    """One step of mlx_lm's generate_step: the model on one token, log-softmax, sampler."""
    cache = make_prompt_cache(model)
    model(mx.array(row)[None], cache=cache)
    mx.eval([c.state for c in cache], mx.random.state)
    logits = model(mx.array(row[-1:])[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return primitives(make_sampler(temp=1.0)(logprobs), logprobs)


def single_run(model, row, tokens):
    """run(i): the wall time of one mlx_lm generate_step decode of one row."""
    sampler = make_sampler(temp=1.0)

    def run(i):
        t0 = time.perf_counter()
        n = sum(1 for _ in generate_step(mx.array(row), model, max_tokens=tokens, sampler=sampler))
        wall = time.perf_counter() - t0
        assert n == tokens
        return wall, None, None
    return run


def rounds(runs: dict, reps: int) -> dict:
    """Every run once to compile (a run that fails there is left out, with its error printed:
    e.g. a kernel path on one backend), then reps interleaved rounds, each run once a round, the
    order reversed every other round. name -> (wall times, host times, the last round's samples)."""
    live = {}
    for name, run in runs.items():
        try:
            run(reps)
            live[name] = run
        except Exception as e:
            print(f"  {name:40s} failed: {type(e).__name__}: {e}", flush=True)
    walls, hosts, samples = {name: [] for name in live}, {name: [] for name in live}, {}
    for r in range(reps):
        for name in list(live) if r % 2 == 0 else list(live)[::-1]:
            wall, host, samples[name] = live[name](r)
            walls[name].append(wall)
            hosts[name] += [] if host is None else [host]
    return {name: (walls[name], hosts[name], samples[name]) for name in live}


# ------------------------------------------------------------------ main

def make_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, vocab, size=max(1, length - 3 * i % 8)).tolist() for i in range(n)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--tokens", type=int, default=128, help="tokens decoded per row")
    ap.add_argument("--group-size", type=int, default=8, help="rows per distinct prompt (GRPO's G)")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--queries", type=int, nargs="+", choices=[1, 2], default=[None],
                    help="also force make_decode_step's queries per row (default: its own choice)")
    ap.add_argument("--lora-layers", type=int, default=0, help="LoRA (rank 8, scale 16) on the last N blocks")
    ap.add_argument("--count-only", action="store_true", help="primitive counts only, no timings")
    ap.add_argument("--dense", action="store_true",
                    help="ours also with dense=True (dequantized weights: what a job's memory budget buys on CUDA)")
    ap.add_argument("--kernel", nargs="+", choices=["on", "off"], default=[None],
                    help="ours with make_decode_step(kernel=True / False): the decode's CUDA kernels or not "
                         "(default: as a job decides, each kernel where it fits)")
    ap.add_argument("--undo", nargs="+", choices=list(UNDO), default=[],
                    help="ours also without each of these kernel paths (the decode's kernel changes of issue 41)")
    ap.add_argument("--eos-every", type=int, default=0, metavar="N",
                    help="ours only: every N-th token id ends a row (EOS off by default), so rows end at "
                         "different steps, as a GRPO step's do")
    ap.add_argument("--ours-only", action="store_true", help="not mlx_lm's decoders (e.g. to compare MLX settings)")
    ap.add_argument("--json", type=Path, help="write the records here as a JSON list")
    args = ap.parse_args()

    model, tokenizer = mlx_lm.load(args.model_dir)
    # As a worker loads a model (worker/runtime/models.py): the projections that read one input fused.
    fused = fuse_shared_inputs(model)
    model.freeze()  # a job's base model is frozen
    if args.lora_layers:
        linear_to_lora_layers(model, args.lora_layers, {"rank": 8, "scale": 16.0, "dropout": 0.0})
        model.eval()
    tokenizer.eos_token_ids = []  # batch_generate stops on these
    eos = range(0, model.args.vocab_size, args.eos_every) if args.eos_every else ()
    on_cpu = mx.default_device() == mx.cpu
    print(f"device {mx.default_device()}, mlx {mx.__version__}, mlx_lm {mlx_lm.__version__}, "
          f"{len(model.layers)} layers ({args.lora_layers} with LoRA, {fused} groups of projections fused), "
          f"{args.tokens} tokens per row", flush=True)
    records = []

    def save():  # after each record: a run cut short keeps what it measured
        if args.json:
            args.json.write_text(json.dumps(records, indent=1))

    def record(name, rows, counter, gpu_counter, times, hosts=None):
        rec = {"decoder": name, "rows": rows, "tokens": args.tokens, "device": str(mx.default_device()),
               "lora_layers": args.lora_layers,
               "primitives": count(counter), "primitives_by_type": dict(counter.most_common())}
        if gpu_counter is not None:
            rec["primitives_gpu"] = count(gpu_counter)
            rec["primitives_gpu_by_type"] = dict(gpu_counter.most_common())
        if times:
            rec["ms_per_position"] = round(1000 * statistics.median(times) / args.tokens, 3)
            rec["seconds"] = [round(t, 4) for t in times]
        if hosts:
            rec["host_ms_per_position"] = round(1000 * statistics.median(hosts) / args.tokens, 3)
        records.append(rec)
        save()
        gpu = f" gpu {rec['primitives_gpu']:5d}" if gpu_counter is not None else ""
        gpu += f" (kernels {gpu_counter['CumMax']})" if gpu_counter and gpu_counter["CumMax"] else ""
        ms = f" {rec['ms_per_position']:8.2f} ms/pos" if times else ""
        ms += f" ({1000 * min(times) / args.tokens:.2f}-{1000 * max(times) / args.tokens:.2f})" if times else ""
        ms += f" (host {rec['host_ms_per_position']:.2f})" if hosts else ""
        print(f"  {name:40s} rows {rows:3d}  prims {rec['primitives']:5d}{gpu}{ms}", flush=True)
        return rec

    for R in args.rows:
        G = min(args.group_size, R)
        prompts = make_prompts(model.args.vocab_size, R // G, args.prompt_len)
        rows = [p for p in prompts for _ in range(G)]

        def both(fn):
            counter = fn()
            if not on_cpu:
                return counter, None
            with fused_as_on_cuda(), kernels_as_on_cuda():
                return counter, fn()

        counts, runs, labels = {}, {}, []
        options = [("queries", args.queries, lambda q: f" queries={q}" if q else ""),
                   ("dense", [False, True] if args.dense else [False], lambda d: " dense" if d else ""),
                   ("kernel", args.kernel, lambda k: {"on": " kernel", "off": " no kernel"}.get(k, "")),
                   ("undo", [None] + args.undo, lambda u: f" undo {u}" if u else "")]
        for choice in itertools.product(*[values for _, values, _ in options]):
            variant = {key: {"on": True, "off": False}.get(c, c) for (key, _, _), c in zip(options, choice)
                       if c is not None}
            # "ours sampling.py", as older sittings named ours (the sampler was one file): their records compare
            label = "ours sampling.py" + "".join(tag(c) for (_, _, tag), c in zip(options, choice))
            try:  # one decoder failing (e.g. a kernel path on one backend) leaves the others' figures
                counts[label] = both(lambda: ours_counts(model, prompts, G, variant))
            except Exception as e:
                print(f"  {label:40s} rows {R:3d}  failed: {type(e).__name__}: {e}", flush=True)
                continue
            labels.append(label)
            runs[label] = ours_run(model, prompts, G, variant, args.tokens, eos)
        batch, single = "mlx_lm batch_generate", "mlx_lm generate_step (1 row)"
        if not args.ours_only:
            counts[batch] = both(lambda: batch_counts(model, rows))
            counts[single] = both(lambda: single_counts(model, rows[0]))
            runs[batch] = batch_run(model, tokenizer, rows, args.tokens)
            runs[single] = single_run(model, rows[0], args.tokens)
        timed = {} if args.count_only else rounds(runs, args.reps)
        recs, first = {}, None
        for name in counts:
            if not args.count_only and name not in timed:
                continue  # failed while compiling (printed)
            times, hosts, samples = timed.get(name, (None, None, None))
            recs[name] = record(name, 1 if name == single else R, *counts[name], times, hosts)
            if samples is not None and name in labels and first is None:
                first = (name, samples)
            elif samples is not None and name in labels:
                recs[name].update(agreement(samples, first[1]))
                print(f"    vs {first[0]}: rows the same {recs[name]['rows_as_first']:.3f}, tokens before a row's "
                      f"first difference {recs[name]['tokens_before_difference']:.4f}, their largest log-prob "
                      f"difference {recs[name]['max_logprob_diff_before']:.2e}", flush=True)
                save()
        anchors = [(labels[0], "ours_first", labels[0])] if labels else []
        anchors += [(batch, "mlx_lm_batch", "mlx_lm batch"), (single, "mlx_lm_single", "mlx_lm single")]
        for label in labels:
            for anchor, key, shown in anchors:
                if label != anchor and label in recs and anchor in recs and not args.count_only:
                    ratios = [a / b for a, b in zip(recs[label]["seconds"], recs[anchor]["seconds"])]
                    recs[label][f"vs_{key}_by_round"] = [round(x, 3) for x in ratios]
                    print(f"  {label} / {shown}: median {statistics.median(ratios):.2f}, "
                          f"min {min(ratios):.2f}, max {max(ratios):.2f} over {len(ratios)} rounds", flush=True)
        save()


if __name__ == "__main__":
    main()
