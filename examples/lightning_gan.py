"""A GAN in PyTorch Lightning the usual way: generator and discriminator in
one LightningModule (one DDP model, ``find_unused_parameters=True``), manual
optimization, ``toggle_optimizer`` switching the other model's parameters off
for each backward. Two CPU processes; the same fit under Lightning's own
``DDPStrategy`` (fp32 all-reduce) and under ``HetcommDDPStrategy``:

    python examples/lightning_gan.py --compression int3 [--optim adam] [--attach]

``--attach`` (with Adam): both optimizers attached together
(``HetcommDDPStrategy(attach_optimizer=True)``: their momentum compressed,
each parameter's read from its own Adam).

Each backward leaves the other model's parameters unused on every rank; DDP
then writes no gradient of them, and hetcomm puts their state slots back after
the backward (hetcomm/unused.py), so their error feedback is not lost. The
switched-off parameters' optimizer does not step, and hetcomm's exact first
steps follow each parameter's own steps (hetcomm/own_steps.py): the
discriminator's first step, DDP's second, is exact as the generator's. Prints
a JSON line (rank 0): the hetcomm fit's distance to the fp32 fit's parameters
over the distance those moved, and whether the replicas are identical.
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

from hetcomm.integrations.lightning import HetcommDDPStrategy


class GAN(pl.LightningModule):
    def __init__(self, optim: str = "sgd") -> None:
        super().__init__()
        self.optim = optim
        torch.manual_seed(0)
        self.g = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 32))
        self.d = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
        self.automatic_optimization = False

    def training_step(self, batch, _):
        (real,) = batch
        opt_g, opt_d = self.optimizers()
        noise = torch.Generator().manual_seed(1000 * self.global_rank + int(self.global_step))
        z = torch.randn(real.shape[0], 8, generator=noise)
        softplus = nn.functional.softplus
        for opt, loss in ((opt_g, lambda: softplus(-self.d(self.g(z))).mean()),
                          (opt_d, lambda: softplus(-self.d(real)).mean() + softplus(self.d(self.g(z).detach())).mean())):
            self.toggle_optimizer(opt)
            self.manual_backward(loss())
            opt.step()
            opt.zero_grad()
            self.untoggle_optimizer(opt)

    def configure_optimizers(self):
        if self.optim == "adam":  # a GAN's usual
            return [torch.optim.Adam(self.g.parameters(), lr=4e-4, betas=(0.5, 0.999)),
                    torch.optim.Adam(self.d.parameters(), lr=2e-3, betas=(0.5, 0.999))]
        return [torch.optim.SGD(self.g.parameters(), lr=0.01),
                torch.optim.SGD(self.d.parameters(), lr=0.05, momentum=0.9)]


def fit(strategy, steps: int, optim: str) -> torch.Tensor:
    """One epoch of ``steps`` steps a rank; the final parameters (every rank's the same, checked by the caller)."""
    torch.manual_seed(1)
    data = TensorDataset(torch.randn(2 * 32 * steps, 32) + 1)
    model = GAN(optim)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=32))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compression", default="int3", help="HookState's compression (default int3)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps a model (default 20)")
    parser.add_argument("--optim", choices=["sgd", "adam"], default="sgd",
                        help="SGD (the discriminator's with momentum) or Adam for both (default sgd)")
    parser.add_argument("--attach", action="store_true",
                        help="attach both optimizers (their momentum compressed; with --optim adam)")
    args = parser.parse_args()
    if args.attach and args.optim != "adam":
        parser.error("--attach needs --optim adam (the generator's SGD has no momentum to compress)")
    start = torch.cat([p.detach().reshape(-1) for p in GAN().parameters()])
    ref = fit(DDPStrategy(find_unused_parameters=True, process_group_backend="gloo"), args.steps, args.optim)
    ours = fit(HetcommDDPStrategy(args.compression, find_unused_parameters=True, process_group_backend="gloo",
                                  attach_optimizer=args.attach, hook_options={"min_compress_numel": 0}),
               args.steps, args.optim)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ours)
    if dist.get_rank() == 0:
        print(json.dumps({"compression": args.compression, "steps": args.steps, "optim": args.optim,
                          "attached": args.attach,
                          "distance_to_fp32": float((ours - ref).norm() / (ref - start).norm()),
                          "replicas_identical": all(torch.equal(ours, f) for f in every)}))
    # free the gloo group now, not while the interpreter exits: a group freed then can abort the process
    # ("terminate called without an active exception", torch's own; README "torchrun, PyTorch Lightning and
    # Accelerate"), as examples/lightning_train.py does
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
