"""A decode step's residual add and the RMSNorm after it as one CUDA kernel (worker/sampling.py
decode_blocks, on MLX's CUDA backend).

A pre-norm block adds each sublayer's output to the residual stream and norms the sum for what
comes next (h = x + r; norm(h)): two primitives, twice per block, a decode step's cost being
about its number of primitives. The kernel gives both h and norm(h), rounded as MLX rounds: h
in the model's dtype T, then rms_norm.cu's formula (the mean of squares in float32, x times
its normalizer cast to T, times the weight in T).
"""

import mlx.core as mx
import mlx.nn as nn

from worker.attention_kernel import cuda, kernel

THREADS = 256  # per row

# One block per row. Each thread writes its elements of h and sums their squares; the block's
# sum goes through shared memory; each thread then norms the elements it wrote (a thread
# reads back only its own writes).
SOURCE = """
  const int H = w_shape[0];
  const size_t m = blockIdx.y;
  const int i = threadIdx.x, lane = i % 32, warp = i / 32;
  float ss = 0.f;
  for (int d = i; d < H; d += THREADS) {
    const T v = static_cast<T>(static_cast<float>(x[m * H + d]) + static_cast<float>(r[m * H + d]));
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
  for (int d = i; d < H; d += THREADS) {
    const T y = static_cast<T>(static_cast<float>(h[m * H + d]) * n);
    normed[m * H + d] = static_cast<T>(static_cast<float>(w[d]) * static_cast<float>(y));
  }
"""

def available(x: mx.array, r: mx.array, norm: nn.Module) -> bool:
    """Whether the kernel can add r to x and norm the sum: MLX's CUDA backend, an nn.RMSNorm over
    x's last axis, x, r and the norm's weight of one floating dtype and x and r of one shape."""
    return (cuda() and type(norm) is nn.RMSNorm and x.shape == r.shape and norm.weight.shape == x.shape[-1:]
            and x.dtype == r.dtype == norm.weight.dtype and x.dtype in (mx.float16, mx.bfloat16, mx.float32))


def add_norm(x: mx.array, r: mx.array, norm: nn.RMSNorm) -> tuple[mx.array, mx.array]:
    """h = x + r and norm(h), as MLX's ops give them."""
    rows = x.size // x.shape[-1]
    return tuple(kernel("mtq_add_rms_norm", ("x", "r", "w", "eps"), ("h", "normed"), SOURCE)(
        inputs=[x, r, norm.weight, mx.array([norm.eps], mx.float32)], template=[("T", x.dtype), ("THREADS", THREADS)],
        grid=(THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype]))
