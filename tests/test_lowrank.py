"""Low-rank (PowerSGD-style) compression: against a pure-torch reference of
the same algorithm, the uncompressed limit, and many buckets inside DDP."""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import _C

from . import models
from .dist_harness import run_ranks

# (offset, rows, cols, rank): a 40x24 matrix at rank 3, a dense vector, a 16x16 matrix at rank 2
LAYOUT = [[0, 40, 24, 3], [960, 1, 30, 0], [990, 16, 16, 2]]
N = 990 + 256


def _reference_step(xs, divisors, residuals, qs, layout):
    """One step of the algorithm across ranks; orthonormalisation by torch's QR
    (columns may differ in sign from Gram-Schmidt; P P^T does not)."""
    world = len(xs)
    ms = [x / d + e for x, d, e in zip(xs, divisors, residuals)]
    out = torch.zeros(N)
    new_res = [torch.zeros(N) for _ in range(world)]
    new_qs = []
    for (off, rows, cols, r), q in zip(layout, qs):
        parts = [m[off:off + rows * cols].view(rows, cols) for m in ms]
        if r == 0:
            out[off:off + rows * cols] = sum(parts).view(-1)
            new_qs.append(q)
            continue
        p = sum(mp @ q for mp in parts)
        p = torch.linalg.qr(p).Q
        qn = sum(mp.t() @ p for mp in parts)
        approx = p @ qn.t()
        out[off:off + rows * cols] = approx.view(-1)
        for k in range(world):
            new_res[k][off:off + rows * cols] = (parts[k] - approx / divisors[k]).view(-1)
        new_qs.append(qn)
    return out, new_res, new_qs


def _initial_qs(layout):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(cols, r, generator=g) if r else None for _, rows, cols, r in layout]


def _ours(rank, world, layout, steps, divisors, node_of=()):
    """``steps`` calls of allreduce_lowrank (hierarchical with ``node_of``)."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    lay = torch.tensor(layout)
    q = torch.cat([q.reshape(-1) for q in _initial_qs(layout) if q is not None])
    assert q.numel() == _C.lowrank_q_numel(lay)
    res = torch.zeros(N)
    g = torch.Generator().manual_seed(rank)
    xs, outs, ress = [], [], []
    sent0 = t.counters()["bytes_sent"]
    for _ in range(steps):
        x = torch.randn(N, generator=g)
        xs.append(x.clone())
        t.allreduce_lowrank(x, divisors[rank], lay, q, res, node_of=list(node_of))
        outs.append(x)
        ress.append(res.clone())
    return {"xs": xs, "outs": outs, "res": ress, "sent_per_step": (t.counters()["bytes_sent"] - sent0) / steps}


@pytest.mark.parametrize("world", [2, 3])
def test_lowrank_matches_pure_torch_reference(world):
    divisors = [float(world + r) / (r + 1) for r in range(world)]
    results = run_ranks(_ours, world, LAYOUT, 3, divisors)
    for r in results[1:]:
        for a, b in zip(r["outs"], results[0]["outs"]):
            assert torch.equal(a, b)  # bit-identical on every rank
    qs = _initial_qs(LAYOUT)
    res = [torch.zeros(N) for _ in range(world)]
    for step in range(3):
        want, res, qs = _reference_step([r["xs"][step] for r in results], divisors, res, qs, LAYOUT)
        torch.testing.assert_close(results[0]["outs"][step], want, rtol=1e-4, atol=1e-5)
        for k in range(world):
            torch.testing.assert_close(results[k]["res"][step], res[k], rtol=1e-4, atol=1e-5)
        res = [r["res"][step] for r in results]  # continue from what the ranks hold


def test_lowrank_full_rank_is_the_exact_weighted_mean():
    batch = [3, 9]
    divisors = [sum(batch) / b for b in batch]
    layout = [[0, 40, 24, 24], [960, 1, 30, 0], [990, 16, 16, 16]]
    results = run_ranks(_ours, 2, layout, 1, divisors)
    want = sum(b * r["xs"][0] for b, r in zip(batch, results)) / sum(batch)
    got = results[0]["outs"][0]
    assert ((got - want).norm() / want.norm()).item() < 1e-5


def _bad_layouts(rank, world):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    errors = []
    for layout, q in [([[0, 10, 10, 11]], 110), ([[0, 10, 10, 2]], 20), ([[0, 10, 10, 2]], 7), ([[5, 10, 10, 0]], 0)]:
        try:
            t.allreduce_lowrank(torch.zeros(100), 1.0, torch.tensor(layout), torch.zeros(q), None)
            errors.append(None)
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_lowrank_layout_errors_are_clear():
    errors = run_ranks(_bad_layouts, 1)[0]
    assert "rank of row 0 must be in [0, min(rows, cols)]" in errors[0]
    assert errors[1] is None  # a valid layout
    assert "Q state must be contiguous float32 with 20 elements" in errors[2]
    assert "outside the bucket" in errors[3]


def _many_buckets(rank, world, steps):
    model = models.mlp(hidden=96)
    ddp = DDP(model, bucket_cap_mb=0.0001)  # about one bucket per parameter
    state = hetcomm.HookState("lowrank", matrix_approximation_rank=2, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        models.train_step(ddp, opt, rank, step, 16)
    st = state.stats()
    return {"params": models.flat_params(model), "buckets": st["last_step"]["buckets"],
            "ratio": st["last_step"]["compression_ratio"], "q": sorted(state.state_dict()["lowrank_q"])}


@pytest.mark.parametrize("world", [2, 4])
def test_lowrank_many_buckets_on_gloo_replicas_identical(world):
    results = run_ranks(_many_buckets, world, 50)
    assert results[0]["buckets"] >= 4
    assert results[0]["ratio"] > 3
    assert len(results[0]["q"]) >= 2
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])
    assert not results[0]["params"].isnan().any()


@pytest.mark.parametrize("node_of", [[0, 0, 1, 1], [0, 1, 0, 1]])
def test_hierarchical_lowrank_is_the_flat_step_with_its_factors_summed_inside_nodes_first(node_of):
    # P = sum_r M_r Q is linear in the M_r: summing P (and Q^T) inside each node, then across the nodes, gives the
    # flat step's approximation and residuals; only the factors travel, never the matrices
    divisors = [10.0 / (r + 1) for r in range(4)]  # batch weights 1/10 .. 4/10: the shares sum to 1
    results = run_ranks(_ours, 4, LAYOUT, 3, divisors, node_of)
    for r in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["outs"], results[0]["outs"]))
    qs = _initial_qs(LAYOUT)
    res = [torch.zeros(N) for _ in range(4)]
    for step in range(3):
        want, res, qs = _reference_step([r["xs"][step] for r in results], divisors, res, qs, LAYOUT)
        torch.testing.assert_close(results[0]["outs"][step], want, rtol=1e-4, atol=1e-5)
        for k in range(4):
            torch.testing.assert_close(results[k]["res"][step], res[k], rtol=1e-4, atol=1e-5)
        res = [r["res"][step] for r in results]
    # the factors: P (152 floats) with the dense part (30), then Q^T (104), each summed inside the node, across,
    # and gathered back: under half the bucket's fp32 bytes a step (an exact sum of the bucket sends more than it)
    factors = 40 * 3 + 16 * 2 + 30 + 24 * 3 + 16 * 2
    for r in results:
        assert r["sent_per_step"] <= 2 * factors * 4 < N * 4 / 2, r["sent_per_step"]
