"""Several optimizers attached to one HookState (``attach_optimizer([opt_g,
opt_d])``): a GAN's generator and discriminator in one DDP model, each
parameter's momentum and Adam's denominator read from the optimizer that
steps it (the reference of the ranking by the update is
test_convergence's ``torch-two`` case); what cannot be attached together is
a ValueError naming the rule, ranks that attach differently an error at the
first step."""

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm

from . import models
from .dist_harness import each_mode, run_ranks
from .test_cli import _bench_script
from .test_convergence import _Both


def _several_errors(rank, world):
    model = models.mlp()
    ps = list(model.parameters())
    out = []
    for opts in ([torch.optim.SGD(ps[:2], lr=0.1, momentum=0.9), torch.optim.Adam(ps[2:])],
                 [torch.optim.Adam(ps[:2]), torch.optim.Adam(ps[2:], betas=(0.5, 0.999))],
                 [torch.optim.Adam(ps), torch.optim.Adam(ps[:1])],
                 [],
                 [torch.optim.Adam(ps[:2]), object()]):
        try:
            hetcomm.HookState("topk").attach_optimizer(opts)
            out.append(None)
        except ValueError as e:
            out.append(str(e))
    a, b = torch.optim.Adam(ps[:2]), torch.optim.Adam(ps[2:])
    try:
        hetcomm.HookState("topk").follow_lr(a).attach_optimizer([a, b])
        out.append(None)
    except ValueError as e:
        out.append(str(e))
    hetcomm.HookState("topk").follow_lr([a, b]).attach_optimizer([a, b])  # the same two: fine
    # rank 1 attaches the first only: named at the first step
    ddp, state = DDP(model), hetcomm.HookState("topk", min_compress_numel=0)
    state.attach_optimizer([a, b] if rank == 0 else a)
    ddp.register_comm_hook(state, hetcomm.hook)
    out.append(models.first_error(ddp, _Both(a, b), rank))
    return out


def test_what_cannot_be_attached_together_is_named():
    for errs in run_ranks(_several_errors, 2):
        assert "of one kind" in errs[0] and "SGD, Adam" in errs[0], errs[0]
        assert "every parameter group must have the same betas[0], got [0.5, 0.9]" in errs[1], errs[1]
        assert "is in optimizer[0] and optimizer[1]" in errs[2], errs[2]
        assert "non-empty list" in errs[3], errs[3]
        assert "optimizer[1] must be a torch.optim.Optimizer" in errs[4] and "object" in errs[4], errs[4]
        assert "already follows" in errs[5] and "given together in one list" in errs[5], errs[5]
        assert "learning rate followed (follow_lr, or attach_optimizer) differs" in errs[6], errs[6]
        assert "rank 0: 'yes, 2 optimizers', rank 1: 'yes'" in errs[6], errs[6]


def _toggle_pair(rank, world, mode, steps):
    """bench/discarded_gradient.py's toggle pair with a GAN's Adam: one DDP model, and a DDP model each."""
    bench = _bench_script("discarded_gradient")
    final, start = bench.run_toggled(mode, steps, rank, "adam")
    each = None if mode == "fp32" else bench.run_separate(mode, steps, rank, "adam")
    return {"final": final, "start": start, "each": each}


def test_a_gans_two_adams_attached_together_rank_top_k_as_a_ddp_model_each():
    """Both models in one DDP model (Lightning's toggle loop), one bucket: with
    the discriminator's Adam alone attached, the generator's parameters have no
    denominator there, and top-k ranked the whole bucket by ``|m|``; with both
    attached each entry is ranked by its own Adam's update, and the pair ends
    as near fp32's weights as with a DDP model (and an attached state) each
    (bench/discarded_gradient.py, 60 steps: 0.416 against 0.594 with D's
    alone, 0.417 a DDP model each; 4 ranks 0.364, 0.631, 0.365)."""
    mode = "topk"
    runs = run_ranks(each_mode, 2, _toggle_pair, ["fp32", f"{mode}+m", f"{mode}+mm"], 60)
    assert all(torch.equal(r[m]["final"], runs[0][m]["final"]) for r in runs for m in r)  # identical replicas
    now = runs[0]
    ref = now["fp32"]["final"]
    travel = (ref - now["fp32"]["start"]).norm()
    one, both, each = ((x - ref).norm() / travel for x in
                       (now[f"{mode}+m"]["final"], now[f"{mode}+mm"]["final"], now[f"{mode}+mm"]["each"]))
    assert both < 1.1 * each and both < one / 1.3, (float(one), float(both), float(each))
