"""DDP steps on one GPU, mode by mode: the median step and where its time goes.

    python3 bench/gpu/profile_steps.py OUT_DIR [MODES]   (default lowrank,torch-powersgd)

Two gloo ranks share GPU 0 (as `bench ddp --device cuda --ranks 2` does) and
train an MLP of about 25M parameters (1024-3500-3500-2048-10, batch 128 a
rank, SGD with momentum). Each mode: 30 warm-up steps, the median of 60 timed
steps (p10 and p90 too), then rank 0 runs 5 steps under torch.profiler. Writes
OUT_DIR/prof.json (the step times), tables_MODE.txt (by self CUDA time, then
self CPU time) and trace_MODE.json (chrome://tracing: the comm thread's CUDA
calls show there, its ATen ops do not). DEV=cpu runs the same on the CPU
(a check of the script, no CUDA profile). MODEL=ddp profiles `bench ddp`'s
model instead (25M parameters in 2 hidden layers of 4870: one 4870 x 4870
matrix holds 95 % of them; input 256)."""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from hetcomm import modes as mode_table
from hetcomm.launch import run_distributed


def _model():
    """The model and its input width."""
    if os.environ.get("MODEL", "mlp") == "ddp":
        from hetcomm.benchmarks.ddp import IN, model_for
        return model_for(25_000_000), IN
    return _mlp(), 1024


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(1024, 3500), nn.ReLU(), nn.Linear(3500, 3500), nn.ReLU(),
                         nn.Linear(3500, 2048), nn.ReLU(), nn.Linear(2048, 10))


def worker(rank, world, modes, out_dir):
    from torch.profiler import ProfilerActivity, profile

    cuda = os.environ.get("DEV", "cuda") == "cuda"
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results = {}
    for mode in modes:
        torch.manual_seed(0)
        m = mode_table.get(mode)
        model, width = _model()
        ddp = nn.parallel.DistributedDataParallel(model.to(dev), **({"device_ids": [0]} if cuda else {}),
                                                  **m.ddp_options(None))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        state = m.register(ddp, opt, total_steps=200)
        g = torch.Generator(device=dev).manual_seed(rank)
        x = torch.randn(128, width, device=dev, generator=g)
        y = torch.randint(0, 10, (128,), device=dev, generator=g)

        def step():
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()

        for _ in range(30):
            step()
        sync()
        times = []
        for _ in range(60):
            t0 = time.perf_counter()
            step()
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        r = {"median_ms": statistics.median(times), "p10_ms": times[6], "p90_ms": times[54]}
        if rank == 0:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                for _ in range(5):
                    step()
                sync()
            table = prof.key_averages()
            by_device = table.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=18,
                                    max_name_column_width=60)
            with open(os.path.join(out_dir, f"tables_{mode}.txt"), "w") as f:
                f.write(by_device + "\n" + table.table(sort_by="self_cpu_time_total", row_limit=18,
                                                       max_name_column_width=60))
            prof.export_chrome_trace(os.path.join(out_dir, f"trace_{mode}.json"))
        else:
            for _ in range(5):
                step()
            sync()
        if state is not None:
            state.close()
        results[mode] = r
        dist.barrier()
    return results


def main() -> None:
    out = sys.argv[1]
    modes = (sys.argv[2] if len(sys.argv) > 2 else "lowrank,torch-powersgd").split(",")
    os.makedirs(out, exist_ok=True)
    r = run_distributed(worker, 2, modes, out)
    if r is None:
        return
    for mode, v in r.items():
        print(f"{mode}: median {v['median_ms']:.2f} ms a step (p10 {v['p10_ms']:.2f}, p90 {v['p90_ms']:.2f})")
    with open(os.path.join(out, "prof.json"), "w") as f:
        json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
