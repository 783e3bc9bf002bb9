"""A job's numbers as inputs of the functions it compiles. mx.compile bakes a Python number that a
compiled function computes with into the kernels it compiles (a fused kernel's name carries its
scalar constants' values), so every new value of a job's LoRA scale, temperature, top_p, clip
range, beta or gradient clip compiled new kernels on every worker that ran it: a few seconds each
on CUDA (docs/performance.md, "A job's numbers as inputs"). Given to the compiled function as an
input (an argument, or an array in its `inputs=` state), a value is read, not compiled in: a sweep
over them compiles nothing new. What picks another graph stays a Python choice (beta 0 or not,
greedy or not, top_p 1 or not).

Each is a float32 array of the number, the value MLX would make of it in float32 math; in lower
precision math, cast it to the other operand's dtype first, as MLX casts a Python number there,
so that the results are those of the number.
"""

import mlx.core as mx


def as_input(value: float) -> mx.array:
    """The number as a 0-d float32 array (it broadcasts as the number would)."""
    return mx.array(value, mx.float32)


def as_inputs(**values: float) -> dict[str, mx.array]:
    """Several numbers by name (as_input each): a compiled function's `inputs=` state."""
    return {name: as_input(value) for name, value in values.items()}
