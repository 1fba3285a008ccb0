"""Low-bit linear gradient wires with error feedback, simulated in Python as
extra modes of ``hetcomm bench train`` (how int3 was chosen; bench/README
"A 3-bit wire"). Loaded through this folder's sitecustomize.py, so the bench's
forked ranks have the modes too:

    PYTHONPATH=bench/sim_wires hetcomm bench train --tasks classify,regress,lm \\
        --optims sgd,adamw --seeds 3 --modes fp32,fp8,sim-int4-b32,sim-int3-b32,sim-int2-b32
    PYTHONPATH=bench/sim_wires hetcomm bench train --ranks 4 ... --modes fp32,fp8,sim2p-int3-b32

``sim-KIND-bB``: each rank sends q(x / world + residual), q per block of B
values with the scale max|x| / L rounded to bf16 (L = 7, 3, 1 for int4, int3,
int2 = ternary; fp4: e2m1's values times max|x| / 6) and values rounded to the
nearest level; the residual keeps the rest; the ranks sum the decoded values
(on 2 ranks what hetcomm's one exchange does). ``sim2p-``: the sum quantized
again with a server residual, as the two phases do on 3 or more ranks.
``sim-int3shuf-b32``: a control of int3's error in time, not a wire. Each
rank runs int3's error feedback as ``sim-int3-b32`` does, so its message
would err by d = q - x / world (the residual's change, e_{t-1} - e_t); it
sends x / world + d shuffled within each block of 32 instead: the same
errors, by block, but at other positions each step, so a value's error no
longer repays its last one (white in time, where error feedback's is blue).
The residual stays int3's (bench/README "int3's 2-rank cells on the Intel
Xeon"):

    PYTHONPATH=bench/sim_wires hetcomm bench train --tasks lm --optims sgd --seeds 33 \
        --modes sim-int3-b32,sim-int3shuf-b32

``simh-int3-b32``: int3 across 2-rank nodes, as ``int3@hierarchical`` sums
on the 2 x 2 testbed: each node's sum exact, coded once with the node's
residual, the nodes' codes summed. ``-xc``: clipped (``--clip-grad-norm``)
by the norm of the step's exact reduced gradient (an extra all-reduce of the
ranks' shares), as ``HookState.clip_grad_norm_`` estimates it; without it a
sim mode is clipped by torch's norm of the handed gradient, which error
feedback's repayment makes larger. ``...burst2exact...``: the burst rule.
After a step whose reduced gradient's norm (the exact one with ``-xc``, else
the coded sum's) is over twice the median of the last 200 steps', the next
16 steps are sent exactly (their residuals repaid in full); every rank
holds the same sums, so the same norms and the same choice (bench/README
"Late excursions across nodes, and more bits while the norm bursts"):

    PYTHONPATH=bench/sim_wires hetcomm bench train --ranks 4 --tasks lm --optims sgd --seeds 8 --scale 4 \
        --eval-every 40 --clip-grad-norm 2 --modes fp32,simh-int3-b32-xc,simh-int3burst2exact-b32-xc
"""
import sys

import torch
import torch.distributed as dist

from hetcomm import modes
from hetcomm.benchmarks import train
from hetcomm.modes import Mode

FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
TOP = {"int4": 7.0, "int3": 3.0, "int2": 1.0, "fp4": 6.0}
BITS = {"int4": 4, "fp4": 4, "int3": 3, "int2": 2}


def quant(v: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    n = v.numel()
    b = torch.nn.functional.pad(v, (0, (-n) % block)).view(-1, block)
    s = (b.abs().amax(1, keepdim=True) / TOP[kind]).to(torch.bfloat16).float()
    s = torch.where(s > 0, s, torch.ones_like(s))
    y = b / s
    if kind == "fp4":
        q = FP4[torch.bucketize(y.abs(), (FP4[1:] + FP4[:-1]) / 2)] * y.sign()
    else:
        q = torch.round(y).clamp(-TOP[kind], TOP[kind])
    return (q * s).view(-1)[:n]


class SimState:
    def __init__(self, kind: str, block: int, two_phase: bool = False, shuffle: bool = False,
                 burst: float = 0.0, hold: int = 0, burst_kind: str = "exact") -> None:
        self.kind, self.block, self.two_phase, self.shuffle = kind, block, two_phase, shuffle
        self.res, self.server = {}, {}
        # the burst rule (burst > 0): after a step whose reduced gradient's norm is over ``burst`` times the median
        # of the last WINDOW steps', the next ``hold`` steps go as ``burst_kind`` (every rank holds the same sum,
        # so the same norms and the same choice)
        self.burst, self.hold, self.burst_kind = burst, hold, burst_kind
        self.norms, self.step_sq, self.last_index, self.left, self.bursting = [], 0.0, None, 0, False
        self.steps = self.burst_steps = 0
        self.node_group, self.per_node = None, 0
        # xclip: the step's exact reduced gradient (the ranks' shares summed, an extra all-reduce) gives the
        # norm clip_grad_norm_ clips by, as hetcomm's HookState.clip_grad_norm_ estimates it, and the burst rule's
        self.xclip, self.exact_sq = False, 0.0
        # the same permutations on every rank (seeded alike), another each step
        self.gen = torch.Generator().manual_seed(12345)


def node_groups(st: SimState, per_node: int) -> None:
    """Ranks r // per_node form a node (every rank makes every group, in the same order)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    for k in range(world // per_node):
        g = dist.new_group(list(range(k * per_node, (k + 1) * per_node)))
        if rank // per_node == k:
            st.node_group = g
    st.per_node = per_node


def shuffled_within_blocks(d: torch.Tensor, block: int, gen: torch.Generator) -> torch.Tensor:
    """d's values moved to random positions inside each block of ``block`` (the last, partial block too)."""
    n = d.numel()
    b = torch.nn.functional.pad(d, (0, (-n) % block)).view(-1, block)
    keys = torch.rand(b.shape, generator=gen)
    if n % block:  # the padding stays in the padding: its keys sort last
        keys.view(-1)[n:] = 2.0
    return b.gather(1, keys.argsort(1)).view(-1)[:n]


def _kept(store: dict, i: int, like: torch.Tensor) -> torch.Tensor:
    r = store.get(i)
    return torch.zeros_like(like) if r is None or r.numel() != like.numel() else r


WINDOW = 200  # steps whose norms' median a burst is measured against


def _new_step(st: SimState) -> None:
    """At a step's first bucket: the last step's norm joins the history, and this step's wire is chosen."""
    if st.last_index is not None:
        norm = (st.exact_sq if st.xclip else st.step_sq) ** 0.5
        hist = sorted(st.norms[-WINDOW:])
        median = hist[len(hist) // 2] if hist else 0.0
        if st.burst > 0 and len(hist) >= 50 and norm > st.burst * median:
            if st.left == 0 and (not dist.is_initialized() or dist.get_rank() == 0):
                print(f"    burst after step {st.steps - 1}: norm {norm:.3g}, {norm / median:.2f}x the median; "
                      f"{st.burst_steps} steps sent as {st.burst_kind} so far", file=sys.stderr, flush=True)
            st.left = st.hold
        st.norms.append(norm)
    st.step_sq = st.exact_sq = 0.0
    st.bursting = st.left > 0
    st.left = max(0, st.left - 1)
    st.steps += 1
    st.burst_steps += st.bursting


def quant_as(v: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """quant, or ``kind`` "exact": v itself (a copy)."""
    return v.clone() if kind == "exact" else quant(v, kind, block)


def sim_hook(st: SimState, bucket):
    x, i = bucket.buffer(), bucket.index()
    if st.last_index is None or i <= st.last_index:
        _new_step(st)
    st.last_index = i
    kind = st.burst_kind if st.bursting else st.kind
    share = x / dist.get_world_size()
    if st.xclip:
        exact = share.clone()
        dist.all_reduce(exact)
        st.exact_sq += float(exact.double().pow(2).sum())
    if st.node_group is not None:  # across nodes, as int3@hierarchical on 2 nodes: the node's sum exact, then coded
        y = share.clone()
        dist.all_reduce(y, group=st.node_group)
        v = y + _kept(st.res, i, y)
        q = quant_as(v, kind, st.block)
        st.res[i] = v - q
        dist.all_reduce(q)  # each node's coded sum, counted once by each of its ranks
        q.div_(st.per_node)
        st.step_sq += float(q.double().pow(2).sum())
        x.copy_(q)
        fut = torch.futures.Future()
        fut.set_result(x)
        return fut
    v = share + _kept(st.res, i, x)
    q = quant_as(v, kind, st.block)
    st.res[i] = v - q
    if st.shuffle:  # send the unquantized value plus the same errors at other places (white in time)
        q = share + shuffled_within_blocks(q - share, st.block, st.gen)
    x.copy_(q)

    def server(fut):
        y = fut.value()[0]
        if st.two_phase:
            v2 = y + _kept(st.server, i, y)
            q2 = quant_as(v2, kind, st.block)
            st.server[i] = v2 - q2
            y.copy_(q2)
        st.step_sq += float(y.double().pow(2).sum())
        return y
    return dist.all_reduce(x, async_op=True).get_future().then(server)


CURRENT = []  # the sim state of this rank's run (one run at a time): bench train's clip asks it


def _clip(state, model, clip, handed):
    """bench train's _clip: a sim mode with xclip clips by its step's exact reduced norm."""
    st = CURRENT[-1] if CURRENT else None
    if clip is None or state is not None or st is None or not st.xclip:
        return _train_clip(state, model, clip, handed)
    norm = torch.tensor(st.exact_sq ** 0.5)
    torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), clip, norm)
    return bool(norm > clip)


_train_clip = train._clip
train._clip = _clip
_hook, _bytes = Mode.comm_hook, Mode.torch_bytes


def comm_hook(self, **overrides):
    if self.hook == "sim":
        o = self.options
        st = SimState(o["kind"], o["block"], o.get("two_phase", False), o.get("shuffle", False),
                      o.get("burst", 0.0), o.get("hold", 0), o.get("burst_kind", "exact"))
        if o.get("per_node"):
            node_groups(st, o["per_node"])
        st.xclip = o.get("xclip", False)
        CURRENT[:] = [st]
        return st, sim_hook, None
    CURRENT.clear()  # another mode's run: no sim state of an earlier run clips it
    return _hook(self, **overrides)


def torch_bytes(self, model, world, steps=None):
    if self.hook == "sim":  # one message a rank (the exchange's bytes)
        return sum(p.numel() for p in model.parameters()) * (BITS[self.options["kind"]] + 16 / self.options["block"]) / 8
    return _bytes(self, model, world, steps)


Mode.comm_hook, Mode.torch_bytes = comm_hook, torch_bytes
for _kind in TOP:
    for _block in (32, 16):
        modes.MODES[f"sim-{_kind}-b{_block}"] = Mode(f"sim-{_kind}-b{_block}", "sim", {"kind": _kind, "block": _block})
    modes.MODES[f"sim2p-{_kind}-b32"] = Mode(f"sim2p-{_kind}-b32", "sim", {"kind": _kind, "block": 32, "two_phase": True})
modes.MODES["sim-int3shuf-b32"] = Mode("sim-int3shuf-b32", "sim", {"kind": "int3", "block": 32, "shuffle": True})
# the burst rule (see the module), flat and across nodes; clipped by the exact reduced norm (-xc)
modes.MODES["sim2p-int3burst2exact-b32"] = Mode("sim2p-int3burst2exact-b32", "sim", {
    "kind": "int3", "block": 32, "two_phase": True, "burst": 2.0, "hold": 16, "burst_kind": "exact"})
for _burst in (False, True):
    _rule = {"burst": 2.0, "hold": 16, "burst_kind": "exact"} if _burst else {}
    _name = "simh-int3burst2exact-b32" if _burst else "simh-int3-b32"
    for _xc in (False, True):
        modes.MODES[_name + ("-xc" if _xc else "")] = Mode(_name + ("-xc" if _xc else ""), "sim", {
            "kind": "int3", "block": 32, "per_node": 2, "xclip": _xc, **_rule})
