"""How to reduce over the measured cluster: a cost model per algorithm and
wire format (time = alpha * messages + bytes * beta per stage, as in NCCL's
tuning and Thakur/Rabenseifner/Gropp) and :func:`plan`, a pure function
(topology, bucket bytes, wire format) -> the algorithm predicted to finish
first, with every alternative's prediction. ``HETCOMM_ALGO`` forces one."""

from __future__ import annotations

import math
import os
from typing import List, Optional

from .topology import ALGORITHMS, ENV_ALGO, WIRE_BYTES, LinkClass, Topology


def _stage(link: LinkClass, messages: float, nbytes: float) -> float:
    return link.alpha * messages + nbytes * link.beta


def predict(topo: Topology, nbytes: float, algorithm: str, wire: str = "none") -> Optional[float]:
    """Predicted seconds for one all-reduce of an fp32 bucket of `nbytes`
    (None: not applicable). wire: none/fp16/bf16 (dense), fp8, onebit, topk:<ratio>."""
    w = topo.world
    if w == 1:
        return 0.0
    worst = topo.worst()
    n_elems = nbytes / 4
    codec = 0.0
    if wire in WIRE_BYTES:
        b = n_elems * WIRE_BYTES[wire]
        if wire != "none":
            codec = 2 * nbytes / (topo.codec_gbps * 1e9 * 4)  # casts are ~4x cheaper than the 1-bit codec
    elif wire.startswith("lowrank"):
        # "lowrank:<fraction of the fp32 elements P, Q and the dense parts make up>"
        frac = float(wire.split(":")[1]) if ":" in wire else 0.1
        return _predict_lowrank(topo, nbytes, algorithm, frac)
    elif wire in ("onebit", "fp8") or wire.startswith("topk"):
        b = None
        codec = 3 * nbytes / (topo.codec_gbps * 1e9)
    else:
        raise ValueError(f"unknown wire format {wire!r}")
    per_node = topo.ranks_per_node()
    nodes = topo.num_nodes
    intra = topo.links.get("intra", worst)
    inter = topo.links.get("inter", worst)
    # The ranks of a node share its link: stages where all of them cross
    # nodes at once carry `share` flows on one link.
    share = (per_node or 1) if nodes > 1 else 1

    def compressed_allreduce(ranks: int, elems: float, link: LinkClass, flows: int) -> float:
        if wire in ("onebit", "fp8"):  # all-to-all + all-gather of 1/32 (1/4) of the data, plus scales
            per_elem = 1 / 8 if wire == "onebit" else 1.0
            return 2 * (ranks - 1) * link.alpha + flows * 2 * (ranks - 1) / ranks * elems * per_elem * 1.02 * link.beta
        ratio = float(wire.split(":")[1]) if ":" in wire else 0.01
        return (ranks - 1) * (link.alpha + flows * 8 * math.ceil(ratio * elems) * link.beta)

    if b is None:  # fp8 / onebit / topk: flat, or compressed across nodes only
        if algorithm == "native":
            return codec + compressed_allreduce(w, n_elems, worst, share)
        if algorithm == "hierarchical" and per_node and nodes > 1:
            local = 2 * _stage(intra, per_node - 1, (per_node - 1) / per_node * nbytes)
            return codec / per_node + local + compressed_allreduce(nodes, n_elems / per_node, inter, share)
        return None
    if algorithm in ("native", "ring"):
        # 2(W-1) steps of b/W bytes; every step waits for the slowest link on the ring
        return codec + _stage(worst, 2 * (w - 1), 2 * (w - 1) / w * b)
    if algorithm == "halving_doubling":
        p = 2 ** int(math.log2(w))
        t, mask = 0.0, p // 2
        while mask >= 1:
            crosses = topo.nodes[0] != topo.nodes[min(mask, w - 1)]
            t += 2 * _stage(topo.link(0, min(mask, w - 1)), 1, b * mask / p * (share if crosses else 1))
            mask //= 2
        if p != w:
            t += 2 * _stage(worst, 1, b)
        return codec + t
    if algorithm == "tree":
        return codec + 2 * math.ceil(math.log2(w)) * _stage(worst, 1, b)
    if algorithm == "hierarchical":
        if not per_node or nodes == 1 or per_node == 1:
            return None
        local = 2 * _stage(intra, per_node - 1, (per_node - 1) / per_node * b)
        return codec + local + _stage(inter, 2 * (nodes - 1), 2 * (nodes - 1) / nodes * b / per_node * share)
    raise ValueError(f"unknown algorithm {algorithm!r}")


def _predict_lowrank(topo: Topology, nbytes: float, algorithm: str, frac: float) -> Optional[float]:
    """Two all-reduces (P, then Q) carrying `frac` of the bucket's bytes in all;
    hierarchical: an exact intra-node all-reduce before and after, low-rank
    across nodes on the node's links."""
    w, worst = topo.world, topo.worst()
    sent = frac * nbytes
    if algorithm == "native":
        return _stage(worst, 4 * (w - 1), 2 * (w - 1) / w * sent)
    per_node, nodes = topo.ranks_per_node(), topo.num_nodes
    if algorithm != "hierarchical" or not per_node or nodes == 1:
        return None
    intra, inter = topo.links.get("intra", worst), topo.links.get("inter", worst)
    local = 2 * _stage(intra, 2 * (per_node - 1), 2 * (per_node - 1) / per_node * nbytes) if per_node > 1 else 0.0
    # each node's matrices are split among its ranks, which share its link
    return local + _stage(inter, 4 * (nodes - 1), 2 * (nodes - 1) / nodes * sent)


_FROM_ENV = object()


def plan(topo: Topology, nbytes: float, wire: str = "none", allowed: Optional[List[str]] = None,
         forced=_FROM_ENV) -> dict:
    """The algorithm predicted fastest for a bucket, with every prediction.
    ``forced`` (default: HETCOMM_ALGO) forces one, where it applies."""
    algos = list(allowed or ALGORITHMS)
    if wire not in WIRE_BYTES:  # compressed codecs run flat ("native") or across nodes only
        algos = [a for a in algos if a in ("native", "hierarchical")]
    predictions = {a: predict(topo, nbytes, a, wire) for a in algos}
    predictions = {a: t for a, t in predictions.items() if t is not None}
    if forced is _FROM_ENV:
        forced = os.environ.get(ENV_ALGO)
    if forced:
        if forced not in ALGORITHMS:
            raise ValueError(f"{ENV_ALGO} must be one of {ALGORITHMS}, got {forced!r}")
        if forced in predictions:
            return {"algorithm": forced, "wire": wire, "predicted_s": predictions, "forced": True}
    best = min(predictions, key=lambda a: (predictions[a], ALGORITHMS.index(a)))
    return {"algorithm": best, "wire": wire, "predicted_s": predictions, "forced": False}


def plan_table(topo: Topology, wires: List[str], sizes: Optional[List[int]] = None) -> List[dict]:
    sizes = sizes or [2 ** k for k in range(12, 29, 2)]
    return [dict(plan(topo, s, w), bytes=s) for w in wires for s in sizes]


def describe(topo: Topology, wires: Optional[List[str]] = None) -> str:
    lines = [f"ranks {topo.world}, nodes {topo.num_nodes} ({topo.source}); 1-bit codec {topo.codec_gbps:.1f} GB/s"]
    for r, (n, d) in enumerate(zip(topo.nodes, topo.devices)):
        mem = f"{d['memory_gb']:.0f} GiB" if d.get("memory_gb") else "?"
        lines.append(f"  rank {r}: node {n}  device {d.get('model')}  memory {mem}  capability {d.get('capability')}")
    for cls, l in topo.links.items():
        lines.append(f"  link {cls:<5}: alpha {l.alpha * 1e6:9.1f} us  beta {1 / l.beta / 1e9:8.3f} GB/s  ({l.pairs} pairs)")
    lines.append(f"{'bytes':>12}  {'wire':<8} {'plan':<17} " + "  ".join(f"{a:>16}" for a in ALGORITHMS))
    for row in plan_table(topo, wires or ["none", "onebit"]):
        preds = "  ".join(f"{row['predicted_s'][a] * 1e3:13.3f} ms" if a in row["predicted_s"] else f"{'-':>16}"
                          for a in ALGORITHMS)
        lines.append(f"{row['bytes']:>12}  {row['wire']:<8} {row['algorithm']:<17} {preds}")
    return "\n".join(lines)
