"""Probe (issue [generic], session 36): the Llama decode step's GEMVs as ONE chain, the way a step runs them.

A Llama-shaped model's GEMVs (per layer: q/k/v with the RMSNorm prologue, o_proj + residual, gate/up + SwiGLU with
the RMSNorm prologue, down_proj + residual; then the head with the final norm), each layer with its own weights,
captured back to back in one CUDA graph with PDL (bench/kernels.py `_bench_graph`). So the weights never fit L2 and
each GEMV follows a different GEMV, as in decode; the attention is left out (o_proj reads q instead). Rows:
- `cublas`: the same projections as `F.linear` calls (no norms, SwiGLU or residuals): what cuBLAS alone takes;
- stage 1: the `half_gemv` ops with their default plans under each PDL prologue (`early_launch` 0 / 1 / 2 x
  `l2_prefetch` on / off, `dsv41/kernels/half_gemv.py`);
- stage 2: with the best prologue, one op kind at a time through a list of plans (the others at their default);
- `best`: every op kind at its best plan.
Fractions are of the chain's weight bytes at the copy bandwidth measured in the same run.

`--e2e`: then `run_llama_benchmark` of the model (prompt 512, 128 tokens, 2 repeats, default options): first the
rows inductor-cudagraphs and dsv41 as the tree has them, then dsv41 with the winners patched in
(`half_gemv._EARLY_LAUNCH`, `_L2_PREFETCH`, each kind's plan; with `--gqa` the best attention plan), so every dsv41
row runs on one lease. `--no-sweep`: only the cuBLAS chain and the tree's defaults, then the e2e as the tree has it.

Usage: python3 bench/probes/half_chain_probe.py [--model llama-1b|llama-8b] [--json PATH] [--e2e] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]
from kernels import _bench_graph, copy_bandwidth  # noqa: E402
from dsv41.kernels import half_gemv as hg, prepare_device, set_pdl  # noqa: E402

# layers, d_model, q heads, kv heads, head dim, ffn, vocab
SHAPES = {"llama-1b": (16, 2048, 32, 8, 64, 8192, 128256), "llama-8b": (32, 4096, 32, 8, 128, 14336, 128256)}
PLANS = [{}, {"block_n": 64}, {"block_k": 128}, {"block_n": 32, "block_k": 256}, {"k_iters": 1}, {"k_iters": 4},
         {"k_iters": 8}, {"block_n": 32, "block_k": 256, "k_iters": 8, "stages": 3}, {"k_iters": 8, "stages": 3},
         {"block_n": 64, "k_iters": 16, "stages": 4}]
KINDS = ("qkv", "o", "gate_up", "down", "head")


def _weights(shape, gen):
    L, d, hq, hkv, hd, ffn, vocab = shape
    w = lambda n, k: (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()  # noqa: E731
    layers = [dict(q=w(hq * hd, d), k=w(hkv * hd, d), v=w(hkv * hd, d), o=w(d, hq * hd), g=w(ffn, d), u=w(ffn, d),
                   down=w(d, ffn), n1=torch.ones(d, device="cuda").bfloat16(),
                   n2=torch.ones(d, device="cuda").bfloat16()) for _ in range(L)]
    head = dict(w=w(vocab, d), n=torch.ones(d, device="cuda").bfloat16())
    return layers, head


def _chain(layers, head, h0, plans):
    """The step's GEMVs with per-kind overrides `plans[kind]` (dict)."""
    def run():
        h = h0
        for ly in layers:
            q, k, v = hg.triton_linear_half_multi(h, [ly["q"], ly["k"], ly["v"]], ly["n1"], 1e-5, 1, **plans["qkv"])
            h = hg.triton_linear_half(q, ly["o"], h, **plans["o"])
            a = hg.triton_linear_half_silu_mul(h, ly["g"], ly["u"], ly["n2"], 1e-5, 1, **plans["gate_up"])
            h = hg.triton_linear_half(a, ly["down"], h, **plans["down"])
        return hg.triton_linear_half(h, head["w"], None, head["n"], 1e-5, 1, **plans["head"])
    return run


def _cublas(layers, head, h0):
    def run():
        h = h0
        for ly in layers:
            q, _, _ = F.linear(h, ly["q"]), F.linear(h, ly["k"]), F.linear(h, ly["v"])
            h = F.linear(q, ly["o"])
            a = F.linear(h, ly["g"]) * F.linear(h, ly["u"])
            h = F.linear(a, ly["down"])
        return F.linear(h, head["w"])
    return run


def _time(fn, reps_ms, tries=3):
    return min(_bench_graph([fn], reps_ms) for _ in range(tries))


def sweep(model, reps_ms, quick, full=True):
    """Time the chain (module docstring): cuBLAS, then stage 1 to 3 (`full`), or the tree's defaults only. Returns
    {model, bytes, copy_tb_s, floor_us, rows, knobs, plans, shapes}: knobs / plans are the winners (knobs None
    without `full`), shapes each kind's (N, K, pair) as `half_gemv._launch` sees it."""
    shape = SHAPES[model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers, head = _weights(shape, gen)
    nbytes = sum(t.numel() * 2 for ly in layers for n, t in ly.items() if n not in ("n1", "n2")) + head["w"].numel() * 2
    h0 = torch.randn(1, shape[1], device="cuda", generator=gen).bfloat16()
    bw = copy_bandwidth(100)
    floor = nbytes / bw
    rows = []

    def row(label, t, **kw):
        rows.append(dict(variant=label, us=t * 1e6, frac=floor / t, **kw))
        print(f"{model} {label:60s} {t * 1e6:9.1f} us  {100 * floor / t:5.1f} % of copy", flush=True)

    print(f"{model}: {nbytes / 1e9:.3f} GB of weights, copy {bw / 1e12:.2f} TB/s, floor {floor * 1e6:.1f} us",
          flush=True)
    row("cublas F.linear chain", _time(_cublas(layers, head, h0), reps_ms))
    if not full:  # the tree's defaults only
        row("half_gemv defaults", _time(_chain(layers, head, h0, {k: {} for k in KINDS}), reps_ms), stage=0)
        del layers, head
        torch.cuda.empty_cache()
        return dict(model=model, bytes=nbytes, copy_tb_s=bw / 1e12, floor_us=floor * 1e6, rows=rows, knobs=None)
    best = None
    for early in (0, 1, 2):
        for pf in (True, False):
            knobs = dict(early_launch=early, l2_prefetch=pf)
            t = _time(_chain(layers, head, h0, {k: dict(knobs) for k in KINDS}), reps_ms)
            row(f"default plans early_launch={early} l2_prefetch={pf}", t, stage=1, knobs=knobs)
            if best is None or t < best[0]:
                best = (t, knobs)
    t0, knobs = best
    chosen = {k: {} for k in KINDS}
    plans = PLANS[:6] if quick else PLANS
    for kind in KINDS:
        top = (t0, {})
        for p in plans[1:]:
            trial = {k: dict(knobs, **chosen[k]) for k in KINDS}
            trial[kind] = dict(knobs, **p)
            try:
                t = _time(_chain(layers, head, h0, trial), reps_ms, tries=2)
            except Exception as exc:  # a plan this shape cannot take
                print(f"{model} {kind} {p}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
                continue
            row(f"{kind} {p}", t, stage=2, kind=kind, plan=p)
            if t < top[0]:
                top = (t, p)
        chosen[kind] = top[1]
        t0 = top[0]
    t = _time(_chain(layers, head, h0, {k: dict(knobs, **chosen[k]) for k in KINDS}), reps_ms)
    row("best " + json.dumps(chosen), t, stage=3, knobs=knobs, plans=chosen)
    shapes = {"qkv": ((shape[2] + 2 * shape[3]) * shape[4], shape[1], False),
              "o": (shape[1], shape[2] * shape[4], False),
              "gate_up": (shape[5], shape[1], True), "down": (shape[1], shape[5], False),
              "head": (shape[6], shape[1], False)}
    del layers, head
    torch.cuda.empty_cache()
    return dict(model=model, bytes=nbytes, copy_tb_s=bw / 1e12, floor_us=floor * 1e6, rows=rows, knobs=knobs,
                plans=chosen, shapes=shapes)


def gqa_sweep(model, reps_ms, context=640):
    """`gqa_decode_attention` at the model's decode shape (M = 1, a bool mask over a static cache of `context`
    rows, one cache per layer), per plan; returns (rows, best overrides)."""
    from dsv41.kernels import gqa_attention as ga
    L, d, hq, hkv, hd = SHAPES[model][:5]
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(1, hq, 1, hd, device="cuda", generator=gen).bfloat16()
    caches = [(torch.randn(1, hkv, context, hd, device="cuda", generator=gen).bfloat16(),
               torch.randn(1, hkv, context, hd, device="cuda", generator=gen).bfloat16()) for _ in range(L)]
    mask = torch.zeros(1, 1, 1, context, dtype=torch.bool, device="cuda")
    mask[..., :context - 64] = True
    rows, best = [], None

    def one(over):
        """Time one plan (`gqa_plan` overrides) over every layer's cache; keep the row and the best."""
        nonlocal best
        calls = [lambda k=k, v=v: ga.triton_gqa_decode_attention(q, k, v, mask, **over) for k, v in caches]
        try:
            t = min(_bench_graph(calls, reps_ms) for _ in range(2))
        except Exception as exc:
            print(f"gqa {over}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            return
        rows.append(dict(plan=over, us_per_layer=t * 1e6))
        print(f"{model} gqa {json.dumps(over):48s} {t * 1e6:7.2f} us/layer", flush=True)
        if best is None or t < best[0]:
            best = (t, over)

    one({"skip_masked": False, "dot": False})  # the kernel before session 37
    one({"dot": False})
    for bs in (16, 32, 64, 128):
        for sp in (None, 4, 8, 16):
            one({"block_s": bs, "dot": True} if sp is None else {"block_s": bs, "splits": sp, "dot": True})
    top = dict(best[1])
    one({**top, "skip_masked": False})  # the mask's load before the cache's is one more round trip
    one({**top, "merge_chunk": 4})
    for nw in (1, 2, 8):
        one({**top, "num_warps": nw})
    return rows, best[1]


def patch(result):
    """Make the winners the defaults of this process (half_gemv's module constants, and a `_launch` wrapper that
    adds the winning plan of the call's shape to its overrides)."""
    if result.get("gqa_best"):
        from dsv41.kernels import gqa_attention as ga
        base_plan, over = ga.gqa_plan, result["gqa_best"]
        ga.gqa_plan = lambda b, hkv, s, **kw: base_plan(b, hkv, s, **{**over, **kw})
    if not result.get("knobs"):
        return
    hg._EARLY_LAUNCH = result["knobs"]["early_launch"]
    hg._L2_PREFETCH = result["knobs"]["l2_prefetch"]
    base = hg._launch
    by_shape = {tuple(v): result["plans"][k] for k, v in result["shapes"].items()}

    def launch(x, weights, residual, pair, overrides, *args, **kw):
        n = weights[0].shape[0] if pair else sum(w.shape[0] for w in weights)
        return base(x, weights, residual, pair, {**by_shape.get((n, x.shape[-1], pair), {}), **overrides}, *args, **kw)
    hg._launch = launch


def e2e(model, save=lambda part: None):
    """`run_llama_benchmark(model)` as the tree has it (rows inductor-cudagraphs, dsv41), then with `e2e.result`'s
    winners patched in (`patch`). Returns {"label:row": kept fields}; `save(part)` after every run."""
    from dsv41.bench_llama import run_llama_benchmark
    out = {}
    kw = dict(prompt_len=512, new_tokens=128, repeats=2, options=None, warm_compile=False)
    runs = [("tree", e2e.tree_rows)]
    if e2e.result.get("knobs") or e2e.result.get("gqa_best"):
        runs.append(("patched", ["dsv41"]))
    for fam in e2e.families:  # families gated on CUDA until measured here (`gpu_unvalidated`), on the patched tree
        runs.append((f"+{fam}", ["dsv41"]))
    for label, rows in runs:
        if label == "patched":
            patch(e2e.result)
        t = time.perf_counter()
        opts = {"gpu_unvalidated": label[1:].split(",")} if label.startswith("+") else None
        r = run_llama_benchmark(model, backends=rows, **{**kw, "options": opts})
        for name, b in r["backends"].items():
            keep = {k: b.get(k) for k in ("decode_tok_s", "roofline_fraction", "kernels_per_step", "max_rel_logit_err",
                                          "compile_s", "note", "step_gpu_busy_us", "step_span_us", "top_kernels_us")}
            out[f"{label}:{name}"] = keep
            print(f"E2E {model} {label:18s} {name:20s} {keep['decode_tok_s']} roofline {keep['roofline_fraction']} "
                  f"kernels {keep['kernels_per_step']} err {keep['max_rel_logit_err']}", flush=True)
        out[f"{label}:roofline_tok_s"] = r["roofline_tok_s"]
        print(f"E2E {label} took {time.perf_counter() - t:.0f} s", flush=True)
        save(out)
    return out


def main():
    """Command line: module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--json")
    ap.add_argument("--reps-ms", type=float, default=40.0)
    ap.add_argument("--e2e", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="only the cuBLAS chain and the tree's default plans")
    ap.add_argument("--gqa", action="store_true", help="sweep the attention plans; the e2e patches the best")
    ap.add_argument("--ungate", action="append", default=[], help="an e2e run more with these gated families on (comma-separated)")
    ap.add_argument("--skip-chain", action="store_true", help="no GEMV chain timing (the e2e and --gqa only)")
    ap.add_argument("--tree-rows", default="inductor-cudagraphs,dsv41", help="rows of the e2e's first run")
    a = ap.parse_args()
    set_pdl(True)
    prepare_device(torch.device("cuda"))
    res = {"model": a.model} if a.skip_chain else sweep(a.model, a.reps_ms, a.quick, full=not a.no_sweep)
    if a.gqa:
        res["gqa_rows"], res["gqa_best"] = gqa_sweep(a.model, a.reps_ms)
    import datetime

    import triton
    res.update(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=datetime.date.today().isoformat())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    if a.e2e:
        e2e.result, e2e.families, e2e.tree_rows = res, a.ungate, a.tree_rows.split(",")

        def save(part):  # after every run: a timeout keeps what has finished
            res["e2e"] = part
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(res, f, indent=1)
        e2e(a.model, save)


if __name__ == "__main__":
    main()
