"""The testbed's CPU quotas make ranks really run at different speeds, and leave nothing behind."""

import glob
import os
import resource
import time

import pytest
import torch

from hetcomm import launch, testbed

from .dist_harness import run_ranks


def _spin(rank, world):
    t0 = time.monotonic()
    n = 0
    while time.monotonic() - t0 < 1.5:
        torch.randn(20000).sum()
        n += 1
    return n / (time.monotonic() - t0)


def test_cpu_quotas_slow_ranks_down_and_are_cleaned_up():
    ok, why = testbed.cpu_quota_support()
    if not ok:
        pytest.skip(why)
    rates = run_ranks(_spin, 2, rank_cpu=[0.2, 1.0])
    assert rates[0] < 0.45 * rates[1], rates
    assert not glob.glob(f"/sys/fs/cgroup/cpu/hetcomm-{os.getpid()}-*") and \
        not glob.glob(f"/sys/fs/cgroup/hetcomm-{os.getpid()}-*")


def test_rank_cpu_must_match_world():
    with pytest.raises(ValueError, match="one quota per rank"):
        launch.spawn_ranks(_spin, 2, rank_cpu=[0.5])


def _boom(rank, world):
    if rank == 1:
        raise KeyError("rank one fails")
    time.sleep(30)


def test_a_failing_rank_fails_the_run_fast():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank one fails"):
        run_ranks(_boom, 2)
    assert time.monotonic() - t0 < 25


def _abort_in_c(rank, world):
    if rank == 0:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left behind
        os.abort()  # what a C++ std::terminate does: SIGABRT, no Python exception
    time.sleep(30)


def test_a_rank_killed_by_a_signal_is_named_with_its_python_stack_and_the_others_are_not_blamed():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        run_ranks(_abort_in_c, 2)
    assert time.monotonic() - t0 < 25
    text = str(err.value)
    assert "rank 0: killed by SIGABRT" in text and "_abort_in_c" in text, text
    assert "rank 1:" not in text and "ranks [1] stopped after the failure" in text, text
