"""bf16 accuracy measured the way it can fail: a backend's logits against an FP32 eager run of the same weights.

`dsv41.bench`'s `max_rel_logit_err` compares a backend with eager in the run's own dtype. In bf16 that cannot tell
whether a fused kernel is as accurate as eager's ATen ops: both round, differently, and the difference between two
bf16 roundings says nothing about which one is closer to the exact value. Here both eager bf16 and each backend are
compared with one FP32 reference, so "dsv41 / eager" is a ratio of errors against the same yardstick.

The reference (`fp32_reference`): `fp32_copy` of the benchmark's model, a `DeepseekV41Flash` of the same config and
weight mode built in float32 whose every floating parameter and buffer is the run's value upcast (bf16 / fp16 ->
fp32 is exact) and whose every other tensor (uint8 FP8 / FP4 codes and UE8M0 scales, int64 hash tables) and every
tensor already in fp32 is the SAME tensor as the model's, shared, not copied: a forward reads weights, never writes
them. It decodes eagerly with the eager reference's greedy tokens teacher-forced (`bench.teacher_forced_logits`),
so its cost is one prefill and N-1 eager FP32 decode steps over at most the N tokens the eager reference ran, then
it is freed before any backend compiles. When the run is already FP32 the run's own eager logits are the reference
(eager's error is then 0).

Memory on the GPU (`h200` preset, checkpoint weights, bf16): the model's floating tensors are 5.72 GB in bf16, of
which 0.33 GB belong to the DSpark draft stages, which plain decode never runs and the copy leaves out; the 5.38 GB
left become 10.76 GB in FP32, newly allocated. The 80.7 GB of uint8 codes and scales and the 0.23 GB of FP32 mHC
weights are shared. Add the copy's own caches (prompt + N tokens) and an FP32 step's temporaries (dequantised
weights twice bf16's size): eager `h200` peaks at ~90 GB alone (2026-11-29), so ~101 GB with the copy, within a
141 GB card, and nothing is compiled yet (`fp32_reference` records the peak it saw as `peak_mem_gb`).
`weight_mode="bf16"` (every weight dense in the model dtype) instead doubles every weight in FP32.

Public names: `fp32_copy`, `fp32_reference`, `per_step_rel_err`, `logit_err_vs_fp32`, `ratio_to_eager`, `fp32_err_text`,
`DEFINITIONS`.
"""

from __future__ import annotations

import gc
import time

import torch
from torch import nn

from .result_text import fp32_err_text  # noqa: F401 (a public name here too)

__all__ = ["fp32_copy", "fp32_reference", "per_step_rel_err", "logit_err_vs_fp32", "ratio_to_eager", "fp32_err_text",
           "DEFINITIONS"]

#: Definitions of the result keys this module computes, merged into `dsv41.bench.DEFINITIONS`.
DEFINITIONS = {
    "logit_err_vs_fp32": "eager's greedy tokens teacher-forced through the backend's decode steps and through an "
                         "FP32 eager copy of the same weights (bf16 values upcast exactly, quantised codes and "
                         "scales shared); per decode step i and sequence b, max_v |logits[b,i,v] - fp32[b,i,v]| / "
                         "max_v |fp32[b,i,v]|, and the row's value is the max over b and i (float64), over the "
                         "steps of the shorter of the row's run and the eager reference. The eager row's value is "
                         "eager's own error (0 when the run is FP32: the reference is then the run's own eager)",
    "logit_err_vs_fp32_eager": "(top level) logit_err_vs_fp32 of the eager reference: what rounding in the run's "
                               "dtype costs ATen's eager ops",
    "logit_err_vs_fp32_over_eager": "the row's logit_err_vs_fp32 / logit_err_vs_fp32_eager (null when eager's is 0 "
                                    "or missing); above 1 the backend is less accurate than eager",
    "fp32_reference": "(top level) how the FP32 reference was obtained: source, tokens, seconds, bytes newly "
                      "allocated for its FP32 parameters and buffers, bytes shared with the model, peak GPU memory "
                      "while it ran (1e9 bytes, CUDA only), or the reason it is missing",
}


def _upcast(t: torch.Tensor):
    """(tensor for the FP32 copy, newly allocated bytes): floating tensors not yet FP32 are upcast (exact from bf16 /
    fp16); anything else (uint8 codes and scales, int64 tables, FP32 tensors) is the same object, shared."""
    if t.is_floating_point() and t.dtype != torch.float32:
        up = t.detach().to(torch.float32)
        return (nn.Parameter(up, requires_grad=False) if isinstance(t, nn.Parameter) else up), up.numel() * 4
    return t, 0


def fp32_copy(model) -> tuple:
    """An FP32 eager copy of `model` (a `DeepseekV41Flash`) holding exactly its weight values.

    Built on the meta device (nothing allocated), then every parameter and non-cache buffer is taken from `model`:
    floating ones that are not FP32 upcast, all others shared (module docstring). The DSpark stages (`mtp`) are left
    out: plain decode never runs them. No caches are allocated (`setup_cache` / `bench.teacher_forced_logits` do).
    Args: model: an unsharded `DeepseekV41Flash` (any dtype, weight mode, device); left unchanged.
    Returns: (the copy in eval mode on the model's device, {"new_bytes": bytes allocated for upcast tensors,
        "shared_bytes": bytes of tensors shared with `model`}).
    Raises: ValueError when the model's modules or tensor shapes are not those its config builds (e.g. a
        tensor-parallel shard), RuntimeError if a tensor of the copy was left unset.
    """
    from .model import DeepseekV41Flash

    tm = getattr(model, "token_map", None)
    dst = DeepseekV41Flash(model.config, model.weight_mode, torch.float32, device="meta", token_map=tm)
    dst.mtp = None  # plain decode never runs the draft stages: their 0.33 GB (h200) need no FP32 copy
    src_mods = dict(model.named_modules())
    new = shared = 0
    for name, mod in dst.named_modules():
        src = src_mods.get(name)
        if src is None or type(src) is not type(mod):
            raise ValueError(f"module {name or '<root>'!r} of the model is not what its config builds "
                             f"({type(src).__name__} vs {type(mod).__name__}): cannot make an FP32 copy")
        for table, src_table in ((mod._parameters, src._parameters), (mod._buffers, src._buffers)):
            for key, t in list(table.items()):
                if t is None:  # caches and optional weights are None until set: setup_cache allocates the copy's
                    continue
                s = src_table.get(key)
                if s is None or tuple(s.shape) != tuple(t.shape):
                    raise ValueError(f"{name}.{key}: the model's tensor {None if s is None else tuple(s.shape)} "
                                     f"does not match the config's {tuple(t.shape)}")
                table[key], nbytes = _upcast(s)
                new += nbytes
                shared += 0 if nbytes else s.numel() * s.element_size()
    left = [n for n, t in list(dst.named_parameters()) + list(dst.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"FP32 copy: tensors left unset: {left[:5]}")
    return dst.eval(), {"new_bytes": new, "shared_bytes": shared}


@torch.no_grad()
def fp32_reference(model, prompt_ids: torch.Tensor, tokens: torch.Tensor,
                   own_logits: torch.Tensor | None = None) -> tuple:
    """Teacher-forced decode logits of an FP32 eager copy of `model` (module docstring), then the copy is freed.

    Args: model: the benchmark's `DeepseekV41Flash`; prompt_ids int64 [B, P] (or [P]); tokens int64 [B, N], N >= 2:
        the eager reference's greedy tokens; own_logits: the eager reference's float32 [B, N-1, V] logits, returned
        as the reference when the model is already FP32 (no copy is built).
    Returns: (float32 [B, N-1, V] on the CPU, info dict for the result's `fp32_reference`: {"source", "tokens",
        "seconds", "new_bytes", "shared_bytes", "peak_mem_gb"}).
    Raises: as `fp32_copy` and `bench.teacher_forced_logits` (ValueError for N < 2 or mismatched batch sizes);
        ValueError when the model is FP32 and `own_logits` is None.
    """
    from .harness import teacher_forced_logits

    n = int(tokens.shape[-1])
    if model.dtype == torch.float32:
        if own_logits is None:
            raise ValueError("the model is FP32: pass the eager reference's own logits as own_logits")
        return own_logits, {"source": "the run's own eager reference (already FP32)", "tokens": n, "seconds": 0.0,
                            "new_bytes": 0, "shared_bytes": 0, "peak_mem_gb": None}
    dev = model.embed.weight.device
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    ref32, info = fp32_copy(model)
    try:
        logits = teacher_forced_logits(ref32, prompt_ids, tokens)
    finally:
        del ref32
        gc.collect()  # the copy's caches and upcast weights go before the first compile needs the memory
        if cuda:
            torch.cuda.empty_cache()
    info.update(source=f"FP32 eager copy of the {str(model.dtype).replace('torch.', '')} weights, teacher-forced",
                tokens=n, seconds=time.perf_counter() - t0,
                peak_mem_gb=torch.cuda.max_memory_allocated(dev) / 1e9 if cuda else None)
    return logits, info


def per_step_rel_err(logits: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error of every decode step: max_v |logits - ref| / max_v |ref| over the last (vocabulary) dim.

    Args: logits, ref: float tensors of one shape [..., V] (e.g. [B, S, V]); ref is the FP32 reference.
    Returns: float64 [...] (e.g. [B, S]) on the CPU; NaN where logits hold NaN (not hidden).
    Raises: ValueError for different shapes, an empty tensor, or a step whose reference logits are all zero.
    """
    if logits.shape != ref.shape:
        raise ValueError(f"logit shapes differ: {tuple(logits.shape)} vs reference {tuple(ref.shape)}")
    if ref.numel() == 0:
        raise ValueError("no logits to compare")
    r = ref.detach().double().cpu()
    scale = r.abs().amax(-1)
    if bool((scale == 0).any()):
        raise ValueError("a step's reference logits are all zero: relative error undefined")
    return (logits.detach().double().cpu() - r).abs().amax(-1) / scale


def logit_err_vs_fp32(logits: torch.Tensor, ref: torch.Tensor) -> float:
    """`DEFINITIONS["logit_err_vs_fp32"]`: the largest `per_step_rel_err` over sequences and steps (a float, NaN if
    the logits hold NaN). Args/raises as `per_step_rel_err`; the reference is truncated by the caller to the row's
    steps (`ref[:, :S]`)."""
    return float(per_step_rel_err(logits, ref).max())


def ratio_to_eager(err: float | None, eager_err: float | None) -> float | None:
    """err / eager_err, or None when either is missing or eager's error is 0 (an FP32 run: nothing to divide by)."""
    if err is None or not eager_err:
        return None
    return err / eager_err
