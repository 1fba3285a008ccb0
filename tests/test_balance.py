"""Throughput-proportional batch split, the uneven sampler and collective rebalancing."""

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hetcomm
from hetcomm.balance import Balancer, ThroughputMeter, UnevenBatchSampler, split_batch

from . import models
from .dist_harness import run_ranks

speeds = st.lists(st.floats(min_value=0.01, max_value=1000.0), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None)
@given(speeds, st.integers(min_value=1, max_value=5000))
def test_split_sums_and_is_proportional(ts, extra):
    b = len(ts) + extra
    sizes = split_batch(b, ts)
    assert sum(sizes) == b and all(s >= 1 for s in sizes)
    # no rank is more than one sample past the proportional step time
    step = max(s / t for s, t in zip(sizes, ts))
    assert step <= max(max(b / sum(ts), 1 / t) + 1 / t for t in ts) + 1e-9
    # ... and faster ranks never get fewer samples
    assert all(sizes[i] >= sizes[j] for i in range(len(ts)) for j in range(len(ts)) if ts[i] > ts[j])
    assert split_batch(b, ts) == sizes  # deterministic


def _min_step(b, ts):
    """The smallest step time max(b_i / t_i) over every split of b into sizes >= 1 (brute force)."""
    if len(ts) == 1:
        return b / ts[0]
    return min(max(c / ts[0], _min_step(b - c, ts[1:])) for c in range(1, b - len(ts) + 2))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([0.5, 1.0, 1.3, 2.0, 3.0, 4.0, 7.0, 10.0, 100.0]), min_size=1, max_size=4),
       st.integers(min_value=0, max_value=26))
def test_split_minimises_the_step_time(ts, extra):
    b = len(ts) + extra
    sizes = split_batch(b, ts)
    assert max(s / t for s, t in zip(sizes, ts)) == pytest.approx(_min_step(b, ts), rel=1e-12), sizes


@settings(max_examples=300, deadline=None)
@given(speeds, st.data())
def test_split_respects_caps(ts, data):
    caps = [data.draw(st.integers(min_value=1, max_value=200)) for _ in ts]
    b = data.draw(st.integers(min_value=len(ts), max_value=sum(caps)))
    sizes = split_batch(b, ts, caps)
    assert sum(sizes) == b
    assert all(1 <= s <= c for s, c in zip(sizes, caps))
    # an uncapped rank never gets less than a capped slower... : ranks below their cap share in proportion
    free = [i for i, (s, c) in enumerate(zip(sizes, caps)) if s < c]
    for i in free:
        for j in free:
            if ts[i] > ts[j]:
                assert sizes[i] >= sizes[j] - 1


def test_split_rejects_bad_input():
    with pytest.raises(ValueError, match="global_batch"):
        split_batch(2, [1, 1, 1])
    with pytest.raises(ValueError, match="throughputs"):
        split_batch(10, [1, 0])
    with pytest.raises(ValueError, match="caps sum"):
        split_batch(10, [1, 1], caps=[4, 4])


def test_split_example():
    assert split_batch(100, [1, 3]) == [25, 75]
    assert split_batch(10, [1, 1, 1]) == [4, 3, 3]
    assert split_batch(64, [1, 2, 4]) == [9, 18, 37]  # the slowest rank 9 units, the fastest 9.25
    # largest remainder gives 26/2 (0.286 time units); the step is shorter with 27/1 (0.27)
    assert split_batch(28, [100, 7]) == [27, 1]
    # the floor of one sample per rank overshoots; the pinned rank gives one back
    assert split_batch(3, [1000, 1, 1], caps=[2, 5, 5]) == [1, 1, 1]
    assert split_batch(8, [1, 1, 1, 8, 1, 9], caps=[1, 1, 1, 4, 1, 2]) == [1, 1, 1, 2, 1, 2]
    # speeds one ulp apart: 2 / 999.9999999999999 rounds to 2 / 1000, a tie the faster rank wins (hypothesis found it)
    assert split_batch(3, [999.9999999999999, 1000.0]) == [1, 2]


def test_meter_smooths():
    m = ThroughputMeter(alpha=0.5)
    m.update(10, 1.0)
    m.update(30, 1.0)
    assert m.rate == pytest.approx(20.0)


@pytest.mark.parametrize("n,sizes", [(1000, [5, 17, 9]), (1001, [5, 17, 9]), (62, [5, 17, 9]), (32, [1, 1, 29])])
def test_sampler_covers_every_index_once_with_equal_steps(n, sizes):
    world = len(sizes)
    for epoch in range(2):
        seen, steps = [], []
        for r in range(world):
            s = UnevenBatchSampler(n, sizes, r, seed=3)
            s.set_epoch(epoch)
            batches = list(s)
            steps.append(len(batches))
            assert all(len(b) >= 1 for b in batches)
            assert [len(b) for b in batches[:-1]] == [sizes[r]] * (len(batches) - 1)
            seen += [i for b in batches for i in b]
        assert len(set(steps)) == 1 and steps[0] == n // sum(sizes)
        assert sorted(seen) == list(range(n))


def test_sampler_split_change_mid_epoch():
    n, world = 500, 2
    samplers = [UnevenBatchSampler(n, [10, 10], r) for r in range(world)]
    its = [iter(s) for s in samplers]
    out = [[next(it) for _ in range(3)] for it in its]
    for s in samplers:
        s.set_batch_sizes([5, 15], from_step=4)
        with pytest.raises(ValueError, match="already handed out"):
            s.set_batch_sizes([5, 15], from_step=2)
        with pytest.raises(ValueError, match="global batch must stay"):
            s.set_batch_sizes([5, 16], from_step=6)
    for r, it in enumerate(its):
        out[r] += list(it)
    assert [len(b) for b in out[0]][:6] == [10, 10, 10, 10, 5, 5]
    assert [len(b) for b in out[1]][:6] == [10, 10, 10, 10, 15, 15]
    assert len(out[0]) == len(out[1]) == 25
    assert sorted(i for r in range(world) for b in out[r] for i in b) == list(range(n))


def _balanced(rank, world, per_sample_s, device="cpu", steps=40, slow_down=None):
    """``slow_down=(step, per_sample_s)``: from that step on the ranks' compute
    takes the new per-sample times (throttling, a co-tenant)."""
    model = models.mlp()
    ddp = models.ddp(model, rank, device)
    state = hetcomm.HookState("none")
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    data_x, data_y = (t.to(models.rank_device(rank, device)) for t in models.batch(0, 0, 4000))
    bal = Balancer(state, global_batch=60, dataset_len=4000, rebalance_every=5, lag=1)
    for step, idx in zip(range(steps), bal.sampler):
        if slow_down is not None and step == slow_down[0]:
            per_sample_s = slow_down[1]
        with bal.step(len(idx)):
            loss = torch.nn.functional.cross_entropy(ddp(data_x[idx]), data_y[idx])
            if device == "cuda":  # this rank's (slow) compute, on the GPU: the host does not wait for it
                torch.cuda._sleep(int(per_sample_s[rank] * len(idx) * 1e9))
            else:
                time.sleep(per_sample_s[rank] * len(idx))
            loss.backward()
        opt.step()
        opt.zero_grad()
    return {"history": [(s, sizes) for s, sizes, _ in bal.history], "sizes": bal.sizes,
            "params": models.flat_params(model)}


@pytest.mark.parametrize("place", ["cpu-gloo", pytest.param("cuda-nccl", marks=pytest.mark.cuda2)], indirect=True)
def test_rebalancing_is_identical_on_every_rank_and_follows_speed(place):
    """On GPUs the slow rank's extra work is GPU time the host never waits
    for: the Balancer must time it with CUDA events to see it."""
    res = place.run(_balanced, 2, PER_SAMPLE, place.device)
    assert res[0]["history"] == res[1]["history"] and res[0]["history"]
    assert res[0]["sizes"] == res[1]["sizes"]
    b0, b1 = res[0]["sizes"]
    assert 2.0 < b0 / b1 < 4.5, res[0]["sizes"]  # about 3:1
    assert torch.equal(res[0]["params"], res[1]["params"])


PER_SAMPLE = [0.0005, 0.0015]  # rank 1 is 3x slower


def test_rebalancing_follows_a_rank_that_slows_down_mid_run():
    """Both ranks equally fast, then rank 0 becomes 3x slower at step 30: the
    split must follow within a few rebalance periods (every 5 steps here)."""
    res = run_ranks(_balanced, 2, [0.001, 0.001], "cpu", 70, (30, [0.003, 0.001]))
    assert res[0]["history"] == res[1]["history"]
    before = [sizes for step, sizes in res[0]["history"] if step <= 30]
    after = [(step, sizes) for step, sizes in res[0]["history"] if step > 30]
    assert not before or all(0.6 < b0 / b1 < 1.6 for b0, b1 in before), before
    assert after and after[0][0] <= 45, after  # adopted within 3 periods of the change
    b0, b1 = res[0]["sizes"]
    assert 1 / 4.5 < b0 / b1 < 1 / 2.0, res[0]["sizes"]  # about 1:3
    assert torch.equal(res[0]["params"], res[1]["params"])
