"""`hetcomm bench links`: what the network between two nodes delivers to the
traffic patterns the all-reduce algorithms make, measured with plain
torch.distributed send/recv (gloo, one TCP connection per pair of ranks), so
the network is measured, not hetcomm's algorithms.

Each pattern moves ``size`` bytes per flow between node 0 and node 1 (the
ranks of a node are its local indices 0..k-1):

- ``single``: local 0 of node 0 sends to local 0 of node 1; nothing else runs.
- ``shared``: every local i of node 0 sends to local i of node 1 at once (k
  flows share node 0's link).
- ``exchange``: local i of node 0 and local i of node 1 send to each other at
  once (the inter-node stage of the hierarchical all-reduce: k flows on each
  link direction).
- ``ring``: every rank sends to the next in node order and receives from the
  one before (one step of the flat ring: one flow on each link direction).
- ``local``: local 0 and local 1 of node 0 send to each other (inside a node,
  no inter-node link: "link" means the node's own loopback).

Per pattern: the median time (slowest rank; min and max of the repeats), the
bytes that crossed the busiest link direction, the link's goodput and, given
the link's rate (``--link-rate``, inside ``hetcomm testbed`` its
``--inter-node-rate``), the fraction of it that was reached. If several concurrent flows reach a smaller fraction than one,
the link (its queue) is what loses, not the algorithm."""

from __future__ import annotations

import os
import time
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from .. import topology
from ..launch import joined, run_distributed
from . import common

ENV_RATE = "HETCOMM_LINK_RATE"  # set by `hetcomm testbed` to its --inter-node-rate
PATTERNS = ("single", "shared", "exchange", "ring", "local")
COLUMNS = [("bytes", "size(B)", "d"), ("pattern", "pattern", "s", 10), ("flows", "flows/link", "d"),
           ("time_ms", "time(ms)", ".1f"), ("min_ms", "min(ms)", ".1f"), ("max_ms", "max(ms)", ".1f"),
           ("link_bytes", "link bytes", "d"), ("mbit_s", "Mbit/s", ".1f"),
           ("of_rate", "of rate", ".2f")]


def rate_bits(text: Optional[str]) -> Optional[float]:
    """'100mbit' -> 1e8 (bits/s); None or '' -> None."""
    if not text:
        return None
    from ..testbed import _rate_bits

    return float(_rate_bits(text))


def _plan(pattern: str, rank: int, nodes: List[List[int]]) -> tuple:
    """(peers this rank sends to, peers it receives from, flows on the busiest
    link direction)."""
    a, b = nodes[0], nodes[1]
    k = len(a)
    send: List[int] = []
    recv: List[int] = []
    if pattern == "single":
        if rank == a[0]:
            send = [b[0]]
        elif rank == b[0]:
            recv = [a[0]]
        return send, recv, 1
    if pattern == "shared":
        if rank in a:
            send = [b[a.index(rank)]]
        elif rank in b:
            recv = [a[b.index(rank)]]
        return send, recv, k
    if pattern == "exchange":
        if rank in a:
            send = recv = [b[a.index(rank)]]
        elif rank in b:
            send = recv = [a[b.index(rank)]]
        return list(send), list(recv), k
    if pattern == "local":
        if rank in a[:2] and k > 1:
            send = recv = [a[1 - a.index(rank)]]
        return list(send), list(recv), 1
    order = [r for node in nodes for r in node]  # ring step over every rank, node by node
    i = order.index(rank)
    return [order[(i + 1) % len(order)]], [order[i - 1]], 1


def _once(send: List[int], recv: List[int], out: torch.Tensor, inbox: torch.Tensor) -> None:
    reqs = [dist.irecv(inbox, src=p) for p in recv] + [dist.isend(out, dst=p) for p in send]
    for r in reqs:
        r.wait()


def _worker(rank: int, world: int, sizes: List[int], patterns: List[str], iters: int, warmup: int,
            link_rate: Optional[str]) -> tuple:
    torch.set_num_threads(1)
    # each rank's node, all-gathered (no link probes: this benchmark is the measurement)
    infos = topology.discover()
    topo = topology.Topology(world, [i["node"] for i in infos], infos, source="discover")
    nodes: Dict[int, List[int]] = {}
    for r, nd in enumerate(topo.node_ids):
        nodes.setdefault(nd, []).append(r)
    groups = [nodes[nd] for nd in sorted(nodes)]
    if len(groups) < 2 or len({len(g) for g in groups}) != 1:
        raise SystemExit("hetcomm bench links: needs 2 or more nodes with the same number of ranks each "
                         f"(found ranks per node {[len(g) for g in groups]}); run it inside `hetcomm testbed`")
    rate = rate_bits(link_rate or os.environ.get(ENV_RATE))
    table = common.Table(COLUMNS)
    if rank == 0:
        print(f"# hetcomm bench links: {len(groups)} nodes x {len(groups[0])} ranks; node 0 <-> node 1; "
              f"link rate {link_rate or os.environ.get(ENV_RATE) or 'not given'}; median of {iters} after "
              f"{warmup} warm-up; time = slowest rank", flush=True)
        table.header()
    rows = []
    for size in sizes:
        out = torch.full((size,), rank % 251, dtype=torch.uint8)
        inbox = torch.empty(size, dtype=torch.uint8)
        for pattern in patterns:
            send, recv, flows = _plan(pattern, rank, groups)
            for _ in range(warmup):
                _once(send, recv, out, inbox)
            times = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                _once(send, recv, out, inbox)
                elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                times.append(float(elapsed))
            if recv and int(inbox[0]) != recv[0] % 251:
                raise RuntimeError(f"hetcomm bench links: rank {rank} received the wrong bytes in {pattern!r}")
            times.sort()
            sec = times[len(times) // 2]
            link_bytes = size * flows
            bits = link_bytes * 8 / sec
            row = {"bytes": size, "pattern": pattern, "flows": flows, "time_ms": sec * 1e3,
                   "min_ms": times[0] * 1e3, "max_ms": times[-1] * 1e3, "link_bytes": link_bytes,
                   "mbit_s": bits / 1e6, "of_rate": bits / rate if rate else float("nan")}
            rows.append(row)
            if rank == 0:
                table.row(row)
    return (rows, {"ranks_per_node": len(groups[0]), "nodes": len(groups), "rate_bits": rate}) if rank == 0 \
        else ([], None)


def main(sizes: List[int], patterns: Optional[List[str]], iters: int, warmup: int, json_path: Optional[str],
         link_rate: Optional[str] = None) -> List[dict]:
    patterns = patterns or list(PATTERNS)
    if not joined():  # ranks spawned here share one node: no link between nodes to measure
        raise SystemExit("hetcomm bench links: measures the link between two nodes; run it inside `hetcomm testbed` "
                         "(or torchrun on 2 or more nodes), e.g. hetcomm testbed --nodes 2 --ranks-per-node 2 "
                         "--inter-node-rate 100mbit -- hetcomm bench links")
    world = int(os.environ["WORLD_SIZE"])
    results = run_distributed(_worker, world, sizes, patterns, iters, warmup, link_rate)
    if results is None:  # a non-zero rank under torchrun / the testbed
        return []
    rows, info = results
    common.write_json(json_path, {"rows": rows}, common.metadata(
        world, iters=iters, warmup=warmup, **info,
        units={"bytes": "B per flow", "time_ms": "milliseconds", "link_bytes": "B on the busiest link direction",
               "mbit_s": "Mbit/s on the busiest link direction", "of_rate": "fraction of the link's rate"}))
    return rows
