"""The `hetcomm` command line: demo, bench, topo, testbed, info (its argument types: hetcomm.cliargs)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional

from .cliargs import (burst, checked, choices_list, comma_list, mode_list, network, nonneg_int, param_count,
                      positive_float, positive_int, quotas, rate, size_bytes, writable_path)


def _demo(args) -> None:
    from . import demo

    demo.main(ranks=args.ranks, modes=args.modes, steps=args.steps,
              batch=args.batch, json_path=args.json, lr=args.lr, png_path=args.plot)


def _bench(args) -> None:
    if args.what == "compress":
        from .benchmarks import common, compress

        compress.main(sizes=common.size_sweep(args.minbytes, args.maxbytes, args.stepfactor), iters=args.iters,
                      warmup=args.warmup, json_path=args.json, threads=args.threads, device=args.device)
    elif args.what == "allreduce":
        from .benchmarks import allreduce, common

        allreduce.main(sizes=common.size_sweep(args.minbytes, args.maxbytes, args.stepfactor),
                       algos=args.algos, wires=args.wires, iters=args.iters, warmup=args.warmup,
                       check=args.check, ranks=args.ranks, json_path=args.json, device=args.device,
                       png_path=args.plot, pieces=args.pieces)
    elif args.what == "links":
        from .benchmarks import common, links

        links.main(sizes=common.size_sweep(args.minbytes, args.maxbytes, args.stepfactor), patterns=args.patterns,
                   iters=args.iters, warmup=args.warmup, json_path=args.json, link_rate=args.link_rate)
    elif args.what == "train":
        from .benchmarks import train

        train.main(ranks=args.ranks, tasks=args.tasks, optims=args.optims, modes=args.modes, scale=args.scale,
                   eval_every=args.eval_every, json_path=args.json, png_path=args.png, lr_scale=args.lr_scale,
                   seeds=args.seeds, clip=args.clip_grad_norm, clip_handed=args.clip_handed,
                   schedule=args.schedule, device=args.device, bucket_mb=args.bucket_mb,
                   reference=args.reference, first_seed=args.first_seed)
    elif args.what == "precision":
        from .benchmarks import precision

        precision.main(ranks=args.ranks, configs=args.configs, modes=args.modes, task=args.task, optims=args.optims,
                       steps=args.steps, overflow_at=args.overflow_at, eval_every=args.eval_every,
                       json_path=args.json, png_path=args.png)
    elif args.what == "ddp" and args.grid:
        from .benchmarks import grid

        grid.main(networks=args.networks, params=args.grid_params, ranks=args.grid_ranks,
                  modes=args.modes or grid.DEFAULT_MODES, iters=args.iters, warmup=args.warmup,
                  global_batch=args.global_batch, json_path=args.json, rounds=args.rounds)
    elif args.what == "ddp":
        from .benchmarks import ddp

        ddp.main(ranks=args.ranks, modes=args.modes, params=args.params, global_batch=args.global_batch,
                 steps=args.iters, warmup=args.warmup, rank_cpu=args.rank_cpu, json_path=args.json,
                 algorithm=args.algorithm, device=args.device, layers=args.layers, bucket_mb=args.bucket_mb,
                 rounds=args.rounds)


def _topo(args) -> None:
    from .launch import run_distributed

    res = run_distributed(_topo_worker, args.ranks, args.wires)
    if res is None:
        return
    text, data = res
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=2)


def _topo_worker(rank, world, wires):
    import torch.distributed as dist

    from . import planner, topology
    from .amp import precision_for
    from .negotiation import across_nodes, link_loads

    topo = topology.detect(use_cache=False)
    precisions = [None] * world
    dist.all_gather_object(precisions, precision_for())
    default = "hierarchical" if across_nodes(topo) else "native"
    text = planner.describe(topo, wires) + "\ncompute precision per rank (hetcomm.amp.precision_for; " \
        "HETCOMM_PRECISION overrides): " + ", ".join(f"{r} {p}" for r, p in enumerate(precisions)) + \
        f"\nfp8 / int3 / onebit / topk / lowrank / fp16 / bf16 at the default algorithm: {default} " + \
        ("(compressed or cast across nodes only)" if default == "hierarchical" else
         "(flat: one node, one rank a node, or nodes of unequal size)")
    if default == "hierarchical":
        ring, hierarchy = link_loads(topo.node_ids)
        text += "\nnone at the default algorithm: native (allreduce_hook's sum; on gloo a ring over all " \
                f"{topo.world} ranks, at least {ring:.2g}x of each bucket on each way of a node's link); " \
                f"algorithm='hierarchical': {hierarchy:.2g}x"
    return text, {"topology": topo.to_json(), "plans": planner.plan_table(topo, wires), "precisions": precisions,
                  "compressed_default": default}


def _testbed(args) -> None:
    from . import testbed

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    sys.exit(testbed.main(args.nodes, args.ranks_per_node, args.inter_node_rate, args.rank_cpu, command, args.timeout,
                          args.sched, args.inter_node_burst))


def _info(args) -> None:
    import hetcomm

    print(json.dumps(hetcomm.build_info(), indent=2))


def main(argv: Optional[List[str]] = None) -> None:
    import hetcomm
    from . import demo, modes, topology
    from .benchmarks import common as bench_common
    from .benchmarks import ddp as bench_ddp
    from .benchmarks import links as bench_links
    from .benchmarks import tasks as bench_tasks
    from .benchmarks import train as bench_train

    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="hetcomm", description="DDP communication for clusters of mixed GPUs",
                                formatter_class=fmt)
    p.add_argument("--version", action="version", version=f"hetcomm {hetcomm.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,bench,topo,testbed,info}")

    d = sub.add_parser("demo", help="train on the digits data over N gloo ranks, once per communication mode",
                       formatter_class=fmt)
    d.add_argument("--ranks", type=positive_int, default=2, help="gloo ranks on this machine")
    d.add_argument("--modes", type=choices_list(list(demo.MODES), "mode"), default=None,
                   help=f"comma-separated modes (default {','.join(demo.DEFAULT_MODES)})")
    d.add_argument("--steps", type=positive_int, default=600)
    d.add_argument("--batch", type=positive_int, default=32, help="samples per rank per step")
    d.add_argument("--lr", type=positive_float, default=0.02, help="SGD learning rate (momentum 0.9)")
    d.add_argument("--json", type=writable_path, default=None, metavar="PATH", help="also write the numbers as JSON")
    d.add_argument("--plot", type=writable_path, default=None, metavar="PATH",
                   help="training loss per mode and step times, as a PNG (needs matplotlib)")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="benchmarks (nccl-tests style tables)", formatter_class=fmt)
    bs = b.add_subparsers(dest="what", required=True)

    def common(q, sizes=True):
        if sizes:
            q.add_argument("-b", "--minbytes", type=size_bytes, default=size_bytes("256K"),
                           help="smallest input size in bytes (K/M/G or KiB/MiB/GiB)")
            q.add_argument("-e", "--maxbytes", type=size_bytes, default=size_bytes("64M"),
                           help="largest input size in bytes")
            q.add_argument("-f", "--stepfactor", type=positive_int, default=4, help="size multiplier between rows (>= 2)")
        q.add_argument("-n", "--iters", type=positive_int, default=10, help="timed iterations")
        q.add_argument("-w", "--warmup", type=nonneg_int, default=2, help="untimed iterations first")
        q.add_argument("--json", type=writable_path, default=None, metavar="PATH")

    c = bs.add_parser("compress", help="each codec's GB/s next to pure torch and the memory bandwidth",
                      formatter_class=fmt)
    common(c)
    c.add_argument("--threads", type=positive_int, default=None, help="torch intra-op threads (default: torch's)")
    c.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda needs a CUDA build of hetcomm")
    a = bs.add_parser("allreduce", help="time, algbw, busbw, #wrong per size x algorithm x wire", formatter_class=fmt)
    common(a)
    a.add_argument("--ranks", type=positive_int, default=2, help="local gloo ranks when not under torchrun/testbed")
    a.add_argument("--algos", type=choices_list(topology.ALGORITHMS, "algorithm"), default=None,
                   help="comma-separated algorithms (default: all that apply)")
    a.add_argument("--wires", type=choices_list(("none", "fp16", "bf16", "fp8", "int3", "onebit", "topk"), "wire"), default=None,
                   help="comma-separated wire formats (default none,fp16,onebit)")
    a.add_argument("--pieces", type=comma_list(nonneg_int), default=[0],
                   help="pieces the onebit/fp8/int3 exchange (native, or across nodes) is pipelined in, 0: by the size "
                        "(the hook's); several side by side, e.g. 1,0")
    a.add_argument("-c", "--check", type=int, choices=[0, 1], default=1,
                   help="compare with a float64 sum of random inputs (1) or not (0); see max_err and #wrong")
    a.add_argument("--plot", type=writable_path, default=None, metavar="PATH",
                   help="busbw against size per algorithm and wire, as a PNG (needs matplotlib)")
    a.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    lk = bs.add_parser("links", help="what the link between two nodes delivers to one flow, several flows and a ring "
                       "step (plain send/recv; inside `hetcomm testbed`)", formatter_class=fmt)
    common(lk)
    lk.add_argument("--patterns", type=choices_list(bench_links.PATTERNS, "pattern"), default=None,
                    help=f"comma-separated traffic patterns (default: {','.join(bench_links.PATTERNS)})")
    lk.add_argument("--link-rate", type=rate, default=None,
                    help="the link's rate for the 'of rate' column (default: the testbed's --inter-node-rate)")
    g = bs.add_parser("ddp", help="real DDP steps: PyTorch's hooks next to hetcomm's modes", formatter_class=fmt)
    common(g, sizes=False)
    g.add_argument("--ranks", type=positive_int, default=2, help="gloo ranks on this machine")
    g.add_argument("--rank-cpu", type=quotas, default=None, help="per-rank CPU quotas in cores, e.g. 0.25,0.75 (root)")
    g.add_argument("--params", type=param_count, default=param_count("1M"), help="model size in parameters (K/M/B)")
    g.add_argument("--global-batch", type=positive_int, default=64, help="samples per step over all ranks")
    g.add_argument("--rounds", type=positive_int, default=1,
                   help="run the modes this many times, taking turns, and pool their timed steps (noise)")
    g.add_argument("--layers", type=positive_int, default=2, help="hidden layers of the MLP (more: more buckets)")
    g.add_argument("--bucket-mb", type=positive_float, default=25.0,
                   help="DDP's bucket_cap_mb for every mode but PowerSGD (which takes one bucket)")
    g.add_argument("--modes", type=mode_list(bench_ddp.check_mode), default=None,
                   help="comma-separated modes (default: all; +bal = balanced; onebit-cN, fp8-cN, int3-cN: N elements per "
                        "scale; topk-kN: N per mille of the entries; auto: HookState('auto') as the README "
                        "recommends, no attach_optimizer; auto+m: with it)")
    g.add_argument("--algorithm", default="default", choices=("default", "auto") + topology.ALGORITHMS,
                   help="HookState(algorithm=...) of hetcomm's modes; default: HookState's (auto for auto, "
                        "native otherwise, hierarchical for a compressed mode on several nodes of several ranks)")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: model and buckets on GPUs (NCCL with a GPU per rank, else gloo ranks sharing them)")
    g.add_argument("--grid", action="store_true",
                   help="run every cell of --networks x --grid-params x --grid-ranks (a shaped network under "
                        "`hetcomm testbed`, 2 nodes, root) and compare auto with the best fixed mode per cell")
    g.add_argument("--networks", type=comma_list(network), default=["loopback", "1gbit", "100mbit"],
                   help="grid: loopback and/or inter-node rates")
    g.add_argument("--grid-params", type=comma_list(param_count), default=[10**6, 5 * 10**6],
                   help="grid: model sizes")
    g.add_argument("--grid-ranks", type=comma_list(positive_int), default=[2, 4],
                   help="grid: rank counts (even: split over 2 nodes when shaped)")

    tr = bs.add_parser("train", help="time to accuracy: real models, each optimizer and mode at fp32's lr",
                       formatter_class=fmt)
    tr.add_argument("--ranks", type=positive_int, default=2, help="local gloo ranks when not under torchrun/testbed")
    tr.add_argument("--tasks", type=choices_list(list(bench_tasks.TASKS), "task"), default=bench_tasks.DEFAULT_TASKS,
                    help="comma-separated tasks (wide: digits with a 4x wider MLP, bound by communication on a "
                         "slow link; cnn: digits through convolutions with batch norm; wide-regress: the regression "
                         "through 1024-wide layers, a gradient rank 4 does not carry; rnn: the language model's text "
                         "through an LSTM; none run unless named)")
    tr.add_argument("--optims", type=choices_list(bench_train.OPTIMIZERS, "optimizer"),
                    default=bench_train.DEFAULT_OPTIMIZERS,
                    help=bench_train.OPTIMIZERS_HELP)
    tr.add_argument("--modes", type=mode_list(modes.get), default=bench_train.DEFAULT_MODES,
                    help="comma-separated modes (fp32 is always run: it sets the target); lowrank-rN and "
                         "torch-powersgd-rN set the rank, onebit-cN, fp8-cN and int3-cN the elements per scale, topk-kN "
                         "its entries in per mille (topk-k30: 3 %%); +m "
                         "compresses the optimizer's momentum (attach_optimizer; -pN after it: a warm-up of N %% "
                         "of the run, warmup_fraction), +lr keeps the gradient's error feedback in the optimizer's "
                         "learning-rate units (follow_lr); @ALGO last sets a hetcomm mode's algorithm "
                         "(fp8@hierarchical)")
    tr.add_argument("--scale", type=positive_float, default=1.0, help="multiplies each task's number of steps")
    tr.add_argument("--lr-scale", type=positive_float, default=1.0,
                    help="multiplies every task's learning rate (fp32's best at 1.0), to check sensitivity")
    tr.add_argument("--schedule", type=checked(bench_train.check_schedule), default="constant",
                    help="the learning rate over each run: constant; warmup (a linear warm-up over the first 5 %% "
                         "of the steps, then constant; warmup:N over N steps); cosine (the same warm-up, then a "
                         "cosine decay to 0, cosine:N; the task's lr is the peak); onecycle (torch's OneCycleLR at the "
                         "task's lr, its momentum cycled too)")
    tr.add_argument("--eval-every", type=positive_int, default=20, help="steps between quality measurements")
    tr.add_argument("--bucket-mb", type=positive_float, default=None,
                    help="DDP's bucket_cap_mb for every mode but PowerSGD (which takes one bucket); default: DDP's "
                         "(a first bucket of 1 MB, then 25 MB)")
    tr.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: each rank's model and buckets on a GPU (NCCL with a GPU per rank, else gloo ranks "
                         "sharing them); needs a CUDA build of hetcomm")
    tr.add_argument("--seeds", type=positive_int, default=1,
                    help="runs per mode with different initialisation and data order; >1 adds a table of means")
    tr.add_argument("--first-seed", type=nonneg_int, default=0, metavar="N",
                    help="run seeds N .. N + --seeds - 1 (to add seeds to an earlier run without repeating its own)")
    tr.add_argument("--reference", default=None, metavar="JSON",
                    help="take fp32's runs (the targets) from an earlier --json of the same tasks, optimizers, "
                         "seeds, steps and ranks instead of running fp32 again (its quality does not depend on the "
                         "link: measure it once on a fast one); 'vs fp32' then compares with that run's times")
    tr.add_argument("--clip-grad-norm", type=positive_float, default=None, metavar="C",
                    help="clip every step's gradients at norm C (hetcomm's modes by the reduced gradient's norm: "
                         "HookState.clip_grad_norm_)")
    tr.add_argument("--clip-handed", action="store_true",
                    help="with --clip-grad-norm: hetcomm's modes clip with torch.nn.utils.clip_grad_norm_ too, by "
                         "the handed gradient's norm (what a loop written for plain DDP does)")
    tr.add_argument("--json", type=writable_path, default=None, metavar="PATH")
    tr.add_argument("--plot", "--png", dest="png", type=writable_path, default=None, metavar="PATH",
                    help="quality against time per mode, as a PNG (needs matplotlib)")

    pr = bs.add_parser("precision", help="each rank in its own precision (bf16 / fp16 + loss scaling / fp32) "
                       "next to all-fp32 and all-fp16: loss curves, replicas, skipped steps", formatter_class=fmt)
    pr.add_argument("--ranks", type=positive_int, default=2, help="local gloo ranks when not under torchrun/testbed")
    pr.add_argument("--configs", type=comma_list(str), default=["fp32", "fp16", "mixed", "naive"],
                    help="comma-separated: fp32, fp16, mixed (bf16/fp16 alternating), mixed3 (bf16/fp16/fp32), naive "
                    "(mixed with torch's GradScaler and allreduce_hook), or precisions per rank such as bf16/fp16/fp32; fp32 is "
                    "always run")
    pr.add_argument("--modes", type=choices_list(("none", "fp16", "bf16", "fp8", "int3", "onebit", "onebit+m", "topk", "topk+m",
                                                  "lowrank", "auto", "auto+m"), "mode"),
                    default=["none", "onebit+m"], help="hetcomm compression modes, each run per config (+m: the "
                    "optimizer's momentum compressed, attach_optimizer)")
    pr.add_argument("--task", choices=list(bench_tasks.TASKS), default="regress")
    pr.add_argument("--optims", type=choices_list(bench_train.OPTIMIZERS, "optimizer"),
                    default=bench_train.DEFAULT_OPTIMIZERS,
                    help=bench_train.OPTIMIZERS_HELP)
    pr.add_argument("--steps", type=positive_int, default=200)
    pr.add_argument("--overflow-at", type=nonneg_int, default=100,
                    help="step at which the first fp16 rank's loss overflows (every rank must skip it)")
    pr.add_argument("--eval-every", type=positive_int, default=10, help="steps between loss measurements")
    pr.add_argument("--json", type=writable_path, default=None, metavar="PATH")
    pr.add_argument("--plot", "--png", dest="png", type=writable_path, default=None, metavar="PATH",
                    help="loss curves, as a PNG (needs matplotlib)")

    t = sub.add_parser("topo", help="detect and measure the topology; print it and the plan table",
                       formatter_class=fmt)
    t.add_argument("--ranks", type=positive_int, default=2, help="local gloo ranks when not under torchrun / testbed")
    t.add_argument("--wires", type=choices_list(("none", "fp16", "bf16", "fp8", "int3", "onebit"), "wire"), default=["none", "onebit"],
                   help="wire formats of the plan table")
    t.add_argument("--json", type=writable_path, default=None, metavar="PATH")
    t.set_defaults(fn=_topo)

    tb = sub.add_parser("testbed", help="run a command once per rank in a simulated cluster (root)",
                        formatter_class=fmt)
    tb.add_argument("--nodes", type=positive_int, default=2)
    tb.add_argument("--ranks-per-node", type=positive_int, default=2)
    tb.add_argument("--inter-node-rate", type=rate, default=None, help="tc tbf rate of each node's link, e.g. 100mbit")
    tb.add_argument("--inter-node-burst", type=burst, default=None,
                    help="tc tbf burst of each node's link, e.g. 400kbit (50 KB): what a message may send at once after "
                         "the link was idle (default: 1 ms of the rate, at least 64kbit; before 2026-12-06 4 ms)")
    tb.add_argument("--rank-cpu", type=quotas, default=None, help="per-rank CPU quotas in cores, e.g. 0.25,0.75,0.5,0.5")
    tb.add_argument("--timeout", type=positive_float, default=1800,
                    help="seconds before the ranks are stopped (long benchmarks need more)")
    tb.add_argument("--sched", choices=("normal", "batch"), default=None,
                    help="the ranks' Linux scheduling policy (default: this process's): batch (SCHED_BATCH) keeps "
                         "ranks that share a few cores from preempting each other at every message, as ranks on "
                         "cores of their own do not")
    tb.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command, e.g. -- hetcomm bench allreduce")
    tb.set_defaults(fn=_testbed)

    i = sub.add_parser("info", help="what this build of hetcomm contains")
    i.set_defaults(fn=_info)

    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    bench_common.set_command(argv)  # the results' "command": these arguments, also when called from Python
    if args.cmd == "bench":
        args.fn = _bench
        if args.what in ("compress", "allreduce", "links"):
            if args.stepfactor < 2:
                p.error("-f/--stepfactor must be >= 2")
            if args.minbytes > args.maxbytes:
                p.error(f"need -b <= -e (got {args.minbytes} > {args.maxbytes} bytes)")
        elif args.what == "ddp" and args.rank_cpu is not None and len(args.rank_cpu) != args.ranks:
            p.error(f"--rank-cpu needs one quota per rank ({args.ranks}), got {len(args.rank_cpu)}")
        elif args.what == "ddp" and args.grid and any(r < 2 or r % 2 for r in args.grid_ranks):
            p.error(f"--grid-ranks must be even and >= 2 (the testbed splits them over 2 nodes), got {args.grid_ranks}")
        elif args.what == "train" and args.reference is not None:
            try:  # before any rank starts: the reference must hold every fp32 run this one needs
                bench_train.reference_runs(args.reference, args.ranks, args.tasks, args.optims, args.modes,
                                           args.scale, args.eval_every, args.lr_scale, args.seeds,
                                           args.clip_grad_norm, args.schedule, args.device, args.bucket_mb,
                                           args.first_seed)
            except ValueError as e:
                p.error(str(e))
    if args.cmd == "testbed":
        if args.rank_cpu is not None and len(args.rank_cpu) != args.nodes * args.ranks_per_node:
            p.error(f"--rank-cpu needs one quota per rank ({args.nodes * args.ranks_per_node}), "
                    f"got {len(args.rank_cpu)}")
        if not [c for c in args.command if c != "--"]:
            p.error("testbed needs a command after --")
        if args.inter_node_burst is not None and args.inter_node_rate is None:
            p.error("--inter-node-burst needs --inter-node-rate (an unshaped link has no token bucket)")
    args.fn(args)


if __name__ == "__main__":
    main(sys.argv[1:])
