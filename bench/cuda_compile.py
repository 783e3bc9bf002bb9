"""Compile the decode's CUDA kernels (worker/decode/*_kernel.py) with NVRTC, on any machine.

    python3 -m pip install --target DIR --no-deps "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*" \
        "nvidia-cuda-cccl==13.*"
    python3 bench/cuda_compile.py --cuda DIR [--mlx-lib LIBMLX | --mlx-src MLX_SOURCE_TREE] [--arch sm_90a]
                                  [--only NAME]
                                  [--model DIR --rows 8 --lora-layers 16]

MLX's CUDA backend compiles a custom kernel (mx.fast.cuda_kernel) at its first call on a GPU, so
a kernel source that does not compile fails a job there, and no test on a CPU sees it. This
traces decode steps as a CUDA GPU would run them (bench/decode.py's kernels_as_on_cuda: each
kernel call where it would run, recorded instead of made) for the models and rows a job
reaches, and compiles every distinct instantiation as MLX 0.32 does: the source that
custom_kernel.cpp's build_kernel makes (a parameter list from the inputs' dtypes and from which
of NAME_shape, NAME_strides and NAME_ndim the source uses, the template arguments as constants)
and the options of jit_module.cpp, for --arch (the H200's by default). It prints each kernel
and its template arguments, and NVRTC's log of any that fails; it exits 1 if one did.

What it traces: Qwen3 models (their attention whole in the kernel: q/k norms and RoPE) and a
Llama model (the kernel on mlx_lm's attention), head dims 64 and 128, in float32, bfloat16 and
float16, and 4- and 8-bit in groups of 32 and 64; without LoRA, with LoRA on the last block and on both;
1 to 8 rows and 32; KV buffers of 3 lengths (attention_kernel.WARPS). A compile checks what the
source says, not what it computes: tests/test_decode.py's CUDA tests do that on a GPU.

--model DIR: only that model's decode (loaded as a job loads it, LoRA on --lora-layers blocks, --rows
rows), each source timed and its compiled module's size printed: what a process pays for a job's
kernels where MLX's PTX cache lacks them (MLX 0.32 never writes custom kernels there;
worker/decode/ptx_cache.py does).

--cuda DIR: where pip put NVRTC, the CUDA runtime's headers and CCCL (the command above; 13.x,
as the mlx-cuda-13 wheel takes). The sources compile with MLX's device headers as a worker
compiles them into MLX's PTX cache: read from MLX's CUDA library (ptx_cache.mlx_headers), the
installed MLX's or --mlx-lib's (a CPU machine's MLX has none: unpack the mlx-cuda wheel and pass
its mlx/lib/libmlx.so); --mlx-src: from an MLX source tree's mlx/backend/cuda/device/ instead.
"""

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx_lm  # noqa: E402
from decode import kernels_as_on_cuda  # noqa: E402
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models import llama, qwen3  # noqa: E402
from mlx_lm.tuner.utils import linear_to_lora_layers  # noqa: E402

from worker.decode import ptx_cache  # noqa: E402
from worker.decode.draw import SamplingParams  # noqa: E402
from worker.decode.sampling import make_decode_step, sample  # noqa: E402
from worker.runtime.projection_groups import fuse_shared_inputs  # noqa: E402

def models():
    """(label, make) for every model traced: make() gives it with random weights, two blocks."""
    base = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512, vocab_size=512, rms_norm_eps=1e-6,
                rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=4096)
    archs = [("qwen3 d128", qwen3, dict(base, model_type="qwen3", num_attention_heads=4, num_key_value_heads=2,
                                        head_dim=128)),
             ("qwen3 d64", qwen3, dict(base, model_type="qwen3", num_attention_heads=4, num_key_value_heads=4,
                                       head_dim=64)),
             ("llama d64", llama, dict(base, model_type="llama", num_attention_heads=4, num_key_value_heads=2))]
    for label, module, args in archs:
        for dtype in (mx.float32, mx.bfloat16, mx.float16):
            for b, group in ((None, None), (4, 64), (4, 32), (8, 64)):
                def make(module=module, args=args, dtype=dtype, b=b, group=group):
                    model = module.Model(module.ModelArgs.from_dict(args))
                    model.update(tree_map(lambda w: w.astype(dtype), model.parameters()))
                    if b is not None:
                        nn.quantize(model, group_size=group, bits=b)
                    mx.eval(model.parameters())
                    return model
                yield f"{label} {str(dtype).removeprefix('mlx.core.')}" + (f" {b}-bit g{group}" if b else ""), make


def with_lora(model, lora_layers: int):
    """The model as a job decodes with it: shared-input projections fused, base frozen, LoRA on its
    last lora_layers blocks (0: none)."""
    fuse_shared_inputs(model)
    model.freeze()
    if lora_layers:
        linear_to_lora_layers(model, lora_layers, {"rank": 8, "scale": 16.0, "dropout": 0.0})
        model.eval()
    return model


class _Traced(Exception):
    pass


def trace(model, rows: int, capacity: int) -> None:
    """sample()'s first decode step, traced and not run: the kernels it calls, recorded."""
    p = SamplingParams(max_tokens=capacity - 4, temperature=1.0)
    step = make_decode_step(model, p, [], 0)

    def first(*args):
        step(*args)
        raise _Traced

    try:
        sample(model, first, [[1, 2, 3, 4]] * rows, 1, p, [], mx.random.key(0))
    except _Traced:
        return
    raise RuntimeError("sample() made no decode step")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cuda", type=Path, required=True, help="pip's --target of nvidia-cuda-nvrtc, -runtime and -cccl")
    ap.add_argument("--mlx-lib", type=Path, help="MLX's CUDA library (libmlx.so), its device headers; default: "
                    "the installed MLX's")
    ap.add_argument("--mlx-src", type=Path, help="an MLX source tree: its device headers, not a library's")
    ap.add_argument("--arch", default="sm_90a", help="NVRTC's --gpu-architecture (MLX: sm_XYa from 9.0 on)")
    ap.add_argument("--only", help="compile only the kernels whose name holds this")
    ap.add_argument("--model", help="trace only this model's decode (a path or Hugging Face id)")
    ap.add_argument("--rows", type=int, default=8, help="with --model: the decode's rows")
    ap.add_argument("--lora-layers", type=int, default=16, help="with --model: blocks with LoRA (0: none)")
    args = ap.parse_args()
    include = next((args.cuda / "nvidia").glob("cu*/include"))
    if args.mlx_src:
        device = args.mlx_src / "mlx/backend/cuda/device"
        found = sorted(device.glob("*.cuh")) + sorted(device.glob("*.h"))
        headers = {str(h.relative_to(args.mlx_src)): h.read_bytes() for h in found}
        if not headers:
            raise SystemExit(f"no MLX device headers under {device}")
    else:
        library = args.mlx_lib or ptx_cache.mlx_library()
        try:
            headers = ptx_cache.mlx_headers(library)
        except ValueError as e:
            raise SystemExit(f"{e}: pass --mlx-lib, the mlx/lib/libmlx.so of an unpacked mlx-cuda wheel") from None
    mlx_include = ptx_cache.site_dirs()[0]  # where MLX's include paths begin
    nvrtc = ptx_cache.NVRTC(ptx_cache.load_nvrtc(next((args.cuda / "nvidia").glob("cu*/lib"))),
                            [mlx_include, include / "cccl", include], args.arch, headers)

    calls: list = []
    with kernels_as_on_cuda(calls):
        if args.model:
            trace(with_lora(mlx_lm.load(args.model)[0], args.lora_layers), args.rows, 64)
        else:
            for label, make in models():
                for lora_layers in (0, 1, 2):  # none, the last block's (a block without LoRA before it), all
                    model = with_lora(make(), lora_layers)
                    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 32):
                        for capacity in (64, 300, 600) if rows == 1 else (64,):
                            trace(model, rows, capacity)
                print(f"traced {label}: {len(calls)} kernel calls so far", flush=True)

    sources = {}
    for kernel, call in calls:
        if args.only and args.only not in kernel["name"]:
            continue
        name, source = ptx_cache.mlx_source(kernel["name"], kernel["input_names"], kernel["output_names"],
                                            kernel["source"], kernel["header"], call["inputs"], call["output_dtypes"],
                                            call.get("template"))
        sources.setdefault(source, name)
    print(f"{len(calls)} kernel calls, {len(sources)} distinct sources", flush=True)
    failed, started = 0, time.perf_counter()
    for source, name in sorted(sources.items(), key=lambda item: item[1]):
        t0 = time.perf_counter()
        try:
            size = f"{len(nvrtc.compile(name, source)[0]) / 1000:6.1f} KB"  # the module MLX's PTX cache holds
            log = ""
        except RuntimeError as e:
            size, log = "", str(e)
        print(f"  {'FAIL' if log else 'ok  '} {name:70s} {time.perf_counter() - t0:5.1f} s {size}", flush=True)
        if log:
            print("\n".join("      " + line for line in log.strip().splitlines()), flush=True)
        failed += bool(log)
    print(f"{len(sources) - failed} compiled, {failed} failed, {time.perf_counter() - started:.1f} s", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
