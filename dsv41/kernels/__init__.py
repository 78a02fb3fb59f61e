"""dsv41 Triton kernels as `torch.library` custom ops (ARCHITECTURE.md "Kernels").

Importing this package registers every op under the `dsv41::` namespace:

- `dsv41::linear_fp8_block`, `dsv41::linear_fp4` (quant_gemv.py): quantised-weight GEMV, the dispatch target.
- `dsv41::linear_fp8_scaled` (gemv_scaled.py): block-FP8 GEMV for the layouts FP8 checkpoints ship (E4M3 codes with
  FP32 or UE8M0 scales per 128x128, 32x32 or 1x128 block), the dispatch target of `passes/fp8_layouts.py`.
- `dsv41::linear_fp8_block_multi` (gemv_multi.py): 2-4 block-FP8 GEMVs of one activation in one launch, the
  sibling_gemv target.
- `dsv41::rope_fp4_quant`, `dsv41::rope_fp4_fake_quant`, `dsv41::rope_fp4_quant_store` (rope_fp4.py).
- `dsv41::c2_norm_rope_fp4_store`, `dsv41::c2_pool_norm_rope_fp4_store` (c2_compressor.py): compressor bank write.
- `dsv41::linear_half`, `linear_half_multi`, `linear_half_silu_mul` (half_gemv.py): bf16 / fp16 GEMV at M <= 8
  with sibling weights, SwiGLU or residual in the same launch, the half_gemv target.
- `dsv41::linear_upcast` (upcast_gemv.py): FP32 GEMV reading a bf16 / fp16 weight once, the upcast_linear target.
- `dsv41::grouped_linear_fp4` (grouped_gemv.py): FP4 GEMV over the gathered routed experts of decode (dispatch target).
  Its default kernel with FP8-quantised activations (act_quant, from `WORDS_MIN_CODES_ACT_QUANT` codes per call; the
  `small` and `tiny` shapes stay on the tile kernel) is the tensor-core GEMV of `grouped_frag.py`
  (E2M1 -> E4M3 decoded into `mma.sync` fragments, inline PTX); otherwise, for bf16 / fp32 x, the word-decode
  CUDA-core GEMV of `grouped_words.py`. `grouped_mma.py` holds an opt-in `tl.dot_scaled` variant (`mma_words=True`;
  slower on the H200, not the default).
  `dsv41::grouped_linear_fp4_pair` (grouped_gemv.py): two of them on one x and one expert selection (MoE w1 / w3,
  the grouped_pair target), x FP8-quantised once for both.
- `dsv41::mhc_mixes`, `dsv41::mhc_collapse_rmsnorm`, `dsv41::mhc_expand` (mhc.py): mHC coefficients, pre-mix + RMSNorm, post-mix.
- `dsv41::moe_router`, `dsv41::moe_combine` (moe.py): MoE router (GEMV + sqrt-softplus + biased top-k) and tail.
- `dsv41::indexer_scores`, `dsv41::indexer_candidates`, `dsv41::indexer_topk` (indexer.py): CSA2 index scores, candidate blocks, top-k.
- `dsv41::engram_lookup`, `dsv41::engram_gate` (engram.py): Engram hash -> FP8 row gather -> dequantise; gate + residual.
- `dsv41::sparse_fp4_attention` (sparse_attention.py): attention over [FP8 window ; gathered FP4 bank rows] with sink + inverse RoPE.
- `dsv41::stream_fork`, `dsv41::stream_launch`, `dsv41::stream_join` (streams.py): side-stream regions placed by the scheduler.

Each op has a CPU reference (its arguments checked, then `dsv41.ref`'s math), a CUDA implementation launching
Triton, and a fake.
The CUDA implementations register through `_common.register_cuda`, so `census.py` can count the kernels one
call launches (shapes only, on meta tensors) for the compiler's static launch count.
`set_pdl(True)` turns on Programmatic Dependent Launch for the CUDA launches.
"""

from . import (c2_compressor, engram, gemv_multi, half_gemv, gemv_scaled, grouped_gemv, indexer, mhc, moe, quant_gemv, rope_fp4,
               sparse_attention, streams, upcast_gemv)
from ._common import pdl_enabled, prepare_device, set_pdl

__all__ = ["c2_compressor", "engram", "gemv_multi", "half_gemv", "gemv_scaled", "grouped_gemv", "indexer", "mhc", "moe", "quant_gemv", "rope_fp4", "sparse_attention", "streams", "upcast_gemv", "set_pdl", "pdl_enabled", "prepare_device"]
