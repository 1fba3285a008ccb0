"""The launcher: its ranks see the caller's environment, fail fast and name
what killed them; the testbed's CPU quotas make ranks really run at
different speeds, and leave nothing behind."""

import glob
import json
import os
import resource
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from hetcomm import launch, testbed

from .dist_harness import run_ranks


def _spin(rank, world):
    """1.5 s of work: its rate, and the share of a core the process got (CPU time over wall time)."""
    t0, c0 = time.monotonic(), time.process_time()
    n = 0
    while time.monotonic() - t0 < 1.5:
        torch.randn(20000).sum()
        n += 1
    wall = time.monotonic() - t0
    return n / wall, (time.process_time() - c0) / wall


def test_cpu_quotas_slow_ranks_down_and_are_cleaned_up():
    """Rank 0 confined to 0.2 of a core gets about that share of one while
    it spins (its CPU time over wall time: what the quota sets, whatever a
    busy machine leaves rank 1), so it runs slower than rank 1, unconfined."""
    ok, why = testbed.cpu_quota_support()
    if not ok:
        pytest.skip(why)
    (rate0, share0), (rate1, share1) = run_ranks(_spin, 2, rank_cpu=[0.2, 1.0])
    assert share0 < 0.3 and share0 < 0.6 * share1, (share0, share1)
    assert rate0 < 0.75 * rate1, (rate0, rate1)
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
    # every rank past gloo's connection first: rank 0 dying inside it would make rank 1 fail on its own ("connection
    # closed by peer"), which is then rightly reported as rank 1's failure, not a rank the harness stopped
    torch.distributed.barrier()
    if rank == 0:
        time.sleep(0.5)  # ... and rank 1 out of the barrier's last exchange, asleep below
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


def _environment(rank, world):
    return dict(os.environ), os.getcwd()


def test_a_rank_sees_the_callers_environment_and_folder_as_they_are_at_the_call_not_the_fork_servers(tmp_path):
    # A fresh interpreter, so that the fork server starts inside it with HETCOMM_TEST_GONE set, in the repository;
    # then the caller drops that variable, sets another and moves to another folder: the next ranks (forked by the
    # same server) see the change (the folder by multiprocessing itself): a relative path names the caller's file.
    code = textwrap.dedent(f"""
        import os, json
        from hetcomm import launch
        from tests.test_testbed import _environment
        os.environ["HETCOMM_TEST_GONE"] = "1"
        first = launch.spawn_ranks(_environment, 2)
        del os.environ["HETCOMM_TEST_GONE"]
        os.environ["HETCOMM_TEST_NEW"] = "2"
        os.chdir({str(tmp_path)!r})
        second = launch.spawn_ranks(_environment, 2)
        print(json.dumps({{"first": first, "second": second, "caller": dict(os.environ), "cwd": os.getcwd()}}))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                         env=dict(os.environ, PYTHONPATH=root))
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(env["HETCOMM_TEST_GONE"] == "1" and "HETCOMM_TEST_NEW" not in env and cwd == root
               for env, cwd in got["first"])
    for env, cwd in got["second"]:
        assert "HETCOMM_TEST_GONE" not in env and env["HETCOMM_TEST_NEW"] == "2"
        assert cwd == got["cwd"] == str(tmp_path)
        # the caller's environment exactly, but for the two defaults every rank sets for itself
        extra = {k: env[k] for k in set(env) - set(got["caller"])}
        assert set(extra) <= {"OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"}, extra
        assert {k: v for k, v in env.items() if k not in extra} == got["caller"]


def _pid_then_sleep(rank, world, folder):
    with open(os.path.join(folder, f"rank{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads process states in /proc (Linux)")
def test_ranks_end_when_the_process_that_started_them_is_killed(tmp_path):
    # SIGTERM runs no Python cleanup in the caller; its ranks (the fork server's children) used to train on
    code = textwrap.dedent(f"""
        from hetcomm import launch
        from tests.test_testbed import _pid_then_sleep
        launch.spawn_ranks(_pid_then_sleep, 2, {str(tmp_path)!r}, timeout=120)
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    caller = subprocess.Popen([sys.executable, "-c", code], cwd=root, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    pids = []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < 2 and time.monotonic() < deadline and caller.poll() is None:
            files = sorted(glob.glob(str(tmp_path / "rank*.pid")))
            pids = [int(open(f).read()) for f in files if os.path.getsize(f)]
            time.sleep(0.1)
        assert len(pids) == 2, f"the ranks did not start (caller exit code {caller.poll()})"
        assert all(_running(p) for p in pids)
        caller.terminate()
        caller.wait(30)
        deadline = time.monotonic() + 20
        while any(_running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_running(p) for p in pids), "a rank outlived the process that started it"
    finally:
        caller.kill()
        for p in pids:
            if _running(p):
                os.kill(p, 9)
