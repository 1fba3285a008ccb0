"""Run by tests/test_examples.py: Lightning's Trainer used as in a notebook,
validate, fit, save, validate the checkpoint, then fit on from it.
``HetcommDDPStrategy(precision_per_device=True)`` under
``Trainer(precision="bf16-mixed")``, rank 0's device fp16 (as a V100's) and
rank 1's bf16 (through HETCOMM_PRECISION), otherwise the strategy's defaults
(auto, error feedback following the SGD's rate); the fp16 rank's loss
overflows at step 10 and again at step 30, in the second fit.

    python tests/lightning_refit.py OUT_DIR

Prints a JSON line (rank 0)."""

import json
import os
import sys

import torch
import torch.distributed as dist

try:
    import lightning.pytorch as pl
except ImportError:
    import pytorch_lightning as pl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
from lightning_train import Digits, gathered  # noqa: E402

from hetcomm.demo import load_digits  # noqa: E402
from hetcomm.integrations.lightning import HetcommDDPStrategy  # noqa: E402


class Validated(Digits):
    def validation_step(self, batch, _):
        x, y = batch
        self.seen_precision = self.trainer.precision  # what this rank's plugin computes in
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)


def main() -> None:
    x, y, x_test, y_test = load_digits()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_test, y_test), batch_size=128)
    os.environ["HETCOMM_PRECISION"] = ("fp16", "bf16")[int(os.environ.get("LOCAL_RANK", 0))]
    strategy = HetcommDDPStrategy(process_group_backend="gloo", precision_per_device=True)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=sys.argv[1], precision="bf16-mixed")
    model = Validated(0.05, overflow_at=10)
    trainer.validate(model, val, verbose=False)  # before any fit: each rank in its device's precision already
    before_fit = [None] * trainer.world_size
    dist.all_gather_object(before_fit, model.seen_precision)
    trainer.fit(model, loader)
    first_state, first_steps = strategy.hook_state, trainer.global_step
    ckpt = os.path.join(sys.argv[1], "first.ckpt")
    trainer.save_checkpoint(ckpt)
    validated = trainer.validate(model, val, ckpt_path=ckpt, verbose=False)[0]["val_acc"]
    model.overflow_at = first_steps + 7
    trainer.fit_loop.max_epochs = 2
    trainer.fit(model, loader, ckpt_path=ckpt)
    state = strategy.hook_state
    ranks = gathered(trainer, model, x_test, y_test)
    scaler = trainer.precision_plugin.scaler
    if trainer.global_rank == 0:
        print(json.dumps({
            **ranks, "validated_in": before_fit, "first_steps": first_steps, "global_step": trainer.global_step, "validated": validated,
            "new_state": state is not first_state, "hook_steps": [first_state.iter, state.iter],
            "precisions": state.stats().get("precisions"), "scaler_of_the_state": scaler._state() is state,
            "loss_scale": scaler.get_scale(), "followed_lrs": state.state_dict()["lrs"]}))
    state.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
