"""H200 probe: how fast can one kernel launch *read* the bytes of each h200 decode GEMV (issue #3's 80 % target)?

The GEMV criterion compares bytes moved / time with the device-to-device copy bandwidth of a large buffer
(`kernels.copy_bandwidth`, read + written). A GEMV launch cannot beat a launch that only reads the same bytes, so
this probe measures that ceiling at the h200 byte counts, with the same timing as `bench/kernels.py` (CUDA-graph
replay of back-to-back launches over rotating copies beyond L2):
- `stream`: a Triton kernel that reads the buffer as 16-byte vectors and XOR-folds them (one int32 stored per
  program, so no load is dead), over a grid of plans (words per program step, warps, programs per SM, grid-stride or
  one contiguous range per program);
- `stream pdl` / `stream pdl early`: the best plan launched with PDL in the graph, waiting for the previous launch
  before its loads (what a GEMV must do for x), and not waiting at all (an upper bound for weight reads started
  before the wait);
- `torch sum`: `torch.sum` of the buffer as int32 (PyTorch's reduction kernel);
- `copy`: a device-to-device copy of half the bytes (the same bytes moved, half read and half written).
Fractions are of the copy bandwidth measured in the same run.

Usage: python3 bench/probes/read_ceiling.py [--json PATH] [--reps-ms MS] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository root

from bench import kernels as kb  # noqa: E402

#: (name, bytes) a decode GEMV launch must read at the h200 shapes: weights plus their scales.
SIZES = [
    ("wq_a 1280x5120 fp8", 1280 * 5120 + 40 * 160),
    ("shared_w1 2304x5120 fp8", 2304 * 5120 + 72 * 160),
    ("grouped w1 6 x 2304x5120 fp4", 6 * 2304 * (2560 + 160)),
    ("wq_b 32768x1280 fp8", 32768 * 1280 + 1024 * 40),
    ("grouped w1+w3 in one launch", 2 * 6 * 2304 * (2560 + 160)),
    ("head 129280x5120 fp8", 129280 * 5120 + 4040 * 160),
]


@triton.jit
def _stream_kernel(src, out, n_words, CHUNKS, BLOCK: tl.constexpr, CONTIG: tl.constexpr, WAIT: tl.constexpr,
                   EARLY: tl.constexpr):
    # Program p reads chunks p, p + P, ... (CONTIG False) or its own contiguous range of CHUNKS chunks, BLOCK int32
    # words per chunk, and stores the XOR of everything it read.
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()
    if WAIT:
        tl.extra.cuda.gdc_wait()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    n_chunks = tl.cdiv(n_words, BLOCK)
    if CONTIG:
        lo = pid * CHUNKS
        hi = tl.minimum(lo + CHUNKS, n_chunks)
        for c in range(lo, hi):
            o = offs + c * BLOCK
            acc ^= tl.load(src + o, mask=o < n_words, other=0, eviction_policy="evict_first")
    else:
        for c in range(pid, n_chunks, nprog):
            o = offs + c * BLOCK
            acc ^= tl.load(src + o, mask=o < n_words, other=0, eviction_policy="evict_first")
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def _stream(buf, out, block, warps, per_sm, contig, pdl=False, wait=False, early=False):
    n_words = buf.numel()
    sms = torch.cuda.get_device_properties(buf.device).multi_processor_count
    grid = sms * per_sm
    chunks = triton.cdiv(triton.cdiv(n_words, block), grid)
    extra = {"launch_pdl": True} if pdl else {}
    return lambda: _stream_kernel[(grid,)](buf, out, n_words, chunks, BLOCK=block, CONTIG=contig, WAIT=wait,
                                           EARLY=early, num_warps=warps, **extra)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    ap.add_argument("--reps-ms", type=float, default=60.0)
    ap.add_argument("--quick", action="store_true", help="fewer plans")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("read_ceiling: needs a CUDA device", file=sys.stderr)
        return 2
    bw = kb.copy_bandwidth(a.reps_ms)
    print(f"copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    plans = [(b, w, p, c) for b in (2048, 4096, 8192) for w in (4, 8) for p in (1, 2, 4, 8) for c in (False, True)
             if not (a.quick and (b == 2048 or c))]
    rows = []
    for name, nbytes in SIZES:
        n_words = -(-nbytes // 16) * 4
        copies = kb._copies_for(n_words * 4)
        bufs = [torch.randint(-2 ** 31, 2 ** 31 - 1, (n_words,), dtype=torch.int32, device="cuda")
                for _ in range(copies)]
        out = torch.empty(132 * 8, dtype=torch.int32, device="cuda")

        def timed(label, makers):
            t = kb._bench_graph(makers, a.reps_ms)
            frac = nbytes / t / bw
            rows.append(dict(size=name, bytes=nbytes, variant=label, us=t * 1e6, of_copy=frac))
            return t

        best = None
        for b, w, p, c in plans:
            if b * 4 > nbytes:
                continue
            t = timed(f"stream block={b} warps={w} per_sm={p} {'contig' if c else 'stride'}",
                      [_stream(buf, out, b, w, p, c) for buf in bufs])
            if best is None or t < best[0]:
                best = (t, b, w, p, c)
        _, b, w, p, c = best
        timed("stream best, pdl, wait first", [_stream(buf, out, b, w, p, c, pdl=True, wait=True) for buf in bufs])
        timed("stream best, pdl, launch dependents first, no wait",
              [_stream(buf, out, b, w, p, c, pdl=True, early=True) for buf in bufs])
        sums = [torch.empty((), dtype=torch.int64, device="cuda") for _ in bufs]
        timed("torch sum", [lambda buf=buf, s=s: torch.sum(buf, dim=0, out=s) for buf, s in zip(bufs, sums)])
        half = n_words // 2
        timed("copy of half the bytes (r + w = bytes)",
              [lambda buf=buf: buf[half:2 * half].copy_(buf[:half]) for buf in bufs])
        mine = [r for r in rows if r["size"] == name]
        top = min((r for r in mine if r["variant"].startswith("stream block")), key=lambda r: r["us"])
        print(f"{name:32s} {nbytes / 1e6:8.2f} MB  best stream {top['us']:8.2f} us ({top['of_copy']:.1%}) "
              f"[{top['variant']}]", flush=True)
        for r in mine:
            if not r["variant"].startswith("stream block"):
                print(f"{'':32s} {r['variant']:52s} {r['us']:8.2f} us ({r['of_copy']:.1%})", flush=True)
        del bufs
        torch.cuda.empty_cache()
    print("SUMMARY read ceiling (best single-launch stream read, fraction of copy bandwidth):")
    for name, nbytes in SIZES:
        mine = [r for r in rows if r["size"] == name]
        top = min((r for r in mine if r["variant"].startswith("stream")), key=lambda r: r["us"])
        print(f"SUMMARY {name:32s} {nbytes / 1e6:8.2f} MB {top['us']:8.2f} us {top['of_copy']:.1%}  {top['variant']}")
    if a.json:
        meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                    copy_bandwidth=bw)
        with open(a.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
