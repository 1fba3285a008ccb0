"""Measuring the links: ping-pong probes of rank pairs in rounds of disjoint
pairs (:func:`probe`, a sample of pairs: :func:`_schedule`), the alpha-beta
fit per link class (:func:`fit`) and the codec's speed on this device
(:func:`measure_codec_gbps`). :func:`hetcomm.topology.detect` runs them when
no cached or given topology applies."""

from __future__ import annotations

import math
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .topology import LinkClass, group_device, sync


def _rounds(world: int) -> List[List[tuple]]:
    """Round-robin schedule (circle method): each round a set of disjoint pairs."""
    n = world + (world % 2)
    ranks = list(range(n))
    out = []
    for _ in range(n - 1):
        pairs = [(ranks[i], ranks[n - 1 - i]) for i in range(n // 2)]
        out.append([(a, b) for a, b in pairs if a < world and b < world])
        ranks = [ranks[0]] + [ranks[-1]] + ranks[1:-1]
    return out


#: Most rounds the probe runs: one inside every node, then node pairs. The fit
#: keeps one median per link class, so a sample of pairs does: every pair would
#: take world - 1 rounds (1.3-1.9 s on 2 x 2 ranks at 100 Mbit, 1.05-1.12 s
#: sampled; 4 x 4: 13.5-13.9 s, 2.7-3.3 s sampled; with the large message
#: sized by doubling, :func:`probe_next`: 0.60-0.70 s and 1.8-2.1 s; repeated
#: for PROBE_REPEATS_S, :func:`large_repeats`: 0.32-0.33 s and 1.0 s).
PROBE_MAX_ROUNDS = 8


def _schedule(nodes: List[str], max_rounds: int = PROBE_MAX_ROUNDS) -> List[List[tuple]]:
    """The probe's rounds of disjoint rank pairs, sampled: one round of pairs
    inside every node at once (local ranks 0-1, 2-3, ...), then rounds of node
    pairs by the circle method, each node in one pair per round (one flow on
    its link, as in hierarchical's inter-node stage) and measured by its k-th
    rank in round k (each NIC in turn), at most ``max_rounds`` in all. Depends
    only on ``nodes``: the same on every rank."""
    members: Dict[str, List[int]] = {}
    for r, n in enumerate(nodes):
        members.setdefault(n, []).append(r)
    groups = list(members.values())
    rounds = [[(g[i], g[i + 1]) for g in groups for i in range(0, len(g) - 1, 2)]]
    for k, node_pairs in enumerate(_rounds(len(groups))):
        if len(rounds) >= max_rounds:
            break
        rounds.append([(groups[u][k % len(groups[u])], groups[v][k % len(groups[v])]) for u, v in node_pairs])
    return [r for r in rounds if r]


#: The large probe message is sized so that one transfer takes at most this
#: long: 1 MiB from ~170 Mbit/s up, less below (1 MiB x 12 transfers per pair
#: took ~1 s at 100 Mbit, and the pairs across one node's link share it). On
#: the 100 Mbit testbed, 2 x 2 ranks: 512 KiB, the probe 1.3-1.7 s instead of
#: 3.2-3.6 s, bandwidth within 0.88-1.01x of the rate (1 MiB: 0.80-0.95x).
PROBE_BUDGET_S = 0.05
PROBE_SIZING = 64 << 10  # bytes of the first sizing exchange (also the large message's least size)
#: The large message's repeats take about this long in round trips: at most
#: ``reps``, at least 2, and the sizing's own exchange of that size counts as
#: one more. At 100 Mbit (512 KiB, 84 ms a round trip) 2 repeats, not 5: on
#: the 2 x 2 testbed the probe took 0.32-0.33 s against 0.56-0.57 (4 x 4:
#: 1.0 s against 1.75-1.78; 10 Mbit: 0.45 against 0.76), the bandwidth it read
#: the same (103.9-104.2 Mbit/s both ways); at 1 Gbit (1 MiB in 17 ms a round
#: trip or less) all 5, as before.
PROBE_REPEATS_S = 0.15


def large_repeats(one_way_s: float, reps: int, budget_s: float = PROBE_REPEATS_S) -> int:
    """How many more times the probe sends its large message, whose one
    transfer took ``one_way_s``: as many round trips as fit in ``budget_s``,
    at least 2, at most ``reps``."""
    fit = int(budget_s / (2 * one_way_s)) if one_way_s > 0 else reps
    return min(reps, max(2, fit))


def probe_next(size: int, one_way_s: float, largest: int, budget_s: float = PROBE_BUDGET_S,
               smallest: int = PROBE_SIZING) -> int:
    """What the probe does after ``size`` bytes took ``one_way_s``: measure
    twice ``size`` next (returned as is) while that is at most ``largest``
    and this transfer took at most half ``budget_s``; else stop, returned as
    minus the large message's bytes: ``size``, or half of it when this
    transfer took over ``budget_s`` (never below ``smallest``). Measured
    doubling by doubling, not extrapolated from one small message: a link
    shaped by a token bucket (a policer, ``tc tbf``) sends its burst at the
    wire's speed, so a message that fits in it looks fast (the testbed at 100
    Mbit with its burst of 50 KB until 2026-12-06: 64 KiB in 1-4 ms where the
    rate needs 5.2, and 1 MiB chosen, 84 ms a transfer, in 3 of 8 probes)."""
    if one_way_s > budget_s and size // 2 >= smallest:
        return -(size // 2)
    if 2 * size <= largest and one_way_s <= budget_s / 2:
        return 2 * size
    return -size


def probe(nodes: List[str], group=None, small: int = 4096, large: int = 1 << 20, reps: int = 5,
          device: Optional[torch.device] = None, max_rounds: int = PROBE_MAX_ROUNDS) -> Dict[tuple, tuple]:
    """One-way time (s) of a `small` and a large message per sampled rank
    pair, and the large message's bytes: ``{(a, b): (t_small, t_large,
    large_bytes)}``, measured by ping-pong in at most ``max_rounds`` rounds of
    disjoint pairs chosen from ``nodes``, the node of each rank
    (:func:`_schedule`), with tensors on
    ``device`` (a GPU measures its own links: NVLink, PCIe, the network). The
    large message is `large` bytes, or less on a slow link (from 64 KiB up,
    doubled while :func:`probe_next` says so, then repeated as
    :func:`large_repeats` says: the lower rank of each pair decides both and
    tells the other). Collective; identical result on every rank."""
    from . import _C

    device = group_device(group, device)
    t = _C.ProcessGroupTransport(group if group is not None else dist.group.WORLD, device)
    me, world = t.rank, t.size
    if len(nodes) != world:
        raise ValueError(f"nodes must name the node of each of the group's {world} ranks, got {len(nodes)}")
    mine = {}
    sizing = min(PROBE_SIZING, large)
    buf = torch.zeros(max(small, sizing, large) // 4, dtype=torch.float32, device=device)

    def exchange(peer: int, first: bool, nbytes: int, reps: int, tag: int, warm_up: bool = True) -> float:
        """The least one-way time of ``reps`` exchanges after a warm-up one
        (``warm_up=False``: the connection is warm already)."""
        view, samples = buf[:nbytes // 4], []
        for i in range(0 if warm_up else 1, reps + 1):
            t0 = time.perf_counter()
            if first:
                t.send(view, peer, tag + i)
                t.recv(view, peer, tag + i)
            else:
                t.recv(view, peer, tag + i)
                t.send(view, peer, tag + i)
            sync(device)  # NCCL's wait() only orders streams
            if i:  # the first exchange warms the connection up
                samples.append((time.perf_counter() - t0) / 2)
        return min(samples)  # the least disturbed exchange (the machine may be busy)

    # tags of a round: reps + 1 small exchanges, 2 sizing ones, then per doubling a decision and an exchange (at
    # most 2 * 32), the last decision, reps large exchanges
    stride = 2 * reps + 70
    for rnd, pairs in enumerate(_schedule(nodes, max_rounds)):
        for a, b in pairs:
            if me not in (a, b):
                continue
            peer, first, tag = b if me == a else a, me == a, rnd * stride
            t_small = exchange(peer, first, small, reps, tag)
            tag += reps + 1
            nbytes, took = sizing, exchange(peer, first, sizing, 1, tag)
            tag += 2
            measured = {nbytes: took}  # this side's time of each size the sizing sent
            while True:
                decision = torch.zeros(2, dtype=torch.float32, device=device)  # the next size, or the last; repeats
                if first:  # powers of two up to 2**24 bytes are exact in a float32
                    step = probe_next(nbytes, took, large, smallest=sizing)
                    decision[0] = step
                    if step < 0:
                        decision[1] = large_repeats(measured[-step], reps)
                    t.send(decision, peer, tag)
                else:
                    t.recv(decision, peer, tag)
                sync(device)
                step = int(decision[0].item())
                if step < 0:
                    nbytes, repeats = -step, int(decision[1].item())
                    break
                nbytes, took = step, exchange(peer, first, step, 1, tag, warm_up=False)  # its exchange: tag + 1
                measured[nbytes] = took
                tag += 2
            t_large = min(measured[nbytes], exchange(peer, first, nbytes, repeats, tag, warm_up=False))
            mine[(min(a, b), max(a, b))] = (t_small, t_large, nbytes)
        t.barrier()
    gathered: List[Optional[dict]] = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    merged = {}
    for g in gathered:
        for pair, v in g.items():  # both ends measured: keep the lower rank's view
            merged.setdefault(pair, v)
    return merged


def fit(nodes: List[str], measurements: Dict[tuple, tuple], small: int = 4096, large: int = 1 << 20) -> Dict[str, LinkClass]:
    """alpha-beta per link class from the pair measurements (medians):
    ``(t_small, t_large)`` (``large`` bytes), or ``(t_small, t_large,
    large_bytes)`` as :func:`probe` returns them."""
    by_class: Dict[str, List[tuple]] = {}
    for (a, b), m in measurements.items():
        ts, tl = m[0], m[1]
        big = m[2] if len(m) > 2 else large
        cls = "intra" if nodes[a] == nodes[b] else "inter"
        # Noise can make the large message look no slower than the small one;
        # then charge it all to bandwidth.
        beta = (tl - ts) / (big - small) if tl > 1.05 * ts else tl / big
        alpha = max(1e-7, ts - small * beta)
        by_class.setdefault(cls, []).append((alpha, beta))
    out = {}
    for cls, vals in by_class.items():
        alphas = sorted(v[0] for v in vals)
        betas = sorted(v[1] for v in vals)
        out[cls] = LinkClass(alpha=alphas[len(alphas) // 2], beta=betas[len(betas) // 2], pairs=len(vals))
    return out


def measure_codec_gbps(numel: int = 1 << 20, device: Optional[torch.device] = None) -> float:
    """GB/s of fp32 input the 1-bit codec encodes+decodes on ``device``."""
    from . import ops

    device = device or torch.device("cpu")
    g = torch.randn(numel, dtype=torch.float32, device=device)
    e = torch.zeros_like(g)
    best = math.inf
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        w, s = ops.sign_encode(g, e)
        ops.sign_decode(w, s, numel)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return numel * 4 / best / 1e9
