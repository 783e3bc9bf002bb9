"""The one way the decode's CUDA kernels (worker/decode/*_kernel.py) are made: MLX's custom
CUDA kernel of a source, made at its first call and kept (mx.fast.cuda_kernel is CUDA's only,
so a kernel is made only where it runs). Each form a call takes (dtypes, dimensions, template
arguments) is put into MLX's PTX cache before its first call (worker/decode/ptx_cache.py), so
that only the first process that meets it compiles it."""

import functools

import mlx.core as mx

from worker.decode import ptx_cache


@functools.cache
def kernel(name: str, input_names: tuple[str, ...], output_names: tuple[str, ...], source: str,
           contiguous: bool = True, header: str = ""):
    made = mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                               source=source, header=header, ensure_row_contiguous=contiguous)
    seeded = set()

    def call(*, inputs, output_dtypes, template=None, **kwargs):
        inputs = [x if isinstance(x, mx.array) else mx.array(x) for x in inputs]  # as MLX takes a number
        form = (tuple((x.dtype, x.ndim) for x in inputs), tuple(output_dtypes), tuple(template or ()))
        if form not in seeded:  # a decode step is traced once (mx.compile): this runs at the trace
            seeded.add(form)
            ptx_cache.seed(*ptx_cache.mlx_source(name, input_names, output_names, source, header, inputs,
                                                 output_dtypes, template))
        return made(inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)
    return call
