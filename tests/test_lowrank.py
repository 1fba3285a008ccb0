"""Low-rank (PowerSGD-style) compression: against a pure-torch reference of
the same algorithm, the uncompressed limit, and many buckets inside DDP."""

import types
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import _C

from . import models
from .dist_harness import hetcomm_records, run_ranks

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
        new_qs.append(torch.linalg.qr(qn).Q)  # the next warm start, orthonormal (signs aside, as Gram-Schmidt's)
    return out, new_res, new_qs


def _initial_qs(layout):
    g = torch.Generator().manual_seed(11)
    return [torch.randn(cols, r, generator=g) if r else None for _, rows, cols, r in layout]


def _q_state(layout):
    """_initial_qs as the engine keeps them: one flat float32 vector."""
    return torch.cat([q.reshape(-1) for q in _initial_qs(layout) if q is not None])


def _ours(rank, world, layout, steps, divisors, node_of=(), scale=1.0, wire="fp32"):
    """``steps`` calls of allreduce_lowrank (hierarchical with ``node_of``; factors sent in ``wire``) on standard
    normal inputs times ``scale``."""
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    lay = torch.tensor(layout)
    q = _q_state(layout)
    assert q.numel() == _C.lowrank_q_numel(lay)
    res = torch.zeros(N)
    g = torch.Generator().manual_seed(rank)
    xs, outs, ress = [], [], []
    t.set_nodes(list(node_of))
    before = t.counters()
    for _ in range(steps):
        x = torch.randn(N, generator=g) * scale
        xs.append(x.clone())
        t.allreduce_lowrank(x, divisors[rank], lay, q, res, node_of=list(node_of), wire=wire)
        outs.append(x)
        ress.append(res.clone())
    after = t.counters()
    return {"xs": xs, "outs": outs, "res": ress, "sent_per_step": (after["bytes_sent"] - before["bytes_sent"]) / steps,
            "across_per_step": (after["bytes_sent_across_nodes"] - before["bytes_sent_across_nodes"]) / steps}


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


def _dense_part(rank, world, divisors):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    x, res = torch.randn(N, generator=g) * 3, torch.randn(N, generator=g) * 1e-3
    sent = (x.clone(), res.clone())
    t.allreduce_lowrank(x, divisors[rank], torch.tensor(LAYOUT), _q_state(LAYOUT), res)
    return {"sent": sent, "out": x, "res": res}


def test_a_dense_part_sums_each_ranks_x_over_its_divisor_plus_its_residual_to_the_bit():
    # M of a part sent dense is x / divisor + residual with torch's roundings (a division by a float, then an
    # addition), and the float32 wire sums it exactly (on two ranks a + b, in either order): torch's bits
    divisors = [2.5, 5 / 3]
    results = run_ranks(_dense_part, 2, divisors)
    dense = slice(960, 990)
    want = sum((r["sent"][0][dense] / d + r["sent"][1][dense]) for r, d in zip(results, divisors))
    for r in results:
        assert torch.equal(r["out"][dense], want)
        assert torch.equal(r["res"][dense], torch.zeros(30))  # an exact sum leaves nothing owed
        assert not torch.equal(r["out"][:960], r["sent"][0][:960])  # the matrices were approximated


def test_a_small_gradient_is_approximated_as_a_large_one():
    # The step is homogeneous: inputs 1e-6 the size give outputs and residuals 1e-6 the size, step after step, as
    # PowerSGD's (exact normalization, an orthonormal warm-start Q). With Q kept as M^T P, unnormalized, P = M M^T P
    # was ~1e-12 at this size, and an epsilon of 1e-8 added to its columns' norms shrank every approximation.
    divisors = [2.0, 2.0]
    big = run_ranks(_ours, 2, LAYOUT, 4, divisors)
    small = run_ranks(_ours, 2, LAYOUT, 4, divisors, (), 1e-6)
    for b, s in zip(big, small):
        for key in ("outs", "res"):
            for step in range(4):
                torch.testing.assert_close(s[key][step] / 1e-6, b[key][step], rtol=1e-3, atol=1e-4)


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
    for residual in (torch.zeros(200)[::2], torch.zeros(100, dtype=torch.float64)):  # strided; not float32
        try:
            t.allreduce_lowrank(torch.zeros(100), 1.0, torch.tensor([[0, 10, 10, 2]]), torch.zeros(20), residual)
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
    assert "residual must be a contiguous float32 tensor, got Float (not contiguous)" in errors[4]
    assert "residual must be a contiguous float32 tensor, got Double" in errors[5]


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
            "ratio": st["last_step"]["compression_ratio"], "q": sorted(state.state_dict()["lowrank_q"]),
            "rounds": st["lowrank_rounds"], "calls": st["last_step"]["collectives"]}


@pytest.mark.parametrize("world", [2, 4])
def test_lowrank_many_buckets_on_gloo_replicas_identical(world):
    results = run_ranks(_many_buckets, world, 50)
    assert results[0]["buckets"] >= 4
    assert results[0]["ratio"] > 3
    assert len(results[0]["q"]) >= 2
    # steps 11-30 ran both schedules in turns, the ranks chose one together (hetcomm.lowrank_rounds): B + 1
    # all-reduces a step pipelined, 2 together
    rounds = results[0]["rounds"]
    assert rounds["state"] == "chosen" and all(r["rounds"] == rounds for r in results)
    assert results[0]["calls"] == (2 if rounds["rounds"] == "together" else results[0]["buckets"] + 1)
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


def _books(xs, divisors, residuals_before, out, residuals_after):
    """Error feedback's books over the ranks: what went in (each rank's x / divisor plus its residual before),
    what the ranks still owe (their residuals after), and how far delivered + owed is from what went in,
    relative to its largest entry."""
    put_in = sum(x / d + e for x, d, e in zip(xs, divisors, residuals_before))
    owed = sum(residuals_after)
    return put_in, owed, ((out + owed - put_in).abs().max() / put_in.abs().max()).item()


# per wire: how far a rounded sum may be from the exact one, relative to its largest entry (bf16: 8 bits; fp8: 3
# mantissa bits, rounded once a rank and, in the two phases on three ranks, once more by the segment's owner), and
# how far the first step's approximation may be from the float32 wire's
_WIRE_ERROR = {"bf16": (2 ** -7, 2e-2), "fp8": (2 ** -3, 0.1)}


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
@pytest.mark.parametrize("world,node_of", [(2, ()), (3, ()), (4, (0, 0, 1, 1))])
def test_lowrank_with_rounded_sums_error_feedback_keeps_what_they_lost(world, node_of, wire):
    # lowrank_wire="bf16": P with the dense parts, then Q^T, summed in bfloat16, half the bytes; "fp8": summed as
    # the fp8 mode sums a bucket (8-bit codes, a float32 scale per 256, across nodes only in the hierarchy), about
    # a quarter. What is delivered plus what the ranks' residuals hold is still the exact sum of what they put in
    # (their weighted x plus the residual before), on the matrices and on the dense part alike: the rounding is
    # sent again the next step.
    divisors = [float(world)] * world if world != 4 else [10.0 / (r + 1) for r in range(4)]  # shares sum to 1
    exact = run_ranks(_ours, world, LAYOUT, 3, divisors, node_of)
    rounded = run_ranks(_ours, world, LAYOUT, 3, divisors, node_of, 1.0, wire)
    for r in rounded[1:]:
        assert all(torch.equal(a, b) for a, b in zip(r["outs"], rounded[0]["outs"]))  # bit-identical on every rank
    dense = slice(960, 990)
    bound, first_bound = _WIRE_ERROR[wire]
    for step in range(3):
        out = rounded[0]["outs"][step]
        put_in, owed, gap = _books([r["xs"][step] for r in rounded], divisors,
                                   [r["res"][step - 1] if step else 0 for r in rounded], out,
                                   [r["res"][step] for r in rounded])
        assert gap < 1e-6, step
        assert not torch.equal(out[dense], put_in[dense])  # the dense part's sum was rounded...
        assert (out[dense] - put_in[dense]).abs().max() < bound * put_in[dense].abs().max()  # ...to the wire
        assert owed[dense].abs().max() > 0  # ...and the residuals hold what it lost
    # the first step starts from the same Q and inputs: its approximation is the float32 wire's, to the rounding
    first, want = rounded[0]["outs"][0], exact[0]["outs"][0]
    assert ((first - want).norm() / want.norm()).item() < first_bound
    for e, r in zip(exact, rounded):
        if wire == "bf16":  # half the bytes, to the byte: both all-reduces carry 2-byte elements
            assert r["sent_per_step"] == e["sent_per_step"] / 2
        elif not node_of:  # a byte an element, a scale and a flag a message: at this size under 0.4x (at scale 0.25x)
            assert r["sent_per_step"] < 0.4 * e["sent_per_step"], (r["sent_per_step"], e["sent_per_step"])
        else:  # the hierarchy sums inside nodes in float32, as the fp8 mode does: the fp8 bytes are the link's
            assert 0 < r["across_per_step"] < 0.4 * e["across_per_step"], (r, e)
            assert r["sent_per_step"] - r["across_per_step"] == e["sent_per_step"] - e["across_per_step"]


def test_lowrank_fp8_wire_carries_a_quarter_of_the_float32_bytes_at_scale():
    # a 2048 x 512 matrix at rank 8: P and Q^T, 20480 floats, in fp8 cost (1 + 4 / 256) / 4 of float32's bytes
    layout = [[0, 2048, 512, 8]]
    sent = {w: run_ranks(_big, 2, layout, w)[0] for w in ("fp32", "fp8")}
    assert abs(sent["fp8"] / sent["fp32"] - (1 + 4 / 256) / 4) < 0.01, sent


def _big(rank, world, layout, wire):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    lay = torch.tensor(layout)
    n = layout[0][1] * layout[0][2]
    q = torch.randn(_C.lowrank_q_numel(lay), generator=torch.Generator().manual_seed(3))
    sent0 = t.counters()["bytes_sent"]
    t.allreduce_lowrank(torch.randn(n, generator=torch.Generator().manual_seed(rank)), 2.0, lay, q, torch.zeros(n),
                        wire=wire)
    return t.counters()["bytes_sent"] - sent0


def test_lowrank_wire_must_be_fp32_bf16_or_fp8():
    with pytest.raises(ValueError, match="lowrank_wire must be None .* or one of"):
        hetcomm.HookState("lowrank", lowrank_wire="fp16")
    errors = run_ranks(_bad_wire, 1)[0]
    assert "lowrank_wire must be one of fp32, bf16, fp8, got 'fp16'" in errors


def _bad_wire(rank, world):
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    try:
        t.allreduce_lowrank(torch.zeros(N), 1.0, torch.tensor(LAYOUT), _q_state(LAYOUT), None, wire="fp16")
    except ValueError as e:
        return str(e)


def _nonfinite_rank(rank, world, bad, where, device, wire="fp32"):
    dev = models.rank_device(rank, device)
    t = _C.ProcessGroupTransport(dist.group.WORLD, dev)
    lay = torch.tensor(LAYOUT)
    g = torch.Generator().manual_seed(rank)
    q = _q_state(LAYOUT).to(dev)
    res = (torch.randn(N, generator=g) * 0.1).to(dev)
    out = []
    for step in range(2):
        x = torch.randn(N, generator=g)
        if step == 0 and bad == "+-inf" and rank >= world - 2:  # two ranks, opposite infinities: the sum is NaN
            x[where] = float("inf") if rank == world - 1 else float("-inf")
        elif step == 0 and rank == world - 1:
            x[where] = float(bad)  # one entry, on one rank
        x = x.to(dev)
        before = (x.clone(), q.clone(), res.clone())
        calls = t.counters()["calls"]
        reduced = t.allreduce_lowrank(x, float(world), lay, q, res, wire=wire)
        out.append({"reduced": reduced, "calls": t.counters()["calls"] - calls,
                    "untouched": all(torch.equal(a.view(torch.int32), b.view(torch.int32))  # bits: NaN too
                                     for a, b in zip(before, (x, q, res)))})
    return out


# where: an entry of the dense part (960..989), of the first matrix, of the second one
@pytest.mark.parametrize("wire", ["fp32", "fp8"])
@pytest.mark.parametrize("bad,where", [("inf", 977), ("nan", 5), ("+-inf", 1100)])
def test_a_lowrank_step_learns_every_ranks_finiteness_from_its_first_all_reduce(bad, where, device, wire):
    # No all-reduce of its own for GradScaler's overflow check: a non-finite entry of M makes its row of P = M Q,
    # or its dense entry, non-finite in the sum every rank receives, so a step is two all-reduces, not three.
    # Where a rank is not finite, every rank stops after the first and leaves the bucket, Q and the residual as
    # they came (the caller then reduces the bucket exactly, as allreduce_hook would). The fp8 wire's sum (two
    # phases on three ranks: two collectives a round) carries the flag in its messages.
    calls = 1 if wire == "fp32" else 2
    for ranks in run_ranks(_nonfinite_rank, 3, bad, where, device, wire):
        assert ranks[0] == {"reduced": False, "calls": calls, "untouched": True}
        assert ranks[1] == {"reduced": True, "calls": 2 * calls, "untouched": False}


def _engine_steps(rank, world, kinds, pipeline, device, steps=2, wires=None, carry=False):
    """Buckets of ``kinds`` ("lowrank": LAYOUT with its own Q and residual; "dense": N floats reduced exactly)
    through the engine on ``device``, ``steps`` steps (``pipeline``: True, False or "hold": pipelined, each
    lowrank bucket waiting for the next before its first all-reduce; ``carry``: each lowrank bucket with a
    carry, what an earlier plan owed); per step the inputs, outputs, residuals, carries before and after, and
    collective calls (tensors on the CPU)."""
    dev = models.rank_device(rank, device)
    engine = hetcomm._C.Engine(dist.group.WORLD, dev)
    lay = torch.tensor(LAYOUT)
    qs = [_q_state(LAYOUT).to(dev) for _ in kinds]
    res = [torch.zeros(N, device=dev) for _ in kinds]
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        xs = [torch.randn(N, generator=g) for _ in kinds]
        cs = [0.1 * torch.randn(N, generator=g) if carry and kind == "lowrank" else None for kind in kinds]
        bufs = [x.to(dev, copy=True) for x in xs]
        carries = [c.to(dev, copy=True) if c is not None else None for c in cs]
        futs = []
        for b, (kind, buf) in enumerate(zip(kinds, bufs)):
            lowrank = kind == "lowrank"
            futs.append(engine.submit_bucket(
                b, buf, _C.Codec.lowrank if lowrank else _C.Codec.none, 2048, 0.01, True, res[b] if lowrank else None,
                None, b == len(kinds) - 1, layout=lay if lowrank else None, q_state=qs[b] if lowrank else None,
                pipeline=bool(pipeline), lowrank_wire=wires[b] if wires else "fp32", hold=pipeline == "hold",
                carry=carries[b]))
        for f in futs:
            f.wait()
        out.append({"xs": xs, "outs": [b.cpu() for b in bufs], "res": [r.to("cpu", copy=True) for r in res],
                    "cs": cs, "carries": [c.cpu() if c is not None else None for c in carries],
                    "collectives": engine.stats()["last_step"]["collectives"]})
    engine.close()
    return out


@pytest.mark.parametrize("world,pipeline", [(2, True), (3, True), (2, "hold"), (3, "hold")])
def test_pipelined_lowrank_buckets_send_a_buckets_second_all_reduce_with_the_next_ones_first(world, pipeline, device):
    kinds = ["lowrank", "lowrank", "dense", "lowrank", "lowrank", "lowrank"]
    piped = run_ranks(_engine_steps, world, kinds, pipeline, device.type)
    alone = run_ranks(_engine_steps, world, kinds, False, device.type)
    # Runs of k lowrank buckets cost k + 1 all-reduces (3 and 4 here), the dense bucket 1; alone, 2 a lowrank
    # bucket. Held (hetcomm.lowrank_rounds: together), a run costs 2: the dense bucket ends the first run's wait.
    assert [s["collectives"] for s in piped[0]] == [3 + 1 + 4 if pipeline is True else 2 + 1 + 2] * 2
    assert [s["collectives"] for s in alone[0]] == [2 * 5 + 1] * 2
    for r in piped[1:]:  # replicas bit-identical
        assert all(torch.equal(a, b) for s, s0 in zip(r, piped[0]) for a, b in zip(s["outs"], s0["outs"]))
    # Against the pure-torch step, bucket by bucket, residuals included
    qs = [_initial_qs(LAYOUT) for _ in kinds]
    res = [[torch.zeros(N) for _ in range(world)] for _ in kinds]
    for step in range(2):
        for b, kind in enumerate(kinds):
            xs = [r[step]["xs"][b] for r in piped]
            if kind == "dense":
                torch.testing.assert_close(piped[0][step]["outs"][b], sum(xs) / world, rtol=1e-5, atol=1e-6)
                continue
            want, want_res, qs[b] = _reference_step(xs, [float(world)] * world, res[b], qs[b], LAYOUT)
            torch.testing.assert_close(piped[0][step]["outs"][b], want, rtol=1e-4, atol=1e-5)
            for k in range(world):
                torch.testing.assert_close(piped[k][step]["res"][b], want_res[k], rtol=1e-4, atol=1e-5)
            res[b] = [r[step]["res"][b] for r in piped]
    if world == 2:  # a sum of two is the same whichever all-reduce carries it: the same bits as alone
        for s, s0 in zip(piped[0], alone[0]):
            assert all(torch.equal(a, b) for a, b in zip(s["outs"] + s["res"], s0["outs"] + s0["res"]))


@pytest.mark.parametrize("world,pipeline", [(2, True), (2, "hold"), (3, "hold")])
def test_pipelined_lowrank_buckets_with_a_carry_pipeline_and_add_it(world, pipeline, device):
    # A bucket whose plan changed carries what the last plan owed (auto's trials switch plans every step): it is
    # pipelined (or held) as one without, its input the bucket plus the carry (in units of its contribution: times
    # the divisor, the world here), the carry zeroed; on 2 ranks the same bits as the unpipelined path's
    kinds = ["lowrank", "lowrank", "dense", "lowrank"]
    piped = run_ranks(_engine_steps, world, kinds, pipeline, device.type, 2, None, True)
    alone = run_ranks(_engine_steps, world, kinds, False, device.type, 2, None, True)
    assert [s["collectives"] for s in piped[0]] == [3 + 1 + 2 if pipeline is True else 2 + 1 + 2] * 2
    assert [s["collectives"] for s in alone[0]] == [2 * 3 + 1] * 2
    qs = [_initial_qs(LAYOUT) for _ in kinds]
    res = [[torch.zeros(N) for _ in range(world)] for _ in kinds]
    for step in range(2):
        for b, kind in enumerate(kinds):
            if kind == "dense":
                continue
            assert all(torch.equal(r[step]["carries"][b], torch.zeros(N)) for r in piped)  # added, then zeroed
            xs = [r[step]["xs"][b] + world * r[step]["cs"][b] for r in piped]
            want, want_res, qs[b] = _reference_step(xs, [float(world)] * world, res[b], qs[b], LAYOUT)
            torch.testing.assert_close(piped[0][step]["outs"][b], want, rtol=1e-4, atol=1e-5)
            for k in range(world):
                torch.testing.assert_close(piped[k][step]["res"][b], want_res[k], rtol=1e-4, atol=1e-5)
            res[b] = [r[step]["res"][b] for r in piped]
    if world == 2:
        for s, s0 in zip(piped[0], alone[0]):
            assert all(torch.equal(a, b) for a, b in zip(s["outs"] + s["res"], s0["outs"] + s0["res"]))


def _held_with_an_overflow(rank, world, device):
    dev = models.rank_device(rank, device)
    engine = hetcomm._C.Engine(dist.group.WORLD, dev)
    lay = torch.tensor(LAYOUT)
    qs, res = [_q_state(LAYOUT).to(dev) for _ in range(2)], [torch.zeros(N, device=dev) for _ in range(2)]
    g = torch.Generator().manual_seed(rank)
    xs = [torch.randn(N, generator=g) for _ in range(2)]
    if rank == world - 1:
        xs[0][7] = float("inf")  # the held bucket, on one rank
    bufs = [x.to(dev, copy=True) for x in xs]
    cs = [0.1 * torch.randn(N, generator=g) for _ in range(2)]  # what earlier plans owed
    carries = [c.to(dev, copy=True) for c in cs]
    futs = [engine.submit_bucket(b, bufs[b], _C.Codec.lowrank, 2048, 0.01, True, res[b], None, b == 1, layout=lay,
                                 q_state=qs[b], pipeline=True, hold=True, carry=carries[b]) for b in range(2)]
    for f in futs:
        f.wait()
    out = (xs, [b.cpu() for b in bufs], [r.cpu() for r in res], engine.stats()["last_step"]["collectives"], cs,
           [c.cpu() for c in carries])
    engine.close()
    return out


def test_held_lowrank_buckets_send_their_rounds_together_and_an_overflow_reduces_its_bucket_exactly(device):
    # Two held buckets (the step's buckets together), each with a carry: one all-reduce of both P's, where bucket
    # 0's sum is not finite (one rank's Inf): it is reduced exactly (every rank sees the Inf; its residual and
    # its carry untouched, the carry left for the next step), and bucket 1 ends its lowrank step alone, its carry
    # added and zeroed: 3 all-reduces
    ranks = run_ranks(_held_with_an_overflow, 3, device.type)
    xs0 = [r[0][0] for r in ranks]
    xs1 = [r[0][1] + 3 * r[4][1] for r in ranks]
    want1, want_res1, _ = _reference_step(xs1, [3.0] * 3, [torch.zeros(N)] * 3, _initial_qs(LAYOUT), LAYOUT)
    for k, (_, outs, res, calls, cs, carries) in enumerate(ranks):
        assert calls == 3
        torch.testing.assert_close(outs[0], sum(xs0) / 3)  # exact, the Inf included
        assert torch.isinf(outs[0][7]) and torch.equal(res[0], torch.zeros(N)) and torch.equal(carries[0], cs[0])
        torch.testing.assert_close(outs[1], want1, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(res[1], want_res1[k], rtol=1e-4, atol=1e-5)
        assert torch.equal(carries[1], torch.zeros(N))


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_pipelined_lowrank_buckets_join_only_buckets_of_their_wire(device, wire):
    # W, W, fp32, W: the second W bucket's first all-reduce carries the first one's second; the fp32 bucket cannot
    # join a W one (nor the last W the fp32), so each of those sends its second alone first. (fp8 on two ranks:
    # one exchange a sum, a collective as bf16's all-reduce.)
    kinds, wires = ["lowrank"] * 4, [wire, wire, "fp32", wire]
    piped = run_ranks(_engine_steps, 2, kinds, True, device.type, 2, wires)
    alone = run_ranks(_engine_steps, 2, kinds, False, device.type, 2, wires)
    assert [s["collectives"] for s in piped[0]] == [7] * 2 and [s["collectives"] for s in alone[0]] == [8] * 2
    for s, s0 in zip(piped[0], alone[0]):  # a sum of two: the same bits whichever all-reduce carries it (fp8's
        same = range(4) if wire == "bf16" else range(2, 4)  # scales are per 256 of what is sent together)
        assert all(torch.equal(s[k][b], s0[k][b]) for k in ("outs", "res") for b in same)
    for r in piped[1:]:  # replicas bit-identical
        assert all(torch.equal(a, b) for s, s0 in zip(r, piped[0]) for a, b in zip(s["outs"], s0["outs"]))
    for b, wire in enumerate(wires):  # every bucket's books balance: delivered + owed = what went in
        for step in range(2):
            gap = _books([r[step]["xs"][b] for r in piped], [2.0, 2.0],
                         [r[step - 1]["res"][b] if step else 0 for r in piped], piped[0][step]["outs"][b],
                         [r[step]["res"][b] for r in piped])[2]
            assert gap < 1e-6, (b, wire, step)
        dense_owed = sum(r[1]["res"][b][960:990] for r in piped)
        assert (dense_owed.abs().max() > 0) == (wire != "fp32")  # only a rounded sum leaves the dense part owed


def _parked_then(rank, world, then, device, hold=False):
    dev = models.rank_device(rank, device)
    engine = hetcomm._C.Engine(dist.group.WORLD, dev)
    lay = torch.tensor(LAYOUT)
    q = _q_state(LAYOUT).to(dev)
    x = torch.randn(N, generator=torch.Generator().manual_seed(rank))
    buf = x.to(dev, copy=True)
    fut = engine.submit_bucket(0, buf, _C.Codec.lowrank, 2048, 0.01, True, torch.zeros(N, device=dev), None, False,
                               layout=lay, q_state=q, pipeline=True, hold=hold)  # not the step's last: it waits
    if then == "sum":
        engine.submit_sum(torch.ones(1, device=dev)).wait()
    else:
        engine.close()
    fut.wait()
    return x, buf.cpu()


@pytest.mark.parametrize("then,hold", [("sum", False), ("close", False), ("sum", True), ("close", True)])
def test_a_parked_lowrank_bucket_ends_its_step_before_any_other_job_and_at_close(then, hold, device):
    # A step interrupted after a bucket that waits for the next one (after its first all-reduce, or held before
    # it): the next job of another kind, or close(), ends its step alone (no hang), with the same result as the
    # pure-torch step
    results = run_ranks(_parked_then, 2, then, device.type, hold)
    want, _, _ = _reference_step([x for x, _ in results], [2.0, 2.0], [torch.zeros(N)] * 2, _initial_qs(LAYOUT), LAYOUT)
    for _, buf in results:
        torch.testing.assert_close(buf, want, rtol=1e-4, atol=1e-5)


def _planted(rows, cols, spectrum, seed):
    """A rows x cols matrix with the given singular values (float64)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(rows, len(spectrum), generator=g, dtype=torch.float64))[0]
    v = torch.linalg.qr(torch.randn(cols, len(spectrum), generator=g, dtype=torch.float64))[0]
    return (u * torch.tensor(spectrum, dtype=torch.float64)) @ v.t()


def test_top_share_is_the_energy_in_the_top_singular_values_and_leaves_the_callers_random_stream(device):
    from hetcomm import lowrank_share

    spectrum = [10.0 * 0.7 ** i for i in range(40)]
    want = {r: sum(s * s for s in spectrum[:r]) / sum(s * s for s in spectrum) for r in (1, 4, 16)}
    gen = torch.Generator().manual_seed(1)
    rng = torch.get_rng_state()
    # exact singular values (the Gram matrix's eigenvalues), of a tall and a wide matrix, then the randomized range
    # finder; none of them warns
    for rows, cols in ((100, 60), (60, 100), (600, 300)):
        g = _planted(rows, cols, spectrum, rows).float().to(device)
        for r, share in want.items():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                num, den = lowrank_share.top_share(g, r, gen)
            exact = min(rows, cols) <= lowrank_share.EXACT_UP_TO
            assert num / den == pytest.approx(share, abs=1e-6 if exact else 2e-3), (rows, r)
            assert num / den <= share + 1e-6  # an estimate from below
    assert torch.equal(torch.get_rng_state(), rng)
    due = [s for s in range(1000) if lowrank_share.LowrankShare.due(s)]
    assert due == [20, 25, 30, 50, 55, 60, 80, 85, 90] + [s for first in (100, 200, 400, 800)
                                                          for s in range(first, first + 21, 5)]
    assert [s for s in range(1000) if lowrank_share.LowrankShare.closes(s)] == [30, 60, 90, 120, 220, 420, 820]


@pytest.mark.cuda
def test_a_reading_of_a_gpu_bucket_is_the_cpu_buckets_bit_for_bit():
    """A GPU bucket's matrices are read on the CPU (cuSOLVER's gesvd and a sync
    a matrix made each reading step of the language model 110-120 ms longer on
    an H200): the same shares as the same bucket on the CPU, exact values and
    the range finder alike, and the CUDA bucket left as it was."""
    from hetcomm import lowrank_share

    mats = [_planted(384, 96, [3.0 * 0.8 ** i for i in range(40)], 1), _planted(600, 300, [1.0] * 50, 2)]
    buf = torch.cat([m.float().reshape(-1) for m in mats])
    layout = torch.tensor([[0, 384, 96, 4], [384 * 96, 600, 300, 4]])
    gpu = buf.cuda()
    readings = []
    for b in (buf, gpu):
        r = lowrank_share.LowrankShare()
        r.add(b, layout, [8, 4])
        readings.append((r._nums, r._den))
    assert readings[0] == readings[1]
    assert torch.equal(gpu.cpu(), buf)


def test_next_close_is_the_first_window_end_at_or_after_a_step():
    from hetcomm import lowrank_share

    ends = [s for s in range(7000) if lowrank_share.LowrankShare.closes(s)]  # ... 3220, 6420
    assert ends[:8] == [30, 60, 90, 120, 220, 420, 820, 1620]
    for step in range(5000):  # what auto's log line names, against the windows the guard reads
        assert lowrank_share.next_close(step) == next(e for e in ends if e >= step), step


def test_a_reading_stops_at_its_budget_and_skips_a_non_finite_step(monkeypatch):
    from hetcomm import lowrank_share

    low, high = _planted(30, 20, [1.0] * 20, 1).float(), _planted(40, 20, [5.0, 1.0, 0.5], 2).float()
    buf = torch.cat([low.reshape(-1), high.reshape(-1)])
    layout = torch.tensor([[0, 30, 20, 2], [600, 40, 20, 2]])
    bad = buf.clone()
    bad[5] = float("inf")
    for name, value in (("FIRST", 1), ("FIRST_SPAN", 2), ("SPAN", 2), ("EVERY", 1), ("LATER", 10)):  # windows 1-3, 10-12, 20-22, ...
        monkeypatch.setattr(lowrank_share, name, value)
    monkeypatch.setattr(lowrank_share, "BUDGET", 600)  # the first matrix only
    quiet, reading = lowrank_share.LowrankShare(), lowrank_share.LowrankShare()
    for r in (quiet, reading):
        for step, b in ((1, buf), (2, bad), (3, buf)):  # an overflow step reads nothing
            r.add(b, layout)
            r.end_step(step, 2, 0, warn=r is reading)
            assert (r.last is None) == (step < 3)
    assert reading.last == {"step": 3, "share": pytest.approx(2 / 20, abs=1e-6), "rank": 2, "readings": 2}
    assert reading.warned and not quiet.warned  # a flat spectrum: 2 of 20 equal values; auto's guard: no warning
    monkeypatch.setattr(lowrank_share, "BUDGET", 1400)  # both
    for step in (10, 11):
        reading.add(buf, layout)
        reading.end_step(step, 2, 0)
    reading.add(bad, layout)
    reading.end_step(12, 2, 0)
    assert reading.last == {"step": 12, "share": pytest.approx((2 + 26.0) / (20 + 26.25), abs=1e-6), "rank": 2,
                            "readings": 2}
    for step in (20, 21, 22):  # a window of overflows: no reading, the last one stays
        reading.add(bad, layout)
        reading.end_step(step, 2, 0)
    assert reading.last["step"] == 12


def _share_run(rank, world, batch, steps):
    """lowrank at rank 1 on a Linear layer: windows of one step, 4 and 8;
    the reference is the top-1 share of a replica's local gradient at step 8."""
    import copy

    from hetcomm import lowrank_share

    lowrank_share.FIRST, lowrank_share.FIRST_SPAN, lowrank_share.SPAN, lowrank_share.LATER = 4, 0, 0, 8
    torch.manual_seed(0)
    model = torch.nn.Linear(48, 40)
    ddp = DDP(model)
    state = hetcomm.HookState("lowrank", matrix_approximation_rank=1, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    reference = None
    with hetcomm_records() as records:
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(batch, 48, generator=g), torch.randn(batch, 40, generator=g)
            if step == 8:
                replica = copy.deepcopy(model)
                torch.nn.functional.mse_loss(replica(x), y).backward()
                s2 = torch.linalg.svdvals(replica.weight.grad.double()).pow(2)
                reference = float(s2[0] / s2.sum())
            opt.zero_grad()
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
    warnings = [r.getMessage() for r in records if "carries" in r.getMessage()]
    out = {"share": state.stats().get("lowrank_share"), "reference": reference, "warnings": warnings}
    state.close()
    return out


def test_lowrank_reads_how_much_of_the_gradient_its_rank_carries_and_warns_once_when_too_little():
    # one sample a rank: a Linear layer's weight gradient is an outer product, all of it in rank 1
    for r in run_ranks(_share_run, 2, 1, 10):
        assert r["share"]["step"] == 8 and r["share"]["rank"] == 1
        assert r["share"]["share"] == pytest.approx(r["reference"], abs=1e-6) and r["reference"] > 0.999
        assert r["warnings"] == []
    # 64 samples of noise: rank 1 carries a small share; rank 0 warns once (steps 4 and 8 both read low)
    r0, r1 = run_ranks(_share_run, 2, 64, 10)
    for r in (r0, r1):
        assert r["share"]["share"] == pytest.approx(r["reference"], abs=1e-6) and r["reference"] < 0.5
    assert len(r0["warnings"]) == 1 and "matrix_approximation_rank=1" in r0["warnings"][0]
    assert r1["warnings"] == []


def test_a_reading_is_of_the_gradient_handed_over_and_runs_at_the_steps_end(monkeypatch):
    """add() only copies the matrices: the exchange reduces the bucket in
    place after it, and end_step reads what was handed over."""
    from hetcomm import lowrank_share

    read = []
    top = lowrank_share.top_shares
    monkeypatch.setattr(lowrank_share, "top_shares", lambda g, ranks, gen: read.append(g.shape) or top(g, ranks, gen))
    monkeypatch.setattr(lowrank_share, "FIRST", 1)
    g = _planted(30, 20, [5.0, 1.0, 0.5], 3).float()
    buf = g.reshape(-1).clone()
    share = lowrank_share.LowrankShare()
    share.add(buf, torch.tensor([[0, 30, 20, 1]]))
    assert read == []  # nothing read yet
    buf.fill_(1.0)  # the exchange writes the sum (a rank-1 matrix: its share would be 1)
    share.end_step(1 + lowrank_share.FIRST_SPAN, 1, 0, warn=False)
    assert read == [(30, 20)]
    assert share.last["share"] == pytest.approx(25.0 / 26.25, abs=1e-6)


def _read_order_run(rank, world):
    """lowrank at rank 1 on two DDP buckets, windows of one step (2 and 8):
    each step's submits and readings, in order."""
    from hetcomm import lowrank_share

    lowrank_share.FIRST, lowrank_share.FIRST_SPAN, lowrank_share.SPAN, lowrank_share.LATER = 2, 0, 0, 8
    events = []
    top = lowrank_share.top_shares
    lowrank_share.top_shares = lambda g, ranks, gen: events.append(("read",)) or top(g, ranks, gen)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(48, 40), torch.nn.ReLU(), torch.nn.Linear(40, 40))
    ddp = DDP(model, bucket_cap_mb=0.004)
    state = hetcomm.HookState("lowrank", matrix_approximation_rank=1, min_compress_numel=0)
    ensure = state._ensure_engine

    class Recorded:
        def __init__(self, engine):
            self._engine = engine

        def __getattr__(self, name):
            return getattr(self._engine, name)

        def submit_bucket(self, **kw):
            events.append(("submit", kw["last"]))
            return self._engine.submit_bucket(**kw)

    state._ensure_engine = lambda device=None: Recorded(ensure(device))
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    steps = []
    for step in range(10):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 48, generator=g), torch.randn(16, 40, generator=g)
        events.clear()
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        steps.append(list(events))
    out = {"steps": steps, "share": state.stats().get("lowrank_share")}
    state.close()
    return out


def test_the_readings_of_a_step_run_after_its_last_bucket_was_submitted():
    """The reading runs while the buckets are exchanged: after every submit
    of its step (the buckets are copied when handed over)."""
    for r in run_ranks(_read_order_run, 2):
        for step, events in enumerate(r["steps"]):
            submits = [e for e in events if e[0] == "submit"]
            # (DDP's first step runs in one bucket, then in its rebuilt layout of bucket_cap_mb)
            assert len(submits) >= (2 if step else 1) and submits[-1] == ("submit", True), (step, events)
            reads = [i for i, e in enumerate(events) if e == ("read",)]
            assert bool(reads) == (step in (2, 8)), (step, events)
            assert all(i > events.index(("submit", True)) for i in reads), (step, events)
        assert r["share"]["step"] == 8


def test_a_small_matrix_is_read_by_the_range_finder_only_where_what_it_leaves_out_bounds_its_error(monkeypatch):
    """Up to EXACT_UP_TO: a 256 x 256 matrix of rank 20 (a step's gradient of
    a small batch) is read by the range finder at 2 x 8 + OVERSAMPLE columns,
    within EXACT_TOL of its exact shares; one whose energy spreads over more
    singular values than that (rank 64, or a slow decay) and one as narrow
    as 4 x those columns take the exact singular values."""
    from hetcomm import lowrank_share

    exact_calls = []
    exact = lowrank_share._exact
    monkeypatch.setattr(lowrank_share, "_exact", lambda g, ranks: exact_calls.append(tuple(g.shape)) or exact(g, ranks))
    gen = torch.Generator().manual_seed(2)
    cases = [((256, 256), [10.0 * 0.6 ** i for i in range(20)], False),  # all of it inside 26 columns
             ((256, 256), [1.0] * 64, True),                             # rank 64: 26 columns leave most out
             ((256, 256), [10.0 * 0.9 ** i for i in range(100)], True),  # a slow decay: over EXACT_TOL left out
             ((200, 256), [10.0 * 0.6 ** i for i in range(20)], False),  # wide
             ((256, 100), [10.0 * 0.6 ** i for i in range(20)], True)]   # 100 < 4 x 26: exact at once
    for (rows, cols), spectrum, falls_back in cases:
        exact_calls.clear()
        g = _planted(rows, cols, spectrum, rows + len(spectrum)).float()
        nums, den = lowrank_share.top_shares(g, [8, 4], gen)
        assert exact_calls == ([(rows, cols)] if falls_back else []), (rows, cols, len(spectrum))
        for r, num in zip((8, 4), nums):
            want = sum(s * s for s in spectrum[:r]) / sum(s * s for s in spectrum)
            assert num / den == pytest.approx(want, abs=lowrank_share.EXACT_TOL + 1e-7), (rows, cols, r)
        assert den == pytest.approx(sum(s * s for s in spectrum), rel=1e-6)
    # above EXACT_UP_TO the range finder's estimate stands, whatever it leaves out (from below)
    exact_calls.clear()
    spectrum = [1.0] * 64
    nums, den = lowrank_share.top_shares(_planted(300, 300, spectrum, 9).float(), [8, 4], gen)
    assert exact_calls == [] and nums[0] / den < 8 / 64 + 1e-6


def test_a_gradient_inside_the_first_basis_is_read_without_power_steps(monkeypatch):
    """A matrix of rank under the range finder's columns (a step's gradient
    of a small batch: the cnn task's 256 x 1024 layer, 32 samples a rank) is
    whole inside the first basis: its shares are the exact ones, read with
    one QR. Up to EXACT_UP_TO one of rank between those columns and twice
    as many is read by a second pass at once (no power steps: they cannot
    bring a basis of k columns within EXACT_TOL of a matrix with more than
    that past its top k singular values), without the exact singular values. Above it one of higher rank runs
    every power step, as Halko et al.'s range finder written out here does,
    and reads what it reads."""
    from hetcomm import lowrank_share

    qrs = []
    qr = torch.linalg.qr
    monkeypatch.setattr(torch.linalg, "qr", lambda a: qrs.append(tuple(a.shape)) or qr(a))
    ranks = [4, 8, 16]
    for rows, cols, rank, seed in ((256, 1024, 32, 4), (1024, 300, 20, 5), (200, 200, 40, 6)):
        # the range finder's columns: 2 x 16 + OVERSAMPLE up to EXACT_UP_TO, else 16 + OVERSAMPLE
        k = (2 * 16 if min(rows, cols) <= lowrank_share.EXACT_UP_TO else 16) + lowrank_share.OVERSAMPLE
        spectrum = [10.0 * 0.85 ** i for i in range(rank)]
        g = _planted(rows, cols, spectrum, seed).float()
        qrs.clear()
        nums, den = lowrank_share.top_shares(g, ranks, torch.Generator().manual_seed(seed))
        assert len(qrs) == (1 if rank < k else 1 + lowrank_share.POWER_STEPS), (rows, cols, rank)
        for r, num in zip(ranks, nums):
            want = sum(s * s for s in spectrum[:r]) / sum(s * s for s in spectrum)
            assert num / den == pytest.approx(want, abs=lowrank_share.EXACT_TOL + 1e-7), (rows, cols, r)
    # auto's guard reads at ranks 8 and 4 (2 x 8 + OVERSAMPLE columns): a batch of 32's gradient has more; a pass
    # at twice the columns holds it, with no power steps before it, and no exact singular values are taken
    exact_calls = []
    exact = lowrank_share._exact
    monkeypatch.setattr(lowrank_share, "_exact", lambda g, ranks: exact_calls.append(tuple(g.shape)) or exact(g, ranks))
    for rank, falls_back in ((32, False), (80, True)):
        spectrum = [10.0 * 0.95 ** i for i in range(rank)]
        g = _planted(256, 1024, spectrum, rank).float()
        qrs.clear()
        exact_calls.clear()
        nums, den = lowrank_share.top_shares(g, [8, 4], torch.Generator().manual_seed(rank))
        assert qrs == [(256, 26), (256, 52)] and exact_calls == ([(256, 1024)] if falls_back else [])
        for r, num in zip((8, 4), nums):
            want = sum(s * s for s in spectrum[:r]) / sum(s * s for s in spectrum)
            assert num / den == pytest.approx(want, abs=lowrank_share.EXACT_TOL + 1e-7), (rank, r)
    # above EXACT_UP_TO and of higher rank than its columns (16 + OVERSAMPLE): the power steps, then the estimate
    g = _planted(300, 400, [10.0 * 0.9 ** i for i in range(60)], 7).float()
    qrs.clear()
    nums, den = lowrank_share.top_shares(g, ranks, torch.Generator().manual_seed(8))
    assert len(qrs) == 1 + lowrank_share.POWER_STEPS
    monkeypatch.setattr(torch.linalg, "qr", qr)
    omega = torch.randn(400, 16 + lowrank_share.OVERSAMPLE, generator=torch.Generator().manual_seed(8))
    y = g @ omega
    for _ in range(lowrank_share.POWER_STEPS):
        y = g @ (g.t() @ torch.linalg.qr(y)[0])
    s2 = torch.linalg.svdvals(torch.linalg.qr(y)[0].t().double() @ g.double()).pow(2)
    assert nums == pytest.approx([float(s2[:r].sum()) for r in ranks], rel=1e-5)
    assert den == pytest.approx(float(g.double().pow(2).sum()), rel=1e-9)


def test_top_shares_reads_every_rank_of_one_spectrum_and_a_matrix_sent_dense_carries_all(monkeypatch):
    from hetcomm import lowrank_share

    spectrum = [10.0 * 0.8 ** i for i in range(30)]
    gen = torch.Generator().manual_seed(3)
    for rows, cols in ((90, 50), (400, 300)):  # exact; the range finder (for the largest rank, 16 + 10 columns)
        g = _planted(rows, cols, spectrum, rows).float()
        nums, den = lowrank_share.top_shares(g, [4, 8, 16], gen)
        for r, num in zip((4, 8, 16), nums):
            want = sum(s * s for s in spectrum[:r]) / sum(s * s for s in spectrum)
            assert num / den == pytest.approx(want, abs=1e-6 if min(rows, cols) <= 256 else 2e-3), (rows, r)
    # a 40 x 12 matrix is approximated at rank 4 (2 * 52 * 4 < 480) but sent dense at 8 and 16: there its share is 1
    assert lowrank_share.compressed_at(40, 12, 4) and not lowrank_share.compressed_at(40, 12, 8)
    m = _planted(40, 12, [1.0] * 12, 5).float()
    for name, value in (("FIRST", 1), ("FIRST_SPAN", 0), ("EVERY", 1)):
        monkeypatch.setattr(lowrank_share, name, value)
    reading = lowrank_share.LowrankShare()
    reading.add(m.reshape(-1), torch.tensor([[0, 40, 12, 4]]), [4, 8, 16])
    reading.end_step(1, 16, 0)
    assert reading.last["ladder"] == [pytest.approx(4 / 12, abs=1e-6), 1.0, 1.0] and not reading.warned


def test_the_rank_ladder_takes_the_smallest_rank_that_carries_enough_and_keeps_q_s_first_columns():
    from hetcomm import lowrank_ladder, lowrank_layout

    bar = lowrank_ladder.RUNG_BAR
    for shares, want in (([bar, 1.0, 1.0], 4), ([bar - 1e-3, bar, 1.0], 8), ([0.5, 0.7, 0.9], 16)):
        ladder = lowrank_ladder.RankLadder(None)
        assert ladder.pending and ladder.rank == 16 and ladder.ranks == [4, 8, 16]  # the top until it chooses
        assert ladder.choose(shares, 30) == want and ladder.rank == want and not ladder.pending
        again = lowrank_ladder.RankLadder(None)
        again.load_state_dict(ladder.state_dict())
        assert again.describe() == ladder.describe()
        given = lowrank_ladder.RankLadder(2)  # a rank given is fixed, and a ladder's saved choice does not move it
        given.load_state_dict(ladder.state_dict())
        assert given.state == "fixed" and given.rank == 2
    legacy = lowrank_ladder.RankLadder(None)  # a state saved before the ladder ran lowrank's default, rank 4: on at 4
    legacy.load_state_dict(None)
    assert legacy.state == "chosen" and legacy.rank == 4 and legacy.shares is None
    # Q at rank 16 -> 4: each matrix keeps its first 4 columns (orthonormal already: Gram-Schmidt keeps them);
    # -> 8: its 4 and 4 drawn from the bucket's stream, then orthonormal; the dense part holds no Q
    old = torch.tensor([[0, 64, 32, 4], [2048, 1, 10, 0], [2058, 48, 48, 4]])
    new = torch.tensor([[0, 64, 32, 8], [2048, 1, 10, 0], [2058, 48, 48, 8]])
    q = torch.randn(_C.lowrank_q_numel(old))
    _C.orthonormalize_blocks(q, [(0, 32, 4), (128, 48, 4)], 0.0)
    wider = lowrank_layout.q_at(q, old, new, "k")
    assert torch.equal(wider, lowrank_layout.q_at(q, old, new, "k"))  # the same on every rank
    for (o_off, n_off, cols) in ((0, 0, 32), (128, 256, 48)):
        before = q[o_off:o_off + cols * 4].view(cols, 4)
        after = wider[n_off:n_off + cols * 8].view(cols, 8)
        torch.testing.assert_close(after[:, :4], before, atol=1e-6, rtol=0)
        torch.testing.assert_close(after.t() @ after, torch.eye(8), atol=1e-5, rtol=0)
    narrower = lowrank_layout.q_at(wider, new, old, "k")
    torch.testing.assert_close(narrower, q, atol=1e-6, rtol=0)


def _ladder_run(rank, world, subspace, steps, ckpt=None, save_at=None, resume=False):
    """Default lowrank (the rank chosen) on a Linear(64, 128) whose inputs lie
    in a ``subspace``-dimensional subspace (its weight gradient has at most
    that rank); share windows of steps 4-6, 20-22 (every step). ``ckpt``: saved
    after ``save_at`` steps; ``resume``: the run goes on from it."""
    from hetcomm import lowrank_share

    lowrank_share.FIRST, lowrank_share.FIRST_SPAN, lowrank_share.EVERY, lowrank_share.LATER = 4, 2, 1, 20
    lowrank_share.SPAN = 2
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128)
    ddp = DDP(model)
    state = hetcomm.HookState("lowrank", min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.02, momentum=0.9)
    basis = torch.randn(subspace, 64, generator=torch.Generator().manual_seed(7))
    first = 0
    if resume:
        saved = torch.load(f"{ckpt}/{rank}.pt", weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state.load_state_dict(saved["hetcomm"])
        first = save_at
    ranks, sent = [], []
    for step in range(first, steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(32, subspace, generator=g) @ basis, torch.randn(32, 128, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        ranks.append(state.stats()["lowrank_rank"]["rank"])
        sent.append(state.stats()["last_step"]["bytes_sent"])
        if ckpt is not None and not resume and step + 1 == save_at:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "hetcomm": state.state_dict()},
                       f"{ckpt}/{rank}.pt")
    out = {"ranks": ranks, "sent": sent, "ladder": state.stats()["lowrank_rank"], "share": state.stats().get("lowrank_share"),
           "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
    state.close()
    return out


@pytest.mark.parametrize("subspace, chosen", [(3, 4), (64, 16)])
def test_default_lowrank_runs_its_top_rank_then_the_one_its_reading_chose_and_resumes_bit_for_bit(tmp_path, subspace,
                                                                                                   chosen):
    runs = run_ranks(_ladder_run, 2, subspace, 24)
    r0 = runs[0]
    assert torch.equal(runs[1]["params"], r0["params"])  # replicas identical
    assert r0["ladder"]["state"] == "chosen" and r0["ladder"]["rank"] == chosen and r0["ladder"]["step"] == 6
    shares = r0["ladder"]["shares"]  # the ranks' lowest, at 4 / 8 / 16
    if chosen == 4:  # a gradient of rank 3: all of it in the top 4
        assert shares[0] > 0.999
    else:  # 64 samples of noise a rank: even 16 carries under the bar
        assert shares[2] < ladder_bar()
    assert r0["ranks"][:6] == [16] * 6 and r0["ranks"][7:] == [chosen] * 17  # chosen at step 7's start
    if chosen == 4:  # P and Q a quarter of rank 16's, the bias (dense) the same
        assert r0["sent"][10] < 0.4 * r0["sent"][3]
    assert r0["share"]["step"] == 22 and r0["share"]["rank"] == chosen and "ladder" not in r0["share"]
    # resumed inside the window (after step 5: two of its readings saved), with the window closed and the choice
    # not yet made (after step 6: the resumed run chooses, and its Q keeps the first columns of the saved rank-16
    # Q), and after the choice (step 9)
    for save_at in (5, 7, 9):
        ckpt = tmp_path / f"c{save_at}"
        ckpt.mkdir()
        run_ranks(_ladder_run, 2, subspace, save_at, str(ckpt), save_at)
        resumed = run_ranks(_ladder_run, 2, subspace, 24, str(ckpt), save_at, True)
        assert torch.equal(resumed[0]["params"], r0["params"]), save_at
        assert resumed[0]["ladder"] == r0["ladder"]


def ladder_bar():
    from hetcomm import lowrank_ladder

    return lowrank_ladder.RUNG_BAR


class _Gathers:
    """An engine stand-in whose all-gather returns this rank's row under the other ranks' given rows."""

    def __init__(self, others):
        self.others, self.rows = others, []

    def submit_config(self, row):
        self.rows.append(row.tolist())
        gathered = torch.stack([row] + [torch.tensor(o, dtype=torch.int64) for o in self.others])
        return types.SimpleNamespace(wait=lambda: gathered)


def test_lowrank_rounds_that_measured_nothing_open_another_window_when_lowrank_runs(monkeypatch):
    # auto admits lowrank at step 30 or later: a window where some rank ran no step of an arm decides pipelined for
    # now; a window from the step the caller reopens it at (A B B A from there) measures, and decides when its 20
    # steps are over. At most AGAIN more windows; the window's start and their count are saved.
    from hetcomm import lowrank_rounds
    clock = [0.0]
    monkeypatch.setattr(lowrank_rounds.time, "monotonic", lambda: clock[0])
    trial = lowrank_rounds.RoundsTrial(True)
    nothing = _Gathers([[31, -1, -1]])
    for step in range(1, 32):
        trial.open_step(step, nothing, counts=False)  # auto ran int3 through steps 11-30
        clock[0] += 0.040
    assert trial.choice == "pipelined" and trial.medians is None and trial.unmeasured
    assert not lowrank_rounds.RoundsTrial(True).unmeasured  # (not decided yet)
    trial.reopen(45)
    assert trial.pending and trial.again == 1 and not trial.unmeasured
    assert [s for s in range(40, 70) if trial.hold(s)] == [46, 47, 50, 51, 54, 55, 58, 59, 62, 63]
    saved = trial.state_dict()
    assert (saved["start"], saved["again"]) == (45, 1)
    engine = _Gathers([[65, int(0.050e9), int(0.020e9)]])
    for step in range(45, 66):
        trial.open_step(step, engine)
        clock[0] += 0.030 if trial.hold(step) else 0.040
    assert engine.rows == [[65, 40_000_000, 30_000_000]]
    assert trial.choice == "together" and trial.medians == pytest.approx({"pipelined": 0.050, "together": 0.030})
    assert not trial.unmeasured  # measured: no window more
    resumed = lowrank_rounds.RoundsTrial(True)  # resumed inside the reopened window: its steps and turns
    resumed.load_state_dict(saved)
    assert resumed.pending and resumed.again == 1 and [s for s in range(44, 48) if resumed.hold(s)] == [46, 47]
    capped = lowrank_rounds.RoundsTrial(True)
    capped._decide(_Gathers([[31, -1, -1]]), 31)
    for k in range(lowrank_rounds.AGAIN):
        assert capped.unmeasured
        capped.reopen(100 * (k + 1))
        capped._decide(_Gathers([[100 * (k + 1) + 20, -1, -1]]), 100 * (k + 1) + 20)
    assert capped.choice == "pipelined" and not capped.unmeasured


def test_lowrank_rounds_measure_both_schedules_in_turns_and_the_slowest_ranks_medians_decide(monkeypatch):
    from hetcomm import lowrank_rounds
    clock = [0.0]
    monkeypatch.setattr(lowrank_rounds.time, "monotonic", lambda: clock[0])
    trial = lowrank_rounds.RoundsTrial(True, start_iter=1)
    # A B B A from step 11: pipelined 11, 14, 15, 18, ...; together 12, 13, 16, 17, ...
    assert [s for s in range(9, 33) if trial.hold(s)] == [12, 13, 16, 17, 20, 21, 24, 25, 28, 29]
    other = [31, int(0.050e9), int(0.020e9)]  # the other rank: together 20 ms, pipelined 50 ms
    engine = _Gathers([other])
    for step in range(1, 32):
        trial.open_step(step, engine)
        clock[0] += 0.030 if trial.hold(step) else 0.040  # this rank: together 30 ms, pipelined 40 ms
    assert trial.times["pipelined"] == pytest.approx([0.040] * 10) and trial.times["together"] == pytest.approx([0.030] * 10)
    assert engine.rows == [[31, 40_000_000, 30_000_000]]  # one all-gather, at step 31
    assert trial.choice == "together" and trial.medians == pytest.approx({"pipelined": 0.050, "together": 0.030})
    assert all(trial.hold(s) for s in (32, 1000))  # every step from now on
    # the slowest rank's medians decide: a rank where together is slower turns the choice
    again = lowrank_rounds.RoundsTrial(True)
    again.load_state_dict({**trial.state_dict(), "choice": None, "medians": None})
    again._decide(_Gathers([[31, int(0.041e9), int(0.045e9)]]), 31)
    assert again.choice == "pipelined" and again.medians == pytest.approx({"pipelined": 0.041, "together": 0.045})
    # ... but only past the margin: pipelined at 0.96x together's is no reason to leave it (PIPELINED_MARGIN 0.95)
    close = lowrank_rounds.RoundsTrial(True)
    close.load_state_dict({**trial.state_dict(), "choice": None, "medians": None})
    close._decide(_Gathers([[31, int(0.043e9), int(0.045e9)]]), 31)
    assert close.choice == "together" and close.medians == pytest.approx({"pipelined": 0.043, "together": 0.045})
    assert 0.043 / 0.045 > lowrank_rounds.PIPELINED_MARGIN > 0.041 / 0.045
    # a rank with no time for an arm: pipelined (the engine's default); ranks at different steps: an error
    empty = lowrank_rounds.RoundsTrial(True)
    empty._decide(_Gathers([[31, -1, 5]]), 31)
    assert empty.choice == "pipelined" and not empty.hold(20)
    with pytest.raises(ValueError, match="different steps"):
        lowrank_rounds.RoundsTrial(True)._decide(_Gathers([[30, 1, 1]]), 31)
    # resumed: the choice and the times; a state from before the trial ran pipelined and stays so
    resumed = lowrank_rounds.RoundsTrial(True)
    resumed.load_state_dict(trial.state_dict())
    assert resumed.choice == "together" and resumed.times == trial.times
    old = lowrank_rounds.RoundsTrial(True)
    old.load_state_dict(None)
    assert old.choice == "pipelined" and not old.pending and not old.unmeasured
    assert not lowrank_rounds.RoundsTrial(False).pending  # other modes: nothing to measure
    # auto: a step that ran another compressed plan is not counted (steps 12 and 15 here)
    mixed = lowrank_rounds.RoundsTrial(True)
    for step in range(1, 17):
        mixed.open_step(step, engine, counts=step - 1 not in (12, 15))
        clock[0] += 0.030 if mixed.hold(step) else 0.040
    assert mixed.times["pipelined"] == pytest.approx([0.040, 0.040])
    assert mixed.times["together"] == pytest.approx([0.030])
    mixed.settle()  # auto without lowrank: pipelined, nothing gathered, no window to open later
    assert mixed.choice == "pipelined" and len(engine.rows) == 1 and not mixed.unmeasured
