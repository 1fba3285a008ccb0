"""Ring, halving-doubling, tree and hierarchical all-reduce over the
transport's point-to-point calls: float64 reference sums, any world size and
length, bit-identical replicas; compression on the inter-node stage only."""

import pytest
import torch
import torch.distributed as dist

from hetcomm import _C, ops

from . import reference as ref
from .dist_harness import run_ranks

LENGTHS = [0, 1, 7, 1000, 100_003]


def _inputs(rank, n):
    return torch.randn(n, generator=torch.Generator().manual_seed(1000 * rank + n))


def _all_algorithms(rank, world, node_of):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    out = {}
    order = list(reversed(range(world)))
    for n in LENGTHS:
        for algo in ["native", "ring", "halving_doubling", "tree", "hierarchical"]:
            x = _inputs(rank, n)
            t.allreduce(x, algo, order=order if algo == "ring" else [], node_of=node_of)
            out[(algo, n)] = x
        h = _inputs(rank, n).half()
        t.allreduce(h, "halving_doubling")
        out[("hd-fp16", n)] = h
    return out


@pytest.mark.parametrize("world,node_of", [(2, [0, 1]), (3, [7, 7, 7]), (4, [0, 0, 1, 1]), (5, [0, 1, 2, 3, 4])])
def test_algorithms_sum_like_float64_and_agree_across_ranks(world, node_of):
    results = run_ranks(_all_algorithms, world, node_of)
    for n in LENGTHS:
        want = sum(_inputs(r, n).double() for r in range(world))
        for algo in ["native", "ring", "halving_doubling", "tree", "hierarchical"]:
            got = results[0][(algo, n)]
            for r in range(1, world):
                assert torch.equal(results[r][(algo, n)], got), (algo, n, r)
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * world)
        torch.testing.assert_close(results[0][("hd-fp16", n)].double(), want, rtol=1e-2, atol=1e-2 * world)


def _errors(rank, world):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    errors = []
    for kwargs in [dict(algorithm="ring", order=[0, 0]), dict(algorithm="hierarchical", node_of=[0, 0, 1]),
                   dict(algorithm="hierarchical", node_of=[0]), dict(algorithm="bogus")]:
        try:
            t.allreduce(torch.zeros(10), **kwargs)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_algorithm_errors_name_the_rule():
    errors = run_ranks(_errors, 2)[0]
    assert "permutation" in errors[0]
    assert "node_of must name a node for each of the 2 ranks" in errors[1]
    assert "node_of must name a node" in errors[2]
    assert "algorithm must be" in errors[3]


NODE_OF = [0, 0, 1, 1, 2, 2]  # 3 nodes x 2 ranks


def _hier_onebit(rank, world, n, chunk):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    shard = _C.hierarchical_shard_numel(n, NODE_OF, rank)
    node, nodes = NODE_OF[rank], len(set(NODE_OF))
    outs = {}
    for inter in ("onebit", "fp8", "int3"):
        wres = torch.zeros(shard)
        sres = torch.zeros(ops.server_residual_numel(shard, nodes, node))
        for step in range(2):
            x = _inputs(rank + 10 * step, n)
            t.allreduce(x, "hierarchical", node_of=NODE_OF, inter=inter, residual=wres, server_residual=sres,
                        chunk=chunk)
            outs[(inter, step)] = x
    before = t.counters()["bytes_sent"]
    x = _inputs(rank, n)
    t.allreduce(x, "hierarchical", node_of=NODE_OF)
    return {"outs": outs, "exact_bytes": t.counters()["bytes_sent"] - before}


def test_hierarchical_compresses_only_across_nodes():
    n, chunk, world = 3000, 128, 6
    results = run_ranks(_hier_onebit, world, n, chunk)
    for r in results[1:]:
        assert all(torch.equal(r["outs"][k], results[0]["outs"][k]) for k in results[0]["outs"])
    # Reference: exact node sums, then the two-phase 1-bit (fp8, int3) all-reduce of
    # each local index's shard across the 3 nodes, residuals carried over.
    half = n // 2
    bounds = [(0, half), (half, n)]
    for inter, encode in (("onebit", ref.sign_encode), ("fp8", ref.fp8_encode), ("int3", ref.int3_encode)):
        wres = {(li, nd): torch.zeros(b - a) for li, (a, b) in enumerate(bounds) for nd in range(3)}
        sres = {(li, nd): torch.zeros(ops.server_residual_numel(b - a, 3, nd)) for li, (a, b) in enumerate(bounds)
                for nd in range(3)}
        for step in range(2):
            xs = [_inputs(r + 10 * step, n) for r in range(world)]
            node_sums = [xs[2 * nd] + xs[2 * nd + 1] for nd in range(3)]
            want = torch.zeros(n)
            for li, (a, b) in enumerate(bounds):
                out, nw, ns, sums = ref.two_phase_allreduce([s[a:b] for s in node_sums],
                                                            [wres[(li, nd)] for nd in range(3)],
                                                            [sres[(li, nd)] for nd in range(3)], [1.0] * 3, chunk,
                                                            encode=encode)
                for nd in range(3):
                    wres[(li, nd)], sres[(li, nd)] = nw[nd], ns[nd]
                want[a:b] = out
            got = results[0]["outs"][(inter, step)]
            if inter != "onebit":  # max-based scales: bit-exact
                assert torch.equal(got, want)
            else:  # mean-based scales summed in another order: a near-zero sum may take the other sign
                assert torch.isclose(got, want, rtol=1e-5, atol=1e-6).float().mean() > 0.999
    # the exact hierarchical all-reduce: rank 0 sends (L-1)/L of n in the
    # node, its shard around the 3-node ring twice, and (L-1)/L back
    assert results[0]["exact_bytes"] == 4 * (half + 2 * (2 * 500) + half)


def _hier_cast(rank, world, node_of, n):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    t.set_nodes(node_of)
    out = {}
    for inter in ("fp16", "bf16"):
        x = _inputs(rank, n)
        before = dict(t.counters())
        t.allreduce(x, "hierarchical", node_of=node_of, inter=inter)
        after = t.counters()
        out[inter] = (x, after["bytes_sent"] - before["bytes_sent"],
                      after["bytes_sent_across_nodes"] - before["bytes_sent_across_nodes"])
    x = _inputs(rank, n)
    before = dict(t.counters())
    t.allreduce(x, "hierarchical", node_of=node_of)
    after = t.counters()
    out["none"] = (x, after["bytes_sent_across_nodes"] - before["bytes_sent_across_nodes"],
                   after["bytes_sent"] - before["bytes_sent"])
    out["shard"] = _C.hierarchical_shard_numel(n, node_of, rank)
    try:
        t.allreduce(_inputs(rank, n).half(), "hierarchical", node_of=node_of, inter="bf16")
    except ValueError as e:
        out["error"] = str(e)
    return out


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 0, 1, 1, 2, 2]])
def test_a_16_bit_cast_crosses_nodes_only(node_of):
    """inter='fp16' / 'bf16': the sum inside each node in float32, rounded to
    16 bits once, summed in 16 bits across the nodes, gathered in 16 bits
    inside the node and widened: on 2 nodes bit for bit the 16-bit sum of the
    two nodes' rounded float32 sums (the same bits on every rank), half the
    exact hierarchy's bytes across nodes; within a 16-bit rounding of the
    float64 sum on 3 nodes. Inside the node the reduce-scatter sends float32,
    the all-gather its shard in 2 bytes an element."""
    n, world = 1001, len(node_of)
    results = run_ranks(_hier_cast, world, node_of, n)
    assert "x must be float32 for inter 'bf16'" in results[0]["error"]
    xs = [_inputs(r, n) for r in range(world)]
    nodes = sorted(set(node_of))
    node_sums = [sum(xs[r] for r in range(world) if node_of[r] == nd) for nd in nodes]
    for inter, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        got = results[0][inter][0]
        for r in range(1, world):
            assert torch.equal(results[r][inter][0], got), (inter, r)
        if len(nodes) == 2:
            assert torch.equal(got, (node_sums[0].to(dtype) + node_sums[1].to(dtype)).float()), inter
            # each rank's shard crosses once, in 2 bytes an element, not 4
            assert [r[inter][2] for r in results] == [r["none"][1] // 2 for r in results]
            assert all(r[inter][2] > 0 for r in results)
        for r in results:  # the exact hierarchy's bytes inside the node, less 2 bytes an element of the gather
            inside, exact_inside = r[inter][1] - r[inter][2], r["none"][2] - r["none"][1]
            assert inside == exact_inside - 2 * r["shard"], (inter, inside, exact_inside, r["shard"])
        # no more error than rounding each node's float32 sum once and the total once
        want = sum(xs).double()
        eps = torch.finfo(dtype).eps
        bound = eps * (sum(s.double().abs() for s in node_sums) + want.abs()) + 1e-6
        assert ((got.double() - want).abs() <= bound).all(), inter
        assert not torch.equal(got, want.float())  # (but rounded: 16 bits crossed)


def _rounds(rank, world, n):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    out = {}
    for algo, node_of in (("ring", []), ("hierarchical", [0, 0, 1, 1][:world] if world == 4 else [0, 1])):
        x = _inputs(rank, n)
        before = dict(t.counters())
        t.allreduce(x, algo, node_of=node_of)
        after = t.counters()
        out[algo] = (x, after["calls"] - before["calls"], after["bytes_sent"] - before["bytes_sent"])
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_two_ranks_sum_in_one_exchange_with_the_rings_bytes(world):
    """A ring of two ranks (the whole ring on 2 ranks; across 2 nodes in the
    hierarchy) exchanges the whole vector once: one send and one receive, not
    two rounds of halves, the same bytes, the same bits on both ranks."""
    n = 1001
    results = run_ranks(_rounds, world, n)
    want = sum(_inputs(r, n).double() for r in range(world))
    for algo in ("ring", "hierarchical"):
        for r in range(1, world):
            assert torch.equal(results[r][algo][0], results[0][algo][0]), (algo, r)
        torch.testing.assert_close(results[0][algo][0].double(), want, rtol=1e-5, atol=1e-5 * world)
    if world == 2:  # ring and hierarchy (one rank a node) are the pair exchange: 1 send + 1 receive, n floats
        assert results[0]["ring"][1:] == (2, 4 * n)
        assert results[0]["hierarchical"][1:] == (2, 4 * n)
    else:  # rank 0 (local index 0, block [0, 500) of [0, 500, 1001)): in its node a reduce-scatter sends the
        # other half, the exchange across the nodes its own half, the all-gather its half back: 3 sends, 3 receives
        assert results[0]["hierarchical"][1:] == (3 * 2, 4 * ((n - n // 2) + n // 2 + n // 2))


ACROSS_ALGOS = ["native", "ring", "halving_doubling", "tree", "hierarchical"]


def _across(rank, world, n):
    """Each algorithm's bytes (sent, received; of those, to / from other nodes)
    with the transport told the nodes as [0, 0, 1, 1], one node a rank, one node for all, and not told."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    out = {}
    for name, nodes in (("2x2", [0, 0, 1, 1]), ("apart", [3, 2, 1, 0]), ("one", [5] * 4), ("unset", [])):
        t.set_nodes(nodes)
        for algo in ACROSS_ALGOS:
            x = _inputs(rank, n)
            before = dict(t.counters())
            t.allreduce(x, algo, order=list(range(world)), node_of=[0, 0, 1, 1])
            after = t.counters()
            out[(name, algo)] = tuple(after[k] - before[k] for k in (
                "bytes_sent", "bytes_recv", "bytes_sent_across_nodes", "bytes_recv_across_nodes"))
    try:
        t.set_nodes([0, 1])
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_bytes_across_nodes_count_what_goes_to_ranks_on_other_nodes():
    """The counters' bytes across nodes: all of them where each rank is a
    node, none on one node (or nodes not told); on 2 nodes x 2 ranks what each
    algorithm's route sends across (a ring in node order: the ranks whose
    successor is on the other node; the hierarchy: each rank's shard once;
    the tree: one edge a rank; the backend's all-reduce: the share of peers
    off the node, 2 of 3), and every byte sent across is received across."""
    n = 1000
    runs = run_ranks(_across, 4, n)
    assert "node_of must name a node for each of the 4 ranks" in runs[0]["error"]
    for algo in ACROSS_ALGOS:
        for r in range(4):
            sent, recv, sent_x, recv_x = runs[r][("apart", algo)]
            assert sent > 0 and (sent_x, recv_x) == (sent, recv), (algo, r)
            for name in ("one", "unset"):
                assert runs[r][(name, algo)] == (sent, recv, 0, 0), (name, algo, r)
        assert sum(runs[r][("2x2", algo)][2] for r in range(4)) == sum(runs[r][("2x2", algo)][3] for r in range(4))
    for r in range(4):
        sent, recv, sent_x, recv_x = runs[r][("2x2", "ring")]
        assert sent_x == (sent if r in (1, 3) else 0) and recv_x == (recv if r in (0, 2) else 0), r
        assert runs[r][("2x2", "hierarchical")][2:] == (4 * n // 2, 4 * n // 2), r
        assert runs[r][("2x2", "tree")][2:] == (4 * n, 4 * n), r
        sent, recv, sent_x, recv_x = runs[r][("2x2", "native")]
        assert sent == 2 * 3 * 4 * n // 4 and (sent_x, recv_x) == (sent * 2 // 3, recv * 2 // 3), r
