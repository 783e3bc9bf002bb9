"""The one way the decode's CUDA kernels (worker/decode/*_kernel.py) are made: MLX's custom
CUDA kernel of a source, made at its first call and kept (mx.fast.cuda_kernel is CUDA's only,
so a kernel is made only where it runs)."""

import functools

import mlx.core as mx


@functools.cache
def kernel(name: str, inputs: tuple[str, ...], outputs: tuple[str, ...], source: str, contiguous: bool = True,
           header: str = ""):
    return mx.fast.cuda_kernel(name=name, input_names=list(inputs), output_names=list(outputs), source=source,
                               header=header, ensure_row_contiguous=contiguous)
