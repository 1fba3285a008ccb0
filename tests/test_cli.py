"""The command line, end to end (small sizes)."""

import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import types

import pytest
import torch

import hetcomm.planner
from hetcomm.benchmarks import tasks as bench_tasks
from hetcomm.benchmarks import common, train, train_results

HETCOMM = [sys.executable, "-m", "hetcomm.cli"]


def _run(args, tmp_path, timeout=240, fresh=False):
    """hetcomm ARGS in tmp_path; it must succeed. In this process (its ranks fork from the fork server the tests
    already run: a fresh interpreter imports torch twice more, 5-6 s a call), with what it printed here captured;
    ``fresh``: in a new interpreter, for what a test reads from the ranks' own output, which goes to the fork
    server's streams here. Returns what it printed (``stdout``, ``stderr``)."""
    if fresh:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(HETCOMM + args, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        return out
    from hetcomm import cli

    def too_long(*_):
        raise TimeoutError(f"hetcomm {' '.join(args)}: still running after {timeout} s")

    out, err = io.StringIO(), io.StringIO()
    here, threads = os.getcwd(), torch.get_num_threads()
    alarm = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(timeout)
    os.chdir(tmp_path)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main(args)
            except SystemExit as e:
                assert e.code in (0, None), f"exit {e.code}\n{err.getvalue()[-3000:]}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, alarm)
        os.chdir(here)
        torch.set_num_threads(threads)  # bench compress sets its own
    return types.SimpleNamespace(stdout=out.getvalue(), stderr=err.getvalue())


def _rejected(args, capsys) -> str:
    """hetcomm ARGS in this process (a refusal needs no fresh interpreter importing torch): it must exit non-zero;
    what it said (stderr, or the SystemExit's message)."""
    from hetcomm import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(args)
    code = exc.value.code
    assert code not in (0, None), args
    return capsys.readouterr().err + (code if isinstance(code, str) else "")


def test_demo_prints_a_table_and_writes_json(tmp_path):
    out = _run(["demo", "--steps", "30", "--modes", "none,onebit,torch-allreduce", "--json", "d.json",
                "--plot", "d.png"], tmp_path, fresh=True)
    assert "mode" in out.stdout and "onebit" in out.stdout and "torch-allreduce" in out.stdout
    for mode in ("none", "onebit", "torch-allreduce"):  # rank 0's progress while it runs, every fifth of the steps
        assert re.search(rf"^  {mode} +step +6/30$", out.stderr, re.M) and " step   30/30" in out.stderr, out.stderr
    assert (tmp_path / "d.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.load(open(tmp_path / "d.json"))
    assert data["meta"]["world_size"] == 2 and data["meta"]["torch"] == torch.__version__
    res = data["results"]
    assert all(r["loss_curve"][-1][0] == 30 for r in res.values())
    assert set(res) == {"none", "onebit", "torch-allreduce"}
    # 30 steps: onebit's last step is compressed (from start_iter, 1 by default)
    assert res["none"]["bytes_per_step"] == res["torch-allreduce"]["bytes_per_step"]
    # fp32's 4 bytes an element against onebit's signs and bf16 scale per 32 (padding aside)
    ratio = 4 / hetcomm.planner.wire_bytes_per_element("onebit")
    assert 0.97 * ratio < res["none"]["bytes_per_step"] / res["onebit"]["bytes_per_step"] <= ratio
    assert res["none"]["accuracy"] == res["torch-allreduce"]["accuracy"]  # bit-identical training
    # the last step's buckets per wire/algorithm, in the JSON and the table's last column (PyTorch's hooks: none)
    assert res["torch-allreduce"]["plans"] == {} and sum(res["onebit"]["plans"].values()) >= 1
    assert all(k.split("/")[0] == "onebit" for k in res["onebit"]["plans"])
    assert all(k.split("/")[0] == "none" for k in res["none"]["plans"])
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    for mode in ("none", "onebit"):
        assert all(f"{k} x{n}" in rows[mode] for k, n in res[mode]["plans"].items()), rows[mode]
    assert rows["torch-allreduce"].rstrip().endswith(" -")


def test_demo_rejects_unknown_mode(capsys):
    assert "unknown mode 'zip'" in _rejected(["demo", "--modes", "zip"], capsys)


def test_bench_compress_table_and_json(tmp_path):
    out = _run(["bench", "compress", "-b", "256K", "-e", "1M", "-f", "4", "-n", "2", "-w", "1", "--json", "c.json"],
               tmp_path)
    assert "memory bandwidth" in out.stdout and "sign_encode+ef" in out.stdout and "int3_encode+ef" in out.stdout
    data = json.load(open(tmp_path / "c.json"))
    assert data["memory_bandwidth_gbps"] > 0
    rows = data["rows"]
    assert {r["bytes"] for r in rows} == {256 * 1024, 1024 * 1024}
    assert all(r["wrong"] in (0, -1) for r in rows), rows  # outputs agree with the torch implementations
    assert all(r["gbps"] > 0 and r["torch_gbps"] > 0 for r in rows)
    # of copy: the codec's least traffic per second over a copy of the same bytes, at the same size
    for r in rows:
        assert r["copy_gbps"] > 0 and math.isclose(r["of_copy"], r["traffic_gbps"] / r["copy_gbps"], rel_tol=1e-9)
    sign = next(r for r in rows if r["codec"] == "sign_encode+ef")
    assert math.isclose(sign["traffic_gbps"], sign["gbps"] / 4 * (12 + 1 / 8 + 2 / 32), rel_tol=1e-9)  # bf16 per 32


def test_info(tmp_path):
    out = _run(["info"], tmp_path)
    assert json.loads(out.stdout)["torch_version"]


@pytest.mark.parametrize("bad", [["bench", "compress", "-b", "0"], ["bench", "compress", "-b", "4M", "-e", "1M"]])
def test_bench_rejects_bad_sizes(bad, capsys):
    said = _rejected(bad, capsys)
    assert "size must be > 0" in said or "-b <= -e" in said


def test_topo_prints_links_and_plan(tmp_path):
    out = _run(["topo", "--ranks", "2", "--json", "t.json"], tmp_path)
    assert "link intra" in out.stdout and "plan" in out.stdout
    data = json.load(open(tmp_path / "t.json"))
    assert data["topology"]["world"] == 2 and data["plans"]
    # each rank's compute precision (this CPU's, or HETCOMM_PRECISION's)
    assert "compute precision per rank" in out.stdout
    assert len(data["precisions"]) == 2 and set(data["precisions"]) <= {"bf16", "fp16", "fp32"}
    # one node: a compressed mode at the default algorithm compresses flat
    assert data["compressed_default"] == "native" and "at the default algorithm: native (flat" in out.stdout


def test_bench_allreduce_rows_are_correct(tmp_path):
    out = _run(["bench", "allreduce", "-b", "64K", "-e", "256K", "-f", "4", "-n", "2", "-w", "1", "--ranks", "3",
                "--wires", "none,fp16,onebit,topk", "--pieces", "1,3", "--json", "a.json", "--plot", "a.png"], tmp_path,
               fresh=True)  # rank 0 prints the rows as they finish
    assert "busbw" in out.stdout and "# Out of bounds values : 0 OK" in out.stdout
    assert (tmp_path / "a.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.load(open(tmp_path / "a.json"))
    assert data["meta"]["world_size"] == 3 and data["meta"]["topology"]["nodes"] == 1
    rows = data["rows"]
    assert {r["algorithm"] for r in rows} == {"native", "ring", "halving_doubling", "tree"}  # one node: no hierarchy
    # random inputs against a float64 sum: every wire within its bound (dense:
    # rounding; 1-bit/top-k: results + residuals = the exact sums)
    assert all(r["wrong"] == 0 for r in rows), rows
    err = {}
    for r in rows:
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * 2 / 3)
        err.setdefault(r["wire"], []).append(r["max_err"])
    assert max(err["none"]) < 1e-6 and 1e-5 < max(err["fp16"]) < 2e-3  # fp32 / fp16 rounding of a 3-term sum
    assert min(err["onebit"] + err["topk"]) > 0.1  # one call of a lossy wire is far off; error feedback repays it
    # native onebit side by side in 1 and 3 pieces: the same sums (bit for bit, so the same error)
    native = {(r["bytes"], r["pieces"]): r["max_err"] for r in rows if (r["algorithm"], r["wire"]) == ("native", "onebit")}
    assert sorted(native) == [(64 << 10, "1"), (64 << 10, "3"), (256 << 10, "1"), (256 << 10, "3")]
    assert all(native[(b, "1")] == native[(b, "3")] for b in (64 << 10, 256 << 10))
    assert {r["pieces"] for r in rows if (r["algorithm"], r["wire"]) != ("native", "onebit")} == {"-"}


def test_bench_ddp_side_by_side(tmp_path):
    out = _run(["bench", "ddp", "--ranks", "2", "--params", "50K", "-n", "2", "-w", "2", "--global-batch", "16",
                "--modes", "torch-allreduce,torch-powersgd,onebit,lowrank-fp32,lowrank@hierarchical,none+bal",
                "--json", "d.json"], tmp_path)
    assert "samples/s" in out.stdout and "ideal" in out.stdout
    data = json.load(open(tmp_path / "d.json"))
    rows = {r["mode"]: r for r in data["rows"]}
    assert set(rows) == {"torch-allreduce", "torch-powersgd", "onebit", "lowrank-fp32", "lowrank@hierarchical",
                         "none+bal"}
    assert rows["onebit"]["bytes_per_step"] * 20 < rows["torch-allreduce"]["bytes_per_step"]
    assert rows["lowrank-fp32"]["bytes_per_step"] * 5 < rows["torch-allreduce"]["bytes_per_step"]
    # a mode's own algorithm stands (bench ddp's --algorithm default once replaced it); bf16 factors (the
    # default): half float32's bytes, which are PowerSGD's
    assert rows["lowrank@hierarchical"]["plans"].startswith("lowrank/hierarchical"), rows
    assert rows["lowrank-fp32"]["plans"].startswith("lowrank/native"), rows
    assert rows["lowrank@hierarchical"]["bytes_per_step"] * 2 == rows["lowrank-fp32"]["bytes_per_step"]
    assert sum(int(b) for b in rows["none+bal"]["local_batches"].split("/")) == 16
    assert all(r["bytes_across_nodes_per_step"] == 0 for r in rows.values())  # loopback: one node
    # lowrank approximates the gradient, as PowerSGD's hook: neither row compresses SGD's momentum; onebit's does
    assert {m: r["momentum_compressed"] for m, r in rows.items()} == {
        "torch-allreduce": False, "torch-powersgd": False, "onebit": True, "lowrank-fp32": False,
        "lowrank@hierarchical": False, "none+bal": False}
    assert all(0 <= r["hidden"] <= 1 and r["step_ms"] > 0 for r in rows.values())


def test_bench_ddp_auto_is_the_readmes_one_line_and_auto_m_attaches_the_optimizer(tmp_path, capsys):
    _run(["bench", "ddp", "--ranks", "2", "--params", "50K", "-n", "2", "-w", "1", "--global-batch", "16",
          "--modes", "auto,auto+m", "--json", "d.json"], tmp_path)
    rows = {r["mode"]: r for r in json.load(open(tmp_path / "d.json"))["rows"]}
    # auto: HookState("auto") without attach_optimizer, the gradient compressed, lowrank offered under its guard
    # (which read it by step 120, inside the untimed warm-up); auto+m: SGD's momentum, no lowrank
    assert not rows["auto"]["momentum_compressed"] and rows["auto+m"]["momentum_compressed"]
    assert rows["auto"]["auto"]["modes"] == ["none", "bf16", "fp8", "int3", "lowrank"], rows["auto"]["auto"]
    assert rows["auto"]["auto"]["lowrank_guard"]["step"] == 120
    assert rows["auto+m"]["auto"]["modes"] == ["none", "bf16", "fp8"] and "lowrank_guard" not in rows["auto+m"]["auto"]
    said = _rejected(["bench", "ddp", "--modes", "onebit+m"], capsys)
    assert "auto+m (auto with attach_optimizer)" in said, said[-2000:]


def test_bench_ddp_many_buckets_in_rounds(tmp_path):
    from hetcomm.benchmarks.ddp import model_for

    _run(["bench", "ddp", "--ranks", "2", "--params", "60K", "--layers", "4", "--bucket-mb", "0.05", "--rounds", "2",
          "-n", "3", "-w", "1", "--global-batch", "8", "--modes", "torch-allreduce,none", "--json", "d.json"], tmp_path)
    data = json.load(open(tmp_path / "d.json"))
    rows = {r["mode"]: r for r in data["rows"]}
    model = model_for(60_000, layers=4)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 5 and rows["none"]["params"] == sum(p.numel() for p in model.parameters())
    # 0.24 MB of gradients in DDP buckets of 0.05 MB: several buckets (DDP's first one is larger), each planned
    assert int(rows["none"]["plans"].split("x")[-1]) >= 2, rows["none"]["plans"]
    for r in rows.values():
        assert r["rounds"] == 2 and len(r["round_step_ms"]) == 2 and all(t > 0 for t in r["round_step_ms"])
        assert 0 <= r["hidden"] <= 1


def test_model_for_has_the_asked_size():
    from hetcomm.benchmarks.ddp import model_for

    for params, layers in [(10**6, 2), (5 * 10**6, 8), (200_000, 1), (60_000, 4)]:
        n = sum(p.numel() for p in model_for(params, layers=layers).parameters())
        assert abs(n - params) < 0.02 * params, (params, layers, n)
    with pytest.raises(ValueError, match="layers must be >= 1"):
        model_for(1000, layers=0)


def test_bench_ddp_on_cuda_without_a_gpu_says_what_is_missing(capsys):
    import hetcomm

    if torch.cuda.is_available() and hetcomm.build_info()["cuda"]:
        pytest.skip("this machine can run bench ddp --device cuda")
    said = _rejected(["bench", "ddp", "--device", "cuda", "--modes", "none"], capsys)
    assert "needs a visible GPU and a CUDA build of hetcomm" in said


@pytest.mark.skipif(sys.platform != "linux", reason="minor page faults are counted where getrusage counts them (Linux)")
def test_bench_train_counts_the_page_faults_of_fresh_memory():
    from hetcomm.benchmarks.train import _minor_faults

    before = _minor_faults()
    block = torch.empty(64 << 20, dtype=torch.uint8)  # over glibc's largest mmap threshold: fresh pages from the kernel
    block.fill_(1)
    touched = _minor_faults() - before
    assert touched >= 32, touched  # 64 MiB in pages of 4 KiB (16384), or of 2 MiB where huge pages back it (32)
    del block


def test_bench_train_time_to_accuracy(tmp_path):
    out = _run(["bench", "train", "--tasks", "regress", "--optims", "sgd", "--modes", "torch-powersgd,onebit+m",
                "--scale", "0.2", "--eval-every", "10", "--json", "t.json", "--png", "t.png"], tmp_path)
    data = json.load(open(tmp_path / "t.json"))
    runs = {r["mode"]: r for r in data["runs"]}
    assert set(runs) == {"fp32", "torch-powersgd", "onebit+m"}  # fp32 always runs: it sets the target
    fp32 = runs["fp32"]
    assert fp32["steps"] == 60 and [p["step"] for p in fp32["curve"]] == list(range(10, 70, 10))
    assert fp32["target"] == fp32["final"] == fp32["curve"][-1]["mse"] and fp32["reached"] and fp32["vs_fp32"] == 1.0
    for r in runs.values():
        times = [p["time_s"] for p in r["curve"]]
        assert times == sorted(times) and r["s_per_step"] * r["steps"] >= times[-1] * 0.999
        assert isinstance(r["minor_faults_per_step"], float) and r["minor_faults_per_step"] >= 0
        assert r["denormals_flushed"] is True  # every mode's run alike (common.denormals_flushed)
        within = [p["mse"] <= 1.02 * fp32["final"] for p in r["curve"]]
        if r["reached"]:  # the first evaluation within 2 % of fp32's final MSE
            first = next(p for p in r["curve"] if p["mse"] <= 1.02 * fp32["final"])
            assert (r["steps_to_target"], r["time_to_target_s"]) == (first["step"], first["time_s"])
            # and the one from which every evaluation stays within it (the one before it, if any, is not)
            i = [p["step"] for p in r["curve"]].index(r["steps_to_stay"])
            assert all(within[i:]) and (i == 0 or not within[i - 1]) and r["steps_to_stay"] >= first["step"]
            assert r["time_to_stay_s"] == r["curve"][i]["time_s"]
        else:
            assert r["steps_to_stay"] is None and r["stay_vs_fp32"] is None
    # the attached optimizer's warm-up: the first 12 of 60 steps, steps 0 and 1 at fp32's bytes and 2-11 in fp8 (a
    # quarter of them and scales; the default), then 1 bit + a bf16 per 32 and more: less than the 12 steps in fp32
    ratio = runs["onebit+m"]["bytes_per_step"] / runs["fp32"]["bytes_per_step"]
    assert (2 + 10 / 4) / 60 < ratio < 0.2, ratio
    # hetcomm's runs say what each evaluated step sent (auto's choice shows there); PyTorch's hooks have no plans
    assert all("plans" not in p for r in (fp32, runs["torch-powersgd"]) for p in r["curve"])
    # the ranks on one node (loopback): nothing crossed nodes
    assert all(r["bytes_across_nodes_per_step"] == 0 for r in runs.values()) and "across KB" in out.stdout
    last = runs["onebit+m"]["curve"][-1]["plans"]
    assert {k.split("/")[0] for k in last} == {"onebit"} and sum(last.values()) >= 1
    assert (tmp_path / "t.png").stat().st_size > 10_000
    assert "vs PowerSGD" in out.stdout and data["meta"]["world_size"] == 2


def _subnormal_survives() -> bool:
    x = torch.tensor([1e-39], dtype=torch.float32)  # subnormal: float32's least normal is 1.18e-38
    return bool((x * 1.0).item() != 0.0)


def test_bench_runs_flush_subnormals_on_the_cpu_and_leave_the_default_after():
    # a decaying momentum's subnormal entries cost the CPU tens of times a normal one's (bench/README "Subnormal
    # momenta on the CPU"); inside, a product of a subnormal is zero, on this thread and the threads it starts
    assert _subnormal_survives()
    with common.denormals_flushed("cpu") as flushed:
        if not flushed:
            pytest.skip("this CPU has no flush-to-zero mode (torch.set_flush_denormal returned False)")
        assert not _subnormal_survives()
        seen = []
        t = threading.Thread(target=lambda: seen.append(_subnormal_survives()))
        t.start()
        t.join()
        assert seen == [False]
    assert _subnormal_survives()  # the default again: the caller's own arithmetic untouched
    with common.denormals_flushed("cuda") as flushed:  # a GPU's kernels keep IEEE's subnormals: nothing set
        assert flushed is False and _subnormal_survives()


def _share_on(rank, world, per_node):
    os.environ["HETCOMM_NODE"] = f"node{rank // per_node}"
    return common.off_node_share()


def test_the_benches_count_a_pytorch_hooks_bytes_across_nodes_by_its_share_of_peers_off_the_node():
    from hetcomm.launch import spawn_ranks

    assert spawn_ranks(_share_on, 4, 2) == [2 / 3] * 4  # 2 nodes x 2 ranks: 2 of each rank's 3 peers
    assert spawn_ranks(_share_on, 3, 1) == [1.0] * 3 and spawn_ranks(_share_on, 2, 2) == [0.0] * 2


def test_bench_train_clips_hetcomm_modes_by_the_reduced_norm(tmp_path):
    _run(["bench", "train", "--tasks", "regress", "--optims", "sgd", "--modes", "onebit+m", "--scale", "0.1",
          "--eval-every", "10", "--clip-grad-norm", "0.2", "--json", "c.json"], tmp_path)
    data = json.load(open(tmp_path / "c.json"))
    clip = {r["mode"]: r["clip"] for r in data["runs"]}
    # PyTorch's hook: torch's clip; hetcomm's mode: HookState.clip_grad_norm_; both clipped (0.2 is below the norm)
    assert clip["fp32"]["by"] == "handed" and clip["onebit+m"]["by"] == "reduced", clip
    assert all(c["max_norm"] == 0.2 and c["clipped_steps"] > 0 for c in clip.values()), clip
    assert data["meta"]["clip"] == 0.2 and data["meta"]["clip_handed"] is False


def test_bench_train_device_cuda_without_a_gpu_is_a_clear_error(capsys):
    if torch.cuda.is_available() and hetcomm.build_info()["cuda"]:
        pytest.skip("this machine has a GPU and a CUDA build: the GPU test below runs instead")
    said = _rejected(["bench", "train", "--tasks", "regress", "--modes", "fp32", "--device", "cuda"], capsys)
    assert "hetcomm bench train --device cuda: needs a visible GPU and a CUDA build of hetcomm" in said


@pytest.mark.cuda
def test_bench_train_on_a_gpu_trains_as_on_the_cpu():
    """Two gloo ranks sharing the GPU: fp32's run ends where the CPU's does
    (the same start and data; float rounding apart), and onebit+m sends the
    CPU run's bytes (the same plan every step) and ends finite."""
    args = (2, ["regress", "classify"], ["sgd", "adamw"], ["onebit+m"], 0.1, 10)
    gpu = {(r["task"], r["optimizer"], r["mode"]): r for r in train.run(*args, device="cuda")}
    cpu = {(r["task"], r["optimizer"], r["mode"]): r for r in train.run(*args)}
    assert gpu.keys() == cpu.keys() and len(gpu) == 8
    for key, r in gpu.items():
        assert r["device"] == "cuda" and cpu[key]["device"] == "cpu"
        assert r["finite"] and r["bytes_per_step"] == cpu[key]["bytes_per_step"], key
        if key[2] == "fp32":
            assert r["final"] == pytest.approx(cpu[key]["final"], rel=1e-3, abs=0.3), key


def test_bench_train_cosine_schedule_applies_to_every_run(tmp_path):
    _run(["bench", "train", "--tasks", "regress", "--optims", "adamw", "--modes", "onebit+m", "--scale", "0.1",
          "--eval-every", "10", "--schedule", "cosine", "--json", "c.json"], tmp_path)
    data = json.load(open(tmp_path / "c.json"))
    assert [(r["mode"], r["schedule"]) for r in data["runs"]] == [("fp32", "cosine"), ("onebit+m", "cosine")]
    assert data["meta"]["schedule"] == "cosine"


@pytest.mark.parametrize("optim", ["sgd", "adamw+m"])
def test_cosine_schedule_is_a_linear_warm_up_then_a_cosine_decay(optim):
    name, _, attach = optim.partition("+")
    opt = train.make_optimizer(name, [torch.nn.Parameter(torch.zeros(3))], 0.2, attach=bool(attach))
    assert train.make_schedule(opt, "constant", 100) is None
    sched = train.make_schedule(opt, "cosine", 100)  # a warm-up of 5 steps, then 95 of decay
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])  # the lr the next optimizer step takes
        opt.step()
        sched.step()
    expected = [0.2 * (s + 1) / 5 for s in range(5)] + [0.1 * (1 + math.cos(math.pi * (s - 5) / 95))
                                                       for s in range(5, 100)]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert max(lrs) == pytest.approx(0.2) and 0 < lrs[-1] < 1e-3
    with pytest.raises(ValueError, match="schedule must be one of"):
        train.make_schedule(opt, "linear", 100)


@pytest.mark.parametrize("name, warm", [("warmup", 30), ("warmup:300", 300), ("warmup:1", 1)])
def test_warmup_schedule_is_a_linear_warm_up_then_the_lr_held(name, warm):
    opt = train.make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(3))], 0.2)
    sched = train.make_schedule(opt, name, 600)  # a warm-up of 5 % of the steps (or N), then 0.2 to the end
    lrs = []
    for _ in range(600):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.2 * (s + 1) / warm for s in range(warm)] + [0.2] * (600 - warm), rel=1e-12)
    cos = train.make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(3))], 0.2)
    sched = train.make_schedule(cos, name.replace("warmup", "cosine"), 600)  # the same warm-up, then the decay
    lrs = []
    for _ in range(600):
        lrs.append(cos.param_groups[0]["lr"])
        cos.step()
        sched.step()
    assert lrs == pytest.approx([0.2 * (s + 1) / warm for s in range(warm)] +
                                [0.1 * (1 + math.cos(math.pi * (s - warm) / (600 - warm))) for s in range(warm, 600)],
                                rel=1e-12)
    for bad in ("warmup:0", "warmup:x", "onecycle:5", "constant:3", "cosine:"):
        with pytest.raises(ValueError, match="warmup:N / cosine:N with N >= 1"):
            train.make_schedule(opt, bad, 600)


@pytest.mark.parametrize("optim", ["sgd", "adamw+m"])
def test_onecycle_schedule_is_torchs_one_cycle_at_the_tasks_lr(optim):
    name, _, attach = optim.partition("+")
    opt = train.make_optimizer(name, [torch.nn.Parameter(torch.zeros(3))], 0.2, attach=bool(attach))
    sched = train.make_schedule(opt, "onecycle", 100)
    lrs, betas = [], []
    for _ in range(100):
        g = opt.param_groups[0]
        lrs.append(g["lr"])
        betas.append(g["betas"][0] if "betas" in g else g["momentum"])
        opt.step()
        sched.step()
    # OneCycleLR's defaults: from 0.2 / 25 up to 0.2 at step 29 (30 %), then down; the momentum the other way
    assert lrs[0] == pytest.approx(0.2 / 25) and max(lrs) == pytest.approx(0.2) and lrs.index(max(lrs)) == 29
    assert lrs[-1] < 1e-5 and betas[0] == pytest.approx(0.95) and min(betas) == pytest.approx(0.85)
    assert betas.index(min(betas)) == 29 and betas[-1] == pytest.approx(0.95)


def test_bench_train_plain_sgd_runs_without_momentum_at_its_own_rate(tmp_path):
    opt = train.make_optimizer("plain", [torch.nn.Parameter(torch.zeros(3))], 0.2)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["momentum"] == 0 and opt.param_groups[0]["lr"] == 0.2
    _run(["bench", "train", "--tasks", "regress", "--optims", "plain", "--modes", "onebit", "--scale", "0.1",
          "--eval-every", "10", "--json", "p.json"], tmp_path)
    runs = json.load(open(tmp_path / "p.json"))["runs"]
    assert [(r["optimizer"], r["mode"]) for r in runs] == [("plain", "fp32"), ("plain", "onebit")]
    assert all(r["lr"] == bench_tasks.TASKS["regress"].lr["plain"] != bench_tasks.TASKS["regress"].lr["sgd"]
               for r in runs)
    with pytest.raises(ValueError, match="optimizer 'plain' .SGD without momentum. has no momentum to compress: run "
                                         "onebit\\+m, topk\\+m-p10 without it"):
        train.run(2, ["regress"], ["sgd", "plain"], ["onebit", "onebit+m", "topk+m-p10"])


@pytest.mark.parametrize("name", ["sgd-fused", "adamw-fused"])
def test_bench_train_fused_optimizers_are_torchs_fused_kernels_at_their_optimizers_rate(tmp_path, name):
    base = name.removesuffix("-fused")
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(40, 7, generator=gen)
    grads = [torch.randn(40, 7, generator=gen) for _ in range(5)]
    params = {}
    for n in (name, base):
        p = torch.nn.Parameter(start.clone())
        opt = train.make_optimizer(n, [p], 0.05)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        params[n] = p.detach()
        assert bool(opt.defaults["fused"]) is (n == name)  # (None: torch decides, the loop on the CPU)
    assert not torch.equal(params[name], start)
    assert torch.allclose(params[name], params[base], rtol=1e-5, atol=1e-6)  # the same steps as torch's loop
    task = bench_tasks.TASKS["regress"]()
    assert train.task_lr(task, name) == train.task_lr(task, base)
    _run(["bench", "train", "--tasks", "regress", "--optims", name, "--modes", "int3", "--scale", "0.1",
          "--eval-every", "10", "--json", "f.json"], tmp_path)
    runs = json.load(open(tmp_path / "f.json"))["runs"]
    assert [(r["optimizer"], r["mode"]) for r in runs] == [(name, "fp32"), (name, "int3")]
    assert all(math.isfinite(r["final"]) and r["lr"] == task.lr[base] for r in runs)
    with pytest.raises(ValueError, match=f"optimizer.s. {name} are torch's fused kernels, and onebit\\+m step "
                                         "hetcomm's own optimizer"):
        train.run(2, ["regress"], [name], ["int3", "onebit+m"])
    with pytest.raises(ValueError, match=f"run it with '{base}'"):
        train.make_optimizer(name, [torch.nn.Parameter(torch.zeros(3))], 0.2, attach=True)


def _synthetic_run(task, mode, seed, values, metric):
    curve = [{"step": 20 * (i + 1), "time_s": 0.1 * (i + 1), metric: v, "loss": 0.0} for i, v in enumerate(values)]
    return {"task": task, "optimizer": "sgd", "mode": mode, "seed": seed, "curve": curve, "final": values[-1],
            "finite": math.isfinite(values[-1]), "s_per_step": 0.01, "bytes_per_step": 1000}


def test_bench_train_leaves_out_the_seeds_where_fp32_itself_diverged(monkeypatch, capsys):
    from hetcomm.benchmarks import tasks

    # the rule: the last evaluation over 1.5x the lowest (perplexity, MSE), 10 points under the highest (accuracy)
    assert tasks.LanguageModel.diverged([5.0, 1.6, 2.5]) and not tasks.LanguageModel.diverged([5.0, 1.6, 2.3])
    assert tasks.Regress.diverged([1.0, 0.2, float("nan")]) and tasks.LanguageModel.diverged([2.0, float("inf")])
    assert tasks.LanguageModel.diverged([float("nan"), 1.6, 2.5]) and not tasks.Regress.diverged([float("inf"), 0.3])
    assert tasks.Classify.diverged([90.0, 98.0, 87.5]) and not tasks.Classify.diverged([90.0, 98.0, 88.5])
    # seed 1's fp32 blew up (13.3 against its own 1.6): against that target int3 "reaches" at once
    runs = [_synthetic_run("lm", "fp32", 0, [3.0, 1.60, 1.60], "perplexity"),
            _synthetic_run("lm", "int3", 0, [3.0, 1.70, 1.62], "perplexity"),
            _synthetic_run("lm", "fp32", 1, [3.0, 1.60, 13.3], "perplexity"),
            _synthetic_run("lm", "int3", 1, [3.0, 1.61, 1.61], "perplexity")]
    runs = train_results.summarise(runs)
    assert [r["fp32_diverged"] for r in runs] == [False, False, True, True]
    assert runs[3]["reached"] and runs[3]["steps_to_target"] == 20  # what the means must not count
    assert [r["spiked_at"] for r in runs] == [None, None, 60, None]
    summary = {a["mode"]: a for a in train_results.aggregate(runs)}
    for mode, final in (("fp32", 1.60), ("int3", 1.62)):
        a = summary[mode]
        assert (a["seeds"], a["fp32_diverged_seeds"], a["reached_seeds"], a["spiked_seeds"]) == (1, 1, 1, 0)
        assert a["final_mean"] == pytest.approx(final) and a["fp32_mean"] == pytest.approx(1.60)
        assert a["time_to_target_s"] == pytest.approx(0.3 if mode == "int3" else 0.2)
    # every seed's fp32 diverged: nothing to average
    alone = train_results.aggregate(train_results.summarise([dict(r) for r in runs[2:]]))
    assert [(a["seeds"], a["fp32_diverged_seeds"], a["final_mean"]) for a in alone] == [(0, 1, None), (0, 1, None)]
    # bench train's report names the seed
    monkeypatch.setattr(train, "run", lambda *args, **kwargs: [dict(r, world_size=4) for r in runs])
    train.main(4, ["lm"], ["sgd"], ["int3"], 1.0, 20, None, None, seeds=2)
    out = capsys.readouterr().out
    assert "# fp32 diverged on lm sgd seed 1 (its perplexity ended 13.3, its own best 1.6)" in out
    assert "seed 0 (" not in out


def _bench_script(name: str):
    """bench/NAME.py, imported as a module."""
    import importlib.util

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", name + ".py")
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_compare_seeds_names_each_runs_spike_and_leaves_out_seeds_whose_fp32_diverged(tmp_path, capsys):
    compare = _bench_script("compare_seeds")
    runs = [_synthetic_run("lm", "fp32", 0, [3.0, 1.60, 1.60], "perplexity"),
            _synthetic_run("lm", "int3", 0, [3.0, 2.6, 1.62], "perplexity"),  # 1.5x of 1.6 is 2.4: not yet
            _synthetic_run("lm", "fp32", 1, [3.0, 1.60, 13.3], "perplexity"),  # blown up, never back
            _synthetic_run("lm", "int3", 1, [3.0, 1.61, 1.61], "perplexity"),
            _synthetic_run("classify", "fp32", 0, [90.0, 98.0, 98.0], "accuracy"),
            _synthetic_run("classify", "int3", 0, [90.0, 98.0, 87.0, 98.0], "accuracy")]  # back to the target
    assert [train_results.spiked_at(r) for r in runs] == [None, None, 60, None, None, 60]
    summary = train_results.aggregate(train_results.summarise(runs))
    assert [(a["task"], a["mode"], a["spiked_seeds"]) for a in summary] == [
        ("lm", "fp32", 0), ("lm", "int3", 0), ("classify", "fp32", 0), ("classify", "int3", 1)]  # seed 1 left out
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs}))
    compare.report(str(path))
    out = capsys.readouterr().out
    assert "(lm, sgd): 1 seeds reached by every mode (fp32 diverged on seeds 1: left out)" in out
    assert "spiked 1: 1@60*" in out and "spiked 1: 0@60\n" in out  # fp32's seed 1 ends so; classify's recovers
    assert out.count("spiked 0") == 2
    # fp32 ran beside int3 (no reference): seed 0 reached at 0.2 s and 0.3 s
    assert "int3 vs fp32 (run beside it): time to the first touch 1.50x (median 1.50x, summed 1.50x)" in out
    # --merge: a second file's seeds join the first's cell; a seed in both is an error
    more = train_results.summarise([_synthetic_run("lm", "fp32", 2, [3.0, 1.60, 1.60], "perplexity"),
                                    _synthetic_run("lm", "int3", 2, [3.0, 1.62, 1.62], "perplexity")])
    path2 = tmp_path / "r2.json"
    path2.write_text(json.dumps({"runs": more}))
    compare.report(str(path), str(path2))
    out = capsys.readouterr().out
    assert f"{path} + {path2} (lm, sgd): 2 seeds reached by every mode (fp32 diverged on seeds 1: left out)" in out
    assert f"{path} + {path2} (classify, sgd): 1 seeds reached by every mode" in out
    assert "int3 vs fp32 (run beside it): time to the first touch 1.25x (median 1.25x, summed 1.25x)" in out
    # fp32 from a --reference file ran elsewhere: no ratio to its times
    path3 = tmp_path / "r3.json"
    path3.write_text(json.dumps({"runs": [dict(r, reference_from="x.json") if r["mode"] == "fp32" else r
                                          for r in more]}))
    compare.report(str(path3))
    assert "vs fp32" not in capsys.readouterr().out
    with pytest.raises(ValueError, match="seed 0 of fp32 on lm with sgd is in an earlier file too"):
        compare.report(str(path), str(path))


def test_auto_choices_counts_each_plan_auto_ended_on_and_its_runs_mean_step(tmp_path, capsys):
    choices = _bench_script("auto_choices")

    def run(optim, plans, s):
        return {"optimizer": optim, "mode": "auto", "s_per_step": s,
                "auto": {"buckets": {k: {"chosen": {"mode": m, "algorithm": a}} for k, (m, a) in plans.items()}}}
    runs = [run("sgd", {"1,0": ("int3", "hierarchical")}, 0.006), run("sgd", {"1,0": ("int3", "hierarchical")}, 0.008),
            run("sgd", {"1,0": ("int3", "native")}, 0.009),
            run("adamw", {"3,2": ("int3", "native"), "1,0": ("fp8", "hierarchical")}, 0.010),
            {"optimizer": "sgd", "mode": "torch-powersgd", "s_per_step": 0.01}]  # not auto's: left out
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": runs}))
    got = {k: [round(x, 6) for x in v] for k, v in choices.choices(str(path)).items()}
    assert got == {("sgd", "int3@hierarchical"): [6.0, 8.0], ("sgd", "int3@native"): [9.0],
                   ("adamw", "int3@native, fp8@hierarchical"): [10.0]}


def test_adam_shadow_reads_fp8s_step_as_fp32s_and_int3s_as_smaller():
    """bench/adam_shadow.py: Adam's update from fp8's message is fp32's (its error is 3 % of the gradient's); from
    int3's, whose error is a quarter of it and adds to the second moment, it is smaller, most where v is small."""
    shadow = _bench_script("adam_shadow").shadow
    fp8, int3 = list(shadow("fp8", 6, 3)), list(shadow("int3", 6, 3))
    assert [row[0] for row in fp8] == [row[0] for row in int3] == [3, 6]
    for _, size, cosine, error, growth in fp8:
        assert abs(size - 1) < 0.01 and cosine > 0.999 and error < 0.06 and all(abs(x - 1) < 0.01 for x in growth)
    for _, size, cosine, error, growth in int3:
        assert 0.9 < size < 0.99 and 0.95 < cosine < 0.999 and 0.15 < error < 0.5
        assert all(x > 1.01 for x in growth) and growth[0] > growth[3]
    with pytest.raises(ValueError, match="codec must be int3 or fp8"):
        next(shadow("onebit", 2, 1))


def test_sim_wires_shuffled_control_moves_each_blocks_errors_within_it():
    """bench/sim_wires' sim-int3shuf-b32 control: each block's values permuted within the block, the partial last
    block's padding left out, another permutation each call; run in a child (importing simwires adds modes)."""
    code = """
import sys, torch
sys.path.insert(0, 'bench/sim_wires')
import simwires
from hetcomm import modes
gen = torch.Generator().manual_seed(0)
d = torch.arange(70.0)
a, b = simwires.shuffled_within_blocks(d, 32, gen), simwires.shuffled_within_blocks(d, 32, gen)
for e in (a, b):
    for lo, hi in ((0, 32), (32, 64), (64, 70)):
        assert sorted(e[lo:hi].tolist()) == list(range(lo, hi)), (lo, e[lo:hi])
assert not torch.equal(a, d) and not torch.equal(a, b)
m = modes.get('sim-int3shuf-b32')
assert m.options == {'kind': 'int3', 'block': 32, 'shuffle': True}
print('ok')
"""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_sim_wires_burst_rule_sends_the_steps_after_a_burst_exactly():
    """bench/sim_wires' burst rule: after a step whose norm is over twice the median of the last steps', the next
    ``hold`` steps go exactly (re-armed by a burst inside them); not before 50 steps of history, not at 1.9x."""
    code = """
import sys
sys.path.insert(0, 'bench/sim_wires')
import simwires
st = simwires.SimState('int3', 32, burst=2.0, hold=3)
st.last_index = 0
def step(norm):  # the last step's norm (as its buckets summed it); whether the step it opens goes exactly
    st.step_sq = norm * norm
    simwires._new_step(st)
    return st.bursting
assert not any(step(5.0) for _ in range(3))  # under 50 steps of history: no rule
assert not any(step(1.0) for _ in range(60))
assert not step(1.9)  # 1.9x the median
assert [step(n) for n in (3.0, 1.0, 1.0, 1.0, 1.0)] == [True, True, True, False, False]
assert [step(n) for n in (2.5, 1.0, 2.5, 1.0, 1.0, 1.0, 1.0)] == [True, True, True, True, True, False, False]
assert st.burst_steps == 8 and st.steps == 3 + 60 + 1 + 5 + 7
print('ok')
"""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux's scheduling policies")
def test_results_record_the_ranks_scheduling_policy():
    # SCHED_BATCH needs no privilege; the testbed's --sched sets it for the ranks (tests/test_netns.py)
    code = ("import os; from hetcomm.benchmarks import common; a = common.metadata(1)['sched']; "
            "os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); print(a, common.metadata(1)['sched'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         preexec_fn=lambda: os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)))
    assert out.returncode == 0 and out.stdout.split() == ["normal", "batch"], out.stderr[-2000:]


def test_bench_train_seeds_compare_means(tmp_path):
    args = ["bench", "train", "--tasks", "regress", "--optims", "sgd", "--modes", "torch-powersgd,onebit+m",
            "--scale", "0.1", "--eval-every", "10", "--seeds", "2", "--json", "s.json"]
    out = _run(args, tmp_path)
    data = json.load(open(tmp_path / "s.json"))
    assert data["meta"]["command"] == "hetcomm " + " ".join(args)  # what cli.main was given, not this process's argv
    runs = data["runs"]
    assert sorted((r["mode"], r["seed"]) for r in runs) == [("fp32", 0), ("fp32", 1), ("onebit+m", 0), ("onebit+m", 1),
                                                             ("torch-powersgd", 0), ("torch-powersgd", 1)]
    # a seed moves the initialisation and the data: the two fp32 runs differ
    fp32 = [r["final"] for r in runs if r["mode"] == "fp32"]
    assert fp32[0] != fp32[1]
    for r in runs:  # each run's target is fp32's of the same seed
        assert r["target"] == fp32[r["seed"]]
    summary = {a["mode"]: a for a in data["summary"]}
    finals = [r["final"] for r in runs if r["mode"] == "onebit+m"]
    assert summary["onebit+m"]["final_mean"] == pytest.approx(sum(finals) / 2)
    assert summary["onebit+m"]["final_std"] == pytest.approx(float(torch.tensor(finals, dtype=torch.float64).std()))
    assert summary["fp32"]["fp32_mean"] == pytest.approx(sum(fp32) / 2) and summary["fp32"]["reached_mean"]
    assert summary["onebit+m"]["reached_mean"] == (summary["onebit+m"]["final_mean"] <= 1.02 * sum(fp32) / 2)
    # against PowerSGD: the mean of the per-seed ratios, over the seeds where both reached their targets
    powersgd = {r["seed"]: r for r in runs if r["mode"] == "torch-powersgd"}
    for mode in ("onebit+m", "torch-powersgd", "fp32"):
        both = [r for r in runs if r["mode"] == mode and r["reached"] and powersgd[r["seed"]]["reached"]]
        for key, time_key in (("vs_powersgd", "time_to_target_s"), ("stay_vs_powersgd", "time_to_stay_s")):
            ratios = [r[time_key] / powersgd[r["seed"]][time_key] for r in both]
            assert summary[mode][key] == (pytest.approx(sum(ratios) / len(ratios)) if ratios else None)
        assert summary[mode]["vs_powersgd_seeds"] == len(both)
        summed = [(r["time_to_target_s"], powersgd[r["seed"]]["time_to_target_s"]) for r in both]
        assert summary[mode]["summed_vs_powersgd"] == (
            pytest.approx(sum(a for a, _ in summed) / sum(b for _, b in summed)) if summed else None)
    assert "over 2 seeds" in out.stdout


def test_bench_train_takes_fp32s_runs_from_a_reference_instead_of_running_them_again(tmp_path, capsys):
    common = ["bench", "train", "--tasks", "regress", "--optims", "sgd", "--eval-every", "10", "--seeds", "2"]
    _run(common + ["--scale", "0.1", "--modes", "onebit+m", "--json", "a.json"], tmp_path)
    out = _run(common + ["--scale", "0.1", "--modes", "onebit+m", "--reference", "a.json", "--json", "b.json"],
               tmp_path)
    a, b = (json.load(open(tmp_path / f)) for f in ("a.json", "b.json"))
    assert "from a.json, not run again" in out.stdout and b["meta"]["reference"] == "a.json"
    for seed in (0, 1):
        ra, rb = ({r["mode"]: r for r in d["runs"] if r["seed"] == seed} for d in (a, b))
        assert rb["fp32"]["reference_from"] == "a.json" and "reference_from" not in rb["onebit+m"]
        assert rb["fp32"]["curve"] == ra["fp32"]["curve"]  # copied, not rerun
        # the runs are deterministic: the same onebit+m run, judged against the same target
        assert rb["onebit+m"]["final"] == ra["onebit+m"]["final"]
        assert rb["onebit+m"]["target"] == ra["onebit+m"]["target"] == ra["fp32"]["final"]
        assert rb["onebit+m"]["steps_to_target"] == ra["onebit+m"]["steps_to_target"]
    # --first-seed 1 runs seed 1 alone: the same runs as a.json's seed 1, fp32's taken from it
    _run(common[:-1] + ["1", "--first-seed", "1", "--scale", "0.1", "--modes", "onebit+m", "--reference", "a.json",
                        "--json", "c.json"], tmp_path)
    c = json.load(open(tmp_path / "c.json"))
    assert sorted((r["mode"], r["seed"]) for r in c["runs"]) == [("fp32", 1), ("onebit+m", 1)]
    ra = {r["mode"]: r for r in a["runs"] if r["seed"] == 1}
    rc = {r["mode"]: r for r in c["runs"]}
    assert rc["onebit+m"]["final"] == ra["onebit+m"]["final"] and rc["onebit+m"]["target"] == ra["fp32"]["final"]
    assert c["meta"]["first_seed"] == 1
    # a reference that lacks a run this one needs (other steps, other ranks, fp32 asked for too): a clear error
    for extra, said in ((["--scale", "0.2", "--modes", "onebit+m"], "no fp32 run with task regress"),
                        (["--scale", "0.1", "--modes", "onebit+m", "--ranks", "3"], "world_size 3"),
                        (["--scale", "0.1", "--modes", "fp32,onebit+m"], "leave fp32 out of --modes"),
                        (["--scale", "0.1", "--modes", "onebit+m", "--bucket-mb", "1"], "--bucket-mb None")):
        told = _rejected(common + extra + ["--reference", str(tmp_path / "a.json")], capsys)
        assert said in told, (extra, told[-2000:])


def test_bench_ddp_grid_compares_auto_with_the_best_fixed_mode(tmp_path):
    out = _run(["bench", "ddp", "--grid", "--networks", "loopback", "--grid-params", "50K", "--grid-ranks", "2",
                "--modes", "torch-allreduce,none,auto", "-n", "3", "--json", "g.json"], tmp_path)
    cells = json.load(open(tmp_path / "g.json"))["cells"]
    assert [(c["network"], c["params"], c["ranks"]) for c in cells] == [("loopback", 50_000, 2)]
    assert "error" not in cells[0], cells[0]["error"]
    rows = {r["mode"]: r["step_ms"] for r in cells[0]["rows"]}
    best = min(("torch-allreduce", "none"), key=rows.get)
    assert cells[0]["best_mode"] == best and cells[0]["auto_vs_best"] == pytest.approx(rows["auto"] / rows[best])
    assert cells[0]["auto_vs_powersgd"] is None  # not measured in this cell
    assert "auto/best" in out.stdout


def test_bench_train_lm_text_is_generated_the_same_every_time():
    from hetcomm.benchmarks import tasks

    a, b = tasks.grammar_text(5000), tasks.grammar_text(5000)
    assert a == b and len(a) == 5000 and a != tasks.grammar_text(5000, seed=1)
    lm = tasks.LanguageModel()
    x, y = lm.batch_for(0, 0)
    assert x.shape == (16, 64) and torch.equal(x[:, 1:], y[:, :-1])  # next-character targets
    ev = lm.evaluate(lm.model())
    assert abs(ev["perplexity"] - math.exp(ev["loss"])) < 1e-6 * ev["perplexity"]
    assert 0.5 * lm.vocab < ev["perplexity"] < 2 * lm.vocab  # an untrained model is about uniform


def _digits_data(task, seed: int, step: int, rank: int):
    """Asserts that ``task`` (seeded ``seed``) draws digits' test set and
    batches: only the model differs. Returns the digits task."""
    from hetcomm.benchmarks import tasks

    digits = tasks.Classify()
    for t in (digits, task):
        t.seed = seed
    assert torch.equal(task.x_test, digits.x_test) and torch.equal(task.y_test, digits.y_test)
    for a, b in zip(task.batch_for(step, rank), digits.batch_for(step, rank)):
        assert torch.equal(a, b)
    return digits


def test_bench_train_wide_task_is_digits_through_a_four_times_wider_mlp(monkeypatch):
    from hetcomm import cli
    from hetcomm.benchmarks import tasks

    wide = tasks.WideClassify()
    digits = _digits_data(wide, 1, 7, 1)
    def widths(task):
        return [m.out_features for m in task.model() if isinstance(m, torch.nn.Linear)]

    assert (widths(digits), widths(wide)) == ([256, 256, 10], [1024, 1024, 10])
    assert sum(p.numel() for p in wide.model().parameters()) == 64 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    ev = wide.evaluate(wide.model())
    assert 0 <= ev["accuracy"] < 40  # untrained: about chance on 10 classes
    # minutes at 100 Mbit: run only when named
    assert "wide" in tasks.TASKS and "wide" not in tasks.DEFAULT_TASKS
    seen = []
    monkeypatch.setattr(cli, "_bench", seen.append)
    cli.main(["bench", "train"])
    cli.main(["bench", "train", "--tasks", "wide,lm"])
    assert [a.tasks for a in seen] == [tasks.DEFAULT_TASKS, ["wide", "lm"]]


def _sgd_momentum_steps(task, model, n):
    """n steps of SGD-momentum at the task's rate on rank 0's batches."""
    opt = torch.optim.SGD(model.parameters(), lr=task.lr["sgd"], momentum=0.9)
    for step in range(n):
        x, y = task.batch_for(step, 0)
        opt.zero_grad()
        task.loss(model(x), y).backward()
        opt.step()


def _a_named_variant_of(variant, base, name, data):
    """``variant`` is the task ``name``, run only when named, with ``base``'s
    data (the attributes ``data``) and, for a seed, its batches."""
    from hetcomm.benchmarks import tasks

    assert name in tasks.TASKS and name not in tasks.DEFAULT_TASKS
    assert all(torch.equal(getattr(variant, a), getattr(base, a)) for a in data)
    for t in (variant, base):
        t.seed = 2
    for a, b in zip(variant.batch_for(5, 1), base.batch_for(5, 1)):
        assert torch.equal(a, b)


def test_bench_train_wide_regress_task_is_the_regression_through_1024_wide_layers():
    """wide-regress: the regression's data, batches and rates' rule through
    1024-wide layers (a 4.4 MB gradient); named, never a default; its own
    AdamW rate (fp32's best there), the regression's SGD rates."""
    from hetcomm.benchmarks import tasks

    wide, narrow = tasks.WideRegress(), tasks.Regress()
    _a_named_variant_of(wide, narrow, "wide-regress", ("x", "y"))
    model = wide.model()
    assert [m.out_features for m in model if isinstance(m, torch.nn.Linear)] == [1024, 1024, 1]
    assert sum(p.numel() for p in model.parameters()) == 32 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 + 1
    assert [m.out_features for m in narrow.model() if isinstance(m, torch.nn.Linear)] == [128, 128, 1]
    assert (wide.lr["sgd"], wide.lr["plain"]) == (narrow.lr["sgd"], narrow.lr["plain"])
    assert wide.lr["adamw"] < narrow.lr["adamw"]
    # a few SGD-momentum steps at its rate lower the MSE over the whole set (evaluate's reading)
    before = wide.evaluate(model)["mse"]
    _sgd_momentum_steps(wide, model, 20)
    with torch.no_grad():
        expected = torch.nn.functional.mse_loss(model(wide.x).squeeze(1), wide.y).item()
    after = wide.evaluate(model)
    assert after["mse"] == after["loss"] == pytest.approx(expected, rel=1e-6)
    assert after["mse"] < 0.9 * before


def test_bench_train_cnn_task_is_digits_through_convolutions_with_batch_norm():
    """The cnn task: digits' images (8 x 8), batches and test set through two
    convolutions with batch norm; evaluated in eval mode (the running
    statistics, not the test set's), and left in the mode it was in."""
    from hetcomm.benchmarks import tasks

    cnn = tasks.ConvClassify()
    _digits_data(cnn, 2, 5, 1)
    model = cnn.model()
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(torch.nn.Conv2d) == 2 and kinds.count(torch.nn.BatchNorm2d) == 2
    assert "cnn" in tasks.TASKS and "cnn" not in tasks.DEFAULT_TASKS
    # a few training steps move batch norm's running statistics away from (0, 1)
    _sgd_momentum_steps(cnn, model, 3)
    stats = {k: v.clone() for k, v in model.state_dict().items() if "running" in k}
    ev = cnn.evaluate(model)
    assert model.training
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in stats.items())  # the evaluation changed none
    model.eval()
    with torch.no_grad():
        out = model(cnn.x_test)
    expected = 100.0 * (out.argmax(1) == cnn.y_test).float().mean().item()
    assert ev["accuracy"] == expected
    assert abs(ev["loss"] - torch.nn.functional.cross_entropy(out, cnn.y_test).item()) < 1e-6
    model.train()
    with torch.no_grad():  # in train mode the test set's own statistics would give another loss
        assert abs(torch.nn.functional.cross_entropy(model(cnn.x_test), cnn.y_test).item() - ev["loss"]) > 1e-6


def test_bench_train_rnn_task_is_the_language_model_through_an_lstm():
    """The rnn task: the language model's text, batches and held-out tail
    through an embedding, two LSTM layers and a linear head; named, never a
    default; evaluated as the perplexity of the held-out tail."""
    from hetcomm.benchmarks import tasks

    rnn, lm = tasks.RecurrentLM(), tasks.LanguageModel()
    _a_named_variant_of(rnn, lm, "rnn", ("train", "held_out"))
    model = rnn.model()
    lstm = [m for m in model.modules() if isinstance(m, torch.nn.LSTM)]
    assert len(lstm) == 1 and lstm[0].num_layers == 2
    before = rnn.evaluate(model)["perplexity"]
    _sgd_momentum_steps(rnn, model, 30)
    starts = torch.arange(0, len(rnn.held_out) - rnn.CTX - 1, rnn.CTX)
    x = torch.stack([rnn.held_out[s:s + rnn.CTX] for s in starts.tolist()])
    y = torch.stack([rnn.held_out[s + 1:s + rnn.CTX + 1] for s in starts.tolist()])
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(x).reshape(-1, rnn.vocab), y.reshape(-1)).item()
    after = rnn.evaluate(model)
    assert after["loss"] == pytest.approx(expected, rel=1e-6)
    assert after["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert after["perplexity"] < 0.7 * before


def test_bench_train_bucket_mb_sets_ddp_buckets_for_hetcomm_modes(monkeypatch):
    """DDP's default puts a first bucket of 1 MB before the 25 MB ones: the wide
    model's 4.5 MB gradient goes in two buckets; --bucket-mb 25 makes it one
    (what PowerSGD's bench mode always runs)."""
    from hetcomm import cli

    def buckets(bucket_mb):
        runs = train.run(2, ["wide"], ["sgd"], ["lowrank"], 0.04, 12, bucket_mb=bucket_mb)
        plans = {r["mode"]: r["curve"][-1].get("plans") for r in runs}
        return sum(plans["lowrank"].values()), plans["fp32"]

    assert buckets(None) == (2, None) and buckets(25.0) == (1, None)
    seen = []
    monkeypatch.setattr(cli, "_bench", seen.append)
    cli.main(["bench", "train", "--tasks", "wide", "--bucket-mb", "25"])
    cli.main(["bench", "train"])
    assert [a.bucket_mb for a in seen] == [25.0, None]
    with pytest.raises(SystemExit):
        cli.main(["bench", "train", "--bucket-mb", "0"])

MALFORMED = [
    ["demo", "--ranks", "0"], ["demo", "--steps", "0"], ["demo", "--steps", "-3"], ["demo", "--batch", "x"],
    ["demo", "--modes", ""], ["demo", "--modes", "none,zip"], ["demo", "--json", "/nonexistent/dir/x.json"],
    ["demo", "--json", "/"], ["bench"], ["bench", "zip"], ["bench", "compress", "-b", "foo"],
    ["bench", "compress", "-b", "1MiBx"], ["bench", "compress", "-b", "-1M"], ["bench", "compress", "-f", "1"],
    ["bench", "compress", "-f", "0"], ["bench", "compress", "-b", "8M", "-e", "1M"], ["bench", "compress", "-n", "0"],
    ["bench", "compress", "-w", "-1"], ["bench", "compress", "--threads", "0"], ["bench", "compress", "--device", "tpu"],
    ["bench", "compress", "--ranks", "2"], ["bench", "allreduce", "--algos", "butterfly"],
    ["bench", "allreduce", "--wires", "int8"], ["bench", "allreduce", "-c", "2"], ["bench", "allreduce", "--ranks", "0"],
    ["bench", "allreduce", "-e", "1e9999"], ["bench", "ddp", "--params", "1B9"], ["bench", "ddp", "--params", "3B"],
    ["bench", "ddp", "--params", "0"], ["bench", "ddp", "--modes", "bogus"], ["bench", "ddp", "--modes", "torch-fp16+bal"],
    ["bench", "ddp", "--rank-cpu", "0,1"], ["bench", "ddp", "--rank-cpu", "0.5"], ["bench", "ddp", "--rank-cpu", "a,b"],
    ["bench", "ddp", "--global-batch", "0"], ["bench", "ddp", "--algorithm", "butterfly"], ["bench", "ddp", "-b", "1M"],
    ["bench", "train", "--tasks", "mnist"], ["bench", "train", "--optims", "lamb"],
    ["bench", "train", "--modes", "fp16+bal"], ["bench", "train", "--modes", "lowrank-r0"],
    ["bench", "train", "--modes", "torch-powersgd-r4+m"], ["bench", "train", "--modes", ""], ["bench", "train", "--scale", "0"], ["bench", "train", "--lr-scale", "-1"],
    ["bench", "train", "--eval-every", "0"], ["bench", "train", "--png", "/no/such/dir/x.png"],
    ["bench", "train", "--seeds", "0"], ["bench", "train", "--first-seed", "-1"], ["bench", "train", "--clip-grad-norm", "0"],
    ["bench", "train", "--schedule", "step"], ["bench", "train", "--schedule", "warmup:0"],
    ["bench", "train", "--reference", "/no/such/runs.json"],
    ["bench", "train", "--reference", "/dev/null", "--modes", "onebit"], ["bench", "ddp", "--grid", "--grid-ranks", "3"],
    ["bench", "ddp", "--grid", "--networks", "fast"], ["bench", "ddp", "--grid", "--grid-params", ""],
    ["topo", "--ranks", "-1"], ["topo", "--wires", "zip"], ["testbed", "--nodes", "0", "--", "true"],
    ["testbed", "--inter-node-rate", "fast", "--", "true"], ["testbed", "--rank-cpu", "0,0,0,0", "--", "true"],
    ["testbed", "--timeout", "0", "--", "true"], ["testbed", "--sched", "idle", "--", "true"], ["testbed"],
    ["testbed", "--inter-node-burst", "50kb", "--", "true"], ["testbed", "--inter-node-burst", "400kbit", "--", "true"],
    ["testbed", "--inter-node-rate", "100mbit", "--inter-node-burst", "8kbit", "--", "true"],
    ["info", "--bogus"], ["--bogus"], [],
]


@pytest.mark.reliability
@pytest.mark.parametrize("argv", MALFORMED, ids=lambda a: " ".join(a) or "(none)")
def test_malformed_invocations_are_one_line_argparse_errors(argv, capsys):
    from hetcomm import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "error:" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1


@pytest.mark.parametrize("text,value", [("256K", 256 << 10), ("1MiB", 1 << 20), ("1M", 1 << 20), ("4gib", 4 << 30),
                                        ("512", 512), ("512B", 512), ("1.5K", 1536)])
def test_sizes_take_binary_suffixes(text, value):
    from hetcomm import cliargs

    assert cliargs.size_bytes(text) == value


def test_version_and_param_counts():
    from hetcomm import cliargs

    out = subprocess.run(HETCOMM + ["--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("hetcomm ")
    assert cliargs.param_count("50K") == 50_000 and cliargs.param_count("1B") == 10**9 and \
        cliargs.param_count("5M") == 5 * 10**6
