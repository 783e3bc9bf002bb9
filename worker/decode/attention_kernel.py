"""One CUDA kernel per layer for a decode step's attention (worker/decode/graph_patches.py
decode_attention, on MLX's CUDA backend).

What it replaces: MLX's fused decode attention takes no array mask, so a masked decode step
ran it through cuDNN with each query given twice (two copies and a slice around it), and wrote
the new key and value with a select over the whole KV buffer (two full copies per layer per
token, which at 32 rows and more also cost the bandwidth). Five primitives per layer become one.
For mlx_lm's Qwen3 attention it also applies the q and k RMSNorms and RoPE to the projections
(graph_patches.kernel_norms_and_rope): four kernels more, and the reshapes and transposes around
them, so that a layer's attention between its projections is this one kernel.

The kernel attends one query per row and head over the slots a row may see (its left padding
hidden, nothing after the new token), with the new key and value taken from its inputs, and
writes them into slot `pos` of the KV buffers it is given: in place, which MLX has no way to
say. That is sound here because those buffers are the decode's own (sample() makes them, each
row its own memory; the kernel takes its inputs as they are, never a copy), and nothing reads
a cache array of an earlier decode step: the step returns the same arrays as its new cache.
"""

import math

import mlx.core as mx
import mlx.nn as nn

from worker.decode.custom_kernel import kernel
from worker.runtime.backend import cuda

WARPS = (4, 8, 16)  # warps per (row, head): more for longer buffers

# Online softmax over keys, one warp per key at a time, each lane holding E of the head's
# dimensions (d = lane + 32 e, so that a warp reads a key's row in one coalesced sweep); the
# warps' partial sums are combined through shared memory at the end. Float32 throughout.
# Every input is read through its strides: a view is never copied first (and a group's left
# padding, repeated from one prompt's, is a broadcast). FUSED: q, k_new and v_new are a block's
# projections as they come, (rows, 1, heads * D) (FLAT: (rows, heads * D)), and the kernel first
# applies what the attention module would: Qwen3's RMSNorm of q and k per head (NORM), then
# RoPE, rounding to T where MLX's own kernels round (rms_norm.cu, rope.cu).
SOURCE = """
  constexpr int E = (D + 31) / 32;
  const int b = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int heads = gridDim.y, kv_heads = keys_shape[1];
  const int hk = h / (heads / kv_heads);
  const int t_new = pos[0], start = pad[b * pad_strides[0]];
  const float scale = params[0];

  // Element d of head hh of row b: a (rows, heads, 1, D) array, or FUSED a (rows, 1, heads * D)
  // one, or FUSED and FLAT a (rows, heads * D) one.
  auto at = [&](const auto& s, int hh, int d) -> size_t {
    return FUSED ? b * s[0] + (size_t)(hh * D + d) * s[FLAT ? 1 : 2] : b * s[0] + hh * s[1] + (size_t)d * s[3];
  };
  auto slot = [&](const auto& s, int t, int d) -> size_t {
    return b * s[0] + hk * s[1] + (size_t)t * s[2] + (size_t)d * s[3];
  };
  auto round_t = [](float x) { return static_cast<float>(static_cast<T>(x)); };

  // FUSED: the query and the new key, normed and rotated, in shared memory (warp 0: q, warp 1: k).
  __shared__ float qk[2][D];
  if constexpr (FUSED) {
    if (warp < 2) {
      float x[E], ss = 0.f;
      for (int e = 0; e < E; ++e) {
        int d = lane + 32 * e;
        x[e] = d < D ? static_cast<float>(warp == 0 ? q[at(q_strides, h, d)] : k_new[at(k_new_strides, hk, d)]) : 0.f;
        ss += x[e] * x[e];
      }
      if constexpr (NORM) {
        for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffff, ss, off);
        const float n = rsqrtf(ss / D + params[1]);
        for (int e = 0; e < E; ++e) {
          int d = lane + 32 * e;
          if (d < D) {
            float w = static_cast<float>(warp == 0 ? q_norm[d * q_norm_strides[0]] : k_norm[d * k_norm_strides[0]]);
            x[e] = round_t(w * round_t(x[e] * n));
          }
        }
      }
      for (int e = 0; e < E; ++e) {
        int d = lane + 32 * e;
        if (d < D) qk[warp][d] = x[e];
      }
      __syncwarp();
      constexpr int half = D / 2;
      const float L = params[3] * static_cast<float>(t_new - start);
      for (int e = 0; e < E; ++e) {
        int d = lane + 32 * e;
        if (d < D) {
          int i = d < half ? d : d - half;
          float theta = L * exp2f(-(static_cast<float>(i) / static_cast<float>(half)) * params[2]);
          float c = cosf(theta), s = sinf(theta), x1 = qk[warp][i], x2 = qk[warp][i + half];
          x[e] = round_t(d < half ? x1 * c - x2 * s : x1 * s + x2 * c);
        }
      }
      __syncwarp();
      for (int e = 0; e < E; ++e) {
        int d = lane + 32 * e;
        if (d < D) qk[warp][d] = x[e];
      }
    }
    __syncthreads();
  }
  auto new_key = [&](int d) -> float {
    return FUSED ? qk[1][d] : static_cast<float>(k_new[at(k_new_strides, hk, d)]);
  };

  if (h % (heads / kv_heads) == 0 && warp == 0) {  // one block per KV head writes the new slot
    for (int d = lane; d < D; d += 32) {
      const_cast<T*>(keys)[slot(keys_strides, t_new, d)] = static_cast<T>(new_key(d));
      const_cast<T*>(values)[slot(values_strides, t_new, d)] = v_new[at(v_new_strides, hk, d)];
    }
  }

  float qv[E], acc[E];
  for (int e = 0; e < E; ++e) {
    int d = lane + 32 * e;
    qv[e] = d < D ? (FUSED ? qk[0][d] : static_cast<float>(q[at(q_strides, h, d)])) * scale : 0.f;
    acc[e] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int t = start + warp; t <= t_new; t += W) {
    // The new token's key and value from the inputs: other blocks may not have written it yet.
    float s = 0.f;
    for (int e = 0; e < E; ++e) {
      int d = lane + 32 * e;
      s += d < D ? qv[e] * (t == t_new ? new_key(d) : static_cast<float>(keys[slot(keys_strides, t, d)])) : 0.f;
    }
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    float m_new = fmaxf(m, s);
    float c = __expf(m - m_new), p = __expf(s - m_new);
    l = l * c + p;
    for (int e = 0; e < E; ++e) {
      int d = lane + 32 * e;
      float v = d < D ? static_cast<float>(t == t_new ? v_new[at(v_new_strides, hk, d)]
                                                      : values[slot(values_strides, t, d)]) : 0.f;
      acc[e] = acc[e] * c + p * v;
    }
    m = m_new;
  }

  __shared__ float ms[W], ls[W], accs[W][E * 32];
  if (lane == 0) { ms[warp] = m; ls[warp] = l; }
  for (int e = 0; e < E; ++e) accs[warp][lane + 32 * e] = acc[e];
  __syncthreads();
  if (warp == 0) {
    float mx_ = -INFINITY;
    for (int w = 0; w < W; ++w) mx_ = ls[w] > 0.f ? fmaxf(mx_, ms[w]) : mx_;
    float total = 0.f, o[E];
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    for (int w = 0; w < W; ++w) {
      if (ls[w] > 0.f) {  // a warp that saw no key (a short row) adds nothing
        float c = __expf(ms[w] - mx_);
        total += ls[w] * c;
        for (int e = 0; e < E; ++e) o[e] += accs[w][lane + 32 * e] * c;
      }
    }
    for (int e = 0; e < E; ++e) {
      int d = lane + 32 * e;
      if (d < D) out[((size_t)b * heads + h) * D + d] = static_cast<T>(o[e] / total);
    }
  }
"""


def available(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel can run a decode step's attention: MLX's CUDA backend, one query per
    row ((rows, heads, 1, D), or (rows, 1, heads * D) or (rows, heads * D) as projected), and a
    head dimension it holds in registers (up to 256)."""
    return (cuda() and (queries.ndim == 2 or queries.shape[-2] == 1) and keys.shape[-1] <= 256
            and keys.dtype in (mx.float16, mx.bfloat16, mx.float32) and queries.dtype == keys.dtype)


def attend(queries, k_new, v_new, keys, values, pos: mx.array, left_pad: mx.array, scale: float, *,
           rope: nn.RoPE | None = None, norms: tuple[nn.RMSNorm, nn.RMSNorm] | None = None) -> mx.array:
    """softmax(scale q k^T) v for queries (rows, heads, 1, D) over slots left_pad[row]..pos of
    keys/values (rows, kv_heads, capacity, D), whose slot pos is k_new/v_new (rows, kv_heads, 1,
    D); pos () and left_pad (rows,) int32. Also writes k_new and v_new into slot pos of keys and
    values, in place.

    rope: queries, k_new and v_new are the block's projections, (rows, 1, heads * D) and (rows,
    1, kv_heads * D), or the same without their second axis; the kernel applies this RoPE to the
    query and the new key (non-traditional, on all D dimensions, at position pos - left_pad),
    after the q and k RMSNorms `norms` if given, and returns the queries' shape."""
    rows, kv_heads, _, d = keys.shape
    heads = queries.shape[1] if rope is None else queries.shape[-1] // d
    warps = next((w for w in WARPS if keys.shape[2] <= 64 * w), WARPS[-1])
    eps = norms[0].eps if norms else 0.0
    rope_args = (math.log2(rope.base), rope.scale) if rope is not None else (0.0, 1.0)
    params = mx.array([scale, eps, *rope_args], mx.float32)
    q_norm, k_norm = (n.weight for n in norms) if norms else (params, params)
    attention = kernel("mtq_decode_attention", ("q", "k_new", "v_new", "keys", "values", "pos", "pad", "params",
                                                 "q_norm", "k_norm"), ("out",), SOURCE, contiguous=False)
    return attention(
        inputs=[queries, k_new, v_new, keys, values, pos, left_pad, params, q_norm, k_norm],
        template=[("T", queries.dtype), ("D", d), ("W", warps), ("FUSED", rope is not None), ("NORM", bool(norms)),
                  ("FLAT", queries.ndim == 2)],
        grid=(32 * warps, heads, rows), threadgroup=(32 * warps, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]
