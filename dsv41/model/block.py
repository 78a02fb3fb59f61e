"""One backbone layer of DeepSeek-V4.1 Flash with single-pass mHC (MODEL.md §2.3, §3), and the weight modes a
model is built in. A module of its own because both the model (`model.py`) and the DSpark drafter (`dspark.py`,
whose stages are Blocks) build on it."""

from __future__ import annotations

import torch
from torch import nn

from ..ref.mhc import mhc_collapse, mhc_expand, mhc_mixes
from .attention import Attention
from .config import ModelConfig
from .engram import Engram
from .moe import MoE
from .norm import RMSNorm

__all__ = ["Block", "WEIGHT_MODES"]

WEIGHT_MODES = ("checkpoint", "bf16")


class Block(nn.Module):
    """One backbone layer: [Engram] -> mHC attention sublayer -> mHC FFN (MoE) sublayer, V4.1 ordering.

    V4.1 "single pass" (MODEL.md §2.3): the layer receives (H, pre_mix); `mixes_attn(H)` gives
    (a_pre, a_post, a_comb); the attention input is `attn_norm(collapse(H, pre_mix))`; then
    `mixes_ffn(H')` gives (f_pre, f_post, f_comb) and the FFN input is `ffn_norm(collapse(H', a_pre))`.
    Returns (H'', f_pre): a sublayer's pre-mix is computed one sublayer earlier.

    Parameters (checkpoint names): `attn_norm.weight`, `ffn_norm.weight`, `hc_{attn,ffn}_{fn,base,scale}`
    (FP32 [24, 4d], [24], [3]), `attn.*`, `ffn.*`, and `engram.*` on Engram layers.
    Shapes: H [B, T, 4, d] model dtype, pre_mix [B, T, 4] FP32.
    """

    def __init__(self, config: ModelConfig, layer_id: int, weight_mode: str, dtype: torch.dtype, device=None):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.norm_eps, self.hc_eps, self.hc_iters = c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters
        n, d = c.hc_mult, c.hidden_size
        m = (2 + n) * n
        f32 = dict(dtype=torch.float32, device=device)
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", nn.Parameter(torch.zeros(m, n * d, **f32), requires_grad=False))
            setattr(self, f"hc_{site}_base", nn.Parameter(torch.zeros(m, **f32), requires_grad=False))
            setattr(self, f"hc_{site}_scale", nn.Parameter(torch.ones(3, **f32), requires_grad=False))
        self.attn_norm = RMSNorm(d, c.rms_norm_eps, dtype, device)
        self.ffn_norm = RMSNorm(d, c.rms_norm_eps, dtype, device)
        self.attn = Attention(c, layer_id, weight_mode, dtype, device)
        self.ffn = MoE(c, weight_mode, dtype, device)
        self.engram = Engram(c, layer_id, weight_mode, dtype, device) if layer_id in c.engram_layer_ids else None

    def mixes(self, site: str, H: torch.Tensor):
        """(pre, post, comb) of sublayer `site` ('attn' or 'ffn') from the residual H."""
        return mhc_mixes(H, getattr(self, f"hc_{site}_fn"), getattr(self, f"hc_{site}_base"),
                         getattr(self, f"hc_{site}_scale"), self.norm_eps, self.hc_eps, self.hc_iters)

    def forward(self, H: torch.Tensor, pre_mix: torch.Tensor, positions: torch.Tensor, shared: dict,
                engram_rows: torch.Tensor | None = None):
        """One block: residual streams H [B, T, 4, d] and this layer's pre mix -> (H', next pre mix); see the class
        docstring for the mHC / attention / Engram / MoE order (MODEL.md §2.3, §3)."""
        if self.engram is not None:
            H = self.engram(H, engram_rows)
        a_pre, a_post, a_comb = self.mixes("attn", H)
        y = self.attn(self.attn_norm(mhc_collapse(H, pre_mix)), positions, shared)
        H = mhc_expand(y, H, a_post, a_comb)
        f_pre, f_post, f_comb = self.mixes("ffn", H)
        y = self.ffn(self.ffn_norm(mhc_collapse(H, a_pre)))
        H = mhc_expand(y, H, f_post, f_comb)
        return H, f_pre
