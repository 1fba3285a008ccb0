"""Convergence on real data (scikit-learn's digits): compressed DDP with error
feedback trains as well as fp32 at the same step count; without error
feedback 1-bit is measurably worse."""

from hetcomm import demo

from .dist_harness import run_ranks


def _train(rank, world, modes):
    return demo.train_digits(rank, world, modes, steps=600, batch=32, lr=0.02)


def test_digits_onebit_topk_lowrank_match_fp32_accuracy():
    res = run_ranks(_train, 2, ["none", "onebit", "topk", "lowrank", "onebit-no-ef"], timeout=240)[0]
    acc = {m: r["accuracy"] for m, r in res.items()}
    loss = {m: r["test_loss"] for m, r in res.items()}
    assert acc["none"] > 94, acc  # the fp32 run itself learned the task
    assert acc["onebit"] >= acc["none"] - 0.5, acc
    assert acc["topk"] >= acc["none"] - 0.5, acc
    assert acc["lowrank"] >= acc["none"] - 0.5, acc  # rank 4
    # error feedback is what makes 1-bit work
    assert acc["onebit-no-ef"] <= acc["onebit"] - 1.0, acc
    assert loss["onebit-no-ef"] > loss["onebit"], loss
    # and the compressed runs really were compressed
    assert res["none"]["bytes_per_step"] / res["onebit"]["bytes_per_step"] > 25
    assert res["none"]["bytes_per_step"] / res["topk"]["bytes_per_step"] > 25
    assert res["none"]["bytes_per_step"] / res["lowrank"]["bytes_per_step"] > 10
