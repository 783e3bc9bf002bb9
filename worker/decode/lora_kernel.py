"""A decode step's LoRA products as two CUDA kernels per projection group (worker/decode/graph_patches.py
grouped_projections, on MLX's CUDA backend).

What they replace: MLX runs y + scale * (x @ A) @ B, the LoRA product added to the base
projection's output y, as four primitives (x cast to float32, two matmuls, then the multiply,
cast and add fused) and two reshapes to make x 2-D; a decode step's cost is about its number
of primitives, and a GRPO job decodes with LoRA on 4 groups of each of its 16 blocks. Here:

  down   t = x @ A in float32 (x cast inside), x as it comes ((rows, 1, K) or (rows, K))
  up     y + T(scale * t @ B), y the base projection's output, rounded as MLX rounds: the
         product in float32, cast to the model's dtype T, then added in T

so a projection group's outputs are those of the plain ops up to float32 summation order. A
and B stay float32 (a job's LoRA weights): bf16 LoRA moved sampled log-probs by up to 0.008.
"""

import mlx.core as mx

from worker.decode.custom_kernel import kernel
from worker.runtime.backend import cuda

THREADS = 1024  # per row in `down`: R of them per slice of K
MAX_RANK = THREADS  # columns of A (a group's ranks together) that `down` holds

# lora_kernel's two formulas as device functions, for its kernels and for those that fold them
# in (norm_kernel, swiglu_kernel: mx.fast.cuda_kernel's header), so all sum in one order.
# lora_up: y + T(scale * t_m @ B[:, j]) for row m's t_m, rounded as MLX rounds.
# lora_down: row m's x @ A (K, R), x[k] given by x_at(k), into t_m; called by every thread of
# the block (it syncs). Thread i sums x[k] * A[k, r] for r = i % R over the k of its slice
# i / R (slices: a power of two): consecutive threads read consecutive elements of A,
# row-major. The slices' sums are added pairwise through shared memory. Unrolled: a thread's
# loads are issued together (its few dozen k would otherwise each wait on memory in turn).
HEADER = """
template <typename T>
__device__ T lora_up(T y, const float* t_m, const float* b, int R, size_t N, size_t j, float scale) {
  float acc = 0.f;
#pragma unroll 8
  for (int r = 0; r < R; ++r) acc += t_m[r] * b[(size_t)r * N + j];
  const T z = static_cast<T>(scale * acc);
  return static_cast<T>(static_cast<float>(y) + static_cast<float>(z));
}

template <int THREADS, typename X>
__device__ void lora_down(X x_at, int K, const float* a, int R, float* t_m) {
  const int i = threadIdx.x;
  int slices = 1;
  while (slices * 2 * R <= THREADS) slices *= 2;
  const int r = i % R, slice = i / R;
  float acc = 0.f;
  if (slice < slices) {
#pragma unroll 8
    for (int k = slice; k < K; k += slices) acc += x_at(k) * a[(size_t)k * R + r];
  }
  __shared__ float part[THREADS];
  part[i] = acc;
  __syncthreads();
  for (int s = slices / 2; s > 0; s /= 2) {
    if (slice < s) part[i] += part[i + s * R];
    __syncthreads();
  }
  if (i < R) t_m[i] = part[i];
}
"""

# One block per row m.
DOWN = """
  const int K = a_shape[0], R = a_shape[1];
  const size_t m = blockIdx.y;
  const T* xm = x + m * K;
  lora_down<THREADS>([&](int k) { return static_cast<float>(xm[k]); }, K, a, R, t + m * R);
"""

# One thread per output element (m, j).
UP = """
  const int R = b_shape[0], N = b_shape[1];
  const size_t m = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;
  out[m * N + j] = lora_up(y[m * N + j], t + m * R, b, R, N, j, scale[0]);
"""


def available(x: mx.array, a: mx.array, b: mx.array) -> bool:
    """Whether the kernels can run a group's LoRA product: MLX's CUDA backend, float32 A and B
    (else MLX's matmul rounds otherwise), at most MAX_RANK columns of A, a floating x."""
    return (cuda() and a.dtype == b.dtype == mx.float32 and a.shape[1] <= MAX_RANK and a.ndim == b.ndim == 2
            and x.dtype in (mx.float16, mx.bfloat16, mx.float32))


def foldable(up: tuple | None, a: mx.array | None, rows: int, n: int, k: int, max_k: int) -> bool:
    """Whether a kernel that folds these formulas in (norm_kernel, swiglu_kernel) can take up
    (t, B, scale: up's inputs but y) for an output of rows x n, and a for input rows of k, at
    most max_k: in this module's forms (float32, 2-D, a's columns at most THREADS)."""
    return ((up is None or (up[0].dtype == up[1].dtype == mx.float32 and up[0].shape == (rows, up[1].shape[0])
                            and up[1].shape[1] == n))
            and (a is None or (a.dtype == mx.float32 and a.ndim == 2 and a.shape[0] == k <= max_k
                               and a.shape[1] <= THREADS)))


def down(x: mx.array, a: mx.array) -> mx.array:
    """x @ a in float32: (..., K) by (K, R) -> (rows, R), rows the product of x's leading dims."""
    rows = x.size // x.shape[-1]
    return kernel("mtq_lora_down", ("x", "a"), ("t",), DOWN, header=HEADER)(
        inputs=[x, a], template=[("T", x.dtype), ("THREADS", THREADS)],
        grid=(THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, a.shape[1])], output_dtypes=[mx.float32])[0]


def up(y: mx.array, t: mx.array, b: mx.array, scale: mx.array | float) -> mx.array:
    """y + (scale * t @ b) cast to y's dtype, rounded as MLX's ops round: y (..., N), t (rows, R)
    from down, b (R, N); scale as scale_input takes it."""
    n = y.shape[-1]
    return kernel("mtq_lora_up", ("y", "t", "b", "scale"), ("out",), UP, header=HEADER)(
        inputs=[y, t, b, scale_input(scale)], template=[("T", y.dtype)],
        grid=(n, y.size // n, 1), threadgroup=(min(256, n), 1, 1),
        output_shapes=[y.shape], output_dtypes=[y.dtype])[0]


def scale_input(scale: mx.array | float) -> mx.array:
    """The kernels' scale input: a (1,) float32 array as it comes (a decode step's input, from
    graph_patches.lora_args), or made of a number."""
    return scale if isinstance(scale, mx.array) else mx.array([scale], mx.float32)
