"""DSpark speculative decoding: draft, verify the block rows at once, accept, roll the caches back (MODEL.md §2.11).

One round, with y the last emitted token at position s:
1. the drafter (`DSpark`) proposes d_1..d_K for positions s+1..s+K from the block [y, noise x (K-1)];
2. the target runs the M = K + 1 rows [y, d_1..d_K] at positions s..s+K in ONE forward (`return_features=True`);
3. greedy acceptance: a = the longest prefix with d_i == argmax(row i-1); the round emits d_1..d_a and the bonus
   token t_a = argmax(row a), i.e. a + 1 tokens (the acceptance length);
4. every cache the forward wrote for the rejected rows a+1..K is restored (`CacheJournal`), so the state is the
   one a plain run that only saw rows 0..a would have; the accepted rows' target features are committed to the
   drafter's rings inside the next draft round. One journal serves a whole generation (`RoundJournal`); on CUDA
   its save and rollback replay from CUDA graphs, as the verify and draft forwards of a graphed wrapper do.

Caches rolled back (every stateful buffer of `dsv41/model`): window rings of every layer (slot p mod W), the
kv-source banks and index keys (row p // ratio, written only by the token that completes a group), the ratio-2
compressor pending state (set to the (k, g) of the last accepted row, kept by the compressor in `kv_trail`,
`score_trail`), and the Engram id history (entry p). The trash row of a bank (written by tokens that complete no
group, never read) is not restored: its contents are unspecified in plain runs too. The DSpark rings need no
rollback: only accepted rows are committed.

Greedy equality with plain decoding holds exactly when the verify forward computes row i exactly as a one-token
decode step would. Row i never depends on later rows (bitwise), but GEMMs over M rows may round differently in
the last bit from the M = 1 ones (CPU BLAS, GPU GEMM tiling); where such a difference straddles an FP8/FP4
fake-quantisation boundary it grows into a whole quantum and can flip a near-tied greedy choice, exactly like
prefill vs decode ("modulo SWA/quant rounding", MODEL.md §4.1). Batch-invariant verify kernels remove this.

Simulated acceptance (BENCHMARK.md "match-expected"): the number of accepted drafts is drawn so that the mean
acceptance length is `expected` (lengths floor(e) and ceil(e)); the round then emits the drafts as if accepted
plus the target's bonus token, and the caches roll back to exactly that many rows. Throughput is representative;
the tokens are not the target's greedy output. The natural (greedy) acceptance is measured alongside.
"""

from __future__ import annotations

import math
import weakref
from typing import List, Sequence

import torch

from .csa import SPEC_TRAIL_ROWS
from .results import Clock, GenerateResult, base_model
from .prefill import PREFILL_CHUNKS, prefill

__all__ = ["CacheJournal", "RoundJournal", "journal_for", "forget_journals", "greedy_acceptance", "MatchExpected",
           "generate_speculative", "ROUND_PHASES"]


class CacheJournal:
    """The pre-verify contents of every cache row a forward over `positions` will overwrite, and the rollback.

    Args:
        model: a `DeepseekV41Flash` (the eager module; caches set up).
        positions: [B, M] int64, the verify rows' positions (contiguous per sequence, M <= sliding_window and
            M <= `csa.SPEC_TRAIL_ROWS`). The journal keeps this tensor and reads it again at every `save()`, so one
            journal serves every round of a generation (and CUDA graphs of `save` / `rollback` stay valid).
    Construction saves once. Tensors it holds: per cache buffer the saved rows [B, M, ...] and per index kind the
    rows written (int64 [B, M]), all allocated here and written in place by `save()`.
    Raises:
        ValueError: M too large for the ring (two rows would share a slot) or for the compressor's trail.
    Source: the cache layouts of dsv41/model/attention.py, csa.py, model.py (MODEL.md §2.5-§2.8, §2.10).
    """

    def __init__(self, model, positions: torch.Tensor):
        b, m = positions.shape
        c = model.config
        if m > c.sliding_window or m > SPEC_TRAIL_ROWS or m < 2:
            raise ValueError(f"a verify of {m} rows needs 2 <= M <= min(sliding_window={c.sliding_window}, "
                             f"SPEC_TRAIL_ROWS={SPEC_TRAIL_ROWS})")
        self.positions = positions
        self.bi = torch.arange(b, device=positions.device)[:, None].expand(b, m)
        # index kind -> (rows written int64 [B, M], bool [B, M] "this row writes it" or None); kinds are shared by
        # every layer with the same window or ratio, so each is computed once per save
        self.kinds: dict = {}
        self.rows = []       # (buffer, index kind, saved [B, M, ...])
        self.compressors = []
        for layer in model.layers:
            a = layer.attn
            for buf in (a.ring_codes, a.ring_scales):
                self._track(buf, ("ring", a.window))
            if a.role == "full":
                for buf in (a.bank_codes, a.bank_scales, a.key_codes, a.key_scales):
                    self._track(buf, ("bank", a.ratio))
            comp = a.compressor
            if comp is not None and comp.kv_state is not None:
                self.compressors.append(comp)
        if model.engram_history is not None:
            self._track(model.engram_history, ("position",))
        self.save()

    def _track(self, buf: torch.Tensor, kind: tuple) -> None:
        """Journal `buf`'s rows of index `kind` ("ring", window) / ("bank", ratio) / ("position",): allocates the
        kind's index (and bank write mask) once and this buffer's saved rows [B, M, ...]."""
        if kind not in self.kinds:
            writes = None if kind[0] != "bank" else torch.empty_like(self.positions, dtype=torch.bool)
            self.kinds[kind] = (torch.empty_like(self.positions), writes)
        index = self.kinds[kind][0]
        self.rows.append((buf, kind, buf[self.bi, index.zero_()].clone()))

    def save(self) -> None:
        """Copy, in place, the current contents of every row a forward over the current `positions` will write."""
        p = self.positions
        for (name, *arg), (index, writes) in self.kinds.items():
            if name == "ring":
                index.copy_(torch.remainder(p, arg[0]))
            elif name == "bank":
                index.copy_(torch.div(p, arg[0], rounding_mode="floor"))
                writes.copy_(torch.remainder(p, arg[0]) == arg[0] - 1)
            else:
                index.copy_(p)
        for buf, kind, saved in self.rows:
            saved.copy_(buf[self.bi, self.kinds[kind][0]])

    def rollback(self, keep: torch.Tensor) -> None:
        """Restore the rows of every verify row i >= keep[b] (keep [B] int64 in [1, M]); see the module docstring."""
        m = self.positions.shape[1]
        rejected = torch.arange(m, device=keep.device)[None, :] >= keep[:, None]
        for buf, kind, saved in self.rows:
            index, writes = self.kinds[kind]
            if writes is None:
                restore, idx = rejected, index
            else:
                # A pair's two tokens share a bank row; only the completing token wrote it. Route the other
                # token to the trash row (last row) with that row's current value, so no row gets two values.
                restore = rejected & writes
                idx = torch.where(writes, index, torch.full_like(index, buf.shape[1] - 1))
            cur = buf[self.bi, idx]
            r = restore.view(*restore.shape, *([1] * (cur.dim() - 2)))
            buf.index_put_((self.bi, idx), torch.where(r, saved, cur))
        last = keep - 1
        b = torch.arange(keep.shape[0], device=keep.device)
        for comp in self.compressors:
            comp.kv_state.copy_(comp.kv_trail[b, last])
            comp.score_state.copy_(comp.score_trail[b, last])


class RoundJournal:
    """The `CacheJournal` of every round of a generation: static positions and keep, replayed from CUDA graphs.

    One verify round runs `save(positions)` before the forward and `rollback(keep)` after. On CUDA (`graphs`),
    the first round runs both uncaptured, the second captures each into a CUDA graph and replays it, later rounds
    copy their positions / keep in and replay: about 600 small indexing kernels per `h200` round, which uncaptured
    cost more host time than the GPU time of the verify itself. Elsewhere every round runs them uncaptured.
    `journal_for` keeps one per model, batch and width, so benchmark runs after the first replay from the start.

    Args:
        model: the `DeepseekV41Flash` (caches set up). batch, width: B and M of the verify rows.
        device: of the caches. graphs: capture on CUDA (default: whether `device` is CUDA).
    Attributes: `captures`, `replays` (counts over both graphs, for tests).
    Raises: ValueError as `CacheJournal` for a width the caches cannot roll back.
    """

    def __init__(self, model, batch: int, width: int, device, graphs: bool | None = None):
        device = torch.device(device)
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self.positions = torch.zeros(batch, width, dtype=torch.int64, device=device)
        self.keep = torch.ones(batch, dtype=torch.int64, device=device)
        # saving the zero positions here is harmless: nothing reads the saved rows before the next save
        self.journal = CacheJournal(model, self.positions)
        self._graph = {"save": None, "rollback": None}
        self._calls = {"save": 0, "rollback": 0}
        self._pool = None
        self.captures = self.replays = 0

    def save(self, positions: torch.Tensor) -> None:
        """Record the rows a forward over `positions` (int64 [B, M]) will write (`CacheJournal.save`)."""
        self.positions.copy_(positions)
        self._run("save", self.journal.save)

    def rollback(self, keep: torch.Tensor) -> None:
        """Restore the rows of the rejected verify rows, keep int64 [B] on the caches' device (`CacheJournal`)."""
        self.keep.copy_(keep)
        self._run("rollback", lambda: self.journal.rollback(self.keep))

    def _run(self, name: str, fn) -> None:
        """`fn()` uncaptured (no graphs, or its first call), else through its CUDA graph (captured on call 2)."""
        self._calls[name] += 1
        if not self.graphs or self._calls[name] == 1:
            fn()
            return
        with torch.cuda.device(self.positions.device):  # capture and replay on the caches' GPU
            if self._graph[name] is None:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    fn()
                self._pool = self._pool or graph.pool()
                self._graph[name] = graph
                self.captures += 1
            self._graph[name].replay()
        self.replays += 1


#: model -> {(batch, width, cache allocation): RoundJournal}
_JOURNALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _allocation(model) -> tuple:
    """The addresses of every buffer of `model` (caches, compressor states): a journal and its CUDA graphs are valid
    while these stay (`setup_cache` or a dtype / device move changes some)."""
    return tuple(b.data_ptr() for _, b in model.named_buffers() if b is not None)


def forget_journals(model) -> None:
    """Drop `model`'s round journals (and with them their hold on its caches). `setup_cache` calls this first, so
    an old allocation is freed before the new one is made."""
    _JOURNALS.pop(model, None)


def journal_for(model, batch: int, width: int) -> RoundJournal:
    """The `RoundJournal` of `model` for verify rows [batch, width] on the caches' device, kept across generations.

    A journal of another allocation (`_allocation`) is dropped. Its tensors are made outside inference mode, so a
    journal first used under `torch.inference_mode()` still serves a later generation outside it.
    Raises: ValueError as `CacheJournal`.
    """
    alloc = _allocation(model)
    mine = _JOURNALS.setdefault(model, {})
    key = (batch, width, alloc)
    if key not in mine:
        for k in [k for k in mine if k[2] != alloc]:
            del mine[k]
        with torch.inference_mode(False):
            mine[key] = RoundJournal(model, batch, width, model.layers[0].attn.ring_codes.device)
    return mine[key]


def _on_device(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (CPU) on `device`; to CUDA through pinned memory without a stream sync (a pageable copy waits for the
    stream, which would expose the host work queued after it)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def greedy_acceptance(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Accepted drafts per sequence: the longest prefix with `drafts[:, i] == target[:, i]`.

    Args: drafts [B, K] int64; target [B, K] (or [B, K+1]; only the first K columns are compared) greedy tokens
        of the verify rows. Returns int64 [B] in [0, K].
    """
    k = drafts.shape[1]
    agree = (drafts == target[:, :k]).to(torch.int64)
    return torch.cumprod(agree, dim=1).sum(dim=1)


class MatchExpected:
    """BENCHMARK.md "match-expected" acceptance: lengths floor(e) or ceil(e) with P(ceil) = e - floor(e).

    Args:
        expected: the mean acceptance length (tokens per round, bonus included), 1 <= expected <= max_len.
        max_len: block size + 1. seed: of the CPU generator that draws the lengths (same draws for every backend).
    Raises: ValueError for an expected length outside [1, max_len].
    """

    def __init__(self, expected: float, max_len: int, seed: int = 0):
        if not 1.0 <= expected <= max_len:
            raise ValueError(f"simulated acceptance length {expected} must lie in [1, block size + 1 = {max_len}]")
        self.expected, self.low = expected, math.floor(expected)
        self.p_high = expected - self.low
        self.gen = torch.Generator().manual_seed(seed)

    def draw(self, batch: int) -> torch.Tensor:
        """Acceptance lengths int64 [batch] (CPU)."""
        u = torch.rand(batch, generator=self.gen, dtype=torch.float64)
        return self.low + (u < self.p_high).to(torch.int64)


@torch.no_grad()
def generate_speculative(model, prompt_ids: torch.Tensor, max_new_tokens: int, compiled_prefill: bool = False,
                         simulate_acceptance: float | None = None, drafter=None, seed: int = 0,
                         round_phases: bool = False, prefill_chunks: Sequence[int] = PREFILL_CHUNKS):
    """Greedy DSpark speculative decoding (module docstring); called by `generate(..., speculative=True)`.

    Args:
        model: a `DeepseekV41Flash` with DSpark stages, or a `torch.compile` wrapper of one (verify rows go through
            it; the prefill runs on the eager module unless `compiled_prefill`, which prefills through `model` in
            chunks of the fixed `prefill_chunks` sizes, as `generate` does).
        prompt_ids: int64 [P] or [B, P]. max_new_tokens: tokens to produce (>= 1).
        simulate_acceptance: None for greedy acceptance, else the "match-expected" mean length (e.g. 5.5).
        drafter: callable with the signature of `DSpark.forward` (e.g. `torch.compile(model.mtp)`); default the
            wrapper's `draft` where it has one (`RegionalModel.draft`, the compiled DSpark region), else the eager
            `model.mtp`. seed: of the simulated-acceptance draws.
        round_phases: also time each round's phases (`ROUND_PHASES`: journal save, verify forward, acceptance +
            rollback, the host sync on the accepted tokens, draft) with CUDA events on GPU (the GPU timeline, idle
            gaps included), the host clock on CPU; six more events per round, so timed runs leave it off.
    Returns:
        `GenerateResult` with tokens [B, max_new_tokens], timestamps (the tokens of one round share its time),
        `acceptance` (tokens per round per sequence), `natural_acceptance` (greedy, measured in every mode),
        `simulated_acceptance` and, with `round_phases`, `round_phases_ms` (one {phase: ms} per round).
    Raises:
        ValueError: no DSpark stages, empty prompt, max_new_tokens < 1, a bad simulated length, a length beyond
        max_position_embeddings.
    """
    base = base_model(model)
    if base.mtp is None:
        raise ValueError("speculative decoding needs a model with DSpark stages (num_dspark_stages > 0)")
    if prompt_ids.dim() == 1:
        prompt_ids = prompt_ids[None]
    b, p = prompt_ids.shape
    if p < 1 or max_new_tokens < 1:
        raise ValueError(f"need a non-empty prompt and max_new_tokens >= 1, got {p}, {max_new_tokens}")
    k = base.config.dspark_block_size
    m = k + 1
    sim = MatchExpected(simulate_acceptance, m, seed) if simulate_acceptance is not None else None
    # The last round may verify past the requested length; with several sequences a fast one keeps going (up to
    # m tokens per round) until the slowest has max_new_tokens.
    need = p + max_new_tokens + m if b == 1 else p + m * max_new_tokens
    if base.max_seq_len >= need and base.batch_size == b:
        base.reset_cache()
    else:
        base.setup_cache(b, need)
    dev = base.embed.weight.device
    if drafter is None:
        # A wrapper that compiles the drafter too (`RegionalModel.draft`) drafts through it; else the eager stages.
        drafter = getattr(model, "draft", None) if model is not base else None
        drafter = drafter if callable(drafter) else base.mtp
    embed_w, head_w = base.embed.weight, base.head.weight
    clock = Clock(dev)

    clock.mark()
    ids = prompt_ids.to(dev)
    pos = torch.arange(p, device=dev)[None].expand(b, p).contiguous()
    if compiled_prefill:
        chunks: list = []
        logits, feats = prefill(model, ids, pos, prefill_chunks, each=lambda o, cp: chunks.append((o[1], cp)),
                                return_features=True)
    else:
        logits, feats = base(ids, pos, last_only=True, return_features=True)
        chunks = [(feats, pos)]
    y = logits[:, -1].argmax(-1)
    out: List[List[int]] = [[t] for t in y.tolist()]
    clock.mark()
    for f, fp in chunks:  # one commit per prefill chunk writes the ring as one commit of the whole prompt does
        base.mtp.commit(f, fp, torch.ones(fp.shape, dtype=torch.bool, device=dev))
    start = torch.full((b,), p, dtype=torch.int64, device=dev)
    offs = torch.arange(m, device=dev)
    none = torch.zeros(b, m, dtype=torch.bool, device=dev)
    drafts, _ = drafter(torch.zeros(b, m, feats.shape[-1], dtype=feats.dtype, device=dev), start[:, None] + offs,
                        none, y, start, embed_w, head_w)
    token_round = [0]
    acceptance, natural = [], []
    journal = journal_for(base, b, m)
    phase_clock = Clock(dev) if round_phases else None
    tick = phase_clock.mark if round_phases else (lambda: None)
    while min(len(o) for o in out) < max_new_tokens:
        tick()
        rows = torch.cat((y[:, None], drafts), dim=1)
        vpos = start[:, None] + offs
        journal.save(vpos)
        tick()
        logits, feats = model(rows, vpos, return_features=True)
        tick()
        target = logits.argmax(-1)
        nat = greedy_acceptance(drafts, target)
        acc = (_on_device(sim.draw(b), dev) - 1) if sim is not None else nat
        keep = acc + 1
        journal.rollback(keep)
        bi = torch.arange(b, device=dev)
        y = target[bi, acc]
        emitted = torch.cat((drafts, y[:, None]), dim=1)
        emitted[bi, acc] = y  # rows 0..acc-1: the accepted drafts; row acc: the target's bonus token
        tick()
        done = min(len(o) for o in out)
        keep_l, nat_l, em_l = keep.tolist(), (nat + 1).tolist(), emitted.tolist()
        for s in range(b):
            out[s].extend(em_l[s][:keep_l[s]])
        acceptance.append(keep_l)
        natural.append(nat_l)
        tick()
        valid = offs[None, :] < keep[:, None]
        start = start + keep
        if min(len(o) for o in out) < max_new_tokens:
            drafts, _ = drafter(feats, vpos, valid, y, start, embed_w, head_w)
        tick()
        clock.mark()
        token_round.extend([len(clock.marks) - 2] * (min(len(o) for o in out) - done))
    ts = clock.seconds()
    tokens = torch.tensor([o[:max_new_tokens] for o in out], dtype=torch.int64)
    return GenerateResult(tokens=tokens, timestamps=[ts[r] for r in token_round[:max_new_tokens]], prompt_len=p,
                          acceptance=acceptance, natural_acceptance=natural, simulated_acceptance=simulate_acceptance,
                          round_phases_ms=_phases_ms(phase_clock) if round_phases else [])


#: The phases of one speculative round, in order (`generate_speculative(round_phases=True)`).
ROUND_PHASES = ("save", "verify", "accept_rollback", "sync", "draft")


def _phases_ms(clock) -> List[dict]:
    """Per round {phase: ms} from `clock`'s marks (len(ROUND_PHASES) + 1 per round; the first mark is t = 0)."""
    t = [0.0] + clock.seconds()
    n = len(ROUND_PHASES) + 1
    return [{ph: 1e3 * (t[r + i + 1] - t[r + i]) for i, ph in enumerate(ROUND_PHASES)} for r in range(0, len(t), n)]

