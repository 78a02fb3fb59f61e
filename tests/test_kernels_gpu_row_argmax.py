"""GPU tests of dsv41::row_argmax (dsv41/kernels/row_argmax.py) at greedy decoding's shapes (Llama-3's 128,256
vocabulary, Qwen's 151,936; 1 to 8 rows) against torch.argmax, with planted ties across splits and NaN, PDL on and
off, under a CUDA graph replayed twice (the arrival counters must be back to zero). Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

from gpu_harness import skip_unless_compiled_gpu  # noqa: E402

skip_unless_compiled_gpu()

from dsv41.kernels import row_argmax as ra  # noqa: E402


@pytest.fixture(params=[False, True], ids=["no_pdl", "pdl"])
def pdl(request):
    from dsv41.kernels import set_pdl
    set_pdl(request.param)
    yield request.param
    set_pdl(False)


@pytest.mark.parametrize("rows, n, dtype", [(1, 128256, torch.bfloat16), (4, 151936, torch.float16),
                                            (8, 128256, torch.float32)])
def test_vocab_rows_equal_torch_argmax(rows, n, dtype, pdl):
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
    x[0, [11, n // 2, n - 1]] = 30.0                 # a tie in three splits: index 11
    if rows > 1:
        x[1, [n // 3, 5]] = float("nan")             # first NaN: index 5
    want = torch.argmax(x, -1)
    out = ra.triton_row_argmax(x)
    assert torch.equal(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        again = ra.triton_row_argmax(x)
    for _ in range(2):
        again.fill_(-7)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(again, want)
