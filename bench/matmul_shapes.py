"""What each matmul of an SFT forward and backward costs where it runs, by shape: LoRA's (the job's
layers, rank 8 on every projection) against full fine-tuning's, so that the difference between
the two steps can be laid on the shapes that make it (issue 41: on the H200 a LoRA step costs
about twice a full one, and neither the matmul count nor the primitive count explains it;
docs/performance.md).

    python bench/matmul_shapes.py MODEL_DIR [--tokens 512] [--rank 8] [--calls 28] [--reps 10]
                                            [--rounds 3] [--pad 64] [--dtype D]

Only the model's config.json is read (no weights). Per block, the projections as a job runs them
(worker/runtime/adapter_layers.py SharedInput): q/k/v as one fused matmul and one LoRA pair of
width 3 x rank, o alone, gate/up fused (2 x rank), down alone. For a projection of input width K,
output width N and LoRA width R on T = --tokens rows (2-D, as the job's layers multiply):

  x W        (T,K) @ (K,N), W stored (N,K)        forward, both
  g W        (T,N) @ (N,K)                        the input's gradient through W, both
  dW         (K,T) @ (T,N), x stored (T,K)        the weight's gradient, full fine-tuning only
  x A        (T,K) @ (K,R)                        LoRA forward
  t B        (T,R) @ (R,N)
  g B^T      (T,N) @ (N,R), B stored (R,N)        LoRA backward: the gradient of t
  dB         (R,T) @ (T,N), t stored (T,R)        B's gradient
  dt A^T     (T,R) @ (R,K), A stored (K,R)        the input's gradient through A
  dA         (K,T) @ (T,R), x stored (T,K)        A's gradient

and the output head (x E^T and its input's gradient, both variants). Each case is timed as
--calls independent matmuls of its shape (as many as the model has blocks by default: distinct
arrays, evaluated together), the cases in interleaved rounds; it prints microseconds a matmul
(min / median / max of the rounds' medians) beside an element-wise add of (T, hidden), whose cost
is the backend's floor per primitive, and what a forward and backward's projection matmuls add
up to for each variant (count x median). --pad P also times LoRA's cases at width P (a rank
padded with zeros gives the same products): whether a wider LoRA product costs less.

Environment variables of MLX (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER) apply per process:
bench/h200_sitting.sh's `graphs` stage runs it with graphs on and off.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.supervisor.openblas import reexec_with_openblas  # noqa: E402

reexec_with_openblas()

import mlx.core as mx  # noqa: E402

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


class Case(NamedTuple):
    """One matmul shape: a @ b with each operand's shape as stored (transposed: its view's .T),
    and how many of it one forward and backward has with LoRA and with full fine-tuning."""
    name: str
    a: tuple
    a_t: bool
    b: tuple
    b_t: bool
    lora: int
    full: int


def cases(cfg: dict, tokens: int, rank: int, pad: int | None) -> list[Case]:
    """Each matmul of one SFT forward and backward's projections and head (module docstring)."""
    h, blocks = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    groups = {"qkv": (h, q + 2 * kv, 3), "o": (q, h, 1), "gate_up": (h, 2 * inter, 2), "down": (inter, h, 1)}
    t = tokens
    out = []
    for g, (k, n, layers) in groups.items():
        out += [Case(f"x W {g}", (t, k), False, (n, k), True, blocks, blocks),
                Case(f"g W {g}", (t, n), False, (n, k), False, blocks, blocks),
                Case(f"dW {g}", (t, k), True, (t, n), False, 0, blocks)]
        for r, label in [(rank * layers, "")] + ([(pad, f" pad {pad}")] if pad else []):
            count = 0 if label else blocks  # a padded case is an alternative, not part of the step
            out += [Case(f"x A {g}{label}", (t, k), False, (k, r), False, count, 0),
                    Case(f"t B {g}{label}", (t, r), False, (r, n), False, count, 0),
                    Case(f"g B^T {g}{label}", (t, n), False, (r, n), True, count, 0),
                    Case(f"dB {g}{label}", (t, r), True, (t, n), False, count, 0),
                    Case(f"dt A^T {g}{label}", (t, r), False, (k, r), True, count, 0),
                    Case(f"dA {g}{label}", (t, k), True, (t, r), False, count, 0)]
    v = cfg["vocab_size"]
    out += [Case("x E^T head", (t, h), False, (v, h), True, 1, 1), Case("g E head", (t, v), False, (v, h), False, 1, 1)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=512, help="rows of a micro-batch (bench/lora_step.py: 4 x 128)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--calls", type=int, help="matmuls of a shape per evaluation (default: the model's blocks)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pad", type=int, help="also time LoRA's matmuls at this width")
    p.add_argument("--dtype", choices=DTYPES, help="default: the model's (config.json torch_dtype)")
    args = p.parse_args()
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    calls = args.calls or cfg["num_hidden_layers"]
    args.dtype = args.dtype or cfg.get("torch_dtype", "float32")
    dtype = DTYPES[args.dtype]
    table = cases(cfg, args.tokens, args.rank, args.pad)

    def operands(shape, transposed):
        xs = [mx.random.normal(shape).astype(dtype) for _ in range(calls)]
        return [x.T for x in xs] if transposed else xs

    work = {"add (T, hidden)": (lambda a, b: a + b, operands((args.tokens, cfg["hidden_size"]), False),
                                operands((args.tokens, cfg["hidden_size"]), False))}
    for c in table:
        work[c.name] = (lambda a, b: a @ b, operands(c.a, c.a_t), operands(c.b, c.b_t))
    mx.eval([w[1:] for w in work.values()])

    us = {name: [] for name in work}
    for r in range(args.rounds):
        names = list(work) if r % 2 == 0 else list(work)[::-1]
        for name in names:
            op, a, b = work[name]
            times = []
            for i in range(args.warmup + args.reps):
                t0 = time.perf_counter()
                mx.eval([op(x, y) for x, y in zip(a, b)])
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            us[name].append(statistics.median(times) / calls * 1e6)

    print(f"device {mx.default_device()}, mlx {mx.__version__}, {args.dtype}, {args.tokens} rows, rank {args.rank}, "
          f"{calls} matmuls a shape per evaluation, {args.rounds} rounds")
    print(f"{'case':24s} {'a (stored)':>14s} {'b (stored)':>14s}  lora  full   us/call min / median / max")
    shapes = {c.name: c for c in table}
    for name, v in us.items():
        c = shapes.get(name)
        a, b = (f"{c.a}{'T' if c.a_t else ''}", f"{c.b}{'T' if c.b_t else ''}") if c else ("", "")
        counts = (c.lora, c.full) if c else ("", "")
        print(f"{name:24s} {a:>14s} {b:>14s}  {counts[0]!s:>4s}  {counts[1]!s:>4s}   "
              f"{min(v):8.1f} / {statistics.median(v):8.1f} / {max(v):8.1f}")
    median = {name: statistics.median(v) for name, v in us.items()}
    for variant, label in (("lora", "LoRA"), ("full", "full")):
        count = {c.name: getattr(c, variant) for c in table}
        print(f"{label}: {sum(count.values())} matmuls, "
              f"{sum(n * median[name] for name, n in count.items()) / 1e3:.1f} ms by the medians")
    if args.pad:
        own = [c for c in table if c.lora and not c.full]  # LoRA's own products at their widths
        widths = sum(c.lora * median[c.name] for c in own)
        padded = sum(c.lora * median[f"{c.name} pad {args.pad}"] for c in own)
        print(f"LoRA's own {sum(c.lora for c in own)} matmuls: {widths / 1e3:.1f} ms at their widths, "
              f"{padded / 1e3:.1f} ms at width {args.pad}")


if __name__ == "__main__":
    main()
