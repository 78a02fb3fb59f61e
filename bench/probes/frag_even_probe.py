"""Probe (issue #3, session 23): the fragment kernel without masks where the shape allows (plan option `even`),
against the masked kernel, at the h200 decode shapes (6 of 96 experts, beyond L2, CUDA-graph replay, PDL on,
act_quant, the activation launch included), with warps / prefetch / register-cap variants; also the pair op (w1 and
w3 of one x). Records registers and spills of each compiled variant and the max relative error against the
reference. Writes JSON (argv[1])."""
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
W13 = [dict(even=False), dict(even=False, maxnreg=None), dict(even=True), dict(even=True, maxnreg=64),
       dict(even=True, maxnreg=56), dict(even=True, num_warps=8), dict(even=True, num_warps=2),
       dict(even=True, num_warps=4, prefetch=True), dict(even=True, num_warps=2, prefetch=True),
       dict(even=True, num_warps=1, prefetch=True), dict(even=True, num_warps=4, split_k=5)]
W2 = [dict(even=False), dict(even=True), dict(even=True, prefetch=False), dict(even=True, split_k=3),
      dict(even=True, split_k=3, prefetch=False), dict(even=True, maxnreg=80), dict(even=False, num_warps=1, split_k=2)]


def main():
    set_pdl(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bw = copy_bandwidth(100)
    rows = []
    for name, n, k, shared, xdt, plans in [("w1w3", 2304, 5120, True, torch.bfloat16, W13),
                                           ("w2", 5120, 2304, False, torch.float32, W2),
                                           ("w2", 5120, 2304, False, torch.bfloat16, W2[:2])]:
        w = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
        s = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
        x = torch.randn(*((1, k) if shared else (1, 6, k)), device="cuda", generator=gen).to(xdt)
        per_call = 6 * n * (k // 2 + k // 32)
        idxs = [torch.randperm(96, device="cuda", generator=gen)[:6][None] for _ in range(_copies_for(per_call))]
        ref = gg.reference_grouped_linear_fp4(x.float(), w, s, idxs[0], True).double()
        for plan in plans:
            cfg = dict(frag=True, **plan)
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
            r = dict(shape=name, x_dtype=str(xdt), plan=plan, regs=regs[0], spills=regs[1], time_us=t * 1e6,
                     frac=per_call / t / bw, max_rel_err=err)
            rows.append(r)
            print(f"{name} {str(xdt)[6:]} {plan} regs={regs}: {t*1e6:.2f} us ({100*per_call/t/bw:.1f} %) "
                  f"err={err:.1e}", flush=True)
        if shared:
            w_b = torch.randint(0, 256, (96, n, k // 2), dtype=torch.uint8, device="cuda", generator=gen)
            s_b = torch.randint(117, 124, (96, n, k // 32), dtype=torch.uint8, device="cuda", generator=gen)
            fn = lambda i: gg.triton_grouped_linear_fp4_pair(x, w, s, w_b, s_b, i, True)
            ya, yb = fn(idxs[0])
            rb = gg.reference_grouped_linear_fp4(x.float(), w_b, s_b, idxs[0], True).double()
            err = max(((ya.double() - ref).abs().max() / ref.abs().max()).item(),
                      ((yb.double() - rb).abs().max() / rb.abs().max()).item())
            t = _bench_graph([lambda i=i: fn(i) for i in idxs], 60)
            rows.append(dict(shape="w1w3 pair op", x_dtype=str(xdt), plan="default", time_us=t * 1e6,
                             frac=2 * per_call / t / bw, max_rel_err=err))
            print(f"w1w3 pair op (default plan): {t*1e6:.2f} us ({100*2*per_call/t/bw:.1f} %) err={err:.1e}", flush=True)
            del w_b, s_b
        del w, s
    json.dump(dict(date=time.strftime("%Y-%m-%d"), gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                   triton=triton.__version__, copy_bw_TBps=bw / 1e12, rows=rows), open(sys.argv[1], "w"), indent=1)
    print(f"copy bandwidth {bw/1e12:.2f} TB/s")
    for shape, xdt in [("w1w3", "torch.bfloat16"), ("w2", "torch.float32"), ("w2", "torch.bfloat16")]:
        rs = sorted([r for r in rows if r["shape"] == shape and r["x_dtype"] == xdt], key=lambda r: r["time_us"])
        print("BEST", shape, xdt, [(r["plan"], r["regs"], round(r["time_us"], 2)) for r in rs[:4]])


if __name__ == "__main__":
    main()
