"""Probe (issue [generic], session 30): how long does `dsv41::rope_kv_store` take at the Llama-3.2-1B / 8B decode
shapes (one new token, bf16, a 4,096-position cache), against the same work as Inductor compiles it unfused
(`torch.compile` of RoPE on q and k plus the two cache writes, rotate-half), each timed as back-to-back calls in one
CUDA graph over enough cache copies that a replay touches more than the L2 (bench/kernels.py `_bench_graph`).

The op moves a few tens of kB, so its byte floor (bytes / the copy bandwidth of the same run) is a fraction of a
microsecond: what the rows show is launch-bound time and the launches saved. Writes JSON (argv[1]).
"""
import json
import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "bench")]
from kernels import _bench_graph, copy_bandwidth  # noqa: E402
from dsv41.kernels import rope_kv as rk, set_pdl, prepare_device  # noqa: E402

SHAPES = [("1b", 32, 8, 64), ("8b", 32, 8, 128)]
T = 4096
COPIES = 16


def _unfused(q, k, v, cos, sin, pos, kc, vc):
    def rot(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), -1)
    c, s = cos[:, :, None], sin[:, :, None]
    qr = q * c + rot(q) * s
    kr = k * c + rot(k) * s
    kc[:, :, pos] = kr.transpose(1, 2)
    vc[:, :, pos] = v.transpose(1, 2)
    return qr


def main(out_path: str) -> None:
    prepare_device(torch.device("cuda"))
    bw = copy_bandwidth(200.0)
    rows = []
    compiled = torch.compile(_unfused, dynamic=False)
    for name, h, hkv, d in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(1, 1, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
        k = torch.randn(1, 1, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        v = torch.randn(1, 1, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16)
        ang = torch.rand(1, 1, d // 2, device="cuda", generator=g) * 6
        cos_h, sin_h = ang.cos(), ang.sin()                      # layout 1: half-width angles
        cos_f, sin_f = torch.cat((cos_h, cos_h), -1).to(q.dtype), torch.cat((sin_h, sin_h), -1).to(q.dtype)
        pos = torch.tensor([T - 7], device="cuda")
        caches = [(torch.zeros(1, hkv, T, d, device="cuda", dtype=q.dtype),
                   torch.zeros(1, hkv, T, d, device="cuda", dtype=q.dtype)) for _ in range(COPIES)]
        stride = list(torch.empty(q.shape).stride())
        moved = 2 * (q.numel() * 2 + k.numel() * 2 + v.numel()) + 2 * cos_h.numel() * 4
        floor_us = moved / bw * 1e6
        for pdl in (False, True):
            set_pdl(pdl)
            fused = [lambda kc=kc, vc=vc: rk.triton_rope_kv_store(q, k, v, cos_h, sin_h, pos, kc, vc, 1, False, stride)
                     for kc, vc in caches]
            t = _bench_graph(fused, 100.0) * 1e6
            rows.append(dict(shape=name, H=h, Hkv=hkv, D=d, row="rope_kv_store", pdl=pdl, us=round(t, 3),
                             bytes=moved, floor_us=round(floor_us, 4), launches=1))
        set_pdl(False)
        unf = [lambda kc=kc, vc=vc: compiled(q, k, v, cos_f, sin_f, pos, kc, vc) for kc, vc in caches]
        t = _bench_graph(unf, 100.0) * 1e6
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled(q, k, v, cos_f, sin_f, pos, *caches[0])
            torch.cuda.synchronize()
        launches = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        rows.append(dict(shape=name, H=h, Hkv=hkv, D=d, row="inductor unfused", pdl=False, us=round(t, 3),
                         bytes=moved, floor_us=round(floor_us, 4), launches=launches))
    res = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
               triton=__import__("triton").__version__, copy_bandwidth_tb_s=round(bw / 1e12, 3), rows=rows)
    with open(out_path, "w") as f:
        json.dump(res, f, indent=1)
    for r in rows:
        print(f"{r['shape']:3} {r['row']:17} pdl={int(r['pdl'])} {r['us']:7.2f} us  launches {r['launches']}  "
              f"floor {r['floor_us']:.3f} us")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "rope_kv_probe.json")
