"""Probe (issue #3, session 25): the fragment GEMV quantising x itself (`fold_x=True`, one launch) against the
activation launch + GEMV (`fold_x=False`, s24's default) and the TMA / tile kernels; h200 dense shapes and the
sibling groups of one x (multi op), CUDA-graph replay, PDL, one bf16 x row, weights beyond L2. Writes JSON (argv[1]).

    git show 1020b14:bench/results/2026-12-03_h200_s25/fold_x.patch | git apply    # the fold_x kernel, not in the tree
    python3 bench/probes/fold_probe.py OUT.json

`fold_x` was not kept (2.1-2.5x slower), so this probe runs only on a tree with that patch applied: it was made
against dsv41/kernels/gemv_frag.py as of a829329 (still the same file when the patch was removed from the tree).
Results: bench/results/2026-12-03_h200_s25/README.md (`fold_probe.json`)."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import GEMV_SHAPES, _bench_graph, _copies_for, copy_bandwidth, _random_fp8_weight
from dsv41.kernels import gemv_frag as gfm, gemv_multi as gm, quant_gemv as qg, set_pdl

MULTI = [("wq_a+wkv", (1280, 512), 5120), ("shared w1+w3", (2304, 2304), 5120), ("wq_b+idx wq_b", (32768, 4096), 1280)]


def run(label, name, fn, ws, nbytes, ref, bw, rows):
    try:
        out = fn(*ws[0])
        out = out if isinstance(out, (list, tuple)) else [out]
        err = max(((o.double() - r).abs().max().item()) / r.abs().max().item() for o, r in zip(out, ref))
        t = _bench_graph([lambda a=a: fn(*a) for a in ws], 40)
    except Exception as exc:
        print(f"{name:14s} {label:22s} {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        return
    rows.append(dict(shape=name, variant=label, us=t * 1e6, frac=nbytes / t / bw, err=err, bytes=nbytes))
    print(f"{name:14s} {label:22s} {t*1e6:8.2f} us ({100*nbytes/t/bw:5.1f} %) err/max {err:.2e}", flush=True)


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
        ref = [qg.reference_linear_fp8_block(x.float(), w0, s0, True).double()]
        for label, over in (("fold_x (default)", {}), ("fold_x=False", {"frag": True, "fold_x": False}),
                            ("tma=True", {"tma": True}), ("tile", {"frag": False, "tma": False})):
            run(label, name, lambda w, s, over=over: qg.triton_linear_fp8_block(x, w, s, True, **over), ws, nbytes,
                ref, bw, rows)
        del ws
        torch.cuda.empty_cache()
    for name, widths, k in MULTI:
        ws0 = [_random_fp8_weight(n, k, gen) for n in widths]
        nbytes = sum(w.numel() + s.numel() for w, s in ws0) + k * 2 + sum(widths) * 2
        sets = [ws0] + [[_random_fp8_weight(n, k, gen) for n in widths] for _ in range(_copies_for(nbytes) - 1)]
        x = torch.randn(1, k, device="cuda", generator=gen).bfloat16()
        ref = [qg.reference_linear_fp8_block(x.float(), w, s, True).double() for w, s in ws0]
        flat = [tuple(t for ws in st for t in ws) for st in sets]
        for label, fold in (("fold_x (default)", True), ("fold_x=False", False)):
            def fn(*a):
                return gm.triton_linear_fp8_block_multi(x, list(a[0::2]), list(a[1::2]), True)
            gfm._FOLD_X = fold  # the multi op takes no plan options: its plan reads the module default
            try:
                run(label, name, fn, flat, nbytes, ref, bw, rows)
            finally:
                gfm._FOLD_X = True
        del sets
        torch.cuda.empty_cache()
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
