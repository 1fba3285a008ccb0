"""A prototype of int3 with its payload compressed by zstd, timed against
the same hook without it: each MODE (``raw``: int3's three bit-plane words as
they are; ``zstd``: compressed at level 1 into a capacity every rank derives
from the last step's messages, the raw words exchanged again where one does
not fit; ``zstd-lengths``: the ranks' compressed lengths all-gathered first,
then the longest one's capacity) is a plain Python comm hook on two ranks (int3 of the gradient with
error feedback, one all-gather of whole messages, every rank decoding both
in rank order), run for STEPS steps of TASK with OPTIM, the modes in turns
REPS times; printed, each run's mean step of steps 40 on and the bytes a step.
It measures what fewer bytes buy where int3's step is the link's (digits with
a core per rank), not hetcomm's hook: no overlap with backward, no pieces, no
finiteness flag. Needs zstandard (``pip install zstandard``). Run once per
rank under torch.distributed's env:// variables (bench/README "Digits with a
core per rank: int3's bytes are its step"):

    hetcomm testbed --nodes 2 --ranks-per-node 1 --inter-node-rate 100mbit --sched batch -- \\
        python bench/int3_zstd_hook.py classify sgd 300 3 raw,zstd,zstd-lengths
"""
import statistics
import sys

import torch
import torch.distributed as dist
from torch import nn

from hetcomm import ops
from hetcomm.benchmarks import common, tasks, train

try:
    import zstandard
except ImportError as e:  # pragma: no cover - an optional benchmark
    sys.exit(f"bench/int3_zstd_hook.py needs zstandard (pip install zstandard): {e}")

HEADER = 8  # bytes: the compressed length (-1: did not fit), then the raw length


class Int3Hook:
    def __init__(self, compress: bool, lengths_first: bool = False):
        self.compress = compress
        self.lengths_first = lengths_first
        self.residual = {}
        self.cap = {}  # bucket -> payload capacity in bytes, the same on every rank
        self.sent = 0
        self.steps = 0
        self.z, self.unz = zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor()

    def reduce(self, bucket):
        g, w = bucket.buffer(), dist.get_world_size()
        i = bucket.index()
        res = self.residual.setdefault(i, torch.zeros_like(g))
        words, scales = ops.int3_encode(g, res, float(w))
        planes = words.view(torch.uint8)
        raw_len = planes.numel()
        cap = self.cap.get(i, raw_len) if self.compress else raw_len
        body = planes
        length = raw_len
        if self.compress:
            packed = self.z.compress(planes.numpy().tobytes())
            if self.lengths_first:  # a round trip of the lengths, then the longest one's capacity
                lengths = [torch.zeros(1, dtype=torch.int32) for _ in range(w)]
                dist.all_gather(lengths, torch.tensor([len(packed)], dtype=torch.int32))
                self.sent += 4
                cap = min(raw_len, (max(int(v) for v in lengths) + 3) // 4 * 4)
            length = len(packed) if len(packed) <= cap else -1
            body = (torch.frombuffer(bytearray(packed), dtype=torch.uint8) if length >= 0
                    else torch.zeros(0, dtype=torch.uint8))
        msg = torch.zeros(HEADER + cap + scales.numel() * 2, dtype=torch.uint8)
        msg[:HEADER].view(torch.int32).copy_(torch.tensor([length, raw_len], dtype=torch.int32))
        msg[HEADER:HEADER + body.numel()].copy_(body[:cap])
        msg[HEADER + cap:].copy_(scales.view(torch.uint8))
        got = [torch.empty_like(msg) for _ in range(w)]
        dist.all_gather(got, msg)
        self.sent += msg.numel()
        heads = [m[:HEADER].view(torch.int32).tolist() for m in got]
        raw_again = None
        if any(h[0] < 0 for h in heads):  # one did not fit: every rank sends its raw words once more
            raw_again = [torch.empty_like(planes) for _ in range(w)]
            dist.all_gather(raw_again, planes.contiguous())
            self.sent += planes.numel()
        out = torch.zeros_like(g)
        for r, m in enumerate(got):
            length = heads[r][0]
            if raw_again is not None:
                p = raw_again[r]
            elif self.compress:
                p = torch.frombuffer(bytearray(self.unz.decompress(m[HEADER:HEADER + length].numpy().tobytes())),
                                     dtype=torch.uint8)
            else:
                p = m[HEADER:HEADER + raw_len]
            s = m[HEADER + cap:].view(torch.bfloat16)
            ops.int3_decode(p.view(torch.int32), s, g.numel(), out=out, accumulate=True)
        if self.compress:  # the next capacity: the largest length every rank saw, with a margin, the scales aligned
            fit = [h[0] for h in heads if h[0] >= 0]
            self.cap[i] = raw_len if not fit else min(raw_len, (int(max(fit) * 1.15) + 64) // 4 * 4)
        self.steps += bucket.is_last()
        fut = torch.futures.Future()
        fut.set_result(out)
        return fut


def _hook(state, bucket):  # DDP checks a hook's parameter names
    return state.reduce(bucket)


def one_run(task_name: str, optim: str, steps: int, mode: str, rank: int):
    task = tasks.TASKS[task_name]()
    ddp = nn.parallel.DistributedDataParallel(task.model())
    opt = train.make_optimizer(optim, ddp.parameters(), train.task_lr(task, optim))
    hook = Int3Hook(mode.startswith("zstd"), mode == "zstd-lengths")
    ddp.register_comm_hook(hook, _hook)
    times = common.timed_steps(ddp, opt, task, rank, steps)
    return 1000 * statistics.mean(times[40:]), hook.sent / max(hook.steps, 1), task.evaluate(ddp.module)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    task_name, optim, steps, reps, modes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        sys.argv[5].split(",")
    means = {m: [] for m in modes}
    for mode in (modes + modes[::-1]) * reps:
        ms, sent, quality = one_run(task_name, optim, steps, mode, rank)
        means[mode].append(ms)
        if rank == 0:
            print(f"{mode}: mean step {ms:.2f} ms, {sent / 1e3:.1f} KB sent a step, {quality}", flush=True)
    if rank == 0:
        for m, v in means.items():
            print(f"{m:6s} mean of the runs' means {statistics.mean(v):.2f} ms  (runs: {[round(x, 2) for x in v]})")
    dist.destroy_process_group()
