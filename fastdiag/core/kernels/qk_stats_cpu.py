"""Head statistics from Q and K on the CPU in one fused native pass (`qk_stats_cpu.c`): the CPU default
behind the torch backend, with `qk_stats_torch` as its fallback (no C compiler, a float64 input, a
torch.func transform) and its twin in the tests (same arguments, same sums, the same float64 reference).

Layout: C kernel (`qk_stats_cpu.c`, built on first use with the system's C compiler into a per-user
cache keyed by the source, the flags and the CPU; its threads are PyTorch's OpenMP pool where
PyTorch runs on GNU OpenMP, its own pthreads elsewhere) -> launcher `qk_stats_cpu` -> `torch.library` op
``fastdiag::qk_stats_cpu`` (what torch.compile and non-strict export see; eager calls skip its dispatch).

Why native: the torch path makes ~8 passes over each chunk of scores, one op each (≈4.6 ms per
HF GPT-2 layer [4, 4, 256, 64] causal at 2 threads where that layer's SDPA forward takes 2.4 ms);
fused, the scores never leave a thread's cache (`benchmarks/qk_torch_cost.py`).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from .constants import LOG_P_FLOOR, LOG2E, MASKED_SCORE, MASS_TOLERANCE

SOURCE = Path(__file__).with_name("qk_stats_cpu.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-pthread", "-std=gnu11")
# float32 scores where no x = s − max of the row can be further off than this (log2 units, worst case
# 2u·(D+2)·max|q·scale·log2 e|·max|k|), float64 elsewhere. Measured against float64 (D 8-128, T 16-128,
# iid keys, keys sharing a mean, near-duplicate keys, causal or not): at this bound the statistics were
# as close to float64 with float32 scores as with float64 ones (5.7e-6 / 6.4e-6 relative, worst case,
# near-uniform attention); at 8x it, float32 scores were 1.2e-5 off where float64 ones were 7e-7.
# A randomly initialised HF GPT-2 layer (D 64) is at ~1.6e-5.
SCORE_ERROR_BOUND = 2.0 ** -12
DISABLE_ENV = "FASTDIAG_NATIVE"       # "0": always the torch path
_TAKEN = (torch.float32, torch.bfloat16, torch.float16)   # input dtypes the kernel takes (16-bit as float32)


class _Args(ctypes.Structure):
    _fields_ = [("q", ctypes.c_void_p), ("q_sb", ctypes.c_int64), ("q_sh", ctypes.c_int64), ("q_st", ctypes.c_int64),
                ("k", ctypes.c_void_p), ("k_sb", ctypes.c_int64), ("k_sh", ctypes.c_int64), ("k_st", ctypes.c_int64),
                ("mask", ctypes.c_void_p), ("mask_kind", ctypes.c_int),
                ("m_sb", ctypes.c_int64), ("m_sh", ctypes.c_int64), ("m_st", ctypes.c_int64), ("m_sk", ctypes.c_int64),
                ("rows_ok", ctypes.c_void_p), ("r_sb", ctypes.c_int64), ("r_st", ctypes.c_int64),
                ("lse", ctypes.c_void_p), ("l_sb", ctypes.c_int64), ("l_sh", ctypes.c_int64), ("l_st", ctypes.c_int64),
                ("B", ctypes.c_int64), ("H", ctypes.c_int64), ("Hk", ctypes.c_int64), ("Tq", ctypes.c_int64),
                ("Tk", ctypes.c_int64), ("D", ctypes.c_int64),
                ("causal", ctypes.c_int), ("scale", ctypes.c_double), ("floor2", ctypes.c_double),
                ("masked", ctypes.c_double),
                ("mass_tolerance", ctypes.c_double), ("score_error_bound", ctypes.c_double),
                ("nthreads", ctypes.c_int)]


_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_unavailable: str | None = None      # why the native kernel cannot be used here, once known


def _cache_dir() -> Path:
    root = os.environ.get("FASTDIAG_CACHE") or os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "fastdiag" / "native"


def _cpu_key() -> str:
    """What -march=native compiles for: the CPU's flags (a cache shared between machines stays right)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _shares_torch_openmp() -> bool:
    """Whether PyTorch runs on GNU OpenMP (its wheel's ``torch/lib/libgomp.so.1``): then the kernel is
    built with -fopenmp and the dynamic linker gives it that same runtime, so its threads are PyTorch's
    pool. Elsewhere (another OpenMP runtime, or none) it starts its own pthreads: two OpenMP runtimes in
    one process would each keep a pool."""
    return (Path(torch.__file__).parent / "lib" / "libgomp.so.1").exists()


def _build(target: Path) -> None:
    compiler = os.environ.get("CC", "cc")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        openmp = ("-fopenmp",) if _shares_torch_openmp() else ()
        subprocess.run([compiler, *FLAGS, *openmp, "-o", tmp, str(SOURCE), "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, target)         # atomic: parallel builders (test workers) never see half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (and `unavailable_reason` says why) where it cannot be built here."""
    global _library, _unavailable
    if _library is not None or _unavailable is not None:
        return _library
    with _lock:
        if _library is not None or _unavailable is not None:
            return _library
        if sys.platform == "win32":
            _unavailable = "the native CPU kernel is built for POSIX systems only"
            return None
        source = SOURCE.read_bytes()
        key = hashlib.sha256(source + repr((FLAGS, _shares_torch_openmp())).encode() + _cpu_key().encode()
                             + platform.machine().encode()).hexdigest()[:16]
        target = _cache_dir() / f"qk_stats_cpu-{key}.so"
        try:
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            _unavailable = (f"the native CPU kernel could not be built ({error}"
                            f"{': ' + detail.decode(errors='replace')[-300:] if detail else ''})")
            warnings.warn(f"fastdiag: {_unavailable}; the CPU statistics use the (slower, equally exact) "
                          f"torch path", RuntimeWarning, stacklevel=2)
            return None
        lib.qk_stats_cpu.argtypes = [ctypes.POINTER(_Args), ctypes.c_void_p]
        lib.qk_stats_cpu.restype = ctypes.c_int
        _library = lib
        return lib


def unavailable_reason() -> str | None:
    if os.environ.get(DISABLE_ENV) == "0":
        return f"{DISABLE_ENV}=0"
    library()
    return _unavailable


def usable(q4: torch.Tensor, k4: torch.Tensor, mask4: torch.Tensor | None) -> bool:
    """Whether `qk_stats_cpu` takes these inputs: CPU, float32 or 16-bit, a bool or floating mask,
    not inside a torch.func transform, the kernel built here."""
    if q4.device.type != "cpu" or k4.device.type != "cpu" or os.environ.get(DISABLE_ENV) == "0":
        return False
    if q4.dtype not in _TAKEN or k4.dtype not in _TAKEN:
        return False
    if mask4 is not None and mask4.dtype != torch.bool and not mask4.dtype.is_floating_point:
        return False
    if torch.compiler.is_compiling():
        # traced: the op (its fake impl) goes into the graph if the kernel is built already; building it
        # (files, a compiler) is not something to trace
        return _library is not None
    if torch._C._functorch.is_functorch_wrapped_tensor(q4) or torch._C._functorch.is_functorch_wrapped_tensor(k4):
        return False
    return library() is not None


def qk_stats_cpu(q4, k4, mask4, is_causal: bool, scale: float, rows_ok, lse, check_lse: bool):
    """`qk_stats_torch`'s sums ``(gram [H, H], entropy_sum [H], rows, invalid)`` in float64, from the
    native kernel (arguments as `qk_stats_torch`, without its chunk size: the kernel holds a cache-sized
    tile per thread). Call only where `usable` says so."""
    if torch.compiler.is_compiling() or type(q4) is not torch.Tensor:
        out = torch.ops.fastdiag.qk_stats_cpu(q4, k4, mask4, is_causal, scale, rows_ok, lse, check_lse)
    else:
        out = _launch(q4, k4, mask4, is_causal, scale, rows_ok, lse, check_lse)
    h = q4.shape[1]
    return out[:h * h].view(h, h), out[h * h:h * h + h], out[h * h + h], out[h * h + h + 1]


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> list[int]:
    """Strides in elements, 0 along broadcast (size-1) dimensions."""
    return [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]


def _launch(q4, k4, mask4, is_causal, scale, rows_ok, lse, check_lse) -> torch.Tensor:
    """The kernel on real CPU tensors: ``[H·H + H + 3]`` float64 (gram, entropy, rows, invalid and the
    number of (row, head) pairs scored again in float64)."""
    lib = library()
    q4 = _last_dim_contiguous(q4 if q4.dtype == torch.float32 else q4.float())
    k4 = _last_dim_contiguous(k4 if k4.dtype == torch.float32 else k4.float())
    b, h, tq, d = q4.shape
    hk, tk = k4.shape[1], k4.shape[2]
    args = _Args()
    args.q = q4.data_ptr()
    args.q_sb, args.q_sh, args.q_st = _strides(q4)[:3]
    args.k = k4.data_ptr()
    args.k_sb, args.k_sh, args.k_st = _strides(k4)[:3]
    if mask4 is not None:
        if mask4.dtype == torch.bool:
            kind = 1
        elif mask4.dtype == torch.float64:
            kind = 3
        else:
            kind = 2
            mask4 = mask4 if mask4.dtype == torch.float32 else mask4.float()
        args.mask, args.mask_kind = mask4.data_ptr(), kind
        args.m_sb, args.m_sh, args.m_st, args.m_sk = _strides(mask4)
    if rows_ok is not None:
        rows_ok = rows_ok if rows_ok.dtype == torch.bool else rows_ok.bool()
        args.rows_ok = rows_ok.data_ptr()
        args.r_sb, args.r_st = _strides(rows_ok)
    if check_lse and lse is not None:
        lse = lse if lse.dtype == torch.float32 else lse.float()
        args.lse = lse.data_ptr()
        args.l_sb, args.l_sh, args.l_st = _strides(lse)
    args.B, args.H, args.Hk, args.Tq, args.Tk, args.D = b, h, hk, tq, tk, d
    args.causal = int(bool(is_causal))
    args.scale = scale
    args.floor2 = LOG_P_FLOOR * LOG2E
    args.masked = MASKED_SCORE
    args.mass_tolerance = MASS_TOLERANCE
    args.score_error_bound = SCORE_ERROR_BOUND
    args.nthreads = torch.get_num_threads()
    out = torch.empty(h * h + h + 3, dtype=torch.float64)
    if lib.qk_stats_cpu(ctypes.byref(args), out.data_ptr()) != 0:
        raise MemoryError(f"qk_stats_cpu: out of memory for q {tuple(q4.shape)}, k {tuple(k4.shape)}")
    return out


@torch.library.custom_op("fastdiag::qk_stats_cpu", mutates_args=(), device_types="cpu")
def _qk_stats_cpu_op(q4: torch.Tensor, k4: torch.Tensor, mask4: torch.Tensor | None, is_causal: bool,
                     scale: float, rows_ok: torch.Tensor | None, lse: torch.Tensor | None,
                     check_lse: bool) -> torch.Tensor:
    return _launch(q4, k4, mask4, is_causal, scale, rows_ok, lse, check_lse)


@_qk_stats_cpu_op.register_fake
def _(q4, k4, mask4, is_causal, scale, rows_ok, lse, check_lse):
    h = q4.shape[1]
    return q4.new_empty(h * h + h + 3, dtype=torch.float64)
