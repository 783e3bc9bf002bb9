"""A decode step's residual add and the RMSNorm after it as one CUDA kernel (worker/decode/graph_patches.py
decode_blocks, on MLX's CUDA backend), with the LoRA kernels on either side of it folded in.

A pre-norm block adds each sublayer's output to the residual stream and norms the sum for what
comes next (h = x + r; norm(h)): two primitives, twice per block, a decode step's cost being
about its number of primitives. The kernel gives both h and norm(h), rounded as MLX rounds: h
in the model's dtype T, then rms_norm.cu's formula (the mean of squares in float32, x times
its normalizer cast to T, times the weight in T).

With LoRA, the sublayer's output projection ends in lora_kernel.up (r = y + T(scale * t @ B))
and the projection group reading norm(h) starts with lora_kernel.down (norm(h) @ A): both are
done here instead (UP, DOWN), with those kernels' own formulas and summation order, so that
a LoRA block's two norms take four kernels of its eight LoRA ones; after the attention, also
the o projection's own down (t = x_o @ A_o, UP_X), which no kernel before it makes.
"""

import mlx.core as mx
import mlx.nn as nn

from worker.decode import lora_kernel
from worker.decode.custom_kernel import kernel
from worker.runtime.backend import cuda

THREADS = lora_kernel.THREADS  # per row: DOWN then sums as lora_kernel.down does
MAX_HIDDEN = 8192  # DOWN: the normed row in shared memory (float32)

# One block per row. Each thread writes its elements of h (UP: making r first, r being the base
# projection's output) and sums their squares; the block's sum goes through shared memory;
# each thread then norms the elements it wrote (a thread reads back only its own writes).
# DOWN: the normed row, kept in shared memory, times A. UP_X: UP's t made first, from the
# projection's input. Unused inputs (no UP, no DOWN, no UP_X) are placeholders.
SOURCE = """
  const int H = w_shape[0];
  const size_t m = blockIdx.y;
  const int i = threadIdx.x, lane = i % 32, warp = i / 32;
  // UP_X: UP's t for this row made here, up_x's row times up_a, as lora_kernel.down makes it.
  __shared__ float t_x[UP_X ? THREADS : 1];
  if constexpr (UP_X) {
    const int K = up_a_shape[0];
    const T* xm = up_x + m * K;
    lora_down<THREADS>([&](int k) { return static_cast<float>(xm[k]); }, K, up_a, up_a_shape[1], t_x);
    __syncthreads();
  }
  const float* t_m = UP_X ? t_x : up_t + m * up_b_shape[0];
  float ss = 0.f;
  for (int d = i; d < H; d += THREADS) {
    T rd = r[m * H + d];
    if constexpr (UP) rd = lora_up(rd, t_m, up_b, up_b_shape[0], H, d, scale[0]);
    const T v = static_cast<T>(static_cast<float>(x[m * H + d]) + static_cast<float>(rd));
    h[m * H + d] = v;
    ss += static_cast<float>(v) * static_cast<float>(v);
  }
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffff, ss, off);
  __shared__ float sums[THREADS / 32];
  if (lane == 0) sums[warp] = ss;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < THREADS / 32; ++w) total += sums[w];
  const float n = rsqrtf(total / H + eps[0]);
  __shared__ float row[DOWN ? MAX_HIDDEN : 1];
  for (int d = i; d < H; d += THREADS) {
    const T y = static_cast<T>(static_cast<float>(h[m * H + d]) * n);
    const T o = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(y));
    normed[m * H + d] = o;
    if constexpr (DOWN) row[d] = static_cast<float>(o);
  }
  if constexpr (DOWN) {
    __syncthreads();
    lora_down<THREADS>([&](int k) { return row[k]; }, H, a, a_shape[1], t + m * a_shape[1]);
  }
"""


def available(x: mx.array, r: mx.array, norm: nn.Module, up: tuple | None = None, a: mx.array | None = None,
              made: tuple | None = None) -> bool:
    """Whether the kernel can add r to x and norm the sum: MLX's CUDA backend, an nn.RMSNorm over
    x's last axis, x, r and the norm's weight of one floating dtype and x and r of one shape;
    up (t, B, scale) and a as add_norm takes them (lora_kernel.foldable), a normed row of at
    most MAX_HIDDEN; made (x_o, A_o) with up, t's rows as lora_kernel.down makes them from it."""
    hidden, rows = x.shape[-1], x.size // x.shape[-1]
    return (cuda() and type(norm) is nn.RMSNorm and x.shape == r.shape and norm.weight.shape == (hidden,)
            and x.dtype == r.dtype == norm.weight.dtype and x.dtype in (mx.float16, mx.bfloat16, mx.float32)
            and lora_kernel.foldable(up, a, rows, hidden, hidden, MAX_HIDDEN)
            and (made is None or (up is not None and made[0].dtype == x.dtype and made[0].size // made[0].shape[-1] == rows
                                  and lora_kernel.foldable(None, made[1], rows, 0, made[0].shape[-1], made[0].shape[-1])
                                  and made[1].shape[1] == up[0].shape[1])))


def add_norm(x: mx.array, r: mx.array, norm: nn.RMSNorm, up: tuple | None = None, a: mx.array | None = None,
             made: tuple | None = None):
    """h = x + r and norm(h), as MLX's ops give them. up (t, B, scale): r is a LoRA projection's
    base output and the sum takes r + T(scale * t @ B) for it, as lora_kernel.up gives it. a:
    also t = norm(h) @ a in float32, as lora_kernel.down gives it. made (x_o, A_o): up's t is
    lora_kernel.down(x_o, A_o), which the kernel makes itself (up's own t is not read, so the
    kernel that made it leaves the graph). Returns (h, norm(h), t), t None without a."""
    rows = x.size // x.shape[-1]
    eps = mx.array([norm.eps], mx.float32)
    t, b, scale = up if up is not None else (eps, eps, 0.0)  # placeholders when not UP (never read)
    up_x, up_a = made if made is not None else (x, eps)  # placeholders of the inputs' dtypes
    outs = kernel("mtq_add_rms_norm", ("x", "r", "w", "eps", "up_t", "up_b", "scale", "a", "up_x", "up_a"),
                  ("h", "normed", "t"), SOURCE, header=lora_kernel.HEADER)(
        inputs=[x, r, norm.weight, eps, eps if made is not None else t, b, lora_kernel.scale_input(scale),
                eps if a is None else a, up_x, up_a],
        template=[("T", x.dtype), ("THREADS", THREADS), ("MAX_HIDDEN", MAX_HIDDEN), ("UP", up is not None),
                  ("DOWN", a is not None), ("UP_X", made is not None)],
        grid=(THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape, (rows, 1 if a is None else a.shape[1])],
        output_dtypes=[x.dtype, x.dtype, mx.float32])
    return outs[0], outs[1], outs[2] if a is not None else None
