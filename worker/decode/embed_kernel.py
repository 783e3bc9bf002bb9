"""A decode step's lookup of a quantized embedding as one CUDA kernel (worker/decode/graph_patches.py
decode_blocks, on MLX's CUDA backend).

What it replaces: nn.QuantizedEmbedding gathers each token's row of packed weights, of scales
and of biases, then dequantizes them: three gathers, a dequantize and the views between them,
eight primitives of a decode step (and a reshape to the step's 2-D rows), where this is one.
Each value is dequantized as MLX's affine_dequantize kernel does it (`scale * T(q) + bias` in
the model's dtype T), so the rows are MLX's own.
"""

import mlx.core as mx
import mlx.nn as nn

from worker.decode.custom_kernel import kernel
from worker.runtime.backend import cuda

THREADS = 128  # per row: each thread dequantizes packed words of it in turn

# One block per token: thread i dequantizes words i, i + THREADS, ... of the token's row.
SOURCE = """
  constexpr int VPW = 32 / BITS;
  const int words = w_shape[1], hidden = words * VPW, groups = hidden / GS;
  const size_t m = blockIdx.y;
  const size_t tok = tokens[m];
  const uint32_t* wr = w + tok * words;
  for (int c = threadIdx.x; c < words; c += THREADS) {
    const uint32_t word = wr[c];
    const T scale = scales[tok * groups + c * VPW / GS], bias = biases[tok * groups + c * VPW / GS];
#pragma unroll
    for (int j = 0; j < VPW; ++j)
      out[m * hidden + c * VPW + j] = scale * static_cast<T>((word >> (BITS * j)) & ((1u << BITS) - 1)) + bias;
  }
"""


def available(tokens: mx.array, embed: nn.Module) -> bool:
    """Whether the kernel can look the tokens up: MLX's CUDA backend, an nn.QuantizedEmbedding of
    affine 4- or 8-bit weights in groups of 32, 64 or 128 with biases, integer tokens."""
    if not (cuda() and type(embed) is nn.QuantizedEmbedding and embed.mode == "affine"):
        return False
    w, scales, biases = embed["weight"], embed["scales"], embed.get("biases")
    return (embed.bits in (4, 8) and embed.group_size in (32, 64, 128) and biases is not None
            and w.dtype == mx.uint32 and w.ndim == 2 and scales.dtype == biases.dtype
            and scales.dtype in (mx.float16, mx.bfloat16, mx.float32)
            and tokens.dtype in (mx.int32, mx.uint32))


def lookup(tokens: mx.array, embed: nn.QuantizedEmbedding, flat: bool = False) -> mx.array:
    """embed(tokens): each token's dequantized row, in the scales' dtype, shaped (*tokens.shape,
    width), or (tokens, width) if flat (a decode step's 2-D rows, without a reshape)."""
    w = embed["weight"]
    rows, width = tokens.size, w.shape[1] * 32 // embed.bits
    return kernel("mtq_embed", ("tokens", "w", "scales", "biases"), ("out",), SOURCE)(
        inputs=[tokens, w, embed["scales"], embed["biases"]],
        template=[("T", embed["scales"].dtype), ("BITS", embed.bits), ("GS", embed.group_size),
                  ("THREADS", THREADS)],
        grid=(THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, width) if flat else (*tokens.shape, width)], output_dtypes=[embed["scales"].dtype])[0]
