"""Shared plumbing of the dsv41 Triton kernels: PDL switch, interpreter detection, launch checks, and the
bit-exact rounding helpers every kernel uses.

Every kernel module in `dsv41/kernels/` follows ARCHITECTURE.md "Kernels": a `torch.library` op whose
CPU implementation is the plain-PyTorch reference and whose CUDA implementation launches a Triton kernel.

PDL (ARCHITECTURE.md "Pipeline stages" 3, "Known traps"): `set_pdl(True)` makes CUDA launches pass
`USE_PDL=True` (the kernel then calls `gdc_wait()` before its first read of the previous kernel's output and
`gdc_launch_dependents()` after its loads) and `launch_pdl=True`. Off by default: outside CUDA graphs the
extended launch costs more than it saves. Never on under the interpreter (inline PTX raises there).

Interpreter (how Triton 3.6-3.9 read TRITON_INTERPRET, checked in both): `@triton.jit` decides between the
compiler and the interpreter when it decorates, and Triton's own `tl.sum`, `tl.max`, `tl.zeros` are
decorated when `triton` is imported. The interpreter therefore works only in a process that had
`TRITON_INTERPRET=1` before `import triton`; `triton_*` launchers raise a clear error on CPU tensors
otherwise (`require_launchable`). Tests run their interpreter cases in such a child process.

Interpreter numerics (Triton 3.9 `runtime/interpreter.py`), the reason for the integer-bit helpers below:
fp32 -> bf16 `.to()` truncates there (the GPU rounds to nearest even), and fp32 -> float8e4nv rounds ties
away from zero and drops the mantissa carry (1.9375 -> 1.0). `round_bf16` and `e4m3_round` give the
IEEE round-to-nearest-even result on both. fp32 -> fp16 `.to()` is correct on both.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Callable, Iterable

import torch
import triton
import triton.language as tl

__all__ = [
    "set_pdl", "pdl_enabled", "launch_pdl_supported", "is_interpreted", "use_pdl_for", "require_launchable",
    "check_tensor", "check_same_device", "check_int_options", "next_power_of_2", "split_k_counters",
    "prepare_device", "COUNTER_SLOTS",
    "round_bf16", "round_to", "e4m3_round", "ue8m0_exponent", "exp2_int", "e2m1_magnitude", "e2m1_value",
    "e2m1_value_scaled_down", "E2M1_HALF_SCALE", "fp4_block_scale", "e2m1_code", "register_cuda", "CUDA_HOSTS",
    "census_active", "prefetch_l2_rows",
]

#: "dsv41::<op>" -> the Python function its CUDA kernel registration runs (`register_cuda`). The launch census
#: (`census.py`) runs these on meta tensors to count the kernels one call launches.
CUDA_HOSTS: dict[str, Callable] = {}
CENSUS = threading.local()


def register_cuda(op_def, name: str) -> Callable:
    """Decorator: register `fn` as the CUDA kernel of the custom op `op_def` (`op_def.register_kernel("cuda")`)
    and keep it in `CUDA_HOSTS[name]` for the launch census. `name` is the op's qualified name, "dsv41::<op>".
    Raises ValueError when `name` is not a registered op of that name."""
    ns, _, op = name.partition("::")
    if not (ns and op and hasattr(getattr(torch.ops, ns), op)):
        raise ValueError(f"register_cuda: {name!r} is not a registered torch.library op")
    if getattr(op_def, "_qualname", name) != name:  # torch.library's CustomOpDef keeps its qualified name here
        raise ValueError(f"register_cuda: {name!r} names another op than {op_def._qualname!r}")

    def deco(fn: Callable) -> Callable:
        """Register `fn` (the op's CUDA implementation) and return it unchanged."""
        op_def.register_kernel("cuda")(fn)
        CUDA_HOSTS[name] = fn
        return fn
    return deco


def census_active() -> bool:
    """True while `census.py` runs a CUDA host function on meta tensors in this thread (launches are counted,
    not made; device checks and persistent buffers are skipped)."""
    return getattr(CENSUS, "depth", 0) > 0


_PDL = False


def set_pdl(enabled: bool) -> None:
    """Turn Programmatic Dependent Launch on or off for every dsv41 kernel launched afterwards.

    Raises TypeError if `enabled` is not a bool. See the module docstring for what PDL changes.
    """
    global _PDL
    if not isinstance(enabled, bool):
        raise TypeError(f"set_pdl expects a bool, got {type(enabled).__name__}")
    _PDL = enabled


def pdl_enabled() -> bool:
    """The current `set_pdl` setting (default False)."""
    return _PDL


@functools.lru_cache(maxsize=None)
def launch_pdl_supported() -> bool:
    """Whether this Triton's CUDA backend accepts the `launch_pdl` launch option (present in 3.6 and 3.9)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))


def is_interpreted(kernel) -> bool:
    """True when `kernel` (a `@triton.jit` object) was decorated under TRITON_INTERPRET=1."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(kernel, InterpretedFunction)


def use_pdl_for(kernel, device: torch.device) -> bool:
    """Whether a launch of `kernel` on `device` uses PDL: `set_pdl(True)`, compiled (not interpreted),
    Triton support, and compute capability >= 9.0 (`griddepcontrol` PTX starts with Hopper)."""
    if not _PDL or device.type != "cuda" or is_interpreted(kernel) or not launch_pdl_supported():
        return False
    return _capability_major(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def require_launchable(kernel, device: torch.device, name: str) -> None:
    """Raise RuntimeError if `kernel` cannot run on `device`: CPU tensors need the interpreter, which needs
    TRITON_INTERPRET=1 in the environment before `triton` is first imported."""
    if device.type == "cuda" or is_interpreted(kernel) or census_active():
        return
    raise RuntimeError(f"{name}: Triton kernels run on CUDA tensors; for {device.type} tensors set "
                       "TRITON_INTERPRET=1 in the environment before triton is first imported")


def check_tensor(name: str, t, *, dtypes: Iterable[torch.dtype] | None = None, ndim: int | None = None,
                 min_ndim: int | None = None) -> None:
    """Raise TypeError / ValueError naming `name` if `t` is not a tensor of an allowed dtype and rank."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of: {allowed}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dims, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Return the common device of the keyword tensors; ValueError naming them if they differ."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must be on one device: {listing}")
    return first


def check_int_options(**values) -> None:
    """Raise ValueError naming the first launch-plan option of `values` that is neither None nor an int (a bool is
    not an int here): plan heuristics take block sizes, warps and counts as Python ints only."""
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name}={value!r} must be an int")


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


# Split-K arrival counters, one int32 per output tile, one buffer per device. Every split-K launch leaves the
# counters it used at 0 and touches them only after its `gdc_wait()`, so kernels on one stream share them even
# under PDL. (Kernels running concurrently on two streams would need a buffer each: there are none yet.)
COUNTERS: dict = {}
#: Counters per device: far more output tiles than any decode launch has (the 129280-row head: 1010 tiles).
COUNTER_SLOTS = 1 << 16


def split_k_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 [>= n] zeroed arrival counters for a split-K launch on `device` (CPU: fresh zeros).

    One buffer of `COUNTER_SLOTS` per CUDA device, allocated by `prepare_device` (the compiler calls it
    before CUDA-graph trees start recording: a buffer first allocated during recording would live in the
    graph's memory pool, which CUDA-graph trees reject) or else on first use.
    Raises: RuntimeError when a launch needs more counters than the buffer has while a CUDA graph is being
    captured (growing it there would allocate inside the graph).
    """
    if census_active():  # the buffer persists across launches: no kernel of the call zeroes it
        return torch.empty(n, dtype=torch.int32, device=device)
    if device.type != "cuda":
        return torch.zeros(n, dtype=torch.int32, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = COUNTERS.get(index)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"split-K launch needs {n} counters on cuda:{index} but only "
                               f"{0 if buf is None else buf.numel()} exist and a CUDA graph is being captured; "
                               "call dsv41.kernels.prepare_device(device) before capturing")
        buf = torch.zeros(max(n, COUNTER_SLOTS), dtype=torch.int32, device=torch.device("cuda", index))
        COUNTERS[index] = buf
    return buf


def split_k_workspace(empty, device: torch.device, split_k: int, out_shape: tuple, tiles: int):
    """(partials, counters) of a split-K launch (quant_gemv, upcast_gemv, grouped_gemv, gemv_rows): FP32
    partials [split_k, *out_shape] from `empty(shape, dtype, device)` (the caller module's allocation seam, which
    tests poison) and `tiles` arrival counters (`split_k_counters`); for split_k == 1 a one-element placeholder of
    each, typed like the real ones and never read (no kernel launch to allocate)."""
    if split_k > 1:
        return empty((split_k, *out_shape), torch.float32, device), split_k_counters(device, tiles)
    return torch.empty(1, dtype=torch.float32, device=device), torch.empty(1, dtype=torch.int32, device=device)


def prepare_device(device: torch.device) -> None:
    """Allocate the per-device state dsv41's kernels keep across launches (the split-K counters) now,
    outside any CUDA-graph memory pool. A no-op on CPU and when already done."""
    device = torch.device(device)
    if device.type == "cuda":
        split_k_counters(device, COUNTER_SLOTS)


# ------------------------------------------------------------------------------------------- Triton helpers
@triton.jit
def split_k_merge_2d(acc, p_ptrs, split_stride, mask, cnt_ptr, tile, pid_k, SPLIT_K: tl.constexpr,
                     SPLIT_POW2: tl.constexpr):
    """Split-K merge of a [BM, BN] FP32 partial `acc` (quant_gemv, upcast_gemv): store it at `p_ptrs` +
    pid_k * split_stride, bump the output tile's arrival counter (acquire/release at GPU scope), and in the last
    program to arrive load every split's partial in one vector load and sum them by a fixed tree (deterministic),
    then reset the counter. Returns (total, arrived): total is 0 in the other programs, which must not store
    (`arrived == SPLIT_K - 1` marks the one that does). .cg loads read L2, never a stale L1 line."""
    tl.store(p_ptrs + pid_k.to(tl.int64) * split_stride, acc, mask=mask)
    # Every thread's partial must be visible before the counter moves (release at GPU scope).
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
    total = tl.zeros_like(acc)
    if arrived == SPLIT_K - 1:
        sp = tl.arange(0, SPLIT_POW2)
        parts = tl.load(p_ptrs[None, :, :] + sp[:, None, None].to(tl.int64) * split_stride,
                        mask=(sp < SPLIT_K)[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=".cg")
        total = tl.sum(parts, axis=0)
        tl.atomic_xchg(cnt_ptr + tile, 0)
    return total, arrived


@triton.jit
def round_bf16(v):
    """fp32 -> fp32 value of the nearest bf16 (ties to even), computed on the bits; NaN stays NaN (the GPU's
    NaN is 0x7FFFFFFF, which the rounding add would carry into -0.0) and +-inf stays inf."""
    b = v.to(tl.uint32, bitcast=True)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.where(v != v, v, r)


@triton.jit
def round_to(v, DT: tl.constexpr):
    """fp32 value of `v` rounded to dtype DT (fp32: unchanged; bf16 to nearest even on the bits, since the
    interpreter's .to() truncates; fp16 by .to(), correct on both), as eager's cast between two ops rounds."""
    if DT == tl.bfloat16:
        v = round_bf16(v)
    elif DT == tl.float16:
        v = v.to(tl.float16).to(tl.float32)
    return v


@triton.jit
def e4m3_round(a):
    """Nearest FP8 E4M3 value (ties to even) of fp32 `a` with 0 <= a <= 448, as fp32.

    Normals (a >= 2^-6) keep 3 mantissa bits (integer RNE on the bits); below 2^-6 the grid is 2^-9, where
    adding and removing 2^14 (whose ulp is 2^-9) rounds to it. Needs FMA contraction to leave the add/sub
    alone, which it does (no multiply involved).
    """
    b = a.to(tl.uint32, bitcast=True)
    rn = ((b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    rs = (a + 16384.0) - 16384.0
    return tl.where(a < 0.015625, rs, rn)


@triton.jit
def ue8m0_exponent(ratio):
    """UE8M0 byte (as int32) of 2^ceil(log2(ratio)) for positive normal fp32 `ratio`, from the IEEE bits:
    exponent field + 1 if the mantissa is non-zero, clamped to [0, 254] (formats.ue8m0_exponent)."""
    rb = ratio.to(tl.int32, bitcast=True)
    e = ((rb >> 23) & 0xFF) + ((rb & 0x7FFFFF) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(e, 0), 254)


@triton.jit
def prefetch_l2_rows(row_ptrs, nbytes, ok):
    """Ask L2 for `nbytes` bytes (int32 scalar, rounded down to a multiple of 16) from each of `row_ptrs` where `ok`:
    one `cp.async.bulk.prefetch.L2.global` per row (PTX ISA 8.0, sm_90+). No data comes back and nothing waits on it,
    so a kernel calls it on its weights before `gdc_wait()`: the weight read then overlaps the previous kernel's tail
    instead of starting after it (the PDL prologue of the published bring-up, "the fixed weights are prefetched into
    L2 during the prologue"). Each pointer must be 16-byte aligned. CUDA only: callers reach it under USE_PDL, which
    is never set under the interpreter."""
    size = (nbytes // 16) * 16
    go = (ok & (size > 0)).to(tl.int32)
    # `size + go * 0`: the scalar size broadcast to the rows' shape, as inline_asm_elementwise takes one per element
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r,r", [row_ptrs.to(tl.int64, bitcast=True), size + go * 0, go], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def exp2_int(e):
    """fp32 2^(e-127) for int32 e in [1, 254] built from the bits (e = 0 gives 0, as formats.ue8m0_to_float)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_magnitude(q):
    """E2M1 magnitude code 0..7 (int32) of fp32 `q` clamped to [-6, 6], ties to the even code
    (formats.e2m1_round: 0.25, 1.25, 2.5, 5 round down; 0.75, 1.75, 3.5 round up)."""
    a = tl.abs(tl.minimum(tl.maximum(q, -6.0), 6.0))
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))


@triton.jit
def e2m1_value(code):
    """fp32 value of a 4-bit E2M1 code (int32 0..15, bit 3 = sign) without a table: magnitude m >= 2 is the
    normal number with FP32 bits (m + 252) << 22, m = 1 is 0.5 (bits 0x3F000000), m = 0 is 0."""
    m = code & 7
    bits = tl.where(m >= 2, (m + 252) << 22, m * 0x3F000000) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


#: `e2m1_value_scaled_down` returns the E2M1 value divided by this (2^14), exactly.
E2M1_HALF_SCALE = tl.constexpr(16384.0)


@triton.jit
def e2m1_value_scaled_down(code):
    """fp32 (E2M1 value of `code`) / 2^14 for int32 codes 0..15, in about four instructions.

    The 3-bit magnitude placed at fp16 bits 9..11 (two exponent bits, one mantissa bit) and the sign at bit
    15 is an fp16 number equal to the E2M1 value times 2^-14, subnormal codes included (fp16 subnormals are
    exact and the fp16 -> fp32 conversion keeps them). Callers multiply by 2^14 once per block sum.
    """
    h = ((code & 7) << 9) | ((code & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp4_block_scale(amax, E4M3_SCALE: tl.constexpr):
    """(scale fp32, scale byte int32) of FP4 E2M1 blocks whose absolute maximum is `amax` (any shape).

    E4M3_SCALE: scale = e4m3_RNE(clamp(amax / 6, 2^-9, 448)), byte = its E4M3 encoding (exponent field with bias 7
    and 3 mantissa bits, or the multiple of 2^-9 for subnormal scales < 2^-6): the bank rows, MODEL.md §2.8.
    Else UE8M0: amax floored at 6 * 2^-126, byte e = ceil(log2(amax / 6)) on the IEEE bits, scale = 2^(e - 127):
    the index keys. Source: dsv41/ref/formats.py quantize_fp4_e4m3_1x16 / quantize_fp4_ue8m0_1x32.
    """
    if E4M3_SCALE:
        scale = e4m3_round(tl.minimum(tl.maximum(tl.math.div_rn(amax, 6.0), 0.001953125), 448.0))
        sbits = scale.to(tl.int32, bitcast=True)
        normal_byte = ((((sbits >> 23) & 0xFF) - 120) << 3) | ((sbits >> 20) & 7)
        sbyte = tl.where(scale < 0.015625, (scale * 512.0).to(tl.int32), normal_byte)
    else:
        sbyte = ue8m0_exponent(tl.math.div_rn(tl.maximum(amax, 6.0 * 1.1754943508222875e-38), 6.0))
        scale = exp2_int(sbyte)
    return scale, sbyte


@triton.jit
def e2m1_code(x, scale):
    """4-bit E2M1 code (sign in bit 3) of x / scale, the division correctly rounded as the reference's fp32 `/`."""
    q = tl.math.div_rn(x, scale)
    return e2m1_magnitude(q) | tl.where(q < 0, 8, 0)
