"""Probe (issue #3, session 22): the fragment kernel's register cap (maxnreg) and warps per program at the h200
decode shapes (6 of 96 experts, beyond L2, CUDA-graph replay, PDL on, act_quant, activation launch included);
w2 also with float32 x (the h200 graph's w2 input once dispatch takes the float32 quantiser input). Records the
registers and spills of each compiled variant. Writes JSON (argv[1])."""
import os, json, sys, time
import torch, triton
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]  # dsv41 and bench/kernels.py, from any working directory
from kernels import _bench_graph, _copies_for, copy_bandwidth
from dsv41.kernels import grouped_frag as gf, grouped_gemv as gg, set_pdl

REGS = {}
_run = gf._grouped_frag_kernel.run


def _recording_run(*args, **kwargs):
    k = _run(*args, **kwargs)
    try:
        REGS["last"] = (k.n_regs, k.n_spills)
    except AttributeError:
        REGS["last"] = (None, None)
    return k


gf._grouped_frag_kernel.run = _recording_run
PLANS = [dict(num_warps=4, prefetch=False), dict(num_warps=2, prefetch=True), dict(num_warps=2, prefetch=False),
         dict(num_warps=1, prefetch=True), dict(num_warps=8, prefetch=False)]
CAPS = [None, 64, 72, 80]


def main():
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    for name, n, k, shared, xdt in [("w1w3", 2304, 5120, True, torch.bfloat16), ("w2", 5120, 2304, False, torch.float32),
                                    ("w2", 5120, 2304, False, torch.bfloat16)]:
        w = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        x = torch.randn(*((1, k) if shared else (1, 6, k)), device="cuda", generator=gen).to(xdt)
        per_call = 6 * n * (k // 2 + k // 32)
        idxs = [torch.randperm(96, device="cuda", generator=gen)[:6][None] for _ in range(_copies_for(per_call))]
        ref = gg.reference_grouped_linear_fp4(x.float(), w, s, idxs[0], True).double()
        for plan in PLANS:
            for cap in CAPS:
                cfg = dict(frag=True, maxnreg=cap, **plan)
                fn = lambda i, cfg=cfg, x=x, w=w, s=s: gg.triton_grouped_linear_fp4(x, w, s, i, True, **cfg)
                try:
                    got = fn(idxs[0]).double()
                    torch.cuda.synchronize()
                    regs = REGS.get("last")
                    err = ((got - ref).abs().max() / ref.abs().max()).item()
                    t = _bench_graph([lambda i=i: fn(i) for i in idxs], 60)
                except Exception as exc:
                    print(f"{name} {xdt} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                r = dict(shape=name, x_dtype=str(xdt), **plan, maxnreg=cap, regs=regs[0], spills=regs[1],
                         time_us=t * 1e6, frac=per_call / t / bw, max_rel_err=err)
                rows.append(r)
                print(f"{name} {str(xdt)[6:]} {plan} cap={cap} regs={regs}: {t*1e6:.2f} us ({100*per_call/t/bw:.1f} %) "
                      f"err={err:.1e}", flush=True)
        del w, s
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")
    for shape, xdt in [("w1w3", "torch.bfloat16"), ("w2", "torch.float32"), ("w2", "torch.bfloat16")]:
        rs = sorted([r for r in rows if r["shape"] == shape and r["x_dtype"] == xdt], key=lambda r: r["time_us"])
        print("BEST", shape, xdt, [(r["num_warps"], r["prefetch"], r["maxnreg"], r["regs"], round(r["time_us"], 2))
                                   for r in rs[:5]])


if __name__ == "__main__":
    main()
