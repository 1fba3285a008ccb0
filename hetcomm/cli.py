"""The `hetcomm` command line: demo, bench, info."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def _demo(args) -> None:
    from . import demo

    demo.main(ranks=args.ranks, modes=args.modes.split(",") if args.modes else None, steps=args.steps,
              batch=args.batch, json_path=args.json)


def _bench(args) -> None:
    if args.what == "compress":
        from .benchmarks import compress

        compress.main(sizes=compress.parse_sizes(args), iters=args.iters, warmup=args.warmup, json_path=args.json,
                      threads=args.threads, device=args.device)
    elif args.what == "allreduce":
        from .benchmarks import allreduce, common

        allreduce.main(sizes=common.size_sweep(args.minbytes, args.maxbytes, args.stepfactor),
                       algos=args.algos.split(",") if args.algos else None,
                       wires=args.wires.split(",") if args.wires else None, iters=args.iters, warmup=args.warmup,
                       check=args.check, ranks=args.ranks, json_path=args.json, device=args.device)
    elif args.what == "ddp":
        from .benchmarks import common, ddp

        rank_cpu = [float(c) for c in args.rank_cpu.split(",")] if args.rank_cpu else None
        ddp.main(ranks=args.ranks, modes=args.modes.split(",") if args.modes else None,
                 params=common.parse_bytes(args.params), global_batch=args.global_batch, steps=args.iters,
                 warmup=args.warmup, rank_cpu=rank_cpu, json_path=args.json, algorithm=args.algorithm)


def _topo(args) -> None:
    from .testbed import run_distributed

    res = run_distributed(_topo_worker, args.ranks, args.wires.split(","))
    if res is None:
        return
    text, data = res
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


def _topo_worker(rank, world, wires):
    from . import planner, topology

    topo = topology.detect(use_cache=False)
    return planner.describe(topo, wires), {"topology": topo.to_json(), "plans": planner.plan_table(topo, wires)}


def _testbed(args) -> None:
    from . import testbed

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    rank_cpu = [float(c) for c in args.rank_cpu.split(",")] if args.rank_cpu else None
    sys.exit(testbed.main(args.nodes, args.ranks_per_node, args.inter_node_rate, rank_cpu, command, args.timeout))


def _info(args) -> None:
    import hetcomm

    print(json.dumps(hetcomm.build_info(), indent=2))


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="hetcomm", description="DDP communication for clusters of mixed GPUs")
    sub = p.add_subparsers(dest="cmd", required=True)

    d = sub.add_parser("demo", help="train on the digits data over N gloo ranks, once per communication mode")
    d.add_argument("--ranks", type=int, default=2, help="gloo ranks on this machine (default 2)")
    d.add_argument("--modes", default=None, help="comma-separated modes (default: the main ones; see hetcomm.demo.MODES)")
    d.add_argument("--steps", type=int, default=600)
    d.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    d.add_argument("--json", default=None, metavar="PATH", help="also write the numbers as JSON")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="benchmarks (nccl-tests style tables)")
    b.add_argument("what", choices=["compress", "allreduce", "ddp"])
    b.add_argument("-b", "--minbytes", default="256K", help="smallest input size in bytes (K/M/G suffixes)")
    b.add_argument("-e", "--maxbytes", default="64M", help="largest input size in bytes")
    b.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows")
    b.add_argument("-n", "--iters", type=int, default=10)
    b.add_argument("-w", "--warmup", type=int, default=2)
    b.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="compress, allreduce: cpu or cuda (a CUDA build of hetcomm; allreduce: one GPU per rank, NCCL)")
    b.add_argument("--json", default=None, metavar="PATH")
    b.add_argument("--ranks", type=int, default=2, help="ddp: gloo ranks on this machine")
    b.add_argument("--rank-cpu", default=None, help="ddp: per-rank CPU quotas in cores, e.g. 0.25,0.75 (root)")
    b.add_argument("--params", default="1M", help="ddp: model size in parameters (K/M suffixes)")
    b.add_argument("--global-batch", type=int, default=64, help="ddp: samples per step over all ranks")
    b.add_argument("--modes", default=None, help="ddp: comma-separated modes (default: all; +bal = balanced)")
    b.add_argument("--algorithm", default="native", help="ddp: HookState(algorithm=...) of hetcomm's modes")
    b.add_argument("--algos", default=None, help="allreduce: comma-separated algorithms (default: all)")
    b.add_argument("--wires", default=None, help="allreduce: comma-separated wire formats (default none,fp16,onebit)")
    b.add_argument("-c", "--check", type=int, default=1, help="allreduce: count wrong elements (1) or not (0)")
    b.set_defaults(fn=_bench)

    t = sub.add_parser("topo", help="detect and measure the topology; print it and the plan table")
    t.add_argument("--ranks", type=int, default=2, help="local gloo ranks when not under torchrun / the testbed")
    t.add_argument("--wires", default="none,onebit", help="wire formats of the plan table")
    t.add_argument("--json", default=None, metavar="PATH")
    t.set_defaults(fn=_topo)

    tb = sub.add_parser("testbed", help="run a command once per rank in a simulated cluster (root)")
    tb.add_argument("--nodes", type=int, default=2)
    tb.add_argument("--ranks-per-node", type=int, default=2)
    tb.add_argument("--inter-node-rate", default=None, help="tc tbf rate of each node's link, e.g. 100mbit, 1gbit")
    tb.add_argument("--rank-cpu", default=None, help="per-rank CPU quotas in cores, e.g. 0.25,0.75,0.5,0.5")
    tb.add_argument("--timeout", type=float, default=1800)
    tb.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- hetcomm bench allreduce")
    tb.set_defaults(fn=_testbed)

    i = sub.add_parser("info", help="what this build of hetcomm contains")
    i.set_defaults(fn=_info)

    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main(sys.argv[1:])
