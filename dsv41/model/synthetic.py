"""Caches filled as if a long context had been prefilled: decode cost versus context without running the prefill.

A decode step's cost depends on the context only through how many cache rows it reads (visible bank and index-key
rows, the window ring), not on what the rows hold. Prefilling 128K tokens with the eager model takes far longer
than the decode measurement itself, so the context sweep of the benchmark (`dsv41 bench --contexts`) fills every
cache with valid random codes for positions [0, context) instead and decodes from position `context`. The tokens
it produces are meaningless; only the timing is used. What is filled (MODEL.md §2.5-2.7, §2.10):

- window rings: the last `sliding_window` positions, FP8 E4M3 bytes without NaN codes, UE8M0 exponents 120-130;
- kv-source banks: the floor(context / ratio) rows a prefill would have written, packed E2M1 with positive E4M3
  scales in [2^-3, 2^2]; index keys: E2M1 with UE8M0 exponents 120-130; rows past the context stay zero;
- ratio-2 compressors: the last token parked in the state (random FP32; a prefill always parks it, and only
  the position parity decides whether it is pending);
- the Engram token history: random compressed ids for positions [0, context).
"""

from __future__ import annotations

import torch

__all__ = ["fill_synthetic_context"]


def _bytes(shape, lo: int, hi: int, gen: torch.Generator, device) -> torch.Tensor:
    return torch.randint(lo, hi + 1, shape, generator=gen, dtype=torch.int32).to(torch.uint8).to(device)


def _fp8_codes(shape, gen: torch.Generator, device) -> torch.Tensor:
    # E4M3 bytes S.EEEE.MMM; magnitude 0x7F is NaN, so draw magnitudes below it and a random sign bit.
    mag = torch.randint(0, 0x7F, shape, generator=gen, dtype=torch.int32)
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int32) << 7
    return (mag | sign).to(torch.uint8).to(device)


@torch.no_grad()
def fill_synthetic_context(model, context: int, seed: int = 0) -> None:
    """Reset `model`'s caches, then fill them as if `context` tokens had been prefilled (module docstring).

    Args:
        model: a `DeepseekV41Flash` (or a torch.compile wrapper of one) after `setup_cache`; every sequence of the
            cache batch gets the same kind of random content.
        context: positions already in the cache (>= 0); the next decode step runs at position `context`.
        seed: seed of the CPU generator the bytes are drawn from (the same bytes for every backend).
    Raises:
        RuntimeError: before `setup_cache`.
        ValueError: context < 0, or context >= the cache's max_seq_len (no room for a decode step).
    """
    base = getattr(model, "_orig_mod", model)
    if base.max_seq_len == 0:
        raise RuntimeError("call setup_cache(batch_size, max_seq_len) before fill_synthetic_context")
    if context < 0 or context >= base.max_seq_len:
        raise ValueError(f"context must lie in [0, max_seq_len={base.max_seq_len}), got {context}")
    base.reset_cache()
    c = base.config
    gen = torch.Generator().manual_seed(seed)
    b = base.batch_size
    for i, layer in enumerate(base.layers):
        a = layer.attn
        dev = a.ring_codes.device
        w = a.window
        filled = min(context, w)
        if filled:
            slots = torch.remainder(torch.arange(context - filled, context), w).to(dev)
            a.ring_codes[:, slots] = _fp8_codes((b, filled, a.ring_codes.shape[-1]), gen, dev)
            a.ring_scales[:, slots] = _bytes((b, filled, a.ring_scales.shape[-1]), 120, 130, gen, dev)
        if a.role != "full":
            continue
        rows = min(context // a.ratio, a.cache_rows)  # complete groups; an odd last token is pending
        if rows:
            a.bank_codes[:, :rows] = _bytes((b, rows, a.bank_codes.shape[-1]), 0, 255, gen, dev)
            # E4M3 bytes 0x20-0x48: exponent fields 4-9, positive scales in [2^-3, 2^2]
            a.bank_scales[:, :rows] = _bytes((b, rows, a.bank_scales.shape[-1]), 0x20, 0x48, gen, dev)
            a.key_codes[:, :rows] = _bytes((b, rows, a.key_codes.shape[-1]), 0, 255, gen, dev)
            a.key_scales[:, :rows] = _bytes((b, rows, a.key_scales.shape[-1]), 120, 130, gen, dev)
        comp = a.compressor
        if comp is not None and comp.kv_state is not None and context:  # the last token is always parked
            comp.kv_state.copy_(torch.randn(comp.kv_state.shape, generator=gen).to(dev))
            comp.score_state.copy_(torch.randn(comp.score_state.shape, generator=gen).to(dev))
    if base.engram_history is not None and context:
        ids = torch.randint(0, c.engram_compressed_vocab_size, (b, context), generator=gen)
        base.engram_history[:, :context] = ids.to(base.engram_history.device)
