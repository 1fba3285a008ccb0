"""A gradient reduced and then thrown away, under error feedback: a toy GAN's
discriminator D (an MLP on 64 features, SGD with momentum 0.9, lr 0.05) trains
for STEPS steps on two gloo ranks; after each of its steps a "generator step"
runs a backward of the generator's loss through D's DDP model, whose gradient
on D is then zeroed before D's next step, as a GAN loop does. Per mode, D's
weights at the end against fp32's (DDP's own all-reduce, the same loop): the
generator's backward reduced through the hook (``reduced``), under
``ddp.no_sync()`` (``no_sync``), and not run at all (``none``), as the distance
to fp32's weights over the distance fp32's weights moved from the start.
Then Lightning's flow (``toggle``): a generator and D in one DDP model
(``find_unused_parameters=True``), each step's parameters of the other
optimizer switched off (``toggle_optimizer``), each optimizer zeroing after
its step; the whole pair's distance to fp32's the same way, and with a DDP
model (and a HookState) each, no parameter left unused (bench/README
"A gradient thrown away after its exchange", and "A parameter no rank used,
held back" for the toggle loop since hetcomm.unused; 4 ranks there too).
Last, ranks that take different branches (``run_branches``): a regression
through one of two hidden layers per rank and step, "apart" (no two ranks
the same) and "random" (bench/README "A parameter no rank used: its step
undone"):

    torchrun --nproc-per-node 2 bench/discarded_gradient.py [MODES [STEPS [OPTIMS [SEEDS]]]]

The toggle pair runs with each of OPTIMS (default ``sgd,adam``): D's SGD
with momentum and the generator's plain SGD, or a GAN's usual Adam for both
(bench/README "Each parameter's own step"). A mode ``MODE+m`` attaches D's
optimizer (its momentum compressed, not the gradient; the generator's own
HookState, with a DDP model each, compresses the gradient); ``MODE+mm`` (Adam)
attaches both, together to the one model's state, each to its own with a
model each (bench/README "Two optimizers attached"). A mode ``MODE@ALGO`` sets
HookState's algorithm; with ``@hierarchical`` each rank's node is
``node{rank // 2}`` unless HETCOMM_NODE says otherwise. SEEDS (default 1)
runs the toggle pair on that many data streams (seed 0 is the default's),
a line each and their means: a single stream's ratio of the two setups moved
from 0.75x to 1.22x from one stream to the next (bench/README "One DDP model
or two: lowrank's toggle pair over seeds").
"""
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hetcomm


def _discriminator() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _register(ddp: DDP, mode: str, momentum_of=None):
    """``mode``'s hook on ``ddp`` (fp32: DDP's own all-reduce); the HookState to close, or None. A mode
    ``NAME+m`` or ``NAME+mm`` attaches ``momentum_of`` (an optimizer or a list of them; None: the state
    compresses the gradient)."""
    if mode == "torch-powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        ddp.register_comm_hook(ps.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2),
                               ps.powerSGD_hook)
    elif mode != "fp32":
        name, _, algorithm = mode.partition("@")
        base = name.removesuffix("+mm").removesuffix("+m")
        state = hetcomm.HookState(base, min_compress_numel=0, algorithm=algorithm or None)
        if base != name and momentum_of is not None:
            state.attach_optimizer(momentum_of)
        ddp.register_comm_hook(state, hetcomm.hook)
        return state
    return None


def run(mode: str, generator_step: str, steps: int, rank: int) -> torch.Tensor:
    d = _discriminator()
    ddp = DDP(d)
    opt = torch.optim.SGD(d.parameters(), lr=0.05, momentum=0.9)
    state = _register(ddp, mode, opt)
    g = torch.Generator().manual_seed(rank + 1)
    softplus = nn.functional.softplus
    for _ in range(steps):
        real, fake = torch.randn(32, 64, generator=g) + 1, torch.randn(32, 64, generator=g)
        opt.zero_grad()
        (softplus(-ddp(real)).mean() + softplus(ddp(fake)).mean()).backward()
        opt.step()
        if generator_step == "reduced":
            softplus(-ddp(fake)).mean().backward()  # D's gradient of it: zeroed before D's next step
        elif generator_step == "no_sync":
            with ddp.no_sync():
                softplus(-ddp(fake)).mean().backward()
    if state is not None:
        state.close()
    return _flat(d)


class _Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.d = _discriminator()
        self.g = nn.Linear(8, 64)

    def forward(self, z, x=None):
        fake = self.g(z)
        return self.d(fake) if x is None else (self.d(x), self.d(fake.detach()))


def _pair_optimizers(pair: _Pair, optim: str):
    """D's and the generator's optimizers: "sgd" (D's with momentum 0.9, lr 0.05; the generator's plain, 0.01)
    or "adam" (a GAN's usual: Adam with betas (0.5, 0.999), D's lr 2e-3, the generator's 4e-4)."""
    if optim == "adam":
        return (torch.optim.Adam(pair.d.parameters(), lr=2e-3, betas=(0.5, 0.999)),
                torch.optim.Adam(pair.g.parameters(), lr=4e-4, betas=(0.5, 0.999)))
    return (torch.optim.SGD(pair.d.parameters(), lr=0.05, momentum=0.9),
            torch.optim.SGD(pair.g.parameters(), lr=0.01))


def _both(mode: str) -> bool:
    """``MODE+mm``: both optimizers attached."""
    return mode.partition("@")[0].endswith("+mm")


def _data(rank: int, seed: int) -> torch.Generator:
    """A rank's stream of the toggle pair's batches (seed 0: the script's first, ``rank + 1``)."""
    return torch.Generator().manual_seed(1000 * seed + rank + 1)


def run_toggled(mode: str, steps: int, rank: int, optim: str = "sgd", seed: int = 0):
    """Lightning's GAN step with toggle_optimizer, both models in one DDP model: (final, initial) parameters."""
    pair = _Pair()
    start = _flat(pair)
    ddp = DDP(pair, find_unused_parameters=True)
    opt_d, opt_g = _pair_optimizers(pair, optim)
    state = _register(ddp, mode, [opt_d, opt_g] if _both(mode) else opt_d)
    g = _data(rank, seed)
    softplus = nn.functional.softplus

    def toggle(opt):
        own = {id(p) for group in opt.param_groups for p in group["params"]}
        for p in pair.parameters():
            p.requires_grad_(id(p) in own)

    for _ in range(steps):
        x, z = torch.randn(32, 64, generator=g) + 1, torch.randn(32, 8, generator=g)
        toggle(opt_g)
        softplus(-ddp(z)).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
        toggle(opt_d)
        real, fake = ddp(z, x)
        (softplus(-real).mean() + softplus(fake).mean()).backward()
        opt_d.step()
        opt_d.zero_grad()
    for p in pair.parameters():
        p.requires_grad_(True)
    if state is not None:
        state.close()
    return _flat(pair), start


def run_separate(mode: str, steps: int, rank: int, optim: str = "sgd", seed: int = 0) -> torch.Tensor:
    """The same GAN steps with a DDP model (and a HookState) each: the generator's backward with D switched off,
    D's with the fakes made without a graph. Its final parameters."""
    pair = _Pair()
    ddp_g, ddp_d = DDP(pair.g), DDP(pair.d)
    opt_d, opt_g = _pair_optimizers(pair, optim)
    # (the generator's gradient compressed, unless MODE+mm attaches its optimizer too)
    states = [_register(ddp_g, mode, opt_g if _both(mode) else None), _register(ddp_d, mode, opt_d)]
    g = _data(rank, seed)
    softplus = nn.functional.softplus
    for _ in range(steps):
        x, z = torch.randn(32, 64, generator=g) + 1, torch.randn(32, 8, generator=g)
        pair.d.requires_grad_(False)
        softplus(-pair.d(ddp_g(z))).mean().backward()
        opt_g.step()
        opt_g.zero_grad()
        pair.d.requires_grad_(True)
        with torch.no_grad():
            fake = pair.g(z)
        (softplus(-ddp_d(x)).mean() + softplus(ddp_d(fake)).mean()).backward()
        opt_d.step()
        opt_d.zero_grad()
    for st in states:
        if st is not None:
            st.close()
    return _flat(pair)


class _Branches(nn.Module):
    """A regression through one of two hidden layers, chosen per call."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.out = nn.Linear(32, 128), nn.Linear(128, 1)
        self.a, self.b = nn.Linear(128, 128), nn.Linear(128, 128)

    def forward(self, x, use_b: bool):
        h = torch.relu(self.body(x))
        return self.out(torch.relu((self.b if use_b else self.a)(h)))


def run_branches(mode: str, how: str, steps: int, rank: int, world: int):
    """Each rank a hidden layer a step (``find_unused_parameters=True``), at random: "apart", never the same
    on two ranks (2 ranks: each layer used by one rank, unused by the other), or "random", each rank's own
    draw (some steps no rank uses one). SGD with momentum 0.9 at lr 0.02; (final, initial) parameters."""
    net = _Branches()
    start = _flat(net)
    ddp = DDP(net, find_unused_parameters=True)
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    state = _register(ddp, mode, opt)
    data, draw = torch.Generator().manual_seed(rank + 1), torch.Generator().manual_seed(123)
    for _ in range(steps):
        heads = torch.randint(0, 2, (world,), generator=draw)
        if how == "apart":
            heads = (heads[0] + torch.arange(world)) % 2
        x = torch.randn(16, 32, generator=data)
        opt.zero_grad()
        ((ddp(x, bool(heads[rank])) - x[:, :4].sum(1, keepdim=True)) ** 2).mean().backward()
        opt.step()
    if state is not None:
        state.close()
    return _flat(net), start


def toggle_pair(modes, steps: int, rank: int, optim: str, seeds: int) -> None:
    """Each mode's toggle pair in one DDP model and with a DDP model each, on ``seeds`` data streams: the
    distance to fp32's weights (the same stream) over fp32's travel, a line a stream; over several, the means."""
    refs = [run_toggled("fp32", steps, rank, optim, seed) for seed in range(seeds)]
    for mode in modes:
        if mode == "torch-powersgd":
            continue  # its hook on find_unused_parameters' zeros: not this script's question
        ones, eaches = [], []
        for seed, (ref, start) in enumerate(refs):
            final, _ = run_toggled(mode, steps, rank, optim, seed)
            apart = run_separate(mode, steps, rank, optim, seed)
            ones.append(float((final - ref).norm() / (ref - start).norm()))
            eaches.append(float((apart - ref).norm() / (ref - start).norm()))
            if rank == 0:
                print(f"{mode:15s} the pair's distance to fp32's / fp32's travel{' (Adam)' if optim == 'adam' else ''}"
                      f"{f', seed {seed}' if seeds > 1 else ''}: toggle_optimizer (one DDP model) {ones[-1]:.4f}, "
                      f"a DDP model each {eaches[-1]:.4f}", flush=True)
        if rank == 0 and seeds > 1:
            ratios = torch.tensor(ones) / torch.tensor(eaches)
            print(f"{mode:15s} over {seeds} seeds{' (Adam)' if optim == 'adam' else ''}: one DDP model "
                  f"{sum(ones) / seeds:.4f}, a DDP model each {sum(eaches) / seeds:.4f} (the means; one / each: "
                  f"geometric mean {float(ratios.log().mean().exp()):.2f}, {float(ratios.min()):.2f}-"
                  f"{float(ratios.max()):.2f})", flush=True)


def main() -> None:
    modes = (sys.argv[1] if len(sys.argv) > 1 else "int3,lowrank,fp8,onebit,topk,torch-powersgd").split(",")
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 60
    optims = (sys.argv[3] if len(sys.argv) > 3 else "sgd,adam").split(",")  # the toggle pair's
    seeds = int(sys.argv[4]) if len(sys.argv) > 4 else 1  # ... and its data streams
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if any(m.endswith("@hierarchical") for m in modes):  # two ranks a node, unless told otherwise
        os.environ.setdefault("HETCOMM_NODE", f"node{rank // 2}")
    ref = run("fp32", "reduced", steps, rank)
    moved = float((ref - _flat(_discriminator())).norm())
    for mode in modes:
        line = []
        for how in ("reduced", "no_sync", "none"):
            line.append(f"{how} {float((run(mode, how, steps, rank) - ref).norm()) / moved:.4f}")
        if rank == 0:
            print(f"{mode:15s} D's distance to fp32's / fp32's travel, the generator's backward: " + ", ".join(line),
                  flush=True)
    for optim in optims:
        toggle_pair(modes, steps, rank, optim, seeds)
    world = dist.get_world_size()
    refs = {how: run_branches("fp32", how, steps, rank, world) for how in ("apart", "random")}
    for mode in modes:
        if mode == "torch-powersgd":
            continue
        line = []
        for how, (ref, start) in refs.items():
            final, _ = run_branches(mode, how, steps, rank, world)
            line.append(f"{how} {float((final - ref).norm() / (ref - start).norm()):.4f}")
        if rank == 0:
            print(f"{mode:15s} ranks through different hidden layers, distance to fp32's / fp32's travel: "
                  + ", ".join(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
