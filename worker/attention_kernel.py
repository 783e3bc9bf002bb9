"""One CUDA kernel per layer for a decode step's attention (worker/sampling.py, on MLX's CUDA backend).

What it replaces: MLX's fused decode attention takes no array mask, so a masked decode step
ran it through cuDNN with each query given twice (two copies and a slice around it), and wrote
the new key and value with a select over the whole KV buffer (two full copies per layer per
token, which at 32 rows and more also cost the bandwidth). Five primitives per layer become one.

The kernel attends one query per row and head over the slots a row may see (its left padding
hidden, nothing after the new token), with the new key and value taken from its inputs, and
writes them into slot `pos` of the KV buffers it is given: in place, which MLX has no way to
say. That is sound here because those buffers are the decode's own (sample() makes them,
row-contiguous, so MLX hands the kernel their memory and not a copy), and nothing reads a
cache array of an earlier decode step: the step returns the same arrays as its new cache.
"""

import mlx.core as mx

WARPS = (4, 8, 16)  # warps per (row, head): more for longer buffers

# Online softmax over keys, one warp per key at a time, each lane holding E of the head's
# dimensions (d = lane + 32 e, so that a warp reads a key's row in one coalesced sweep); the
# warps' partial sums are combined through shared memory at the end. Float32 throughout.
SOURCE = """
  constexpr int E = (D + 31) / 32;
  const int b = blockIdx.z, h = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int heads = q_shape[1], kv_heads = keys_shape[1], capacity = keys_shape[2];
  const int hk = h / (heads / kv_heads);
  const int t_new = pos[0], start = pad[b];
  const size_t buf = ((size_t)b * kv_heads + hk) * capacity * D;
  const size_t nk = ((size_t)b * kv_heads + hk) * D;
  const size_t qo = ((size_t)b * heads + h) * D;

  if (h % (heads / kv_heads) == 0 && warp == 0) {  // one block per KV head writes the new slot
    T* kw = const_cast<T*>(keys) + buf + (size_t)t_new * D;
    T* vw = const_cast<T*>(values) + buf + (size_t)t_new * D;
    for (int d = lane; d < D; d += 32) {
      kw[d] = k_new[nk + d];
      vw[d] = v_new[nk + d];
    }
  }

  float qv[E], acc[E];
  for (int e = 0; e < E; ++e) {
    int d = lane + 32 * e;
    qv[e] = d < D ? static_cast<float>(q[qo + d]) * scale[0] : 0.f;
    acc[e] = 0.f;
  }
  float m = -INFINITY, l = 0.f;
  for (int t = start + warp; t <= t_new; t += W) {
    // The new token's key and value from the inputs: other blocks may not have written it yet.
    const T* kr = t == t_new ? k_new + nk : keys + buf + (size_t)t * D;
    const T* vr = t == t_new ? v_new + nk : values + buf + (size_t)t * D;
    float s = 0.f;
    for (int e = 0; e < E; ++e) {
      int d = lane + 32 * e;
      s += d < D ? qv[e] * static_cast<float>(kr[d]) : 0.f;
    }
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffff, s, off);
    float m_new = fmaxf(m, s);
    float c = __expf(m - m_new), p = __expf(s - m_new);
    l = l * c + p;
    for (int e = 0; e < E; ++e) {
      int d = lane + 32 * e;
      acc[e] = acc[e] * c + (d < D ? p * static_cast<float>(vr[d]) : 0.f);
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
      if (d < D) out[qo + d] = static_cast<T>(o[e] / total);
    }
  }
"""

_kernel = None


def cuda() -> bool:
    """Whether MLX runs on its CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def available(queries: mx.array, keys: mx.array) -> bool:
    """Whether the kernel can run a decode step's attention: MLX's CUDA backend, one query per
    row, and a head dimension it holds in registers (up to 256)."""
    return (cuda() and queries.shape[2] == 1 and keys.shape[-1] <= 256
            and keys.dtype in (mx.float16, mx.bfloat16, mx.float32) and queries.dtype == keys.dtype)


def attend(queries, k_new, v_new, keys, values, pos: mx.array, left_pad: mx.array, scale: float) -> mx.array:
    """softmax(scale q k^T) v for queries (rows, heads, 1, D) over slots left_pad[row]..pos of
    keys/values (rows, kv_heads, capacity, D), whose slot pos is k_new/v_new (rows, kv_heads, 1,
    D); pos () and left_pad (rows,) int32. Also writes k_new and v_new into slot pos of keys and
    values, in place."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mtq_decode_attention",
            input_names=["q", "k_new", "v_new", "keys", "values", "pos", "pad", "scale"],
            output_names=["out"], source=SOURCE)
    rows, heads, _, d = queries.shape
    warps = next((w for w in WARPS if keys.shape[2] <= 64 * w), WARPS[-1])
    return _kernel(
        inputs=[queries, k_new, v_new, keys, values, pos, left_pad, mx.array([scale], mx.float32)],
        template=[("T", queries.dtype), ("D", d), ("W", warps)],
        grid=(32 * warps, heads, rows), threadgroup=(32 * warps, 1, 1),
        output_shapes=[queries.shape], output_dtypes=[queries.dtype])[0]
