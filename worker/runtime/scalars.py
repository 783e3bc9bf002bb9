"""A job's numbers as inputs of the functions it compiles. mx.compile bakes a Python number that a
compiled function computes with into the kernels it compiles (a fused kernel's name carries its
scalar constants' values), so every new value of a job's LoRA scale, temperature, top_p, clip
range, beta or gradient clip compiled new kernels on every worker that ran it: a few seconds each
on CUDA (docs/performance.md, "A job's numbers as inputs"). Given to the compiled function as an
input (an argument, or an array in its `inputs=` state), a value is read, not compiled in: a sweep
over them compiles nothing new. What picks another graph stays a Python choice (beta 0 or not,
greedy or not, top_p 1 or not). A mean is taken with `mean`: mx.mean's divisor is a constant of
the batch's size, so every batch size compiled kernels of its own.

Each is an array of the number as MLX would make it in the math it goes into (float32, or the
model's dtype for a LoRA scale), so that the results are those of the number.
"""

import mlx.core as mx


def as_input(value: float, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The number as a 0-d array (it broadcasts as the number would), float32 unless the math it
    goes into is in another dtype: then that dtype, the value MLX would make of the number there."""
    return mx.array(value, dtype)


def as_inputs(**values: float) -> dict[str, mx.array]:
    """Several numbers by name (as_input each): a compiled function's `inputs=` state."""
    return {name: as_input(value) for name, value in values.items()}


def mean(x: mx.array, axis: int | None = None) -> mx.array:
    """x's mean (over `axis`, or all of it) as mx.mean computes it, sum times 1/count, with the count
    summed on the device: mx.mean's 1/count is a scalar constant, compiled into the kernels, so a
    job of another batch size compiled its loss's kernels again (tests/test_scalars.py)."""
    count = mx.ones(x.shape, mx.float32).sum(axis)
    return x.sum(axis) * mx.reciprocal(count).astype(x.dtype)
