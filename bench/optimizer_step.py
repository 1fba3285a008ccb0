"""One optimizer step of each task's model on one thread, torch's kernels
side by side: ``bench train``'s optimizer as torch runs it unless asked (on
the CPU a loop over the parameters), ``foreach=True`` and ``fused=True``
(``--optims sgd-fused`` / ``adamw-fused``); the median of REPEATS steps after
WARM, in ms, with the gradients fixed and subnormals flushed, as in every run
of ``hetcomm bench train`` (bench/README "torch's fused AdamW"):

    python bench/optimizer_step.py [adamw|sgd] [TASK,...]
"""
import statistics
import sys
import time

import torch

from hetcomm.benchmarks import tasks

WARM, REPEATS = 20, 200
KINDS = {"as it comes": {}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def step_ms(params, optim: str, kind: dict) -> float:
    opt = (torch.optim.AdamW(params, lr=1e-3, **kind) if optim == "adamw"
           else torch.optim.SGD(params, lr=1e-3, momentum=0.9, **kind))
    times = []
    for i in range(WARM + REPEATS):
        t0 = time.perf_counter()
        opt.step()
        if i >= WARM:
            times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def main() -> None:
    optim = sys.argv[1] if len(sys.argv) > 1 else "adamw"
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(tasks.TASKS)
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    gen = torch.Generator().manual_seed(0)
    print(f"# {optim} at the task's shapes, one thread, median of {REPEATS} steps (ms): " + ", ".join(KINDS))
    for name in names:
        task = tasks.TASKS[name]()
        params = list(task.model().parameters())
        for p in params:
            p.grad = 1e-3 * torch.randn(p.shape, generator=gen)
        times = [step_ms(params, optim, kind) for kind in KINDS.values()]
        print(f"{name:13s} {sum(p.numel() for p in params):>9d} values {len(params):>3d} tensors  " +
              "  ".join(f"{t:7.3f}" for t in times) + f"   fused over as it comes {times[2] / times[0]:.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
