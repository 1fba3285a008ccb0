"""A parameter this rank's backward did not reach (``find_unused_parameters``,
Lightning's ``toggle_optimizer``): its error feedback is held back for the
step, not lost into a slot DDP throws away (hetcomm.unused); and lowrank's
warm start survives a matrix whose gradient was zero on every rank."""

import math
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import discards, topology, unused
from hetcomm.bucket_keys import sig_of

from . import models
from .dist_harness import each_mode, run_ranks
from .test_ddp_options import _GanPair, _toggled

HOLD_MODES = ["int3", "fp8", "onebit", "topk", "lowrank"]


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.a(h).square().mean() + (self.b(h).square().mean() if use_b else 0.0)


#: per step, whether each rank uses head b (rank 0 alone leaves it at step 3)
_USE_B = [True, True, False, None, True]


def _slots(state, model, world, rank):
    """Each parameter's slice of its bucket's residual by name, and of the
    server's residual (three or more ranks, or nodes: this rank's segment of
    the sum) by "server " and name, where the residual holds some of it: a
    hierarchical plan's holds this rank's shard of its node's sum (one bucket)."""
    index = state._buckets.params
    (key, residual), = state._buckets.residuals.items()
    server = state._buckets.server_residuals.get(key)
    sig = sig_of(key)
    numel = sum(math.prod(index.shapes[n]) for n in sig)
    hierarchical = residual.numel() != numel
    node_of = list(state.topology.node_ids) if hierarchical else []
    bases = hetcomm._C.state_offsets(numel, world, rank, node_of, hierarchical)
    out, off = {}, 0
    for n in sig:
        size = math.prod(index.shapes[n])
        name = next(k for k, p in model.named_parameters() if p is index.param(n))
        for prefix, r, base in (("", residual, 0 if not hierarchical else bases[0]), ("server ", server, bases[1])):
            if r is not None:
                lo, hi = max(off, base), min(off + size, base + r.numel())
                if lo < hi:
                    out[prefix + name] = r[lo - base:hi - base].clone()
        off += size
    return out


def _held(rank, world, mode, hold, algorithm):
    """Head b of one bucket used as _USE_B says; each step's residual slots by name (after the step). The
    hierarchical runs: two nodes of two ranks (HETCOMM_NODE)."""
    if not hold:  # the path before hetcomm.unused: every slot's message carries its residual
        unused.UnusedParams.unused = lambda self, sig, param_of: []
    if algorithm == "hierarchical":
        os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    net = _TwoHeads()
    ddp = DDP(net, find_unused_parameters=True)
    state = hetcomm.HookState(mode, start_iter=0, min_compress_numel=0, algorithm=algorithm)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)  # each gradient applied (at lr 0: the same inputs each step)
    slots = []
    for step, use in enumerate(_USE_B):
        opt.zero_grad(set_to_none=True)
        ddp(models.batch(rank, step, 8)[0], rank != 0 if use is None else use).backward()
        opt.step()
        slots.append(_slots(state, net, world, rank))
    state.close()
    return slots


@pytest.mark.parametrize("hold", [True, False])
@pytest.mark.parametrize("algorithm", ["native", "hierarchical"])
def test_a_parameter_no_rank_used_keeps_what_error_feedback_owes_it(algorithm, hold):
    """Three ranks (native: flat), or two nodes of two (hierarchical: each rank's
    residual is of its shard of the node's sum). Step 2: head b unused on
    every rank. Its residual slots stay as they were to the bit (held back:
    DDP writes no gradient of it back), and so do those of the server's
    residual (the two-phase codecs' segment of the sum), while head a's move;
    without the hold (the old path) they move too, and what they repaid was
    lost. Step 3, flat: rank 0 alone leaves b unused: the codecs that send a
    zero exactly (int3, fp8, topk) leave its slots as they were, and step 4
    repays them."""
    modes = HOLD_MODES if algorithm == "native" else ["int3", "fp8", "onebit", "lowrank"]
    results = run_ranks(each_mode, 3 if algorithm == "native" else 4, _held, modes, hold, algorithm)
    for mode in modes:
        servers = seen = 0
        for rank, slots in enumerate(r[mode] for r in results):
            before, after = slots[1], slots[2]
            assert any(not torch.equal(before[k], after[k]) for k in before if "b." not in k), (mode, rank)
            names = [k for k in before if k.endswith(("b.weight", "b.bias"))]
            servers += sum(k.startswith("server ") for k in names)
            for name in names:
                seen += 1
                if hold or mode != "topk":  # (top-k may leave a small residual unsent either way)
                    assert before[name].abs().sum() > 0, (mode, rank, name)  # it owed something
                    assert torch.equal(before[name], after[name]) == hold, (mode, rank, name)
            if hold and rank == 0 and mode in ("int3", "fp8", "topk") and algorithm == "native":
                assert torch.equal(slots[3]["b.weight"], slots[2]["b.weight"]), mode
                assert not torch.equal(slots[4]["b.weight"], slots[3]["b.weight"]), mode
        assert seen > 0, mode
        assert (servers > 0) == (mode in ("int3", "fp8", "onebit") and algorithm == "native"), (mode, servers)


GAN_STEPS = 20


def _gan(rank, world, mode, hold):
    """Lightning's GAN loop (tests.test_ddp_options._toggled) on one DDP model; the pair's final parameters."""
    if not hold:
        unused.UnusedParams.unused = lambda self, sig, param_of: []
    pair = _GanPair()
    start = models.flat_params(pair)
    ddp = DDP(pair, find_unused_parameters=True)
    state = None
    if mode != "torch":
        state = hetcomm.HookState(mode, min_compress_numel=0)
        ddp.register_comm_hook(state, hetcomm.hook)
    opt_d = torch.optim.SGD(pair.d.parameters(), lr=0.05, momentum=0.9)
    opt_g = torch.optim.SGD(pair.g.parameters(), lr=0.05)
    for step in range(GAN_STEPS):
        _toggled(rank, opt_d, opt_g, pair, ddp, step)
    if state is not None:
        state.close()
    return {"final": models.flat_params(pair), "start": start}


def test_the_toggle_loop_in_one_ddp_model_follows_fp32():
    """Lightning's toggle_optimizer loop, generator and discriminator in one
    DDP model: with the switched-off parameters' error feedback held back,
    int3 and lowrank end within a third of the distance to fp32's weights
    that the old path (their repayments lost) ended at (measured by
    bench/discarded_gradient.py at 60 steps: 0.011 against 0.112 of fp32's
    travel with int3, 0.0034 against 0.027 with lowrank)."""
    held = run_ranks(each_mode, 2, _gan, ["torch", "int3", "lowrank"], True)[0]
    lost = run_ranks(each_mode, 2, _gan, ["int3", "lowrank"], False)[0]
    ref = held["torch"]["final"]
    travel = (ref - held["torch"]["start"]).norm()
    for mode in ("int3", "lowrank"):
        now, before = ((r[mode]["final"] - ref).norm() / travel for r in (held, lost))
        assert now < before / 3, (mode, float(now), float(before))


def _zero_at_first(rank, world, exact):
    """A 64 x 64 layer b that no rank uses in lowrank's first step (rank 4, from step 0), used after:
    b's reduced gradient at each step (SGD at lr 0: the parameters stay)."""
    torch.manual_seed(0)
    net = _TwoHeads()
    ddp = DDP(net, find_unused_parameters=True)
    if not exact:
        state = hetcomm.HookState("lowrank", start_iter=0, min_compress_numel=0, matrix_approximation_rank=4)
        ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    grads = []
    for step in range(4):
        opt.zero_grad(set_to_none=True)
        ddp(models.batch(rank, step, 2)[0], step > 0).backward()  # 2 samples a rank: b's gradient has rank <= 4
        grads.append(None if net.b.weight.grad is None else net.b.weight.grad.clone())
        opt.step()
    if not exact:
        state.close()
    return grads


def test_lowrank_approximates_a_matrix_that_was_zero_on_every_rank():
    """lowrank's warm start Q is the summed P^T M of the step before: where a
    matrix's M was zero on every rank it was zero, and Gram-Schmidt leaves a
    zero column zero, so every later approximation of that matrix was zero
    (its gradient lost to a residual that only grew). Q now keeps its columns
    there: from the next step the rank-4 approximation of a gradient of rank
    <= 4 comes close to the exact mean."""
    exact = run_ranks(_zero_at_first, 2, True)[0]
    approx = run_ranks(_zero_at_first, 2, False)[0]
    assert exact[0] is None and approx[0] is None  # no rank used b at step 0: DDP left it None
    for step in (2, 3):
        err = (approx[step] - exact[step]).norm() / exact[step].norm()
        assert err < 0.5, (step, float(err))


def test_switched_off_parameters_are_warned_of_where_their_plan_cannot_hold_them(caplog):
    """hetcomm.discards' warning of parameters that do not require a gradient
    in a stateful bucket: given where the plan does not hold their error
    feedback back (under the attached momentum), not where it does."""
    on, off = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2), requires_grad=False)
    for held in (True, False):
        watch = discards.DiscardWatch()
        caplog.clear()
        with caplog.at_level("WARNING", logger="hetcomm"):
            watch.see(0, 0, [on, off], "int3", unused_held=held)
        watch.close()
        assert ("do not require a gradient" in caplog.text) != held, held
