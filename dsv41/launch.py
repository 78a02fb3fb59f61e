"""Process-group setup for tensor-parallel runs: torchrun-compatible init, a local spawner, `dsv41 run --tp`.

- `init_distributed()` in a process started by `torchrun` (or by `spawn`): reads RANK / WORLD_SIZE /
  LOCAL_RANK, picks NCCL on CUDA (one GPU per local rank) or gloo on CPU, and turns NVLink multicast
  (NVLS / symmetric-memory multicast) off before the process group exists.
- `spawn(fn, world_size, *args)`: run `fn(*args)` on `world_size` local processes inside an initialised
  group, without torchrun; returns every rank's return value.
- `run_tp(args)`: the body of `dsv41 run --tp N` (every rank builds the same seeded model, `apply_tp`, the
  chosen backend, greedy generation; rank 0 prints the table and writes the JSON).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "spawn", "launch_ranks", "run_tp", "MULTICAST_OFF_ENV", "barrier_gap_us",
           "allreduce_kernel_durations_us"]

#: Set before the process group is created: NVLink SHARP / multicast objects off (NCCL, torch symmetric
#: memory, NVSHMEM). The lent multi-GPU machines must run with multicast off.
MULTICAST_OFF_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class DistInfo:
    """This process in the default group: rank, world_size, local_rank, backend (`nccl`/`gloo`), device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise RuntimeError(f"init_distributed: environment variable {name} is not set (start the process with "
                           "torchrun or dsv41.launch.spawn)")
    try:
        return int(value)
    except ValueError:
        raise RuntimeError(f"init_distributed: {name}={value!r} is not an integer") from None


def init_distributed(device: str | None = None) -> DistInfo:
    """Initialise (once) the default process group from torchrun's environment.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (default RANK), MASTER_ADDR/MASTER_PORT (env:// rendezvous).
    Sets `MULTICAST_OFF_ENV` in os.environ first. Device `cuda` (default when CUDA is available) ->
    NCCL, `cuda:LOCAL_RANK` made current; `cpu` -> gloo, and torch's intra-op threads are set to
    cpu_count / LOCAL_WORLD_SIZE unless OMP_NUM_THREADS is set (local ranks share the cores).
    A process whose default group already exists gets its description back unchanged.

    Args: device: `cuda`, `cpu` or None (auto).
    Returns: `DistInfo`.
    Raises:
        RuntimeError: RANK or WORLD_SIZE missing or not integers; CUDA requested but unavailable or
            LOCAL_RANK >= the number of visible GPUs.
        ValueError: a device other than cpu/cuda.
    """
    if dist.is_initialized():
        backend = dist.get_backend()
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return DistInfo(dist.get_rank(), dist.get_world_size(), local, backend, dev)
    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = kind.split(":")[0]
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"init_distributed: device must be 'cuda' or 'cpu', got {device!r}")
    os.environ.update(MULTICAST_OFF_ENV)
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    local = int(os.environ.get("LOCAL_RANK", rank))
    if kind == "cuda":
        if not torch.cuda.is_available() or local >= torch.cuda.device_count():
            raise RuntimeError(f"init_distributed: LOCAL_RANK={local} needs a GPU but "
                               f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} are visible")
        torch.cuda.set_device(local)
        dev, backend = torch.device("cuda", local), "nccl"
    else:
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))
        dev, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)
    return DistInfo(rank, world, local, backend, dev)


def _free_port() -> int:
    # Bind port 0 to let the OS pick a free port; it is released before the group binds it (tiny race).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(rank, fn, world_size, port, device, queue, args):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    init_distributed(device)
    try:
        result = fn(*args)
    except BaseException:
        # `join` re-raises the first failure it sees, which may be a peer's broken collective: print the
        # root cause of this rank too.
        print(f"[dsv41.launch.spawn] rank {rank} failed:", file=sys.stderr)
        traceback.print_exc()
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle copies tensor data into the message; the queue's own pickler would pass shared-memory
    # file descriptors that die with this process.
    queue.put((rank, pickle.dumps(result)))


def spawn(fn, world_size: int, *args, device: str | None = None) -> list:
    """Run `fn(*args)` on `world_size` local processes (start method `spawn`), each inside the default
    process group set up by `init_distributed(device)` on a free local port.

    Args:
        fn: a picklable (module-level) function; its return value must be picklable.
        world_size: number of processes (>= 1); on CUDA at most the number of visible GPUs.
        device: passed to `init_distributed` (`cuda`, `cpu` or None = auto).
    Returns:
        [fn's return value on rank 0, ..., on rank world_size - 1].
    Raises:
        ValueError: world_size < 1.
        torch.multiprocessing.ProcessRaisedException: a rank raised (the other ranks are terminated). Its
            message is the first failure seen, possibly a peer's broken collective; every failing rank
            prints its own traceback to stderr. ProcessExitedException: a rank died without a Python exception.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be a positive int, got {world_size!r}")
    os.environ.update(MULTICAST_OFF_ENV)
    mp = torch.multiprocessing
    queue = mp.get_context("spawn").SimpleQueue()
    ctx = mp.start_processes(_spawn_entry, args=(fn, world_size, _free_port(), device, queue, args),
                             nprocs=world_size, join=False, start_method="spawn")
    results: dict = {}

    def drain():
        """Move every rank's pickled result from the queue into `results`."""
        while not queue.empty():
            rank, value = queue.get()
            results[rank] = pickle.loads(value)

    # Drain while waiting: a large result blocks its sender until read, so join alone could deadlock.
    while not ctx.join(timeout=0.05):
        drain()
    drain()
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise RuntimeError(f"spawn: ranks {missing} exited without returning a result")
    return [results[r] for r in range(world_size)]


# ---------------------------------------------------------------------------------------- dsv41 run --tp
def _run_tp_rank(args) -> int:
    """One rank of `dsv41 run --tp N` (inside an initialised group). Returns the exit code."""
    import json

    from . import harness
    from .model import benchmark_prompt, generate
    from .model.budget import budget
    from .model.tp import apply_tp

    info = init_distributed(args.device)
    device = str(info.device)
    preset = args.preset or ("small" if info.device.type == "cuda" else "tiny")
    prompt_len = args.prompt_len or (4096 if info.device.type == "cuda" else 32)
    new_tokens = args.new_tokens or (64 if info.device.type == "cuda" else 16)
    moe_mode = getattr(args, "tp_moe", None) or "tp"
    pad_to = getattr(args, "tp_pad_to", None)
    torch.manual_seed(args.seed)
    model = harness.build_model(preset, device, args.weight_mode, args.dtype, args.seed)
    plan = apply_tp(model, moe_mode=moe_mode, pad_to=pad_to)
    prompt = benchmark_prompt(model.config, prompt_len, device=device)
    result = {**harness.environment(device), "preset": preset, "backend": args.backend, "device": info.device.type,
              "weight_mode": args.weight_mode, "dtype": str(model.dtype).replace("torch.", ""),
              "prompt_len": prompt_len, "new_tokens": new_tokens,
              "tp": {"world_size": info.world_size, "backend": info.backend, "moe_mode": moe_mode,
                     "pad_to": plan.pad_to, "inter_per_rank": plan.inter, "heads_per_rank": plan.heads}}
    ref = generate(model, prompt, new_tokens) if args.backend != "eager" and args.check else None
    runner = harness.compile_model(model, args.backend)
    t0 = time.perf_counter()
    generate(runner, prompt, new_tokens)
    result["compile_and_warmup_s"] = time.perf_counter() - t0
    out = generate(runner, prompt, new_tokens)
    if info.device.type == "cuda":
        result["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9
    b = budget(model.config, max_seq_len=prompt_len + new_tokens)
    result.update(tokens=out.tokens[0].tolist(), prefill_tok_s=out.prefill_tok_s, decode_tok_s=out.decode_tok_s,
                  kv_bytes_per_token=b.kv_bytes_per_token, kv_bytes_per_token_allocated=b.kv_bytes_per_token_allocated,
                  tokens_match_eager=None if ref is None else bool(torch.equal(ref.tokens, out.tokens)))
    if info.device.type == "cuda" and info.world_size > 1:
        result["tp"].update(_profile_barrier_gap(runner, prompt, min(new_tokens, 2), info.world_size))
    # Every rank must produce the same tokens (replicated head on identical all-reduced activations).
    toks = [None] * info.world_size
    dist.all_gather_object(toks, result["tokens"])
    result["tp"]["ranks_agree"] = all(t == toks[0] for t in toks)
    ok = result["tp"]["ranks_agree"] and result["tokens_match_eager"] is not False
    if info.rank == 0:
        from rich.console import Console
        from rich.table import Table
        table = Table(title=f"dsv41 run --tp {info.world_size} ({moe_mode}): {preset} ({args.weight_mode}, "
                            f"{result['dtype']}) on {info.world_size} x {info.device.type}")
        for col in ("backend", "prefill tok/s", "decode tok/s", "tokens", "ranks agree", "matches eager"):
            table.add_column(col)
        table.add_row(args.backend, f"{out.prefill_tok_s:,.1f}", f"{out.decode_tok_s:,.2f}", str(new_tokens),
                      "yes" if result["tp"]["ranks_agree"] else "NO",
                      "-" if ref is None else ("yes" if result["tokens_match_eager"] else "NO"))
        Console().print(table)
        if result["tp"].get("barrier_gap_us_median") is not None:
            Console().print(f"all-reduce barrier gap (profiler, {result['tp']['collectives']} collectives): median "
                            f"{result['tp']['barrier_gap_us_median']:.1f} us, max {result['tp']['barrier_gap_us_max']:.1f}"
                            f" us; all-reduce itself median {result['tp']['allreduce_us_median']:.1f} us")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
    return 0 if ok else 1


def allreduce_kernel_durations_us(events) -> list:
    """Durations (us) of the NCCL all-reduce kernels among raw profiler `events`, in start order.

    `events`: Kineto events (`prof.profiler.kineto_results.events()`: methods name(), device_type(), start_ns(),
    duration_ns()); reading these directly avoids building torch.profiler's event tree, which takes minutes for
    an eager decode of a large model. A kernel counts when it ran on the device and its name contains
    "AllReduce" (NCCL's `ncclDevKernel_AllReduce_*` / `ncclKernel_AllReduce_*`).
    """
    ks = [e for e in events if "AllReduce" in e.name() and getattr(e.device_type(), "name", "") == "CUDA"]
    ks.sort(key=lambda e: e.start_ns())
    return [e.duration_ns() / 1e3 for e in ks]


def barrier_gap_us(durations_per_rank: list) -> dict:
    """Median wait at the all-reduce barrier from per-rank all-reduce kernel durations (us).

    An all-reduce kernel starts when its rank arrives and ends when all ranks' data is combined, so the rank that
    arrives first runs longest: for collective i the arrival gap is max_r d_r[i] - min_r d_r[i], and the transfer
    itself is about min_r d_r[i]. No cross-GPU clock is needed.
    Args: durations_per_rank: one list per rank, the same collectives in the same order (equal lengths).
    Returns: {"collectives", "barrier_gap_us_median", "barrier_gap_us_max", "allreduce_us_median"} (None values
    when there were no collectives).
    Raises: ValueError when the ranks saw different numbers of collectives.
    """
    import statistics
    lengths = {len(d) for d in durations_per_rank}
    if len(lengths) != 1:
        raise ValueError(f"ranks saw different numbers of all-reduce kernels: {sorted(lengths)}")
    n = lengths.pop()
    if n == 0:
        return {"collectives": 0, "barrier_gap_us_median": None, "barrier_gap_us_max": None,
                "allreduce_us_median": None}
    cols = list(zip(*durations_per_rank))
    gaps = [max(c) - min(c) for c in cols]
    return {"collectives": n, "barrier_gap_us_median": statistics.median(gaps), "barrier_gap_us_max": max(gaps),
            "allreduce_us_median": statistics.median(min(c) for c in cols)}


def _profile_barrier_gap(runner, prompt, new_tokens: int, world_size: int) -> dict:
    """Profile (device activity only) one short generation on every rank and return `barrier_gap_us` of its
    all-reduce kernels (prefill and decode collectives together)."""
    from torch.profiler import ProfilerActivity, profile

    from .model import generate
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(runner, prompt, new_tokens)
        torch.cuda.synchronize()
    mine = allreduce_kernel_durations_us(prof.profiler.kineto_results.events())
    everyone = [None] * world_size
    dist.all_gather_object(everyone, mine)
    try:
        return {"profiled_new_tokens": new_tokens, **barrier_gap_us(everyone)}
    except ValueError as exc:
        return {"profiled_new_tokens": new_tokens, "barrier_gap_error": str(exc)}


def run_tp(args) -> int:
    """`dsv41 run --tp N`: tensor-parallel eager/compiled generation on N ranks; rank 0 writes the JSON.

    Under torchrun (RANK and WORLD_SIZE set) this process is one rank; otherwise N local processes are
    spawned. Reads the `dsv41 run` arguments (`preset`, `prompt_len`, `new_tokens`, `backend`, `device`,
    `weight_mode`, `dtype`, `seed`, `check`, `json`) plus `tp` (N), `tp_moe` (`tp`/`ep`, default `tp`)
    and `tp_pad_to` (default None = `dsv41.model.tp.DEFAULT_PAD_TO`).
    Returns: 0 when every rank produced the same tokens (and they match the eager run when checked), else 1.
    Raises:
        ValueError: tp < 1; under torchrun, WORLD_SIZE != tp; whatever `apply_tp` rejects.
    """
    return launch_ranks(_run_tp_rank, args.tp, args, device=args.device)


def launch_ranks(fn, n: int, args, device: str | None = None) -> int:
    """Run `fn(args)` (a module-level function returning an exit code) on `n` tensor-parallel ranks: under
    torchrun (RANK and WORLD_SIZE set) in this process as one rank, else on `n` spawned local processes.
    Returns the largest exit code. Raises ValueError for n < 1 or a torchrun WORLD_SIZE other than n."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"--tp must be a positive int, got {n!r}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != n:
            raise ValueError(f"--tp {n} but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']} processes")
        created = not dist.is_initialized()
        init_distributed(device)
        try:
            return fn(args)
        finally:
            if created:  # a caller's own group stays up
                dist.destroy_process_group()
    return max(spawn(fn, n, args, device=device))
