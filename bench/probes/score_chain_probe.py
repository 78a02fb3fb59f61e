"""Issue 37 probe: why the indexer's score chain fuses on CPU and not on CUDA.

On CUDA (torch 2.11, bf16) the index layers keep their score chain as Inductor kernels plus one FP32 cuBLAS GEMM
(`sm80_xmma_gemm_f32f32`, 6 x 53 µs per `small` step), while on CPU `dsv41::indexer_scores` takes it. This probe
runs `layer_launches_probe.py` on a preset with the indexer's value check instrumented: for every probe comparison
it records the shapes, devices, dtypes, the largest deviation against the reference relative to the tolerance, and
the TF32 settings in force; for every region evaluation that raises, the exception. Everything goes to OUT.json
beside the layer-launch probe's own output (`OUT.json` + `.launches.json`).

    python3 bench/probes/score_chain_probe.py OUT.json [preset (tiny)] [device (cuda)]
"""
import json
import os
import runpy
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
import dsv41.passes.indexer as ix  # noqa: E402
from dsv41.passes.engine import RegionEvaluator  # noqa: E402

out_path = sys.argv[1]
preset = sys.argv[2] if len(sys.argv) > 2 else "tiny"
device = sys.argv[3] if len(sys.argv) > 3 else "cuda"
log = {"comparisons": [], "evaluate_errors": []}
agree = ix.scores_agree


def tf32_state() -> dict:
    """The FP32 matmul settings in force while the pass runs."""
    return {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def logged_agree(got, ref):
    """`scores_agree`, recording how far `got` is from `ref` and why it fails."""
    ok = agree(got, ref)
    row = {"ok": bool(ok), "got": [str(getattr(got, "dtype", type(got))), list(getattr(got, "shape", ())),
                                   str(getattr(got, "device", ""))],
           "ref": [str(ref.dtype), list(ref.shape)], **tf32_state()}
    if isinstance(got, torch.Tensor) and got.shape == ref.shape:
        g, r = got.double().cpu(), ref.double().cpu()
        ninf_g, ninf_r = torch.isinf(g) & (g < 0), torch.isinf(r) & (r < 0)
        row["neg_inf_mismatch"] = int((ninf_g != ninf_r).sum())
        fin = torch.isfinite(r) & torch.isfinite(g)
        if bool(fin.any()):
            scale = float(r[fin].abs().max())
            err = (g[fin] - r[fin]).abs()
            tol = 1e-5 * scale + 1e-5 * r[fin].abs()
            row["max_err_over_tol"] = float((err / tol).max())
            row["max_abs_err"] = float(err.max())
            row["scale"] = scale
    log["comparisons"].append(row)
    return ok


evaluate = RegionEvaluator.evaluate


def logged_evaluate(self, ends, env):
    """`RegionEvaluator.evaluate`, recording the exception of a region that cannot be evaluated."""
    try:
        return evaluate(self, ends, env)
    except Exception as e:  # noqa: BLE001 - recorded, then raised again unchanged
        log["evaluate_errors"].append({"error": f"{type(e).__name__}: {e}"[:600],
                                       "where": traceback.format_exc(limit=-4)[-1500:]})
        raise


ix.scores_agree = logged_agree
RegionEvaluator.evaluate = logged_evaluate
sys.argv = ["layer_launches_probe.py", out_path + ".launches.json", preset, device]
try:
    runpy.run_path(os.path.join(ROOT, "bench", "probes", "layer_launches_probe.py"), run_name="__main__")
finally:
    log["evaluate_errors"] = log["evaluate_errors"][:40]
    json.dump({"preset": preset, "device": device, "torch": torch.__version__, **log}, open(out_path, "w"), indent=1)
    bad = [c for c in log["comparisons"] if not c["ok"]]
    print(f"score comparisons: {len(log['comparisons'])}, failed {len(bad)}; evaluate errors "
          f"{len(log['evaluate_errors'])}", flush=True)
    for c in bad[:6]:
        print("  failed:", {k: c.get(k) for k in ("got", "max_err_over_tol", "neg_inf_mismatch", "allow_tf32",
                                                   "float32_matmul_precision")}, flush=True)
    for e in log["evaluate_errors"][:4]:
        print("  error:", e["error"][:300], flush=True)
