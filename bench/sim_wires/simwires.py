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
"""
import torch
import torch.distributed as dist

from hetcomm import modes
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
    def __init__(self, kind: str, block: int, two_phase: bool = False, shuffle: bool = False) -> None:
        self.kind, self.block, self.two_phase, self.shuffle = kind, block, two_phase, shuffle
        self.res, self.server = {}, {}
        # the same permutations on every rank (seeded alike), another each step
        self.gen = torch.Generator().manual_seed(12345)


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


def sim_hook(st: SimState, bucket):
    x, i = bucket.buffer(), bucket.index()
    share = x / dist.get_world_size()
    v = share + _kept(st.res, i, x)
    q = quant(v, st.kind, st.block)
    st.res[i] = v - q
    if st.shuffle:  # send the unquantized value plus the same errors at other places (white in time)
        q = share + shuffled_within_blocks(q - share, st.block, st.gen)
    x.copy_(q)

    def server(fut):
        y = fut.value()[0]
        if st.two_phase:
            v2 = y + _kept(st.server, i, y)
            q2 = quant(v2, st.kind, st.block)
            st.server[i] = v2 - q2
            y.copy_(q2)
        return y
    return dist.all_reduce(x, async_op=True).get_future().then(server)


_hook, _bytes = Mode.comm_hook, Mode.torch_bytes


def comm_hook(self, **overrides):
    if self.hook == "sim":
        return SimState(self.options["kind"], self.options["block"], self.options.get("two_phase", False),
                        self.options.get("shuffle", False)), sim_hook, None
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
