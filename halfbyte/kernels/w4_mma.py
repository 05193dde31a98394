"""The CUDA 4-bit tensor-core matmul for 1-16 fp16 rows (cuda/w4_mma.cu): build, load, launch.

Triton's gemv_w4 / gemm_w4 stay the fallback: this path needs nvcc at first use (the library is
built once per GPU architecture and source version, ~5 s, into ~/.cache/halfbyte or
$HALFBYTE_CACHE_DIR) and a GPU of compute capability 8.0 or newer. quant_matmul uses it when
HALFBYTE_W4_KERNEL=cuda (being measured against the Triton kernels). Why it exists: BENCHMARKS.md (2026-12-04, fourth session). The reference is
quant_matmul.quant_matmul_ref."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from halfbyte.kernels.quant_gemv import _counter_buffer
from halfbyte.kernels.triton_utils import HAS_TRITON, _pdl_on

SOURCE = Path(__file__).with_name("cuda") / "w4_mma.cu"
COLS = 64  # columns per block (the .cu file's COLS)
WARPS = 4  # warps per block, splitting its K range
STEP_K = 128  # a warp's K range is a whole number of these and of groups
MAX_ROWS = 16
DEPTHS = (4, 8)  # steps of weights in flight per thread: the compiled variants
# programmatic dependent launch: 1 lets the next kernel launch after this one's wait, 2 at once
# (HALFBYTE_PDL_EARLY=1; being measured)
_PDL_MODE = 2 if os.environ.get("HALFBYTE_PDL_EARLY") == "1" else 1


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def _cache_dir() -> Path:
    return Path(os.environ.get("HALFBYTE_CACHE_DIR") or Path.home() / ".cache" / "halfbyte")


@functools.cache
def _library(major: int, minor: int) -> ctypes.CDLL | None:
    """The built library for this architecture, or None (with one warning) where it cannot be built."""
    nvcc = _nvcc()
    if nvcc is None:
        return None
    arch = f"sm_{major}{minor}{'a' if major == 9 else ''}"  # sm_90a: griddepcontrol (PDL)
    flags = ["-O3", "-std=c++17", f"-arch={arch}", "-shared", "-Xcompiler", "-fPIC", "-cudart", "shared"]
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    path = _cache_dir() / f"w4_mma-{arch}-{digest}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            built = Path(tmp) / path.name
            run = subprocess.run([nvcc, *flags, "-o", str(built), str(SOURCE)], capture_output=True, text=True)
            if run.returncode != 0:
                warnings.warn(f"halfbyte: nvcc could not build {SOURCE.name}, using the Triton kernels: "
                              f"{run.stderr.strip()[-400:]}", stacklevel=3)
                return None
            os.replace(built, path)  # complete or absent, never half-written
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        warnings.warn(f"halfbyte: cannot load {path}: {e}; using the Triton kernels", stacklevel=3)
        return None
    vp, i32 = ctypes.c_void_p, ctypes.c_int
    lib.hb_w4_mma.argtypes = [vp] * 7 + [i32] * 9 + [vp]  # x .. counters, M .. depth, device, stream
    lib.hb_w4_mma.restype = i32
    lib.hb_w4_mma_init.argtypes = [i32]
    lib.hb_w4_mma_init.restype = i32
    lib.hb_w4_mma_registers.argtypes = [i32, i32]
    lib.hb_w4_mma_registers.restype = i32
    return lib


@functools.cache
def _ready(device_index: int) -> ctypes.CDLL | None:
    """The library with its kernels loaded on this device, or None."""
    if os.environ.get("HALFBYTE_W4_KERNEL") == "triton":
        return None
    major, minor = torch.cuda.get_device_capability(device_index)
    if major < 8:
        return None
    lib = _library(major, minor)
    if lib is None:
        return None
    err = lib.hb_w4_mma_init(device_index)
    if err != 0:
        warnings.warn(f"halfbyte: w4_mma kernels did not load (CUDA error {err}); using the Triton kernels", stacklevel=3)
        return None
    return lib


def chosen() -> bool:
    """Whether quant_matmul routes 1-16 row 4-bit calls here (HALFBYTE_W4_KERNEL=cuda)."""
    return os.environ.get("HALFBYTE_W4_KERNEL") == "cuda"


def available(device: torch.device) -> bool:
    return device.type == "cuda" and _ready(_index(device)) is not None


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def supports(x: torch.Tensor, bits: int, group_size: int, qweight: torch.Tensor, scales: torch.Tensor,
             mins: torch.Tensor) -> bool:
    """4 bits, 1-16 fp16 rows, N a multiple of 64, K of 32, groups a power of two >= 32, aligned
    contiguous operands (16-byte loads of x and of weight words), and the library built."""
    if bits != 4 or x.dtype != torch.float16 or x.device.type != "cuda" or x.dim() != 2:
        return False
    m, k = x.shape
    n = qweight.shape[1]
    if not (1 <= m <= MAX_ROWS and n % COLS == 0 and k % 32 == 0 and group_size >= 32
            and group_size & (group_size - 1) == 0):
        return False
    if not (x.is_contiguous() and qweight.is_contiguous() and scales.is_contiguous() and mins.is_contiguous()):
        return False
    if x.data_ptr() % 16 or qweight.data_ptr() % 16 or scales.data_ptr() % 8 or mins.data_ptr() % 8:
        return False
    return available(x.device)


def plan(n: int, k: int, group_size: int, sms: int) -> tuple[int, int]:
    """(split, k_per_warp): each warp's K range a whole number of max(group, 128) k, as short as
    keeps the grid within about two waves of 4 resident blocks per SM (short ranges put more
    bytes in flight at once; each block adds a partial sum to reduce)."""
    unit = max(group_size, STEP_K)
    units = -(-k // unit)
    per_warp = 1
    while per_warp < units and (n // COLS) * -(-units // (WARPS * per_warp)) > 2 * 4 * sms:
        per_warp *= 2
    k_per_warp = per_warp * unit
    return -(-k // (WARPS * k_per_warp)), k_per_warp


def w4_mma(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
    k_per_warp: int | None = None, depth: int = 4, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 16, K] fp16 -> [M, N] fp16 (fresh, or written into `out`). k_per_warp: override the
    plan (a multiple of max(group, 128)); depth: 4 or 8 steps of weights in flight per thread."""
    m, k = x.shape
    n = qweight.shape[1]
    if not supports(x, 4, group_size, qweight, scales, mins):
        raise ValueError(f"w4_mma: unsupported call x {tuple(x.shape)} {x.dtype}, N {n}, group {group_size}")
    if depth not in DEPTHS:
        raise ValueError(f"w4_mma: depth must be one of {DEPTHS}, got {depth}")
    device = x.device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split, planned = plan(n, k, group_size, sms)
    if k_per_warp is not None:
        if k_per_warp % max(group_size, STEP_K):
            raise ValueError(f"w4_mma: k_per_warp {k_per_warp} is not a multiple of {max(group_size, STEP_K)}")
        split = -(-k // (WARPS * k_per_warp))
    else:
        k_per_warp = planned
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=device)
    partial = torch.empty(split, m, n, dtype=torch.float32, device=device) if split > 1 else out
    counters = _counter_buffer(device, n // COLS)
    index = _index(device)
    lib = _ready(index)
    assert lib is not None
    pdl = _PDL_MODE if HAS_TRITON and _pdl_on(index) else 0
    err = lib.hb_w4_mma(
        x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), mins.data_ptr(), out.data_ptr(), partial.data_ptr(),
        counters.data_ptr(), m, n, k, group_size, split, k_per_warp, pdl, depth,
        index, torch.cuda.current_stream(device).cuda_stream,
    )
    if err != 0:
        raise RuntimeError(f"w4_mma: kernel launch failed with CUDA error {err}")
    return out


def registers(device: torch.device, rows: int, depth: int = 4) -> int:
    """Registers per thread of the kernel instance for `rows` rows (benchmark reports)."""
    lib = _ready(_index(device))
    return -1 if lib is None else lib.hb_w4_mma_registers(rows, depth)
