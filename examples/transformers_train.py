"""Hugging Face transformers' Trainer + hetcomm: checkpoint and resume through
the Trainer's own ``checkpoint-N`` folders.

    torchrun --nproc_per_node 2 examples/transformers_train.py --steps 40 --save-at 20 --out /tmp/hf
    torchrun --nproc_per_node 2 examples/transformers_train.py --steps 40 --save-at 20 --out /tmp/hf --resume

Trains an MLP on scikit-learn's digits (a module whose forward takes the
batch's ``labels`` and returns the loss, as a Trainer wants) with the
Trainer's defaults for a fine-tune: AdamW (--optim sgd: SGD with momentum 0.9;
--attach: its momentum compressed, ``attach_optimizer``) with a linear schedule and a warm-up
of a tenth, the gradient clipped at norm 1 (--max-grad-norm), 2 micro-batches of --batch a step
(gradient accumulation), the Trainer's own DDP settings (for a model that is not a
``PreTrainedModel``: ``find_unused_parameters=True``), and the gradient in --compression (default int3;
``auto`` decides by measured step times, so its runs do not repeat bit for
bit). --save-at N: the Trainer's checkpoint after step N (each rank's hook
state beside its files); --resume: ``train(resume_from_checkpoint=...)`` from
it, on to --steps; --resume-fresh: the same with the checkpoint's hetcomm
files removed first (the hook's state starts afresh). Rank 0 prints a JSON
line at the end, with what the ``hetcomm`` logger warned of there.
"""

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainingArguments

import hetcomm
import hetcomm.integrations.transformers
from hetcomm.demo import load_digits, make_model


class Digits(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "labels": self.y[i]}


class Classifier(nn.Module):
    """hetcomm.demo's MLP, its loss computed from the batch's labels."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model(seed=0)

    def forward(self, x, labels=None):
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the whole run")
    p.add_argument("--compression", default="int3")
    p.add_argument("--batch", type=int, default=16, help="samples per micro-batch and rank")
    p.add_argument("--out", required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--resume-fresh", action="store_true")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="the Trainer's clipping (0: off)")
    p.add_argument("--optim", choices=("adamw", "sgd"), default="adamw", help="sgd: momentum 0.9")
    p.add_argument("--attach", action="store_true", help="compress the optimizer's momentum (attach_optimizer)")
    p.add_argument("--logging-steps", type=int, default=0, help="log the loss and gradient norm every N steps")
    args = p.parse_args()

    warned = []  # what the hetcomm logger warned of on this rank

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warned.append(record.getMessage())

    logging.getLogger("hetcomm").addHandler(Seen(logging.WARNING))
    x, y, x_test, y_test = load_digits()
    ckpt = os.path.join(args.out, f"checkpoint-{args.save_at}")
    targs = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=2, learning_rate=3e-3 if args.optim == "adamw" else 0.05,
        optim="adamw_torch" if args.optim == "adamw" else "sgd", optim_args="momentum=0.9" if args.optim == "sgd" else None,
        lr_scheduler_type="linear", warmup_steps=args.steps // 10,
        max_grad_norm=args.max_grad_norm, save_strategy="steps" if args.save_at else "no",
        save_steps=args.save_at or 500, logging_strategy="steps" if args.logging_steps else "no",
        logging_steps=args.logging_steps or 500, report_to="none", use_cpu=True, seed=0, dataloader_drop_last=True,
        disable_tqdm=True)
    model = Classifier()
    trainer = Trainer(model=model, args=targs, train_dataset=Digits(x, y))
    state = hetcomm.integrations.transformers.register(trainer, hetcomm.HookState(args.compression),
                                                       attach_optimizer=args.attach)
    if args.resume or args.resume_fresh:
        if args.resume_fresh and targs.process_index == 0:
            for name in os.listdir(ckpt):
                if name.startswith("hetcomm-rank"):
                    os.remove(os.path.join(ckpt, name))
        dist.barrier()
        trainer.train(resume_from_checkpoint=ckpt)
    else:
        trainer.train()
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, flat)
    with torch.no_grad():
        acc = (model.net(x_test).argmax(1) == y_test).float().mean().item()
    stats = state.stats()
    if targs.process_index == 0:
        print(json.dumps({"steps": trainer.state.global_step, "hook_steps": state.iter, "accuracy": acc,
                          "replicas_identical": all(torch.equal(flat, f) for f in every),
                          "plans": sorted({f"{q['mode']}/{q['algorithm']}" for q in stats["plans"].values()}),
                          "files": sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else [],
                          "checksum": float(flat.double().sum()), "warnings": warned,
                          "attached": stats.get("attached"), "clip_calls": stats.get("clip", {}).get("calls", 0),
                          "grad_norms": [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]}))
    state.close()


if __name__ == "__main__":
    main()
