"""GPU tests of the `sparse_attention` and `indexer` kernels (compiled Triton on CUDA), at `h200` decode shapes
and at the interpreter tests' odd shapes, against the same float64 references as the CPU tests.

Skipped without CUDA and under TRITON_INTERPRET=1 (the CPU tests cover the interpreted kernels).
"""

from __future__ import annotations


import pytest
import torch

from gpu_harness import load_reference, skip_unless_compiled_gpu  # noqa: E402

skip_unless_compiled_gpu()

from dsv41.kernels import indexer as ik  # noqa: E402
from dsv41.kernels import sparse_attention as sa  # noqa: E402
from dsv41.model import ModelConfig  # noqa: E402



SA = load_reference("test_kernels_sparse_attention")
IX = load_reference("test_kernels_indexer")
DEV = torch.device("cuda")
H200 = ModelConfig.preset("h200")


def _cuda(args):
    return [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("name", sorted(SA.CASES))
def test_sparse_attention_matches_float64_reference_on_gpu(name):
    args = SA.make_inputs(**SA.CASES[name])
    for split in (None, 1, 3):
        got = sa.triton_sparse_fp4_attention(*_cuda(args), split=split)
        SA.check(got.cpu(), args, f"{name} split={split}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_sparse_attention_at_h200_decode_shape(dtype):
    c = H200
    args = SA.make_inputs(b=1, t=1, h=c.num_attention_heads, d=c.head_dim, s=c.sliding_window, n=4096,
                          k=c.index_topk, r=c.qk_rope_head_dim, dtype=dtype, seed=11, p_visible=1.0, p_empty=0.05)
    SA.check(torch.ops.dsv41.sparse_fp4_attention(*_cuda(args)).cpu(), args, "h200 decode")


@pytest.mark.parametrize("n", [5, 600, 4096])
def test_indexer_scores_topk_candidates_on_gpu(n):
    c = H200
    q, w, codes, scales, nv = IX.make_score_inputs(1, 1, c.index_n_heads, c.index_head_dim, n, torch.bfloat16, n)
    got = ik.triton_indexer_scores(*_cuda([q, w, codes, scales, nv]))
    ref = IX.ref_scores64(q, w, codes, scales, nv)
    got = got.cpu()
    inf = torch.isinf(ref)
    assert not torch.isnan(got).any() and torch.equal(torch.isinf(got), inf)
    # 64 heads x 128 channels of signed products cancel: bound the error by the scores' scale, not each score
    err = (got.double() - ref)[~inf].abs()
    assert bool((err <= 2e-5 * (1 + ref[~inf].abs().max())).all()), float(err.max())
    k = min(c.index_topk, 512)
    gen = torch.Generator().manual_seed(n)
    for s in (ref.float(), IX.tie_scores(1, 2, n, gen)):
        assert torch.equal(ik.triton_indexer_topk(s.to(DEV), k).cpu(), IX.ref_topk(s, k))
    s = IX.tie_scores(1, 1, n, gen)
    nvis = torch.full((1, 1), n)
    block, n_blocks = c.candidate_block_size, min(c.candidate_topk_blocks, -(-n // c.candidate_block_size))
    got_c = ik.triton_indexer_candidates(s.to(DEV), nvis.to(DEV), block, n_blocks).cpu()
    assert torch.equal(got_c, IX.ref_candidates(s, nvis, block, n_blocks))


def test_indexer_topk_splits_long_rows_on_gpu():
    gen = torch.Generator().manual_seed(5)
    s = IX.tie_scores(1, 1, 131072, gen)
    for split in (None, 4):
        assert torch.equal(ik.triton_indexer_topk(s.to(DEV), 512, split=split).cpu(), IX.ref_topk(s, 512))
