"""A cache write that dsv41's rewrites leave in front of a read of the cache's old contents is moved behind it, so
Inductor writes the cache in place instead of cloning it and copying it back (dsv41/compiler/write_order.py)."""

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from dsv41.compiler.write_order import WriteOrderPass, order_cache_writes

aten = torch.ops.aten


def _ring_step(ring, slot, row, q):
    # The order a rewrite can produce: the functional write first, then a read of the ring as it was.
    new = aten.index_put.default(ring, [slot], row)
    scores = (ring.float() @ q).softmax(0)
    ring.copy_(new)
    return scores


def _traced(fn):
    args = (torch.randn(8, 4), torch.tensor([3]), torch.randn(1, 4), torch.randn(4))
    return make_fx(fn)(*(a.clone() for a in args)), args  # tracing runs fn: the ring it writes is a copy


def _write_and_reads(gm):
    """Position of the index_put and of every other node reading the ring placeholder directly."""
    ring = next(iter(gm.graph.nodes))
    nodes = list(gm.graph.nodes)
    write = next(i for i, n in enumerate(nodes) if n.target is aten.index_put.default)
    reads = [i for i, n in enumerate(nodes) if n.op == "call_function" and ring in n.args
             and n.target not in (aten.index_put.default, aten.copy_.default)]
    return write, reads


def test_write_moves_behind_the_old_read_and_values_do_not_change():
    gm, args = _traced(_ring_step)
    ring0 = args[0].clone()
    expect_ring = args[0].clone()
    expect = _ring_step(expect_ring, *args[1:])
    write, reads = _write_and_reads(gm)
    assert reads and write < min(reads)
    moved = order_cache_writes(gm.graph)
    gm.recompile()
    assert len(moved) == 1 and moved[0]["cache"] == next(iter(gm.graph.nodes)).name
    write, reads = _write_and_reads(gm)
    assert write > max(reads)
    ring = ring0.clone()
    got = gm(ring, *args[1:])
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    torch.testing.assert_close(ring, expect_ring, rtol=0, atol=0)
    assert ring[3].eq(args[2][0]).all() and not ring0[3].eq(args[2][0]).all()


def _used_in_between(ring, slot, row, q):
    new = aten.index_put.default(ring, [slot], row)
    early = new.sum()  # a user of the new version before the old read: the write cannot move past the read
    scores = ring.float() @ q + early
    ring.copy_(new)
    return scores


def _no_copy_back(ring, slot, row, q):
    new = aten.index_put.default(ring, [slot], row)  # a functional result the caller keeps; not a cache write
    return new, ring @ q


def test_writes_that_cannot_or_need_not_move_stay():
    for fn in (_used_in_between, _no_copy_back):
        gm, _ = _traced(fn)
        before = [n.name for n in gm.graph.nodes]
        assert order_cache_writes(gm.graph) == []
        assert [n.name for n in gm.graph.nodes] == before


def test_write_already_after_its_reads_is_left_alone():
    def in_order(ring, slot, row, q):
        """Read, then write: the order Inductor already writes in place."""
        scores = ring @ q
        ring.index_put_([slot], row)
        return scores

    gm, _ = _traced(in_order)
    assert order_cache_writes(gm.graph) == []


def test_the_pass_puts_the_graph_back_when_it_raises(monkeypatch):
    import dsv41.compiler.write_order as wo
    gm, _ = _traced(_ring_step)
    before = [n.name for n in gm.graph.nodes]

    def boom(graph):
        """Move a node out of order, then fail: the pass must put the graph back."""
        next(n for n in graph.nodes if n.target is aten.index_put.default).append(next(iter(graph.nodes)))
        raise RuntimeError("injected")

    monkeypatch.setattr(wo, "order_cache_writes", boom)
    p = WriteOrderPass()
    p(gm.graph)
    assert [n.name for n in gm.graph.nodes] == before
    assert "injected" in p.results[0][0]["failed"]


def test_tiny_rings_are_written_in_place(tiny_dsv41):
    """Every layer's window ring (codes and scales) is read by the fused attention op, which the rewrite places
    after the model's ring write; the report lists each write moved, and the decoded tokens still equal eager's."""
    writes = tiny_dsv41["report"]["schedule"]["cache_writes_in_place"]
    assert not [w for w in writes if "failed" in w]
    attention_reads = [w for w in writes if "sparse_fp4_attention" in w["after"] or "stream_join" in w["after"]]
    assert len(attention_reads) >= 2 * 8, writes
    assert tiny_dsv41["compiled_tokens"] == tiny_dsv41["eager_tokens"]


def _value_is_old_rows(ring, slot, row, q):
    new = aten.index_put.default(ring, [slot], ring[0:1])  # the value is a view of the ring's old contents
    scores = ring @ q
    ring.copy_(new)
    return scores


def _index_from_the_ring(ring, slot, row, q):
    idx = (ring[:1, 0].abs() * 0).long() + slot  # the index is computed from the ring
    new = aten.index_put.default(ring, [idx], row)
    scores = ring @ q
    ring.copy_(new)
    return scores


@pytest.mark.parametrize("fn", [_value_is_old_rows, _index_from_the_ring])
def test_a_write_that_reads_the_cache_itself_stays(fn):
    """Made in place after the move, such a scatter would read rows it has already overwritten (found by review:
    wrong rows on `torch.compile(backend="dsv41")`)."""
    gm, args = _traced(fn)
    before = [n.name for n in gm.graph.nodes]
    assert order_cache_writes(gm.graph) == []
    assert [n.name for n in gm.graph.nodes] == before


def test_compiled_write_of_old_rows_equals_eager():
    """The review's reproduction: with the write moved and made in place, rows 4-7 came back as 0-3."""
    ring = torch.arange(32.0).view(8, 4)
    args = (torch.tensor([1, 2]), torch.zeros(1, 4), torch.ones(4))

    def step_functional(ring, slot, row, q):
        """The write's value is the ring's old rows 0-1, and the ring is read again after the write."""
        new = ring.index_put([slot], ring[0:2])
        scores = ring.sum(1) * q.sum()
        ring.copy_(new)
        return scores

    want_ring = ring.clone()
    want = step_functional(want_ring, *args)
    torch._dynamo.reset()
    got_ring = ring.clone()
    got = torch.compile(step_functional, backend="dsv41")(got_ring, *args)
    assert torch.equal(got, want) and torch.equal(got_ring, want_ring)
