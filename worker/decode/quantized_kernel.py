"""A decode step's quantized matmuls as one CUDA kernel each (worker/decode/graph_patches.py
grouped_projections, on MLX's CUDA backend).

What it replaces: MLX 0.32's CUDA quantized matmul of a decode step's 8 rows runs its
tensor-core GEMM, whose tiles are far taller than 8 rows (under 8 rows, a vector kernel that
adds in bf16): a gate projection of the qwen3-0.6b shape takes far longer than reading its
1.6 MB of 4-bit weights would (docs/performance.md, "H200: projections and norms as kernels").
Here one warp makes one output column for every row: it reads the column's packed weights once,
dequantizes them as MLX's GEMM does (the weight times its scale in the model's dtype T, plus the
bias in T), and adds their products with each row's inputs in float32, so the result is MLX's
up to float32 summation order. It re-reads the rows' inputs for every column, so from 32 rows MLX's GEMM is faster.
"""

import mlx.core as mx
import mlx.nn as nn

from worker.decode.custom_kernel import kernel
from worker.runtime.backend import cuda

MAX_ROWS = 8  # more: MLX's GEMM (at 32 rows its tensor cores beat this kernel, which reads x once per column)
WARPS = 8  # output columns per block

# Lane l of the warp of column n reads 16 bytes of its packed weights at a time (CHUNK values of
# one quantization group), dequantizes them, and adds their products with each row's CHUNK
# inputs; the lanes' sums are added by shuffles. x is read 16 bytes at a time where its address
# allows (a row of K values, K a multiple of CHUNK, keeps that alignment), else value by value.
SOURCE = """
  constexpr int VPW = 32 / BITS, CHUNK = 4 * VPW, XV = 16 / sizeof(T);
  const int N = w_shape[0], K = w_shape[1] * VPW, groups = K / GS;
  int rows = 1;  // x's rows, at most M: one module for every row count a decode reaches
  for (int i = 0; i < x_ndim - 1; ++i) rows *= x_shape[i];
  const int lane = threadIdx.x % 32, n = blockIdx.x * WARPS + threadIdx.x / 32;
  if (n >= N) return;  // a whole warp: nothing below waits on the block
  const uint32_t* wn = w + (size_t)n * (K / VPW);
  const T* sn = scales + (size_t)n * groups;
  const T* bn = biases + (size_t)n * groups;
  const bool vector_x = reinterpret_cast<size_t>(x) % 16 == 0;
  auto round_t = [](float v) { return static_cast<float>(static_cast<T>(v)); };
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; ++m) acc[m] = 0.f;
  for (int c = lane; c < K / CHUNK; c += 32) {
    const int k0 = c * CHUNK;
    const float s = static_cast<float>(sn[k0 / GS]), b = static_cast<float>(bn[k0 / GS]);
    float wv[CHUNK];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t word = wn[c * 4 + i];
#pragma unroll
      for (int j = 0; j < VPW; ++j)
        wv[i * VPW + j] = round_t(round_t(static_cast<float>((word >> (BITS * j)) & ((1u << BITS) - 1)) * s) + b);
    }
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= rows) break;
      const T* xm = x + (size_t)m * K + k0;
      float sum = 0.f;
      if (vector_x) {
#pragma unroll
        for (int v = 0; v < CHUNK / XV; ++v) {
          const uint4 raw = reinterpret_cast<const uint4*>(xm)[v];
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int i = 0; i < XV; ++i) sum += static_cast<float>(e[i]) * wv[v * XV + i];
        }
      } else {
#pragma unroll
        for (int i = 0; i < CHUNK; ++i) sum += static_cast<float>(xm[i]) * wv[i];
      }
      acc[m] += sum;
    }
  }
#pragma unroll
  for (int m = 0; m < M; ++m) {
    if (m >= rows) break;
    float v = acc[m];
    for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffff, v, off);
    if (lane == 0) out[(size_t)m * N + n] = static_cast<T>(v);
  }
"""

def available(x: mx.array, m: nn.Module) -> bool:
    """Whether the kernel can multiply x (..., K) by a quantized module's weights (an
    nn.QuantizedLinear, or a tied nn.QuantizedEmbedding as its output projection): MLX's CUDA
    backend, affine 4- or 8-bit quantization in groups of 32, 64 or 128, at most MAX_ROWS rows,
    x, the scales and the biases of one floating dtype."""
    if not (cuda() and type(m) in (nn.QuantizedLinear, nn.QuantizedEmbedding) and m.mode == "affine"):
        return False
    w, scales, biases = m["weight"], m["scales"], m.get("biases")
    chunk = 4 * 32 // m.bits if m.bits in (4, 8) else 0
    return (chunk > 0 and m.group_size in (32, 64, 128) and biases is not None and w.dtype == mx.uint32
            and w.ndim == 2 and (w.shape[1] * 32 // m.bits) == x.shape[-1] and x.shape[-1] % chunk == 0
            and x.size // x.shape[-1] <= MAX_ROWS and x.dtype == scales.dtype == biases.dtype
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32))


def matmul(x: mx.array, m: nn.Module) -> mx.array:
    """x @ dequantized(m's weights).T, (..., K) -> (..., N), as MLX's quantized matmul gives it
    (the module's own bias, if any, not added)."""
    w = m["weight"]
    n = w.shape[0]
    return kernel("mtq_quantized_matmul", ("x", "w", "scales", "biases"), ("out",), SOURCE)(
        inputs=[x, w, m["scales"], m["biases"]],
        template=[("T", x.dtype), ("M", MAX_ROWS), ("BITS", m.bits), ("GS", m.group_size), ("WARPS", WARPS)],
        grid=(32 * WARPS * ((n + WARPS - 1) // WARPS), 1, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(*x.shape[:-1], n)], output_dtypes=[x.dtype])[0]
