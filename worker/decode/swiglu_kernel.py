"""A decode step's MLP activation, swiglu(gate, up), as one CUDA kernel (worker/decode/graph_patches.py
decode_blocks, on MLX's CUDA backend), with the LoRA kernels on either side of it folded in.

A Qwen3 block's gate and up projections are one matmul (fuse_shared_inputs,
worker/runtime/projection_groups.py) whose output MLX splits, then swiglu's kernel multiplies
silu(gate) by up. Here the kernel reads the fused output itself, with MLX's own Sigmoid and
Multiply (the ops its compiled swiglu runs, each rounding to the model's dtype T), so the
result is MLX's exactly. With LoRA, the gate/up
group's last kernel (lora_kernel.up: y + T(scale * t @ B)) and the down projection's first
(lora_kernel.down: its input @ A) are done here too (UP, DOWN), with their formulas and
summation order: in a LoRA block those two and the activation are one kernel, not three.
"""

import mlx.core as mx

from worker.decode import lora_kernel
from worker.decode.custom_kernel import kernel
from worker.runtime.backend import cuda

THREADS = lora_kernel.THREADS  # per row: DOWN sums as lora_kernel.down does
MAX_WIDTH = 8192  # DOWN: the activation's row in shared memory (float32)

HEADER = lora_kernel.HEADER + """
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
"""

# One block per row of y (rows, 2F): gate in its first F columns, up in the others. Each thread
# makes its elements of the activation (UP: gate and up first made with lora_kernel's
# lora_up); DOWN: the row, kept in shared memory, times A. Unused inputs (no UP, no DOWN) are
# placeholders.
SOURCE = """
  const size_t m = blockIdx.y;
  const T* ym = y + m * 2 * F;
  __shared__ float row[DOWN ? MAX_WIDTH : 1];
  for (int j = threadIdx.x; j < F; j += THREADS) {
    T g = ym[j], u = ym[F + j];
    if constexpr (UP) {
      const int R = up_b_shape[0];
      g = lora_up(g, up_t + m * R, up_b, R, 2 * F, j, scale[0]);
      u = lora_up(u, up_t + m * R, up_b, R, 2 * F, F + j, scale[0]);
    }
    const T v = Multiply{}(Multiply{}(g, Sigmoid{}(g)), u);
    out[m * F + j] = v;
    if constexpr (DOWN) row[j] = static_cast<float>(v);
  }
  if constexpr (DOWN) {
    __syncthreads();
    lora_down<THREADS>([&](int k) { return row[k]; }, F, a, a_shape[1], t + m * a_shape[1]);
  }
"""


def available(y: mx.array, up: tuple | None = None, a: mx.array | None = None) -> bool:
    """Whether the kernel can run swiglu on y (..., 2F), gate then up: MLX's CUDA backend, a
    floating y; up (t, B, scale) and a as swiglu takes them, in lora_kernel's forms (float32,
    2-D, a's columns at most THREADS), a row of at most MAX_WIDTH."""
    width = y.shape[-1]
    return (cuda() and y.dtype in (mx.float16, mx.bfloat16, mx.float32) and width % 2 == 0
            and lora_kernel.foldable(up, a, y.size // width, width, width // 2, MAX_WIDTH))


def swiglu(y: mx.array, up: tuple | None = None, a: mx.array | None = None):
    """silu(gate) * up of y = [gate, up] along its last axis, as mlx_lm's swiglu gives it. up
    (t, B, scale): y is the gate/up group's base output, and gate and up are those of
    y + T(scale * t @ B), as lora_kernel.up gives them. a: also t = the result @ a in float32,
    as lora_kernel.down gives it. Returns (result, t), t None without a."""
    width = y.shape[-1]
    rows, f = y.size // width, width // 2
    scale = lora_kernel.scale_input(up[2] if up is not None else 0.0)
    t, b = up[:2] if up is not None else (scale, scale)  # placeholders when not UP (never read)
    outs = kernel("mtq_swiglu", ("y", "up_t", "up_b", "scale", "a"), ("out", "t"), SOURCE, header=HEADER)(
        inputs=[y, t, b, scale, scale if a is None else a],
        template=[("T", y.dtype), ("F", f), ("THREADS", THREADS), ("MAX_WIDTH", MAX_WIDTH), ("UP", up is not None),
                  ("DOWN", a is not None)],
        grid=(THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(*y.shape[:-1], f), (rows, 1 if a is None else a.shape[1])],
        output_dtypes=[y.dtype, mx.float32])
    return outs[0], outs[1] if a is not None else None
