"""PyTorch Lightning + hetcomm: two CPU processes, onebit compression of the
optimizer's momentum, a checkpoint that resumes with each rank's hetcomm state.

    python examples/lightning_train.py --epochs 3 --out /tmp/pl
    python examples/lightning_train.py --epochs 3 --precisions 16-mixed,bf16-mixed --overflow-at 30 --out /tmp/pl16

Prints a JSON line (rank 0) with the hook's step count, the bytes it reduced
and whether the replicas are identical. --precisions: rank r's Lightning
precision is entry r (cycled), as if the ranks were different GPUs: "16-mixed"
(fp16 autocast and loss scaling, which Lightning itself runs on CUDA only: here
its MixedPrecision plugin on the CPU), "bf16-mixed" or "32-true"; the strategy
hands the mixed ones' scalers to hetcomm.amp.GradScaler (a 32-true rank among
them is refused: every rank or none runs one). --device-precisions: each rank
in its device's precision (HetcommDDPStrategy(precision_per_device=True) under
Trainer(precision="bf16-mixed")), the devices' precisions given per rank as
--precisions gives Lightning's (through HETCOMM_PRECISION, as a V100 would say
fp16 and an A100 bf16). --overflow-at N: the loss overflows at step N on the
fp16 ranks. --lbfgs: torch.optim.LBFGS (with --no-attach; Lightning runs it
in 32-true and bf16-mixed, not under a loss scaler).
"""

import argparse
import json
import os

import torch
import torch.distributed as dist

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

from hetcomm.demo import load_digits, make_model
from hetcomm.integrations.lightning import HetcommDDPStrategy

LBFGS_ITERS = 3  # --lbfgs: backward passes (each through the hook) per optimizer step


class Digits(pl.LightningModule):
    def __init__(self, lr: float, cosine: bool = False, overflow_at: int = -1, lbfgs: bool = False) -> None:
        super().__init__()
        self.net, self.lr, self.cosine, self.overflow_at = make_model(seed=0), lr, cosine, overflow_at
        self.lbfgs = lbfgs
        self.taken = 0  # optimizer steps this process took (an overflow on any rank skips the step on every rank)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.global_step == self.overflow_at and self.trainer.precision == "16-mixed":
            loss = loss * 1e9  # scaled, its fp16 backward overflows on this rank
        return loss

    def configure_optimizers(self):
        if self.lbfgs:  # a fixed count of closures a step, the same on every rank (the loss is each rank's own:
            # tolerance_change 0 never stops one rank early on it; no line search, which would read it too)
            opt = torch.optim.LBFGS(self.parameters(), lr=self.lr, max_iter=LBFGS_ITERS, tolerance_change=0.0)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        opt.register_step_post_hook(lambda *_: setattr(self, "taken", self.taken + 1))
        if not self.cosine:
            return opt
        # stepped after every optimizer step; hetcomm's error feedback follows the rate it sets
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def gathered(trainer, model: Digits, x_test: torch.Tensor, y_test: torch.Tensor) -> dict:
    """Whether every rank holds the same parameters, each rank's optimizer
    steps, this rank's test accuracy and its parameters' sum (a collective:
    every rank calls it)."""
    flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    every, taken = [None] * trainer.world_size, [None] * trainer.world_size
    dist.all_gather_object(every, flat)
    dist.all_gather_object(taken, model.taken)
    with torch.no_grad():
        acc = (model.net(x_test).argmax(1) == y_test).float().mean().item()
    return {"replicas_identical": all(torch.equal(flat, f) for f in every), "optimizer_steps": taken,
            "accuracy": acc, "checksum": float(flat.double().sum())}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--compression", default="onebit")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", required=True, help="folder for the checkpoint and the result")
    p.add_argument("--resume", action="store_true", help="continue from <out>/last.ckpt")
    p.add_argument("--devices", type=int, default=2, help="CPU processes (a resumed fit may change it)")
    p.add_argument("--warmup-compression", choices=("none", "fp8"),
                   help="the warm-up's wire (attach_optimizer's warmup_compression; default: its default, fp8 "
                        "since the strategy passes the fit's length)")
    p.add_argument("--cosine", action="store_true", help="a cosine learning-rate schedule over the fit, every step")
    p.add_argument("--no-attach", action="store_true",
                   help="compress the gradient (the strategy's error feedback then follows the optimizer's rate)")
    p.add_argument("--clip", type=float, default=None,
                   help="Trainer(gradient_clip_val=...): clipped by the reduced gradient's norm through hetcomm")
    p.add_argument("--precisions", default=None,
                   help="comma-separated 16-mixed / bf16-mixed / 32-true, rank r takes entry r (cycled); default: 32-true")
    p.add_argument("--device-precisions", default=None,
                   help="comma-separated fp16 / bf16: what rank r's device computes fastest (precision_per_device)")
    p.add_argument("--overflow-at", type=int, default=-1, help="the 16-mixed ranks' loss overflows at this step")
    p.add_argument("--lbfgs", action="store_true",
                   help=f"torch.optim.LBFGS (max_iter {LBFGS_ITERS}) instead of SGD with momentum; with --no-attach")
    args = p.parse_args()

    x, y, x_test, y_test = load_digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device_precisions:  # this rank's device, as hetcomm.amp.precision_for would read it on a GPU
        devices = args.device_precisions.split(",")
        os.environ["HETCOMM_PRECISION"] = devices[local_rank % len(devices)]
    strategy = HetcommDDPStrategy(args.compression, process_group_backend="gloo",  # None: attach_optimizer's default
                                  attach_optimizer=False if args.no_attach else
                                  {"warmup_compression": args.warmup_compression},
                                  precision_per_device=bool(args.device_precisions))
    # Lightning starts a process per rank running this script again (LOCAL_RANK set); Trainer(precision="16-mixed")
    # on a CPU falls back to bf16, its plugin itself runs fp16 there too
    plugins = None
    if args.precisions or args.device_precisions:
        names = (args.precisions or "bf16-mixed").split(",")  # per device: the strategy sets each rank's
        name = names[local_rank % len(names)]
        plugins = None if name == "32-true" else [pl.plugins.precision.MixedPrecision(name, "cpu")]
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=args.out, gradient_clip_val=args.clip,
                         plugins=plugins)
    model = Digits(args.lr, args.cosine, args.overflow_at, args.lbfgs)
    ckpt = os.path.join(args.out, "last.ckpt")
    trainer.fit(model, loader, ckpt_path=ckpt if args.resume else None)
    trainer.save_checkpoint(ckpt)
    state = strategy.hook_state
    ranks = gathered(trainer, model, x_test, y_test)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if trainer.global_rank == 0:
        stats = state.stats()
        result = {**ranks, "hook_steps": state.iter, "global_step": trainer.global_step,
                  "batches_per_epoch": trainer.num_training_batches,  # this world's: a resumed fit may change it
                  "start_iter": state.start_iter, "clip": stats.get("clip"),
                  "followed_lrs": state.state_dict()["lrs"],  # the rate error feedback is in units of
                  "bytes_sent": stats["total"]["bytes_sent"], "fp32_bytes": stats["total"]["fp32_bytes"],
                  "scaler": scaler and type(scaler).__module__ + "." + type(scaler).__name__,
                  "loss_scale": scaler and scaler.get_scale(), "precisions": stats.get("precisions")}
        print(json.dumps(result))
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump(result, f)
    # stop hetcomm's comm thread and free the gloo group now, not while the interpreter exits (as the torchrun
    # examples do: a group freed during finalization can abort the process)
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
