"""Which MLX backend this process computes on. The decode step's CUDA kernels
(worker/decode/*_kernel.py) run only on CUDA, and the memory plan gives a decode dense copies of
quantized weights only there (worker/runtime/memory_plan.py); both ask here, so that planning
memory loads no part of the decoder."""

import mlx.core as mx


def cuda() -> bool:
    """Whether MLX runs on its CUDA backend."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()
