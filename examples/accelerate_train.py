"""Hugging Face Accelerate + hetcomm: checkpoint and resume through
``accelerator.save_state`` / ``load_state``.

    torchrun --nproc_per_node 2 examples/accelerate_train.py --steps 60 --save-at 30 --out /tmp/acc
    torchrun --nproc_per_node 2 examples/accelerate_train.py --steps 60 --save-at 30 --out /tmp/acc --resume

(``accelerate launch --num_processes 2 --cpu`` starts it as well.) Trains an
MLP on scikit-learn's digits with SGD (momentum 0.9), its momentum in onebit
(``attach_optimizer`` on Accelerate's prepared optimizer, a fifth of the run
as warm-up) unless --compression/--no-attach say otherwise, in micro-batches of
--batch accumulated over --accumulate (``accelerator.accumulate``: DDP's
no_sync). --save-at N: ``save_state`` after step N into <out>/state (each
rank's hetcomm state beside Accelerate's files); --resume: ``load_state`` from
there (saved after step --save-at) and on to --steps; --clip C:
``accelerator.clip_grad_norm_`` at C (by the reduced gradient's norm). Rank 0
prints a JSON line at the end, with what the ``hetcomm`` logger warned of there.
"""

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator

import hetcomm
import hetcomm.integrations.accelerate
from hetcomm.demo import load_digits, make_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60, help="optimizer steps of the whole run")
    p.add_argument("--compression", default="onebit")
    p.add_argument("--no-attach", action="store_true", help="compress the gradient (no attach_optimizer)")
    p.add_argument("--batch", type=int, default=16, help="samples per micro-batch and rank")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--out", required=True)
    p.add_argument("--save-at", type=int, default=-1)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--clip", type=float, default=0.0, help="accelerator.clip_grad_norm_ at this norm (0: off)")
    args = p.parse_args()
    warned = []  # what the hetcomm logger warned of on this rank

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logging.getLogger("hetcomm").addHandler(Seen(logging.WARNING))

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate)
    rank, world = accelerator.process_index, accelerator.num_processes
    x, y, x_test, y_test = load_digits()
    model = make_model(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = accelerator.prepare(model, opt)
    state = hetcomm.integrations.accelerate.register(accelerator, model, hetcomm.HookState(args.compression))
    if not args.no_attach:
        state.attach_optimizer(opt, total_steps=args.steps)  # (it takes the torch optimizer Accelerate wraps)
    folder = os.path.join(args.out, "state")
    start = 0
    if args.resume:
        if args.save_at <= 0:
            p.error("--resume needs --save-at: the step the state was saved after")
        accelerator.load_state(folder)
        start = args.save_at
    for step in range(start, args.steps):
        for micro in range(args.accumulate):
            g = torch.Generator().manual_seed((step * args.accumulate + micro) * world + rank)
            idx = torch.randint(0, len(y), (args.batch,), generator=g)
            with accelerator.accumulate(model):  # no_sync but on the last micro-batch, which steps
                accelerator.backward(torch.nn.functional.cross_entropy(model(x[idx]), y[idx]))
                if args.clip and accelerator.sync_gradients:  # by the reduced gradient's norm, through the state
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                opt.step()
                opt.zero_grad()
        if step + 1 == args.save_at and not args.resume:
            accelerator.save_state(folder)
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every = [None] * world
    dist.all_gather_object(every, flat)
    with torch.no_grad():
        acc = (model.module(x_test).argmax(1) == y_test).float().mean().item()
    stats = state.stats()
    if rank == 0:
        print(json.dumps({"steps": args.steps, "hook_steps": state.iter, "accuracy": acc,
                          "replicas_identical": all(torch.equal(flat, f) for f in every),
                          "plans": sorted(f"{q['mode']}/{q['algorithm']}" for q in stats["plans"].values()),
                          "files": sorted(os.listdir(folder)) if os.path.isdir(folder) else [],
                          "checksum": float(flat.double().sum()), "warnings": warned,
                          "clip_calls": stats.get("clip", {}).get("calls", 0)}))
    state.close()
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
