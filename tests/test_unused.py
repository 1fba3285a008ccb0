"""A parameter no rank used in a step (``find_unused_parameters``,
Lightning's ``toggle_optimizer``): its slots of the state are put back after
the backward, not lost into a slot DDP throws away, and left to the ordinary
reduction where another rank used it (hetcomm.unused); and lowrank's warm
start survives a matrix whose gradient was zero on every rank."""

import math
import os

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import lowrank_layout, topology, unused
from hetcomm.bucket_keys import sig_of

from . import models
from .dist_harness import each_mode, run_ranks
from .test_cli import _bench_script
from .test_ddp_options import _GanPair, _toggled

UNDO_MODES = ["int3", "fp8", "onebit", "topk", "lowrank"]


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, x, use_b):
        h = torch.relu(self.body(x))
        return self.a(h).square().mean() + (self.b(h).square().mean() if use_b else 0.0)


#: per step, whether each rank uses head b (None: rank 0 alone leaves it, at step 2; no rank uses it at step 3)
_USE_B = [True, True, None, False, True]


def _slots(state, model, world, rank):
    """Each parameter's slice of its bucket's residual by name, of the
    server's residual (three or more ranks, or nodes: this rank's segment of
    the sum) by "server " and name, where the residual holds some of it (a
    hierarchical plan's holds this rank's shard of its node's sum), and of
    the attached momentum by "momentum " and name (one bucket), and of
    lowrank's Q by "q " and name (a matrix approximated at a rank)."""
    index = state._buckets.params
    (key, residual), = state._buckets.residuals.items()
    server = state._buckets.server_residuals.get(key)
    momentum = state._buckets.momentum.get(key)
    sig = sig_of(key)
    numel = sum(math.prod(index.shapes[n]) for n in sig)
    q, layout = state._buckets.lowrank_q.get(key), state._buckets.layouts.get(key)
    spans = {} if q is None or layout is None else lowrank_layout.q_slots(
        [torch.empty(math.prod(index.shapes[n])) for n in sig], layout[1], q)
    qs = {i: t[off:off + size].clone() for i, [(t, off, size)] in spans.items()}
    hierarchical = residual.numel() != numel
    node_of = list(state.topology.node_ids) if hierarchical else []
    bases = hetcomm._C.state_offsets(numel, world, rank, node_of, hierarchical)
    out, off = {}, 0
    for i, n in enumerate(sig):
        size = math.prod(index.shapes[n])
        name = next(k for k, p in model.named_parameters() if p is index.param(n))
        if i in qs:
            out["q " + name] = qs[i]
        for prefix, r, base in (("", residual, 0 if not hierarchical else bases[0]), ("server ", server, bases[1]),
                                ("momentum ", momentum, 0)):
            if r is not None:
                lo, hi = max(off, base), min(off + size, base + r.numel())
                if lo < hi:
                    out[prefix + name] = r[lo - base:hi - base].clone()
        off += size
    return out


def _run_heads(rank, world, mode, undo, algorithm, attached=False):
    """Head b of one bucket used as _USE_B says; each step's state slots by name (after the step), and with
    ``attached`` (SGD's momentum compressed) the optimizer's momentum buffer of b.weight. The hierarchical
    runs: two nodes of two ranks (HETCOMM_NODE)."""
    if not undo:  # no slot kept: every slot's message carries its state, as before hetcomm.unused
        unused.UnusedParams.unused = lambda self, sig, param_of: []
    if algorithm == "hierarchical":
        os.environ[topology.ENV_NODE] = f"node{rank // 2}"
    net = _TwoHeads()
    ddp = DDP(net, find_unused_parameters=True)
    # (lowrank at rank 4: its matrices approximated, each with its Q)
    state = hetcomm.HookState(mode, start_iter=0, min_compress_numel=0, algorithm=algorithm, **models.fixed_rank(mode))
    # each gradient applied (at lr 0: the same inputs each step)
    opt = torch.optim.SGD(net.parameters(), lr=0.0, momentum=0.9 if attached else 0.0)
    if attached:
        state.attach_optimizer(opt)
    ddp.register_comm_hook(state, hetcomm.hook)
    slots, buffers = [], []
    for step, use in enumerate(_USE_B):
        opt.zero_grad(set_to_none=True)
        ddp(models.batch(rank, step, 8)[0], rank != 0 if use is None else use).backward()
        opt.step()
        slots.append(_slots(state, net, world, rank))
        buffers.append(opt.state[net.b.weight].get("momentum_buffer") if attached else None)
        if buffers[-1] is not None:
            buffers[-1] = buffers[-1].clone()
    state.close()
    return {"slots": slots, "buffers": buffers}


def _check_undone(modes, undone, plain, attached=False):
    """Step 3 (no rank used b): b's slots stay as step 2 left them, to the
    bit, in every state kept (residual, server's, momentum), while a's move;
    without the undo they move too (top-k may leave a small residual unsent
    either way). Step 2 (rank 0 alone left b unused): every slot as the
    plain path leaves it (nothing put back where another rank used it).
    Returns how many server slots were seen per mode."""
    servers = {}
    for mode in modes:
        seen = servers[mode] = 0
        for rank, (mine, theirs) in enumerate(zip((r[mode]["slots"] for r in undone),
                                                  (r[mode]["slots"] for r in plain))):
            assert mine[2].keys() == theirs[2].keys() and all(
                torch.equal(mine[2][k], theirs[2][k]) for k in mine[2]), (mode, rank)
            for run, undo in ((mine, True), (theirs, False)):
                before, after = run[2], run[3]
                assert any(not torch.equal(before[k], after[k]) for k in before if "b." not in k), (mode, rank)
                names = [k for k in before if k.endswith(("b.weight", "b.bias"))]
                if undo:
                    servers[mode] += sum(k.startswith("server ") for k in names)
                for name in names:
                    seen += 1
                    if undo or mode != "topk":
                        assert before[name].abs().sum() > 0, (mode, rank, name)  # it owed something
                        assert torch.equal(before[name], after[name]) == undo, (mode, rank, name, undo)
            assert not attached or all(k in mine[3] for k in ("momentum b.weight", "momentum a.weight")), mode
        assert seen > 0, mode
    return servers


@pytest.mark.parametrize("algorithm", ["native", "hierarchical"])
def test_a_parameter_no_rank_used_gets_its_slots_back_after_the_backward(algorithm):
    """Three ranks (native: flat), or two nodes of two (hierarchical: each
    rank's residual is of its shard of the node's sum); every codec with
    error feedback (_check_undone). The server's residual (the two-phase
    codecs' segment of the sum) is kept too."""
    modes = UNDO_MODES if algorithm == "native" else ["int3", "fp8", "onebit", "lowrank"]
    world = 3 if algorithm == "native" else 4
    undone = run_ranks(each_mode, world, _run_heads, modes, True, algorithm)
    plain = run_ranks(each_mode, world, _run_heads, modes, False, algorithm)
    servers = _check_undone(modes, undone, plain)
    for mode in modes:
        assert (servers[mode] > 0) == (mode in ("int3", "fp8", "onebit") and algorithm == "native"), mode


def test_the_attached_momentum_of_a_parameter_no_rank_used_stays_the_optimizers():
    """Under the attached momentum (SGD's, three ranks): the step no rank used
    b, torch's SGD skips it (no gradient) and its momentum buffer stays; the
    hook's momentum of b is put back with the residuals, so it stays the
    optimizer's buffer (without the undo it decayed by beta: the compressed
    momentum and the optimizer's parted)."""
    modes = ["int3", "lowrank"]
    undone = run_ranks(each_mode, 3, _run_heads, modes, True, "native", True)
    plain = run_ranks(each_mode, 3, _run_heads, modes, False, "native", True)
    _check_undone(modes, undone, plain, attached=True)
    for mode in modes:
        for runs, undo in ((undone, True), (plain, False)):
            for r in runs:
                buffers, slots = r[mode]["buffers"], r[mode]["slots"]
                assert torch.equal(buffers[3], buffers[2]), mode  # torch's SGD skipped b at step 3
                store = slots[3]["momentum b.weight"].view_as(buffers[3])
                scale = float(buffers[3].abs().max())
                assert torch.allclose(store, buffers[3], atol=1e-5 * scale) == undo, (mode, undo)


def _grads_left(rank, world, how):
    """int3, _USE_B on two ranks, DDP's gradients kept as ``how`` says: "none" (zero_grad's default),
    "zeros" (set_to_none=False: DDP leaves the unused parameter's zeros, their version unmoved), "view"
    (gradient_as_bucket_view=True, set_to_none=False: b's gradient is its slot of the bucket). Each step's
    residual slots, and b.weight's gradient after step 3."""
    net = _TwoHeads()
    ddp = DDP(net, find_unused_parameters=True, gradient_as_bucket_view=how == "view")
    state = hetcomm.HookState("int3", start_iter=0, min_compress_numel=0)
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    slots = []
    for step, use in enumerate(_USE_B):
        opt.zero_grad(set_to_none=how == "none")
        ddp(models.batch(rank, step, 8)[0], rank != 0 if use is None else use).backward()
        if step == 3:
            grad = None if net.b.weight.grad is None else net.b.weight.grad.clone()
        opt.step()
        slots.append(_slots(state, net, world, rank))
    state.close()
    return {"slots": slots, "grad": grad}


def test_the_undo_reads_ddps_choice_from_the_gradient_it_left():
    """Whether some rank used a parameter is DDP's choice, read from its
    gradient after the backward: None where it was None, an unmoved version
    where it was a tensor (set_to_none=False), both put back. A gradient that
    is a view of the bucket (gradient_as_bucket_view) is what the hook wrote
    there, repayment included, and the optimizer applies it: nothing put back."""
    runs = run_ranks(each_mode, 2, _grads_left, ["none", "zeros", "view"])
    for r in runs:
        for how in ("none", "zeros", "view"):
            before, after = r[how]["slots"][2]["b.weight"], r[how]["slots"][3]["b.weight"]
            assert before.abs().sum() > 0, how
            assert torch.equal(before, after) == (how != "view"), how
        assert r["none"]["grad"] is None and torch.equal(r["zeros"]["grad"], torch.zeros(64, 64))
        assert r["view"]["grad"].abs().sum() > 0  # the repayment, applied


GAN_STEPS = 20


def _gan(rank, world, mode, undo):
    """Lightning's GAN loop (tests.test_ddp_options._toggled) on one DDP model; the pair's final parameters.
    ``MODE+m``: D's SGD attached (its momentum compressed)."""
    if not undo:
        unused.UnusedParams.unused = lambda self, sig, param_of: []
    pair = _GanPair()
    start = models.flat_params(pair)
    ddp = DDP(pair, find_unused_parameters=True)
    opt_d = torch.optim.SGD(pair.d.parameters(), lr=0.05, momentum=0.9)
    opt_g = torch.optim.SGD(pair.g.parameters(), lr=0.05)
    state = None
    if mode != "torch":
        state = hetcomm.HookState(mode.removesuffix("+m"), min_compress_numel=0)
        if mode.endswith("+m"):
            state.attach_optimizer(opt_d)
        ddp.register_comm_hook(state, hetcomm.hook)
    for step in range(GAN_STEPS):
        _toggled(rank, opt_d, opt_g, pair, ddp, step)
    if state is not None:
        state.close()
    return {"final": models.flat_params(pair), "start": start}


def test_the_toggle_loop_in_one_ddp_model_follows_fp32():
    """Lightning's toggle_optimizer loop, generator and discriminator in one
    DDP model: with the switched-off parameters' slots put back, int3,
    lowrank and int3 of the attached momentum end within a third of the
    distance to fp32's weights that the plain path (their repayments lost)
    ended at (bench/discarded_gradient.py at 60 steps: 0.011 against 0.112
    of fp32's travel with int3, 0.0041 against 0.027 with lowrank, 0.035
    against 0.255 with int3 of the momentum)."""
    modes = ["int3", "lowrank", "int3+m"]
    undone = run_ranks(each_mode, 2, _gan, ["torch"] + modes, True)[0]
    lost = run_ranks(each_mode, 2, _gan, modes, False)[0]
    ref = undone["torch"]["final"]
    travel = (ref - undone["torch"]["start"]).norm()
    for mode in modes:
        now, before = ((r[mode]["final"] - ref).norm() / travel for r in (undone, lost))
        assert now < before / 3, (mode, float(now), float(before))


def _branches(rank, world, mode, steps):
    """bench/discarded_gradient.py's run_branches, "apart": two ranks, each step through one hidden layer each,
    never the same one (which, at random), so every hidden layer is used by one rank and unused by the other.
    The final parameters and the start."""
    final, start = _bench_script("discarded_gradient").run_branches(mode, "apart", steps, rank, world)
    return {"final": final, "start": start}


def test_ranks_that_leave_different_parameters_unused_stay_near_fp32():
    """Where another rank used a parameter, its slots take the ordinary
    reduction. lowrank's residual is each rank's message less its share of
    the approximated sum, so it cancels across ranks only within a step:
    holding this rank's slot back before the step (this module's first
    form) left the others' uncancelled. In this loop lowrank then ended 0.42
    of fp32's travel from fp32's weights at 40 steps (0.73 at 60, bench/README
    "A parameter no rank used: its step undone"); now 0.040 (0.058)."""
    runs = run_ranks(each_mode, 2, _branches, ["fp32", "lowrank"], 40)[0]
    ref = runs["fp32"]["final"]
    off = (runs["lowrank"]["final"] - ref).norm() / (ref - runs["fp32"]["start"]).norm()
    assert off < 0.1, float(off)


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


def test_the_undo_runs_after_the_backward_that_kept_and_only_for_it():
    """UnusedParams alone (one process, no DDP): slots kept inside a backward
    are put back at its end where the parameter's gradient stayed None, not
    where the backward wrote one; outside a backward nothing is kept; what a
    backward that failed before its end kept is dropped, not put back later."""
    keeper = unused.UnusedParams()
    used, idle = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    buffer = torch.zeros(5)
    grads = [buffer[:3], buffer[3:]]
    state = torch.arange(5.0)
    assert not keeper.keep([used, idle], grads, buffer, [0, 1], [(state, 0)])  # no backward runs
    x = torch.ones(3, requires_grad=True)

    def in_backward(fail):
        def hook(grad):
            assert keeper.keep([used, idle], grads, buffer, [0, 1], [(state, 0)])
            state.add_(10.0)  # the reduction moves every slot
            if fail:
                raise RuntimeError("a failing backward")
            return grad
        return hook

    handle = x.register_hook(in_backward(False))
    (x * used).sum().backward()  # used's gradient written; idle's stays None
    handle.remove()
    assert used.grad is not None and idle.grad is None
    assert torch.equal(state, torch.tensor([10.0, 11.0, 12.0, 3.0, 4.0]))  # idle's slots put back, used's not
    used.grad = None
    handle = x.register_hook(in_backward(True))
    with pytest.raises(RuntimeError, match="a failing backward"):
        (x * used).sum().backward()
    handle.remove()
    assert torch.equal(state, torch.tensor([20.0, 21.0, 22.0, 13.0, 14.0]))  # its end never came: nothing put back
    other = torch.zeros(5)
    y = torch.ones(3, requires_grad=True)

    def keep_other(grad):
        assert keeper.keep([used, idle], grads, buffer, [1], [(other, 0)])
        other.add_(1.0)
        return grad

    y.register_hook(keep_other)
    (y * 2).sum().backward()
    assert torch.equal(other, torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0]))  # its own kept slots back
    assert torch.equal(state, torch.tensor([20.0, 21.0, 22.0, 13.0, 14.0]))  # the failed backward's dropped
    keeper.close()
