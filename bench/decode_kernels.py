"""GPU time of one decode step's kernels by row count, each kernel alone: 200 copies of one op
evaluated together (so the device, not the host, is what is timed once it is the slower).

    python3 bench/decode_kernels.py MODEL_DIR [--rows 1 8 16 32 64]

For each row count: the first block's q, k, gate and down projections (quantized in a 4-bit
model: MLX's quantized matmul) of (rows, 1, K) inputs, as mlx_lm's models give them, and the gate
and down ones of (rows, K) inputs (2-D: MLX 0.32's CUDA backend runs a 3-D input as `rows`
products of one row; worker/decode/graph_patches.py decode_blocks), the decode attention with
two queries and a boolean mask (the cuDNN path, worker/decode/graph_patches.py fused_queries)
over 152 keys, and the KV cache write (a select).
On CUDA, a second line: the decode's own kernels beside the MLX ops they replace, a q/k/v
group's LoRA product (rank 8 each, float32 A and B) by MLX's ops and by lora_kernel's down and
up, the gate projection by quantized_kernel (at most its MAX_ROWS rows), the residual add
with the RMSNorm after it by MLX's ops and by norm_kernel, and the MLP's activation on the
gate/up output by MLX's split and swiglu and by swiglu_kernel; for a Qwen3 model, the
attention kernel on the q/k/v group's output split (q/k norms, RoPE, 152 slots: the decode's
attention of a block).
Microseconds per op, the input add of each copy included.
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import mlx_lm  # noqa: E402
from mlx_lm.models.activations import swiglu  # noqa: E402

from worker.decode import attention_kernel, graph_patches, lora_kernel, norm_kernel, quantized_kernel, swiglu_kernel  # noqa: E402
from worker.runtime.logprobs import attention_mask  # noqa: E402


def timed(make, n: int = 200) -> float:
    mx.eval([make(i) for i in range(n)])  # compiles
    outs = [make(i) for i in range(n)]
    t0 = time.perf_counter()
    mx.eval(outs)
    return (time.perf_counter() - t0) / n * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64])
    args = ap.parse_args()
    model, _ = mlx_lm.load(args.model_dir)
    attn, mlp, a = model.layers[0].self_attn, model.layers[0].mlp, model.args
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    for rows in args.rows:
        x = mx.random.normal((rows, 1, a.hidden_size)).astype(dtype)
        h = mx.random.normal((rows, 1, a.intermediate_size)).astype(dtype)
        line = [f"rows {rows:3d}"]
        for name, proj, inp in (("q", attn.q_proj, x), ("k", attn.k_proj, x), ("gate", mlp.gate_proj, x),
                                ("gate 2-D", mlp.gate_proj, x[:, 0]), ("down", mlp.down_proj, h),
                                ("down 2-D", mlp.down_proj, h[:, 0])):
            line.append(f"{name} {timed(lambda i: proj(inp + i)):7.1f} us")
        q = mx.random.normal((rows, a.num_attention_heads, 2, head_dim)).astype(dtype)
        k = mx.random.normal((rows, a.num_key_value_heads, 152, head_dim)).astype(dtype)
        mask = attention_mask(mx.array([100, 101]), mx.arange(152), mx.zeros((rows,), mx.int32))
        line.append(f"attention {timed(lambda i: mx.fast.scaled_dot_product_attention(q + i, k, k, scale=0.08, mask=mask)):7.1f} us")
        one = (mx.arange(152) == 100)[None, None, :, None]
        line.append(f"kv write {timed(lambda i: mx.where(one, k[:, :, :1] + i, k)):7.1f} us")
        print(" | ".join(line), flush=True)
        if attention_kernel.cuda():
            print("          " + " | ".join(ours(attn, mlp, model.layers[0].post_attention_layernorm, x[:, 0])), flush=True)


def ours(attn, mlp, norm, x) -> list[str]:
    """The decode's CUDA kernels beside the MLX ops they replace, on x (rows, hidden)."""
    rank, n = 8, attn.q_proj.weight.shape[0] + attn.k_proj.weight.shape[0] + attn.v_proj.weight.shape[0]
    a = 0.02 * mx.random.normal((x.shape[-1], 3 * rank))
    b = 0.02 * mx.random.normal((3 * rank, n))
    y = mx.random.normal((x.shape[0], n)).astype(x.dtype)
    line = [f"qkv LoRA mlx {timed(lambda i: y + (2.0 * (((x + i) @ a) @ b)).astype(x.dtype)):7.1f} us",
            f"lora_kernel {timed(lambda i: lora_kernel.up(y, lora_kernel.down(x + i, a), b, 2.0)):7.1f} us"]
    if quantized_kernel.available(x, mlp.gate_proj):
        line.append(f"gate quantized_kernel {timed(lambda i: quantized_kernel.matmul(x + i, mlp.gate_proj)):7.1f} us")
    r = mx.random.normal(x.shape).astype(x.dtype)
    line.append(f"add+norm mlx {timed(lambda i: norm(x + r + i)):7.1f} us")
    if norm_kernel.available(x, r, norm):
        line.append(f"norm_kernel {timed(lambda i: norm_kernel.add_norm(x + i, r, norm)[1]):7.1f} us")
    g = mx.random.normal((x.shape[0], 2 * mlp.gate_proj.weight.shape[0])).astype(x.dtype)
    line.append(f"swiglu mlx {timed(lambda i: swiglu(*mx.split(g + i, 2, axis=-1))):7.1f} us")
    if swiglu_kernel.available(g):
        line.append(f"swiglu_kernel {timed(lambda i: swiglu_kernel.swiglu(g + i)[0]):7.1f} us")
    if graph_patches.kernel_norms_and_rope(attn):  # the whole attention between the projections
        d, kv_heads = attn.q_norm.weight.shape[0], attn.k_proj.weight.shape[0] // attn.q_norm.weight.shape[0]
        keys, values = (mx.random.normal((x.shape[0], kv_heads, 152, d)).astype(x.dtype) for _ in range(2))
        pos, pad = mx.array(100, mx.int32), mx.zeros((x.shape[0],), mx.int32)
        cut = [attn.q_proj.weight.shape[0], attn.q_proj.weight.shape[0] + kv_heads * d]

        def whole(i):
            q, k, v = mx.split(y + i, cut, axis=-1)
            return attention_kernel.attend(q, k, v, keys, values, pos, pad, d ** -0.5, rope=attn.rope,
                                           norms=(attn.q_norm, attn.k_norm))
        line.append(f"attention_kernel {timed(whole):7.1f} us")
    return line


if __name__ == "__main__":
    main()
