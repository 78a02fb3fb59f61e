"""Print a short table of every result JSON in a folder (the last thing bench/run_gpu.sh prints)."""

import glob
import json
import os
import sys


def main(folder: str) -> None:
    """Print one line per `dsv41 run` / benchmark JSON found in `folder`."""
    rows = []
    for fn in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(fn) as f:
            d = json.load(f)
        name = os.path.basename(fn) + (" (partial)" if d.get("partial") else "")  # a run cut by its time limit
        if "decode_tok_s" in d:
            rows.append(f"{name:34s} {d.get('backend', ''):10s} prefill {d['prefill_tok_s']:10.1f} tok/s  "
                        f"decode {d['decode_tok_s']:8.2f} tok/s  peak {d.get('peak_mem_gb', float('nan')):6.1f} GB  "
                        f"match {d.get('tokens_match_eager')}")
            if "tp" in d:
                t = d["tp"]
                rows.append(f"{'':34s} tp {t.get('world_size')} {t.get('moe_mode')} pad {t.get('pad_to')} "
                            f"(inter/rank {t.get('inter_per_rank')})  ranks agree {t.get('ranks_agree')}  barrier gap "
                            f"median {t.get('barrier_gap_us_median')} us, all-reduce {t.get('allreduce_us_median')} us")
        elif "backends" in d:
            for b, r in d["backends"].items():
                dec = r.get("decode_tok_s") or {}
                rows.append(f"{name:34s} {b:22s} decode {dec.get('median', float('nan')):8.2f} tok/s "
                            f"(min {dec.get('min', float('nan')):.2f}, max {dec.get('max', float('nan')):.2f})  "
                            f"match {r.get('tokens_match_eager')}"
                            + (f"  logit err vs fp32 {r['logit_err_vs_fp32']:.2e}" if r.get("logit_err_vs_fp32")
                               is not None else ""))
        elif "rows" in d:  # bench/kernels.py: the plan's row and the best sweep row per (kernel, shape, M)
            best: dict = {}
            for k in d["rows"]:
                if not {"kernel", "shape", "M", "variant"} <= k.keys():  # a probe's rows (own table printed)
                    continue
                key = (k["kernel"], k["shape"], k["M"])
                if k["variant"] == "triton (graph)" or k["variant"].startswith("sweep"):
                    slot = best.setdefault(key, {})
                    tag = "plan" if k["variant"] == "triton (graph)" else "sweep"
                    if tag not in slot or k["time_us"] < slot[tag]["time_us"]:
                        slot[tag] = k
            for (kern, shape, m), slot in best.items():
                line = f"{name:34s} {kern:18s} {shape:18s} M={m}"
                for tag in ("plan", "sweep"):
                    if tag in slot:
                        k = slot[tag]
                        line += (f"  {tag} {k['time_us']:8.2f} us {k['frac_of_copy']:5.0%}"
                                 + (f" [{k['variant'][6:]}]" if tag == "sweep" else ""))
                rows.append(line)
    print("\n".join(["=" * 100, "summary"] + rows))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/raw")
