"""The decode's CUDA kernels seeded into MLX's PTX cache (worker/decode/ptx_cache.py): MLX's names
for them on any machine; on CUDA, that MLX loads what was seeded instead of compiling."""

import logging
import shutil
import subprocess
import sys
import uuid

import mlx.core as mx
import pytest

from worker.decode import custom_kernel, ptx_cache
from worker.runtime.backend import cuda
from worker.supervisor import kernel_cache

cuda_only = pytest.mark.skipif(not cuda(), reason="MLX's PTX cache is CUDA's")


def test_the_hash_is_libstdcxxs_std_hash():
    """MLX names a custom kernel's module by std::hash of its source: libstdc++'s _Hash_bytes on
    64 bits. The values printed by `printf("%zx", std::hash<std::string>{}(s))` (g++ 12, x86-64)
    for strings that end on and off a multiple of 8 bytes."""
    text = b"# mlx-train-queue\n\nFine"
    assert ptx_cache.std_hash(b"") == 0x553E93901E462A6E
    assert ptx_cache.std_hash(b"a") == 0x454DDEE488C1ED6B
    assert ptx_cache.std_hash(b"hello world!") == 0x5B83CB3A55A9669F
    assert [ptx_cache.std_hash(text[:n]) for n in (7, 8, 9, 16, 23)] == [
        0x3F5B2867F8D23506, 0xAB60861F0873F5F8, 0x36434FD8038973A, 0x40E1DEDB5A47B51, 0x99B59CA268237CEB]


def test_a_kernels_source_and_name_are_mlxs():
    """custom_kernel.cpp's build_kernel: the name takes the template arguments, a parameter list
    from the inputs' dtypes (shape and strides where the source names them, not for a scalar),
    then the outputs; the template arguments as constants before the source."""
    x, w, eps = mx.zeros((2, 8), mx.bfloat16), mx.zeros((8,), mx.float32), mx.array(1e-6)
    name, source = ptx_cache.mlx_source("k", ("x", "w", "eps"), ("out",), "out[0] = x[w_shape[0]] + eps[0];",
                                        "// header\n", [x, w, eps], [mx.bfloat16],
                                        [("T", mx.bfloat16), ("N", 4), ("UP", True)])
    assert name == "custom_kernel_k_bfloat16_t_4_t"
    # MLX's get_type_string spells a dtype argument, not the dtype's own name (MLX printed
    # custom_kernel_mtq_lora_down_bfloat16_t_1024 for lora_kernel.down on an H100)
    names = [ptx_cache.mlx_source("k", ("x",), ("out",), "", "", [x], [mx.float32], [("T", t)])[0]
             for t in (mx.float16, mx.float32, mx.int32)]
    assert names == ["custom_kernel_k_float16_t", "custom_kernel_k_float", "custom_kernel_k_int32_t"]
    assert source == ptx_cache.DEFAULT_HEADER + """// header
namespace mlx::core::cu {

namespace cg = cooperative_groups;

__global__ void custom_kernel_k_bfloat16_t_4_t(
    const __nv_bfloat16* x,
    const float* w,
    const __grid_constant__ Shape w_shape,
    const float* eps,
    __nv_bfloat16* out) {
  using T = __nv_bfloat16;
  constexpr int N = 4;
  constexpr bool UP = true;

out[0] = x[w_shape[0]] + eps[0];
}

} // namespace mlx::core::cu
"""


def test_the_module_is_where_mlx_looks_for_it(tmp_path):
    """jit_module.cpp get_ptx_path: NAME_HASH.ptx in the cache folder, a name over 245 characters
    cut into folders; write_module writes the code whole, the lowered name beside it."""
    source = "the source"
    path = ptx_cache.module_path(tmp_path, "custom_kernel_k", source)
    assert path == tmp_path / f"custom_kernel_k_{ptx_cache.std_hash(source.encode()):x}.ptx"
    long = ptx_cache.module_path(tmp_path, "k" * 300, source)
    assert long.parent.parent == tmp_path and len(long.parent.name) == 245
    ptx_cache.write_module(path, "custom_kernel_k", b"\x7fELF code", "_ZN3mlx4core2cu15custom_kernel_kEv", source)
    assert path.read_bytes() == b"\x7fELF code" and path.with_suffix(".cu").read_text() == source
    lowered = "mlx::core::cu::custom_kernel_k\t_ZN3mlx4core2cu15custom_kernel_kEv\n"
    assert path.with_suffix(".txt").read_text() == lowered
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == sorted(
        [path.name, path.with_suffix(".txt").name, path.with_suffix(".cu").name])


LIBRARY = r"""
static const char utils[] = "// Copyright  2025 Apple Inc.\n#pragma once\n// utils\n";
static const char config[] = "// Copyright  2025 Apple Inc.\n#define MAX_NDIM 10\n";
static const char other[] = "// Copyright  2024 someone\n";
/* jit_module.cpp's two arrays, the headers first as MLX's library has them, between others that
   start and end with other strings, so that no two arrays make one run of pointers */
__attribute__((used)) const char* const before[] = {"x", other, "mlx/backend/cuda/device/x.h", "x"};
__attribute__((used)) const char* const g_headers[] = {config, utils};
__attribute__((used)) const char* const g_include_names[] = {"mlx/backend/cuda/device/config.h",
                                                            "mlx/backend/cuda/device/utils.cuh"};
__attribute__((used)) const char* const after[] = {"x", other, other, other, "x"};
"""


@pytest.mark.skipif(not shutil.which("cc") or sys.platform != "linux", reason="builds an ELF library with cc")
@pytest.mark.parametrize("relocations", ["rela", "relr"])
def test_mlxs_device_headers_are_read_from_its_library_by_name(tmp_path, relocations):
    """The wheel embeds the headers MLX gives NVRTC in its library, as an array of names and one of
    texts: a library laid out so (built here with the arrays' relocations, as MLX's is built, and
    packed as newer linkers pack them) gives each name its own text, not a lone pointer's nor a run
    of another length."""
    (tmp_path / "lib.c").write_text(LIBRARY)
    packed = ["-Wl,-z,pack-relative-relocs"] if relocations == "relr" else []
    built = subprocess.run(["cc", "-shared", "-fPIC", "-O2", *packed, "-o", tmp_path / "lib.so", tmp_path / "lib.c"],
                           capture_output=True, text=True)
    if built.returncode and packed:
        pytest.skip(f"this linker packs no relative relocations: {built.stderr.strip()}")
    assert built.returncode == 0, built.stderr
    assert (b".relr.dyn" in (tmp_path / "lib.so").read_bytes()) == bool(packed)  # the layout the case names
    assert ptx_cache.mlx_headers(tmp_path / "lib.so") == {
        "mlx/backend/cuda/device/config.h": b"// Copyright  2025 Apple Inc.\n#define MAX_NDIM 10\n",
        "mlx/backend/cuda/device/utils.cuh": b"// Copyright  2025 Apple Inc.\n#pragma once\n// utils\n"}


def test_packed_relative_relocations_are_each_address_and_its_bitmaps():
    """SHT_RELR: an address, then bitmaps (odd entries) of the 63 words after it, each bitmap
    carrying on where the last ended."""
    entries = [0x10000, 0b1011, 1 << 63 | 1, 0x20000]
    assert ptx_cache.relr(entries) == [0x10000, 0x10008, 0x10018, 0x10008 + 63 * 8 + 62 * 8, 0x20000]


def test_a_library_without_mlxs_device_headers_says_so(tmp_path):
    """MLX's CPU library has no device headers; a file that is no library neither."""
    (tmp_path / "text.so").write_bytes(b"not an ELF")
    with pytest.raises(ValueError, match="not a 64-bit"):
        ptx_cache.mlx_headers(tmp_path / "text.so")
    if not cuda():
        with pytest.raises(ValueError, match="0 arrays of MLX's device header names"):
            ptx_cache.mlx_headers(ptx_cache.mlx_library())


@pytest.mark.skipif(cuda(), reason="a machine without CUDA")
def test_without_cuda_seeding_leaves_the_kernel_to_mlx_and_says_so_once(caplog, monkeypatch):
    monkeypatch.setattr(ptx_cache, "_seen", set())
    monkeypatch.setattr(ptx_cache, "_compiler", [])
    x = mx.zeros((4,), mx.float32)
    with caplog.at_level(logging.WARNING, logger=ptx_cache.__name__):
        for source in ("out[0] = x[0];", "out[0] = 2 * x[0];"):
            ptx_cache.seed(*ptx_cache.mlx_source(f"k{uuid.uuid4().hex}", ("x",), ("out",), source, "", [x],
                                                 [mx.float32], None))
    assert len(caplog.records) == 1 and "left to MLX" in caplog.text
    assert ptx_cache._compiler == [None]


@cuda_only
def test_mlx_loads_a_seeded_kernel_instead_of_compiling_it():
    """The module seeded under a kernel's name is what MLX runs: seeded with another source's
    code (times 3 where the kernel's own adds 1), the kernel multiplies. So the name (template
    arguments of each kind: a dtype's name is MLX's get_type_string, bfloat16_t), the hash, the
    files and the launch's parameters are MLX's own."""
    a = mx.arange(4, dtype=mx.bfloat16)
    name = f"mtq_seed_test_{uuid.uuid4().hex}"
    template = [("T", mx.bfloat16), ("N", 3), ("UP", True)]
    own = "out[threadIdx.x] = static_cast<T>(static_cast<float>(a[threadIdx.x]) + 1.0f);"
    other = "out[threadIdx.x] = static_cast<T>(static_cast<float>(a[threadIdx.x]) * N);"
    kname, source = ptx_cache.mlx_source(name, ("a",), ("out",), own, "", [a], [mx.bfloat16], template)
    code, lowered = ptx_cache.nvrtc().compile(kname, ptx_cache.mlx_source(name, ("a",), ("out",), other, "", [a],
                                                                          [mx.bfloat16], template)[1])
    path = ptx_cache.module_path(kernel_cache.kernel_dir(mx.__version__, "cuda"), kname, source)
    ptx_cache.write_module(path, kname, code, lowered, source)
    made = mx.fast.cuda_kernel(name=name, input_names=["a"], output_names=["out"], source=own)
    out = made(inputs=[a], output_shapes=[a.shape], output_dtypes=[mx.bfloat16], grid=(4, 1, 1), threadgroup=(4, 1, 1),
               template=template)
    assert out[0].tolist() == [0.0, 3.0, 6.0, 9.0]


@cuda_only
def test_a_decode_kernel_is_in_mlxs_cache_after_its_first_call():
    """custom_kernel.kernel seeds each form of a call before MLX runs it, and the kernel computes
    its own source's result; one that includes MLX's device headers (swiglu_kernel's Sigmoid) too,
    rounding as MLX's own sigmoid does."""
    a = mx.arange(-4, 4, dtype=mx.bfloat16).reshape(2, 4) / 3
    name = f"mtq_seed_test_{uuid.uuid4().hex}"
    source = "out[threadIdx.x] = Sigmoid{}(a[threadIdx.x]) * static_cast<T>(a_shape[1]);"
    header = '#include "mlx/backend/cuda/device/unary_ops.cuh"\n'
    made = custom_kernel.kernel(name, ("a",), ("out",), source, header=header)
    out = made(inputs=[a], output_shapes=[(8,)], output_dtypes=[mx.bfloat16], grid=(8, 1, 1), threadgroup=(8, 1, 1),
               template=[("T", mx.bfloat16)])
    assert out[0].tolist() == (mx.sigmoid(a).reshape(8) * mx.array(4, mx.bfloat16)).tolist()
    kname, whole = ptx_cache.mlx_source(name, ("a",), ("out",), source, header, [a], [mx.bfloat16],
                                        [("T", mx.bfloat16)])
    assert ptx_cache.module_path(kernel_cache.kernel_dir(mx.__version__, "cuda"), kname, whole).exists()
