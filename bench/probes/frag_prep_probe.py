"""Probe (issue #3, session 24, call 3): the fragment GEMV at its default plan against the TMA and tile kernels, and
the GEMV launch alone (activations prepared once outside the graph) to price the activation launch; h200 dense
shapes, CUDA-graph replay, PDL, one bf16 x row, weights beyond L2. Writes JSON (argv[1])."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import GEMV_SHAPES, _bench_graph, _copies_for, copy_bandwidth, _random_fp8_weight
from dsv41.kernels import gemv_frag as gfm, grouped_frag as gf, quant_gemv as qg, set_pdl
from dsv41.kernels._common import split_k_workspace


def gemv_only(xq, xs, w, s, y, part, cnt, plan):
    words = w.view(torch.int32)
    gfm._frag_gemv_kernel[plan["grid"]](
        xq.view(torch.int32), xs, words, s, y, part, cnt, w.shape[0], w.shape[1], words.stride(0), s.stride(0),
        ITERS=plan["ITERS"], SPLIT_K=plan["SPLIT_K"], SPLIT_POW2=plan["SPLIT_POW2"], W=plan["num_warps"],
        PREFETCH=plan["PREFETCH"], EVEN=plan["EVEN"], USE_PDL=True, ASM=True, num_warps=plan["num_warps"],
        launch_pdl=True)


def main():
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    for name, fmt, n, k in GEMV_SHAPES:
        if fmt != "fp8":
            continue
        w0, s0 = _random_fp8_weight(n, k, gen)
        nbytes = w0.numel() + s0.numel() + k * 2 + n * 2
        ws = [(w0, s0)] + [_random_fp8_weight(n, k, gen) for _ in range(_copies_for(nbytes) - 1)]
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = qg.reference_linear_fp8_block(x.float(), w0, s0, True).double()
        plan = gfm.frag_gemv_plan(n, k, sm_count=132)
        xq, xs = gf.prepare_frag_x(x, qg._empty, False, part_order=False)
        y = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        part, cnt = split_k_workspace(qg._empty, x.device, plan["SPLIT_K"], (1, n), plan["grid"][0])
        variants = [("default", lambda w, s: qg.triton_linear_fp8_block(x, w, s, True)),
                    ("tma=True", lambda w, s: qg.triton_linear_fp8_block(x, w, s, True, tma=True)),
                    ("tile (frag=False, tma=False)", lambda w, s: qg.triton_linear_fp8_block(x, w, s, True, frag=False,
                                                                                            tma=False)),
                    ("frag=True", lambda w, s: qg.triton_linear_fp8_block(x, w, s, True, frag=True)),
                    ("frag GEMV launch alone", lambda w, s: gemv_only(xq, xs, w, s, y, part, cnt, plan))]
        for label, fn in variants:
            try:
                out = fn(w0, s0)
                out = y if out is None else out
                err = ((out.double() - ref).abs().max().item()) / ref.abs().max().item()
                t = _bench_graph([lambda w=w, s=s: fn(w, s) for w, s in ws], 40)
            except Exception as exc:
                print(f"{name:10s} {label:30s} {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                continue
            rows.append(dict(shape=name, N=n, K=k, variant=label, us=t * 1e6, frac=nbytes / t / bw, err=err,
                             plan=dict(plan, grid=list(plan["grid"]))))
            print(f"{name:10s} {label:30s} {t*1e6:8.2f} us ({100*nbytes/t/bw:5.1f} %) err/max {err:.2e}", flush=True)
        del ws
        torch.cuda.empty_cache()
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
