"""Probe (issue #3): the word-decode grouped FP4 GEMV (`dsv41/kernels/grouped_words.py`) against the tile kernel
of `grouped_gemv` (words=False) at the h200 decode shapes (6 of 96 experts, beyond L2, CUDA-graph replay, PDL on),
act_quant on and off; --sweep adds `SWEEP`'s plans, --small the `small` preset shapes (4 of 32 experts; those
stacks fit in L2). Prints the best rows per shape and writes JSON (--json).

    python3 bench/grouped_words_probe.py --sweep --small --json OUT.json      # on the GPU machine
"""
import argparse, json, sys, time
import torch, triton
sys.path.insert(0, "bench")
from kernels import _bench_graph, _copies_for, copy_bandwidth
from dsv41.kernels import grouped_gemv as gg
from dsv41.kernels import set_pdl

#: Plans of the word-decode kernel tried with --sweep (the h200 shapes). Register caps and a register prefetch of
#: the next K tile were tried in this session too and dropped (slower: bench/results/2026-12-01_h200_s19/words3.json).
SWEEP = [dict(block_n=bn, block_k=bk, k_iters=ki, num_warps=nw, x_perm=xp)
         for bn, bk, ki, nw in [(32, 256, 1, 1), (16, 256, 1, 1), (32, 128, 1, 1), (32, 512, 1, 1), (64, 256, 1, 1),
                                (16, 512, 1, 1), (32, 256, 2, 1), (32, 128, 2, 1), (64, 128, 1, 1), (64, 256, 1, 2),
                                (32, 256, 1, 2), (64, 128, 4, 4), (128, 256, 1, 4)]
         for xp in (True, False)]
#: Plans of the tensor-core fragment kernel (`grouped_frag.py`) tried with --frag.
FRAG_SWEEP = [dict(num_warps=nw, split_k=sk, prefetch=pf) for nw, sk in [(1, 1), (1, 2), (2, 1), (2, 2), (4, 1),
                                                                          (4, 2), (8, 1)]
              for pf in (False, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps-ms", type=float, default=200)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--small", action="store_true", help="also the `small` preset shapes (4 of 32 experts)")
    ap.add_argument("--frag", action="store_true", help="also the fragment kernel (frag=True) and FRAG_SWEEP")
    a = ap.parse_args()
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(a.reps_ms)
    rows = []
    shapes = [("grouped_w1w3", 2304, 5120, 96, 6), ("grouped_w2", 5120, 2304, 96, 6)]
    if a.small:
        shapes += [("small_w1w3", 512, 1024, 32, 4), ("small_w2", 1024, 512, 32, 4)]
    for name, n, k, experts, topk in shapes:
        w = torch.randint(0, 256, (experts, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(117, 124, (experts, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        shared = name.endswith("w1w3")
        x = torch.randn(*((1, k) if shared else (1, topk, k)), device="cuda", dtype=torch.bfloat16, generator=gen)
        per_call = topk * n * (k // 2 + k // 32)
        idxs = [torch.randperm(experts, device="cuda", generator=gen)[:topk][None]
                for _ in range(_copies_for(per_call))]
        for aq in (True, False):
            ref = gg.reference_grouped_linear_fp4(x.float(), w, s, idxs[0], aq).double()
            cfgs = [("tile", dict(words=False)), ("words", dict(words=True)), ("default", {})]
            if a.frag and aq:
                cfgs += [("frag", dict(frag=True))] + [("frag", dict(frag=True, **c)) for c in FRAG_SWEEP]
            if a.sweep and name.startswith("grouped"):
                cfgs += [("words", dict(words=True, **c)) for c in SWEEP]
            for kind, cfg in cfgs:
                fn = lambda i, cfg=cfg: gg.triton_grouped_linear_fp4(x, w, s, i, aq, **cfg)
                try:
                    got = fn(idxs[0]).double()
                    torch.cuda.synchronize()
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    t = _bench_graph([lambda i=i: fn(i) for i in idxs], a.reps_ms / (1 if len(cfg) < 2 else 4))
                except Exception as exc:
                    print(f"  {name} aq={aq} {cfg}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                    continue
                r = dict(shape=name, act_quant=aq, kernel=kind, **cfg, time_us=t * 1e6, frac=per_call / t / bw,
                         max_rel_err=err)
                rows.append(r)
                print(f"{name} aq={aq} {kind} {cfg}: {t*1e6:.1f} us frac={per_call/t/bw:.3f} err={err:.1e}",
                      flush=True)
        del w, s
    out = dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=triton.__version__, copy_bw_TBps=bw / 1e12, pdl=True, rows=rows)
    for name in [sh[0] for sh in shapes]:
        for aq in (True, False):
            for kind in ("tile", "words", "default", "frag"):
                rs = [r for r in rows if r["shape"] == name and r["act_quant"] == aq and r["kernel"] == kind]
                if rs:
                    best = min(rs, key=lambda r: r["time_us"])
                    print(f"SUMMARY {name} aq={aq} {kind:8s} best {best['time_us']:.1f} us "
                          f"({100 * best['frac']:.0f} %) err {max(r['max_rel_err'] for r in rs):.1e} "
                          f"{ {k: v for k, v in best.items() if k in ('num_warps', 'split_k', 'prefetch')} }")
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")
    for name in [sh[0] for sh in shapes]:
        for aq in (True, False):
            rs = sorted([r for r in rows if r["shape"] == name and r["act_quant"] == aq], key=lambda r: r["time_us"])
            tile = [r for r in rs if r["kernel"] == "tile"]
            keys = ("block_n", "block_k", "k_iters", "num_warps", "x_perm", "split_k", "prefetch")
            print(name, "aq", aq, "tile", f"{tile[0]['time_us']:.1f}" if tile else "-", "best:",
                  [(r["kernel"], {k: v for k, v in r.items() if k in keys}, round(r["time_us"], 1)) for r in rs[:3]])


if __name__ == "__main__":
    main()
