"""Each parameter's own step (hetcomm.own_steps): the schedule of exact
steps follows the steps a bucket's switched-on parameters took, so a GAN
whose two models share one DDP model (Lightning's toggle_optimizer) takes
the discriminator's first steps exact as a DDP model each would; ranks whose
parameters require gradients differently get an error, not a mismatched wire."""

import copy
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm
from hetcomm import own_steps

from . import models
from .dist_harness import each_mode, run_ranks
from .test_cli import _bench_script
from .test_ddp_options import _GanPair, _toggled


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "fs"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_toggled_models_exact_steps_are_those_of_its_own_steps(one_rank_group):
    """Two models in one bucket, switched on in turns (the generator at even
    steps, the discriminator at odd ones), an Adam attached: each model's
    exact steps are the ones a state of its own would take at its own
    steps (the first, and the doublings: its steps 0, 1, 2, 4, 8, 16), and
    the global schedule's are not imposed on the other model."""
    g, d = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))
    state = hetcomm.HookState("int3").attach_optimizer(hetcomm.optim.AdamW([g, d]))
    alone = hetcomm.HookState("int3").attach_optimizer(hetcomm.optim.AdamW([nn.Parameter(torch.zeros(1))]))
    params = [g, d]
    exact = {"g": [], "d": []}
    for step in range(64):
        on = "g" if step % 2 == 0 else "d"
        g.requires_grad_(on == "g")
        d.requires_grad_(on == "d")
        own = state._own_steps.step([0, 1], lambda n: params[n], step)
        if state._planner.schedule(own) != "c":
            exact[on].append(step // 2)  # the model's own step number
    for name in ("g", "d"):
        assert exact[name] == [k for k in range(32) if not alone._compressed_at(k)], name
    assert exact["d"][:6] == [0, 1, 2, 4, 8, 16]
    # a model whose parameters stay switched on reads the global step; a frozen one does not count
    g.requires_grad_(True)
    state, frozen = hetcomm.HookState("int3"), nn.Parameter(torch.zeros(2), requires_grad=False)
    assert [state._own_steps.step([0, 1], [g, frozen].__getitem__, s) for s in range(6)] == list(range(6))


def _gan_pair(rank, world, mode, steps, own):
    """bench/discarded_gradient.py's toggle pair with a GAN's Adam (one DDP model) and the same with a DDP model
    each; ``own`` False: the schedule read at the global step (own steps patched out)."""
    bench = _bench_script("discarded_gradient")
    if not own:
        own_steps.OwnSteps.step = lambda self, sig, param_of, step: step
    final, start = bench.run_toggled(mode, steps, rank, "adam")
    each = None if not own or mode == "fp32" else bench.run_separate(mode, steps, rank, "adam")
    return {"final": final, "start": start, "each": each}


def test_a_gan_with_adam_in_one_ddp_model_ends_where_a_ddp_model_each_ends():
    """Lightning's toggle loop with Adam, both models in one DDP model: the
    discriminator's first step is DDP's second. Read at its own step it is
    exact, and int3 and fp8 end as near fp32's weights as with a DDP model
    (and a HookState) each; read at the global step it was compressed, its
    Adam's second moment set from the compressed gradient, and they end 2-3x
    as far (bench/discarded_gradient.py at 20 steps: int3 0.142 against
    0.296, a DDP model each 0.150; fp8 0.0073 against 0.0233 and 0.0073)."""
    modes = ["int3", "fp8"]
    now = run_ranks(each_mode, 2, _gan_pair, ["fp32"] + modes, 20, True)[0]
    before = run_ranks(each_mode, 2, _gan_pair, modes, 20, False)[0]
    ref = now["fp32"]["final"]
    travel = (ref - now["fp32"]["start"]).norm()
    for mode in modes:
        own, glob, each = ((x - ref).norm() / travel
                           for x in (now[mode]["final"], before[mode]["final"], now[mode]["each"]))
        assert own < 1.2 * each and own < glob / 1.8, (mode, float(own), float(glob), float(each))


def _resumed_toggle(rank, world, mode, keep_off_steps):
    """The toggle loop (tests.test_ddp_options._toggled) with Adam for 4 steps straight, and again saved after
    the generator's first backward (DDP's step 0; the discriminator not yet stepped) and resumed in new
    objects; ``keep_off_steps`` False drops the parameters' steps switched off from the saved state. ``MODE+mm``:
    both Adams attached together."""
    def build():
        pair = _GanPair()
        ddp = DDP(pair, find_unused_parameters=True)
        opts = (torch.optim.Adam(pair.d.parameters(), lr=2e-3), torch.optim.Adam(pair.g.parameters(), lr=4e-4))
        state = hetcomm.HookState(mode.removesuffix("+mm"), min_compress_numel=0)
        if mode.endswith("+mm"):
            state.attach_optimizer(list(opts))
        ddp.register_comm_hook(state, hetcomm.hook)
        return pair, ddp, opts, state

    pair, ddp, (opt_d, opt_g), state = build()
    for step in range(4):
        _toggled(rank, opt_d, opt_g, pair, ddp, step)
    straight = models.flat_params(pair)
    state.close()

    pair, ddp, (opt_d, opt_g), state = build()
    z = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    for p in pair.d.parameters():
        p.requires_grad_(False)
    nn.functional.softplus(-ddp(z)).mean().backward()  # the generator's step alone
    opt_g.step()
    opt_g.zero_grad()
    for p in pair.parameters():
        p.requires_grad_(True)
    sd = copy.deepcopy(state.state_dict())
    assert sd["off_steps"], sd["off_steps"]  # the discriminator's parameters: one step off
    if not keep_off_steps:
        sd.pop("off_steps")
    saved = (copy.deepcopy(pair.state_dict()), copy.deepcopy(opt_d.state_dict()), copy.deepcopy(opt_g.state_dict()))
    state.close()
    pair, ddp, (opt_d, opt_g), state = build()
    pair.load_state_dict(saved[0])
    opt_d.load_state_dict(saved[1])
    opt_g.load_state_dict(saved[2])
    state.load_state_dict(sd)
    # the rest of step 0 (the discriminator's backward), then steps 1-3
    x = models.batch(rank, 0, 16)[0] + 1
    z = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))
    for p in pair.g.parameters():
        p.requires_grad_(False)
    nn.functional.softplus(-ddp(z, x)).mean().backward()
    opt_d.step()
    opt_d.zero_grad()
    for p in pair.parameters():
        p.requires_grad_(True)
    for step in range(1, 4):
        _toggled(rank, opt_d, opt_g, pair, ddp, step)
    state.close()
    return {"straight": straight, "resumed": models.flat_params(pair)}


def test_resume_keeps_each_parameters_steps_switched_off():
    """Saved after the generator's first step, before the discriminator's:
    the resumed run takes the discriminator's first step exact as the
    straight run did, and ends on its parameters to the bit; without the
    saved steps switched off it compresses that step and ends elsewhere. The
    same with both Adams attached together and top-k of their momentum (each
    entry ranked by its own Adam's denominator, read from the loaded ones)."""
    kept = run_ranks(each_mode, 2, _resumed_toggle, ["int3", "topk+mm"], True)
    dropped = run_ranks(each_mode, 2, _resumed_toggle, ["int3"], False)
    for r in kept:
        for mode in ("int3", "topk+mm"):
            assert torch.equal(r[mode]["straight"], r[mode]["resumed"]), mode
    assert not torch.equal(dropped[0]["int3"]["straight"], dropped[0]["int3"]["resumed"])


def _disagree(rank, world):
    """Rank 1 switches a layer off in steps 0-1 that rank 0 keeps on; at step 2 it is on again on rank 1, whose
    own step for its bucket is then 0 (exact), where rank 0 compresses it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    ddp = DDP(model, find_unused_parameters=True)
    state = hetcomm.HookState("int3", min_compress_numel=0, timeout=timedelta(seconds=5))
    ddp.register_comm_hook(state, hetcomm.hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = time.monotonic()
    try:
        for step in range(4):
            model[0].weight.requires_grad_(not (rank == 1 and step < 2))
            ddp(models.batch(rank, step, 8)[0][:, :16]).square().mean().backward()
            opt.step()
            opt.zero_grad()
    except RuntimeError as e:
        return {"error": str(e), "step": step, "seconds": time.monotonic() - start}
    finally:
        try:
            state.close()
        except Exception:
            pass
    return {"error": None, "step": step}


def test_ranks_whose_parameters_require_gradients_differently_get_an_error():
    """The rank whose own step departs from the global one compares its plan
    with the others' before the bucket goes out: it raises, naming
    requires_grad, within the state's timeout, and the other rank's exchange
    fails with it instead of meeting a wire of another kind."""
    out = run_ranks(_disagree, 2, check=False, pg_timeout=10, timeout=120)  # (DDP's own group is left mid-step)
    assert None not in out, out
    assert out[1]["error"] is not None and "require gradients differently" in out[1]["error"], out[1]
    assert out[1]["step"] == 2 and out[0]["error"] is not None and out[0]["step"] == 2, out
    assert out[1]["seconds"] < 60 and out[0]["seconds"] < 60, out
