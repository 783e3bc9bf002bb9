"""The decode's CUDA kernels in MLX's own PTX cache, so that a new process loads them from disk.

MLX 0.32 compiles a custom kernel (mx.fast.cuda_kernel) with NVRTC in every process: its
custom_kernel.cpp asks get_jit_module for it with use_disk_cache false, so MLX never writes it to
the PTX cache. It does read the cache first, though (jit_module.cpp's JitModule). So before a
kernel's first call, seed() looks for the file MLX will look for (the module name MLX gives the
kernel: its name and the libstdc++ hash of its source), and where it is missing compiles the
source as MLX would (NVRTC, MLX's options, the device's architecture) and writes it there. MLX
then loads it instead of compiling; the next process, and the fleet's workers through the kernel
share (worker/supervisor/kernel_share.py), find it too. Anything that fails here leaves the
kernel to MLX, which compiles it as before.

mlx_source() makes the source as custom_kernel.cpp's build_kernel does, byte for byte: the module
name hashes it. NVRTC gets MLX's device headers as named headers, as jit_module.cpp gives them;
the wheel embeds those in its library rather than ship them as files, so mlx_headers() reads them
from there. The module is then what MLX would compile: the same source, headers, options and
NVRTC.
"""

import ctypes
import logging
import mmap
import os
import struct
from pathlib import Path

import mlx.core as mx

from worker.supervisor import kernel_cache

log = logging.getLogger(__name__)

CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
              mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
              mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}
# MLX's get_type_string (backend/common/compiled.cpp), which names a dtype template argument in
# the kernel's name: CUDA's type names but for the two half types
TYPE_NAMES = dict(CUDA_TYPES) | {mx.float16: "float16_t", mx.bfloat16: "bfloat16_t"}
DEFAULT_HEADER = '''
#include "mlx/backend/cuda/device/utils.cuh"

#include <cooperative_groups.h>

'''
HEADER_PREFIX = b"mlx/backend/cuda/device/"  # jit_module.cpp's INCLUDE_PREFIX
HEADER_START = b"// Copyright"  # each device header's first line
RELATIVE = {62: 8, 183: 1027}  # ELF machine: its R_*_RELATIVE relocation (x86-64, AArch64)
MAX_FILE_NAME = 245  # jit_module.cpp get_ptx_path: longer module names become folders
_MASK = 2**64 - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes) -> int:
    """std::hash<std::string> of libstdc++ on 64 bits (_Hash_bytes, seed 0xc70f6907): the hash MLX's
    custom kernels name their modules by."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)
    n = len(data)
    aligned = n & ~7
    h = (0xC70F6907 ^ (n * _MUL)) & _MASK
    for i in range(0, aligned, 8):
        h = ((h ^ (shift_mix(int.from_bytes(data[i:i + 8], "little") * _MUL & _MASK) * _MUL & _MASK)) * _MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _MASK
    return shift_mix(shift_mix(h) * _MUL & _MASK)


def mlx_source(name: str, input_names, output_names, source: str, header: str, inputs, output_dtypes,
               template) -> tuple[str, str]:
    """(the kernel's name, its whole source) as MLX's custom_kernel.cpp makes them for one call."""
    template = template or []

    def hashed(value) -> str:
        if isinstance(value, bool):
            return "_t" if value else "_f"
        if isinstance(value, int):
            return f"_{value}"
        return "_" + TYPE_NAMES[value]

    kname = "custom_kernel_" + name + "".join(hashed(v) for _, v in template)
    params = []
    for arg, x in zip(input_names, inputs):
        params.append(f"    const {CUDA_TYPES[x.dtype]}* {arg}")
        if x.ndim > 0:
            for suffix, kind in (("_shape", "Shape"), ("_strides", "Strides"), ("_ndim", "int")):
                if arg + suffix in source:
                    params.append(f"    const __grid_constant__ {kind} {arg}{suffix}")
    params += [f"    {CUDA_TYPES[d]}* {arg}" for arg, d in zip(output_names, output_dtypes)]
    constants = []
    for arg, value in template:
        if isinstance(value, bool):
            constants.append(f"  constexpr bool {arg} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            constants.append(f"  constexpr int {arg} = {value};")
        else:
            constants.append(f"  using {arg} = {CUDA_TYPES[value]};")
    whole = (DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
             + f"__global__ void {kname}(\n" + ",\n".join(params) + ") {\n"
             + ("\n".join(constants) + "\n\n" if constants else "") + source
             + "\n}\n\n} // namespace mlx::core::cu\n")
    return kname, whole


def module_path(cache_dir: Path, kname: str, source: str) -> Path:
    """Where MLX looks for the kernel's compiled module (jit_module.cpp get_ptx_path)."""
    module = f"{kname}_{std_hash(source.encode()):x}"
    path = cache_dir
    while len(module) > MAX_FILE_NAME:
        path, module = path / module[:MAX_FILE_NAME], module[MAX_FILE_NAME:]
    return path / (module + ".ptx")


def mlx_headers(library: Path) -> dict[str, bytes]:
    """MLX's device headers by name, as jit_module.cpp gives them to NVRTC (g_include_names,
    g_headers), read from MLX's library (an ELF of 64 bits). Each array is a run of pointers, each
    pointer a relative relocation to a NUL-terminated string: the names are the one run of strings
    that start with HEADER_PREFIX, the headers the one run as long of texts that start with
    HEADER_START. ValueError where the library is not laid out so (MLX's CPU library has none)."""
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError(f"{library} is not a 64-bit little-endian ELF")
        relative = RELATIVE.get(struct.unpack_from("<H", data, 0x12)[0])
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phsize, phnum, shsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        segments = []  # (address, file offset, size) of what is loaded
        for i in range(phnum):
            kind, _, offset, address, _, size = struct.unpack_from("<IIQQQQ", data, phoff + i * phsize)
            if kind == 1:  # PT_LOAD
                segments.append((address, offset, size))

        def at(address: int) -> int | None:
            """The file offset of a loaded address."""
            for base, offset, size in segments:
                if base <= address < base + size:
                    return offset + address - base
            return None

        pointers = {}  # address of a pointer -> address it points at
        for i in range(shnum):
            _, kind, _, _, offset, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shsize)
            if kind == 4:  # SHT_RELA
                for where, info, addend in struct.iter_unpack("<QQq", data[offset:offset + size]):
                    if info & 0xFFFFFFFF == relative:
                        pointers[where] = addend
            elif kind == 19:  # SHT_RELR, packed relative relocations (ld -z pack-relative-relocs)
                for where in relr(entry for (entry,) in struct.iter_unpack("<Q", data[offset:offset + size])):
                    if (stored := at(where)) is not None:  # the addend is what the file holds there
                        pointers[where] = struct.unpack_from("<Q", data, stored)[0]

        def text(address: int, start: bytes) -> bytes | None:
            """The NUL-terminated string at the address if it begins with start."""
            if (offset := at(address)) is None or data[offset:offset + len(start)] != start:
                return None
            return bytes(data[offset:data.find(b"\0", offset)])

        def runs(start: bytes) -> list[list[bytes]]:
            """The strings of each run of consecutive pointers to strings that begin with start."""
            strings = {w: s for w, address in pointers.items() if (s := text(address, start)) is not None}
            found, last = [], None
            for where in sorted(strings):
                if where != last:
                    found.append([])
                found[-1].append(strings[where])
                last = where + 8
            return found

        names = [r for r in runs(HEADER_PREFIX) if len(r) > 1]
        headers = [r for r in runs(HEADER_START) if names and len(r) == len(names[0])]
    if len(names) != 1 or len(headers) != 1:
        raise ValueError(f"{library} has {len(names)} arrays of MLX's device header names and {len(headers)} of "
                         "headers as long, where MLX's CUDA library has one of each")
    return dict(zip((n.decode() for n in names[0]), headers[0]))


def relr(entries) -> list[int]:
    """The addresses a SHT_RELR section relocates (64 bits): an even entry is an address, and the
    next entries that are odd are bitmaps of the 63 words after it, then after those."""
    addresses, next_word = [], 0
    for entry in entries:
        if entry & 1 == 0:
            addresses.append(entry)
            next_word = entry + 8
        else:
            addresses += [next_word + 8 * (bit - 1) for bit in range(1, 64) if entry >> bit & 1]
            next_word += 63 * 8
    return addresses


class NVRTC:
    """NVRTC through ctypes with MLX's options and include paths (jit_module.cpp compile,
    include_path_args) and MLX's device headers as named headers (headers: name -> text, as
    mlx_headers reads them), for one architecture."""

    def __init__(self, lib: ctypes.CDLL, include_dirs: list[Path], arch: str, headers: dict[str, bytes]):
        self.lib = lib
        self.names = [n.encode() for n in headers]
        self.texts = list(headers.values())
        self.options = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode()]
        self.options += [f"--include-path={d}".encode() for d in include_dirs]

    def compile(self, kname: str, source: str) -> tuple[bytes, str]:
        """(the module's machine code, the kernel's lowered name); raises with NVRTC's log."""
        lib, prog = self.lib, ctypes.c_void_p()
        check = self._check
        n = len(self.names)
        check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{kname}.cu".encode(), n,
                                     (ctypes.c_char_p * n)(*self.texts), (ctypes.c_char_p * n)(*self.names)),
              "nvrtcCreateProgram")
        try:
            expression = f"mlx::core::cu::{kname}".encode()
            check(lib.nvrtcAddNameExpression(prog, expression), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(self.options))(*self.options)
            if lib.nvrtcCompileProgram(prog, len(self.options), opts) != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetProgramLog(prog, text)
                raise RuntimeError(f"NVRTC could not compile {kname}: {text.value.decode(errors='replace')}")
            lowered = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(prog, expression, ctypes.byref(lowered)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            code = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetCUBIN(prog, code), "nvrtcGetCUBIN")
            return code.raw, lowered.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: NVRTC error {rc}")


def write_module(path: Path, kname: str, code: bytes, lowered: str, source: str) -> None:
    """The files MLX's write_cached_ptx would write: the kernel's lowered name, its source, and its
    code last (the file MLX looks for), each renamed into place whole, since another process on
    the same cache may be reading them."""
    kernel_cache.write_whole(path.with_suffix(".txt"), f"mlx::core::cu::{kname}\t{lowered}\n".encode())
    kernel_cache.write_whole(path.with_suffix(".cu"), source.encode())
    kernel_cache.write_whole(path, code)


def mlx_library() -> Path:
    """The installed MLX's library, whose device headers mlx_headers reads."""
    return Path(mx.__file__).resolve().parent / "lib" / "libmlx.so"


def site_dirs() -> tuple[Path, Path]:
    """(the mlx package's include folder, CUDA's headers) where MLX finds them."""
    site = Path(mx.__file__).resolve().parents[1]
    cuda = site / "nvidia" / "cu13" / "include"
    if not cuda.exists():
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        cuda = Path(home) / "include"
    return site / "mlx" / "include", cuda


def _device_arch() -> str:
    """sm_XY, with 'a' from 9.0 on, of device 0 (jit_module.cpp compile), through the driver."""
    cuda = ctypes.CDLL("libcuda.so.1")
    device, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0):
        raise RuntimeError("no CUDA device")
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, device)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, device)
    return f"sm_{major.value}{minor.value}{'a' if major.value >= 9 else ''}"


def load_nvrtc(folder: Path) -> ctypes.CDLL:
    """The folder's libnvrtc, its builtins library first: libnvrtc loads that by name, from the
    loader's paths."""
    for builtins in sorted(folder.glob("libnvrtc-builtins.so*")):
        ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(str(folder / "libnvrtc.so.13"))


def nvrtc() -> NVRTC:
    """NVRTC as MLX finds it (the nvidia-cuda-nvrtc package beside mlx, else CUDA_HOME's or the
    loader's), with the headers of the installed MLX's library."""
    include, cuda = site_dirs()
    headers = mlx_headers(mlx_library())
    folder = next((f for f in (cuda.parent / "lib", cuda.parent / "lib64") if (f / "libnvrtc.so.13").exists()), None)
    lib = load_nvrtc(folder) if folder else ctypes.CDLL("libnvrtc.so.13")
    return NVRTC(lib, [include, include / "cccl", cuda], _device_arch(), headers)


_seen: set[Path] = set()
_compiler: list = []  # the NVRTC of this process, made at the first kernel that needs one; [None]: none


def seed(kname: str, source: str) -> None:
    """Make sure MLX finds the kernel of this source in its PTX cache (compiling it where missing);
    where that fails, log why once and leave the kernel to MLX."""
    path = module_path(kernel_cache.kernel_dir(mx.__version__, "cuda"), kname, source)
    if path in _seen:
        return
    _seen.add(path)
    if path.exists():
        return
    try:
        if not _compiler:
            _compiler.append(nvrtc())
        if _compiler[0] is not None:
            code, lowered = _compiler[0].compile(kname, source)
            write_module(path, kname, code, lowered, source)
    except Exception as e:  # MLX compiles the kernel itself, as it did before this cache
        if not _compiler:
            _compiler.append(None)
        log.warning("the decode's kernel %s is left to MLX to compile: %s", kname, e)
