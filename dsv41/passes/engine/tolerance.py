"""Tolerance helpers: how a region's probe result is compared with its reference, probes that pin constants,
and the names given to near-misses of RMS statistics."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

__all__ = ["wide_scale_probes", "agree_where_representable", "rms_norm_eps_outside", "rms_eps_reason", "close",
           "close_rounded", "close_exact", "close_scaled", "randn_probe"]


def wide_scale_probes(scale: torch.Tensor) -> list:
    """Probe scale tensors (uint8, shaped like `scale`) that together hold every UE8M0 byte 1..254.

    The first probe keeps its exponents in 2^-11 .. 2^4 so that products stay finite in float16; a region that
    equals the reference there but clamps or saturates other exponents (e.g. `exp2((e - 127).clamp(-11, 4))`)
    would pass it, so the weight is also compared on these. Bytes 0 and 255 (2^-127, NaN) are left out: spellings
    may legitimately differ there. At most 8 probes (small scale tensors see fewer bytes).
    """
    n = scale.numel()
    gen = torch.Generator().manual_seed(4321)
    out = []
    for i in range(min(8, -(-254 // max(n, 1)))):
        vals = (torch.arange(n) + i * n) % 254 + 1
        out.append(vals[torch.randperm(n, generator=gen)].reshape(scale.shape).to(torch.uint8).to(scale.device))
    return out


def agree_where_representable(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """`got` equals `ref` (2 ulps) at every element where the reference is 0 or a normal number of its dtype;
    overflowed and subnormal reference values are not compared (rounding spellings may differ there)."""
    if got.shape != ref.shape:
        return False
    if got.dtype == ref.dtype and torch.equal(got, ref):
        return True  # the usual verdict, in one pass (the masked float64 compare below is ~20x slower)
    g, r = got.double(), ref.double()
    fi = torch.finfo(ref.dtype)
    keep = (r == 0) | ((r.abs() >= fi.tiny) & (r.abs() <= fi.max))
    return bool(torch.allclose(g[keep], r[keep], rtol=2 * fi.eps, atol=0.0))


def rms_norm_eps_outside(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The RMSNorm look-alike `weight * x / (sqrt(mean(x^2)) + eps)` (eps outside the square root), in FP32, cast
    back to `x.dtype`: x [..., d], weight [d] or None. Only for naming a near-miss (`rms_eps_reason`)."""
    xf = x.float()
    y = xf / (xf.pow(2).mean(-1, keepdim=True).sqrt() + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def rms_eps_reason(lits: Iterable[float], outside_matches: Callable[[float], bool]) -> tuple[str, str]:
    """(check, reason) of an RMS statistic that agrees with `x * rsqrt(mean(x^2) + eps)` at ordinary magnitudes but
    with none of the region's literals `lits` as eps at small ones. `outside_matches(eps)` says whether the region
    computes the eps-outside-the-square-root look-alike (`rms_norm_eps_outside`); the reason then says that, since
    the literal is there, only placed elsewhere."""
    lits = list(lits)
    for eps in lits:
        if outside_matches(eps):
            return "rms_eps", (f"the RMSNorm adds its eps {eps} outside the square root, x / (sqrt(mean(x^2)) + eps); "
                               "the fused op computes x * rsqrt(mean(x^2) + eps) (MODEL.md §2.2), which differs "
                               "for small x")
    return "rms_eps", ("the RMS statistic agrees with x * rsqrt(mean(x^2) + eps) at ordinary magnitudes but, at small "
                       f"ones, with none of the region's literals {lits} as the eps inside the square root")


def close(got, ref: torch.Tensor, rtol: float, atol: float) -> bool:
    """Same shape and dtype, finite, and |got - ref| <= atol + rtol |ref| elementwise (compared in float64 on the
    CPU: probes may have run on the graph's device). False when `got` is not a tensor."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
        return False
    g, r = got.double().cpu(), ref.double().cpu()
    return bool(torch.isfinite(g).all()) and bool(((g - r).abs() <= atol + rtol * r.abs()).all())


def close_rounded(got, ref) -> bool:
    """Agreement up to one rounding of the result dtype (FP32: a few ulps of a differently ordered sum): rtol
    max(eps, 1e-5), atol 1% of that times max |ref|. False when either is not a tensor."""
    if not isinstance(ref, torch.Tensor):
        return False
    rtol = max(torch.finfo(ref.dtype).eps, 1e-5)
    return close(got, ref, rtol, rtol * 1e-2 * float(ref.double().abs().max()))


def randn_probe(shape, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0, device=None) -> torch.Tensor:
    """A standard-normal probe of `shape` drawn in float64 from `gen`, times `scale`, cast to `dtype` (on `device`)."""
    out = (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
    return out if device is None else out.to(device)


def close_exact(got, ref: torch.Tensor) -> bool:
    """Equal, or within 2 ulps of the dtype (a hand-written exp2 may round its last bit differently); same shape
    and dtype required. False when `got` is not a tensor."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if torch.equal(got, ref):
        return True
    eps = torch.finfo(ref.dtype).eps
    return bool(torch.allclose(got.float(), ref.float(), rtol=2 * eps, atol=0.0))


def close_scaled(got, ref: torch.Tensor, ulps: int = 4) -> bool:
    """Equal, or within `ulps` ulps of the dtype relative to each element and to max |ref| (a differently
    ordered FP32 sum); same shape and dtype required. False when `got` is not a tensor."""
    if not isinstance(got, torch.Tensor) or got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if torch.equal(got, ref):
        return True
    eps = torch.finfo(ref.dtype).eps
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return bool(torch.allclose(got.float(), ref.float(), rtol=ulps * eps, atol=ulps * eps * scale))
