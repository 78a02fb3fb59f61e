"""Why do the h200 graph's MoE w2 sites get act_quant=False on the GPU (s21)? Wraps act_quant.act_quant_input and
records, for every call that finds no fake-quant input, each dominator tried and the probe comparison.
    python3 bench/probes/diag_act_quant.py OUT.json moe            # MoE block alone at h200 dims, 96 experts, CUDA
    python3 bench/probes/diag_act_quant.py OUT.json bench ARGS...  # dsv41.bench with ARGS"""
import atexit, json, math, os, runpy, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # dsv41 from this checkout
import torch
import dsv41.passes.act_quant as D
import dsv41.passes.dispatch  # noqa: F401  (loads dispatch_gathered too)
from dsv41.model import formats
from dsv41.passes.engine import RegionNotClosed

LOG = []
_orig = D.act_quant_input


def _detail(lhs, k, ev, sourced):
    lv = D.tensor_val(lhs)
    tried = []
    gen = torch.Generator().manual_seed(99)
    for d in D.dominators(lhs, sourced):
        if d is lhs:
            continue
        dv = D.tensor_val(d)
        shape = D.concrete_shape(dv)
        rec = dict(node=d.name, op=d.op, target=str(d.target), dtype=str(dv.dtype), shape=list(shape))
        if dv.dtype == lv.dtype and shape and shape[-1] == k and math.prod(shape) == math.prod(D.concrete_shape(lv)):
            mag = torch.exp2(torch.randint(-8, 9, (*shape[:-1], k // 32, 1), generator=gen).double())
            probe = torch.randn(*shape[:-1], k // 32, 32, generator=gen, dtype=torch.float64) * mag
            probe = probe.reshape(shape).to(dv.dtype).to(dv.device)
            try:
                got = ev.evaluate([lhs], {d: probe})[lhs]
                ref = formats.fake_quant_fp8_1x32(probe).reshape(got.shape)
                bad = (got.float() != ref.float()) & ~(got.isnan() & ref.isnan())
                rec.update(probed=True, got_dtype=str(got.dtype), ref_dtype=str(ref.dtype), mismatches=int(bad.sum()),
                           example=[(float(probe.reshape(got.shape)[bad][i]), float(got[bad][i]), float(ref[bad][i]))
                                    for i in range(min(4, int(bad.sum())))])
            except RegionNotClosed as e:
                rec.update(probed=True, region_not_closed=str(e)[:300])
        tried.append(rec)
        if d.op != "call_function" or not D.is_dataflow_op(d):
            rec["stop"] = True
            break
    return tried


def wrapped(lhs, k, ev, sourced):
    r = _orig(lhs, k, ev, sourced)
    e = dict(k=k, found=r is not None, lhs=lhs.name, lhs_shape=list(D.concrete_shape(D.tensor_val(lhs))),
             stack=(lhs.meta.get("stack_trace") or "").strip().splitlines()[-3:])
    if r is None and k in (2304, 5120):
        e["tried"] = _detail(lhs, k, ev, sourced)[:60]
    LOG.append(e)
    return r


D.act_quant_input = wrapped
for _m in ("dispatch", "dispatch_gathered"):  # they bound the name at import
    setattr(sys.modules["dsv41.passes." + _m], "act_quant_input", wrapped)
out = sys.argv[1]
atexit.register(lambda: json.dump(LOG, open(out, "w"), indent=1, default=str))
if sys.argv[2] == "moe":
    import dsv41
    from dsv41.model import ModelConfig
    from dsv41.model.moe import MoE
    cfg = ModelConfig.preset("h200")
    m = MoE(cfg, "checkpoint", torch.bfloat16, device="cuda").eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dtype == torch.uint8:
                p.random_(0, 256) if "scale" not in n else p.random_(120, 130)
            else:
                p.normal_(0, 0.02)
    x = torch.randn(1, 1, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        torch.compile(m, backend="dsv41")(x)
    for name, fam in dsv41.last_report().to_dict()["families"].items():
        if fam.get("matches"):
            print(name, [(s["pattern"], s["location"]["line"]) for s in fam["sites"]])
else:
    sys.argv = ["dsv41.bench"] + sys.argv[3:]
    runpy.run_module("dsv41.bench", run_name="__main__")
