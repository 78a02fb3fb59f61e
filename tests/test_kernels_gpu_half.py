"""GPU tests of the half-precision GEMV ops (dsv41/kernels/half_gemv.py) at Llama-3.2-1B / 8B decode shapes, with
PDL on and off and replayed from a CUDA graph.

Run on a CUDA machine: `python -m pytest tests/test_kernels_gpu_half.py -q`. Skipped without a CUDA GPU and under
TRITON_INTERPRET=1 (the interpreter cases are tests/test_kernels_half_gemv.py, whose float64 oracles and bounds
these reuse, imported by path). Every launcher output and workspace is NaN-poisoned first.
"""

from __future__ import annotations

import pytest
import torch

from gpu_harness import load_reference, replay_poisoned, skip_unless_compiled_gpu  # noqa: E402
from interp_harness import poison_outputs  # noqa: E402

skip_unless_compiled_gpu()

import dsv41.kernels as kernels  # noqa: E402
from dsv41.kernels import half_gemv as hg  # noqa: E402

R = load_reference("test_kernels_half_gemv")
DEV = torch.device("cuda")
#: (name, [N_i], K): Llama-3.2-1B q/k/v, o, gate/up, down and a slice of the head; 8B gate/up and down.
SHAPES = [("qkv_1b", [2048, 512, 512], 2048), ("o_1b", [2048], 2048), ("gate_up_1b", [8192, 8192], 2048),
          ("down_1b", [2048], 8192), ("head_slice", [16384], 2048), ("gate_up_8b", [14336, 14336], 4096),
          ("down_8b", [4096], 14336)]


@pytest.fixture(autouse=True)
def _poisoned(monkeypatch):
    poison_outputs(monkeypatch, hg)
    yield
    kernels.set_pdl(False)


def _data(widths, k, rows, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, rows, k, generator=gen) * 2).to(dtype)
    ws = [(torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype) for n in widths]
    return x, ws


@pytest.mark.parametrize("pdl", [False, True])
@pytest.mark.parametrize("rows", [1, 6])
@pytest.mark.parametrize("name, widths, k", SHAPES, ids=[s[0] for s in SHAPES])
def test_ops_match_float64_at_decode_shapes(name, widths, k, rows, pdl):
    kernels.set_pdl(pdl)
    x, ws = _data(widths, k, rows, torch.bfloat16, len(name) + k)
    xg, wg = x.to(DEV), [w.to(DEV) for w in ws]
    if len(widths) == 2 and widths[0] == widths[1]:
        R.check_swiglu(hg.triton_linear_half_silu_mul(xg, wg[0], wg[1]).cpu(), x, ws[0], ws[1])
    if len(widths) > 1:
        for y, w in zip(hg.triton_linear_half_multi(xg, wg), ws):
            R.check_linear(y.cpu(), x, w)
    r = torch.randn(1, rows, widths[0], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    R.check_linear(hg.triton_linear_half(xg, wg[0], r.to(DEV)).cpu(), x, ws[0], r)


def test_fp16_and_cuda_graph_replay_with_pdl():
    kernels.set_pdl(True)
    x, (wg, wu) = _data([1024, 1024], 512, 1, torch.float16, 7)
    xg, wgg, wug = x.to(DEV), wg.to(DEV), wu.to(DEV)
    wdt = torch.randn(512, 1024, dtype=torch.float16, device=DEV) / 32
    r = torch.randn(1, 1, 512, dtype=torch.float16, device=DEV)
    kernels.prepare_device(DEV)
    # Compile both kernels outside the capture.
    torch.ops.dsv41.linear_half(torch.ops.dsv41.linear_half_silu_mul(xg, wgg, wug), wdt, r)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        h = torch.ops.dsv41.linear_half_silu_mul(xg, wgg, wug)
        out = torch.ops.dsv41.linear_half(h, wdt, r)
    xg.copy_((torch.randn(1, 1, 512, device=DEV) * 2).half())
    g.replay()
    torch.cuda.synchronize()
    R.check_swiglu(h.cpu(), xg.cpu(), wg, wu)
    R.check_linear(out.cpu(), h.cpu(), wdt.cpu(), r.cpu())


@pytest.mark.parametrize("mode", [1, 2])
def test_rmsnorm_prologue_at_llama_shapes(mode):
    kernels.set_pdl(True)
    x, (wq, wk, wg, wu) = _data([2048, 512, 8192, 8192], 2048, 1, torch.bfloat16, 9)
    nw = (1 + 0.1 * torch.randn(2048, generator=torch.Generator().manual_seed(2))).bfloat16()
    xn, slack = R.rms_oracle(x, nw, 1e-5, mode)
    xg, nwg = x.to(DEV), nw.to(DEV)
    ys = hg.triton_linear_half_multi(xg, [wq.to(DEV), wk.to(DEV)], nwg, 1e-5, mode)
    for y, w in zip(ys, (wq, wk)):
        R.check_linear(y.cpu(), xn, w, slack=slack)
    R.check_swiglu(hg.triton_linear_half_silu_mul(xg, wg.to(DEV), wu.to(DEV), nwg, 1e-5, mode).cpu(), xn, wg, wu,
                   slack)


@pytest.mark.parametrize("pdl", [False, True])
def test_qwen_biased_qkv_matches_float64(pdl):
    """Qwen2-1.5B-like q / k / v (1536 -> 1536, 256, 256) with biases, one launch, against float64."""
    kernels.set_pdl(pdl)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 1536, generator=gen).to(torch.bfloat16)
    ws = [(torch.randn(n, 1536, generator=gen) / 1536 ** 0.5).to(torch.bfloat16) for n in (1536, 256, 256)]
    bs = [torch.randn(n, generator=gen).to(torch.bfloat16) for n in (1536, 256, 256)]
    got = hg.triton_linear_half_multi(x.to(DEV), [w.to(DEV) for w in ws], biases=[b.to(DEV) for b in bs])
    torch.cuda.synchronize()
    for y, w, b in zip(got, ws, bs):
        want = x.double() @ w.double().t() + b.double()
        assert torch.allclose(y.cpu().double(), want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("early", [0, 1, 2])
def test_dependent_chain_in_a_graph_under_each_pdl_prologue(early, prefetch):
    """Six launches, each reading the one before, replayed from a CUDA graph with the next launch let in early: a
    program that read x before its predecessor had finished would see the NaN the outputs are poisoned with."""
    kernels.set_pdl(True)
    kernels.prepare_device(DEV)
    gen = torch.Generator().manual_seed(11)
    k, f = 1024, 2048
    wg, wu = [(torch.randn(f, k, generator=gen) / k ** 0.5).bfloat16() for _ in range(2)]
    wd = (torch.randn(k, f, generator=gen) / f ** 0.5).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).bfloat16()
    x = (torch.randn(1, k, generator=gen) * 2).bfloat16().to(DEV)
    dev = [t.to(DEV) for t in (wg, wu, wd, nw)]
    over = dict(early_launch=early, l2_prefetch=prefetch)

    def step():
        outs, h = [], x
        for _ in range(3):
            a = hg.triton_linear_half_silu_mul(h, dev[0], dev[1], dev[3], 1e-5, 1, **over)
            h = hg.triton_linear_half(a, dev[2], h, **over)
            outs += [a, h]
        return outs

    outs = replay_poisoned(step)
    h = x.cpu()
    for i in range(3):
        a, h_next = outs[2 * i].cpu(), outs[2 * i + 1].cpu()
        xn, slack = R.rms_oracle(h, nw, 1e-5, 1)
        R.check_swiglu(a, xn, wg, wu, slack)
        R.check_linear(h_next, a, wd, h)
        h = h_next
