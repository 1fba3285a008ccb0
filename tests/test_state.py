"""HookState validation and the import contract (a one-rank gloo group)."""

import os
import subprocess
import sys
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hetcomm


@pytest.fixture(autouse=True, scope="module")
def one_rank_group(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "fs"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_hookstate_needs_an_initialized_process_group():
    code = ("import hetcomm\n"
            "try:\n    hetcomm.HookState('onebit')\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "init_process_group" in out.stdout, (out.stdout, out.stderr)


@pytest.mark.parametrize("kwargs,option", [
    (dict(compression="int8"), "compression"),
    (dict(compression="auto", start_iter=0), "start_iter"),
    (dict(start_iter=-1), "start_iter"),
    (dict(start_iter=2.5), "start_iter"),
    (dict(chunk_size=100), "chunk_size"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(min_compress_numel=-5), "min_compress_numel"),
    (dict(topk_ratio=0.0), "topk_ratio"),
    (dict(topk_ratio=1.5), "topk_ratio"),
    (dict(topk_ratio="0.1"), "topk_ratio"),
    (dict(error_feedback="yes"), "error_feedback"),
    (dict(topk_exact=1), "topk_exact"),
    (dict(timeout=5), "timeout"),
    (dict(timeout=timedelta(seconds=0)), "timeout"),
    (dict(process_group="world"), "process_group"),
    (dict(transport="mpi"), "transport"),
    (dict(algorithm="butterfly"), "algorithm"),
    (dict(rank=0), "rank"),
    (dict(matrix_approximation_rank=0), "matrix_approximation_rank"),
    (dict(matrix_approximation_rank=2, rank=3), "not both"),
    (dict(lowrank_wire="fp16"), "lowrank_wire"),
])
def test_bad_options_are_value_errors_naming_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        hetcomm.HookState(**kwargs)


def test_start_iter_0_is_fine_for_every_codec_but_auto():
    assert hetcomm.HookState("onebit", start_iter=0, error_feedback=False).start_iter == 0
    assert hetcomm.HookState("topk", start_iter=0).start_iter == 0  # DDP's rebuilt buckets adopt what is owed
    assert hetcomm.HookState("auto", start_iter=0, error_feedback=False).start_iter == 0


def test_set_local_batch_size_validates():
    s = hetcomm.HookState()
    for bad in (0, -3, float("nan"), float("inf"), True, "8", torch.tensor([3, 4]), torch.tensor(True),
                torch.tensor(0), np.bool_(True), np.int64(-2)):
        with pytest.raises(ValueError, match="batch_size"):
            s.set_local_batch_size(bad)
    # what a loop has at hand: an int, a NumPy scalar (a NumPy sampler), a token count as a one-element tensor
    for good, want in ((7, 7.0), (np.int64(9), 9.0), (np.float32(2.5), 2.5), (torch.tensor(517), 517.0),
                       (torch.tensor([12.0]), 12.0)):
        s.set_local_batch_size(good)
        assert s._local_batch == want and type(s._local_batch) is float


class _FakeBucket:
    def __init__(self, buf):
        self._buf = buf

    def buffer(self):
        return self._buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return [self._buf]


def test_non_float_bucket_is_a_value_error():
    with pytest.raises(ValueError, match="bucket dtype must be floating point"):
        hetcomm.hook(hetcomm.HookState(), _FakeBucket(torch.zeros(4, dtype=torch.int64)))


def test_a_tensor_for_a_bucket_names_ddps_grad_bucket():
    # what FSDP's hooks hand over (fully_shard's set_all_reduce_hook with functools.partial(hetcomm.hook, state))
    with pytest.raises(ValueError, match="bucket must be DDP's GradBucket .*FSDP's hooks"):
        hetcomm.hook(hetcomm.HookState(), torch.zeros(4))


def test_sparse_bucket_is_a_value_error_naming_sparse_false():
    # DDP hands an nn.Embedding(sparse=True)'s gradient over as a sparse bucket (every rank alike)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (4,))
    with pytest.raises(ValueError, match="sparse gradient .*construct it with sparse=False"):
        hetcomm.hook(hetcomm.HookState(), _FakeBucket(sparse))


def test_checkpoint_per_rank_round_trips_and_names_what_it_lacks():
    s = hetcomm.HookState("onebit")
    saved = hetcomm.checkpoint.PerRank(s).state_dict()
    assert list(saved) == ["rank0"] and isinstance(saved["rank0"], bytes)
    fresh = hetcomm.HookState("onebit")
    hetcomm.checkpoint.PerRank(fresh).load_state_dict(saved)
    assert fresh.state_dict().keys() == s.state_dict().keys()
    with pytest.raises(ValueError, match="no 'rank0' entry of bytes .*keys \\['rank1'\\]"):
        hetcomm.checkpoint.PerRank(fresh).load_state_dict({"rank1": saved["rank0"]})
    with pytest.raises(ValueError, match="compression"):  # another mode's state, as HookState.load_state_dict says
        hetcomm.checkpoint.PerRank(hetcomm.HookState("topk")).load_state_dict(saved)
    with pytest.raises(ValueError, match="state must be a hetcomm.HookState"):
        hetcomm.checkpoint.PerRank(object())


def test_accelerate_register_names_what_it_needs():
    from hetcomm.integrations.accelerate import register

    with pytest.raises(ValueError, match="state must be a hetcomm.HookState"):
        register(object(), torch.nn.Linear(2, 2), object())
    with pytest.raises(ValueError, match="a DistributedDataParallel, got Linear: .*num_processes > 1"):
        register(object(), torch.nn.Linear(2, 2), hetcomm.HookState())


def test_stats_before_the_first_bucket_read_as_after_one_with_every_count_zero():
    # a loop that prints stats()["last_step"] before its first step, or after resuming a finished run, reads
    # zeros where it raised a KeyError (no engine yet); the same keys as an engine's after a step
    s = hetcomm.HookState("int3")
    before = s.stats()
    assert before["last_step"]["bytes_sent"] == 0 and before["total"]["buckets"] == 0
    assert before["last_step"]["compression_ratio"] == 1.0 and before["nonfinite_steps"] == 0
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    ddp.register_comm_hook(s, hetcomm.hook)
    ddp(torch.randn(8, 64)).sum().backward()
    after = s.stats()
    s.close()
    assert after["total"]["buckets"] == 1 and after["total"]["numel"] == 64 * 64 + 64
    for part in ("total", "last_step"):
        assert set(before[part]) == set(after[part])
    assert set(before) <= set(after)


def test_hook_needs_a_hookstate():
    with pytest.raises(ValueError, match="state must be a hetcomm.HookState"):
        hetcomm.hook(object(), _FakeBucket(torch.zeros(4)))


def test_load_state_dict_rejects_foreign_state():
    s = hetcomm.HookState("onebit")
    with pytest.raises(ValueError, match="not a hetcomm HookState state"):
        s.load_state_dict({"residuals": {}})
    sd = hetcomm.HookState("topk").state_dict()
    with pytest.raises(ValueError, match="compression"):
        s.load_state_dict(sd)
    sd = s.state_dict()
    sd["world_size"] = 4
    with pytest.raises(ValueError, match="load each rank's own state"):
        s.load_state_dict(sd)


def test_import_never_initialises_cuda():
    # As torchao's lean-import test: make any CUDA initialisation fail loudly,
    # then import hetcomm and use its build query.
    code = (
        "import torch, torch.cuda\n"
        "def boom(*a, **k): raise RuntimeError('CUDA was initialised')\n"
        "torch.cuda._lazy_init = boom\n"
        "torch.cuda.init = boom\n"
        "import sys, tempfile, torch.distributed as dist, hetcomm, hetcomm.ops\n"
        "hetcomm.build_info()\n"
        "dist.init_process_group('gloo', store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)\n"
        "hetcomm.HookState('auto-precision')\n"
        "assert not torch.cuda.is_initialized()\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


_ANY = st.one_of(st.none(), st.booleans(), st.integers(-3, 5000), st.sampled_from([2**63, -2**63, 2**31]),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                 st.sampled_from(["onebit", "topk", "lowrank", "auto", "ring", "pg", "none", "hierarchical"]))


@pytest.mark.reliability
@settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.dictionaries(st.sampled_from(["compression", "start_iter", "error_feedback", "chunk_size",
                                        "min_compress_numel", "topk_ratio", "topk_exact", "rank", "algorithm",
                                        "matrix_approximation_rank", "lowrank_wire",
                                        "transport", "timeout", "candidates"]), _ANY, max_size=4), _ANY)
def test_fuzz_hookstate_arguments_are_accepted_or_value_errors(kwargs, batch):
    try:
        s = hetcomm.HookState(**kwargs)
    except ValueError as e:
        assert any(name in str(e) for name in kwargs) or "start_iter" in str(e), (kwargs, e)
        return
    try:
        s.set_local_batch_size(batch)
    except ValueError as e:
        assert "batch_size" in str(e)
    s.close()


def test_auto_options_are_checked():
    with pytest.raises(ValueError, match="candidates is for compression='auto'"):
        hetcomm.HookState("onebit", candidates=["onebit"])
    for bad in (["zip"], [], "onebit", ["none", "none"], True, 5, 2.5):  # the last three once a TypeError
        with pytest.raises(ValueError, match="candidates must be"):
            hetcomm.HookState("auto", candidates=bad)
    with pytest.raises(ValueError, match="start_iter"):
        hetcomm.HookState("auto", start_iter=0)
    s = hetcomm.HookState("auto")
    assert s.start_iter == 1  # the trial from step 1: DDP's buckets were rebuilt in its forward
    assert s.algorithm == "auto"  # auto compression chooses the algorithm too
    assert hetcomm.HookState("onebit").algorithm == "native"


def test_rank_is_a_deprecated_alias_of_matrix_approximation_rank():
    with pytest.warns(DeprecationWarning, match="matrix_approximation_rank"):
        s = hetcomm.HookState("lowrank", rank=2)
    assert s.matrix_approximation_rank == 2
    s.close()


def test_literal_option_types_match_the_accepted_values():
    # The Literal annotations (for type checkers; hetcomm ships py.typed) cannot drift from what HookState accepts.
    import typing

    from hetcomm import state, topology

    assert set(typing.get_args(state.Compression)) == set(state.COMPRESSIONS)
    assert set(typing.get_args(state.Algorithm)) == set(topology.ALGORITHMS) | {"auto"}
    assert os.path.exists(os.path.join(os.path.dirname(state.__file__), "py.typed"))


def test_the_cores_enums_are_the_names_python_plans_with():
    # One table per concept: the planner's algorithm and wire names are the
    # C++ enums' own (exported with py::enum_), not a mirrored id table.
    from hetcomm import _C, options, topology

    assert tuple(_C.Algo.__members__) == topology.ALGORITHMS
    wires = set(options.COMPRESSIONS) - {"auto", "auto-precision"}
    assert set(_C.Codec.__members__) == wires
    t = _C.ProcessGroupTransport(dist.group.WORLD)
    with pytest.raises(ValueError, match="algorithm must be one of native, ring, halving_doubling, tree, hierarchical"):
        t.allreduce(torch.zeros(4), "butterfly")
    x = torch.arange(4.0)
    for name in topology.ALGORITHMS[:-1]:  # one rank: every flat algorithm leaves x as it is
        t.allreduce(x, name)
    assert torch.equal(x, torch.arange(4.0))


# ---- the one mode table (hetcomm.modes) of the demo, the benchmarks and the tests ----
@pytest.mark.parametrize("name", list(hetcomm.modes.MODES))
def test_every_mode_of_the_table_registers_and_trains_a_step(name):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    mode = hetcomm.modes.get(name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    state = mode.register(ddp, opt, total_steps=100)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).square().sum().backward()
        opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    if mode.is_torch:
        assert state is None
        hook_state, hook, _ = mode.comm_hook()
        assert (hook is powerSGD_hook.powerSGD_hook) == (name == "torch-powersgd")
        assert isinstance(hook_state, powerSGD_hook.PowerSGDState) == (name == "torch-powersgd")
        return
    assert isinstance(state, hetcomm.HookState) and state.iter == 3
    assert state.compression == name.split("+")[0].replace("-no-ef", "").replace("-no-lowrank", "")
    assert (state.candidates is not None and "lowrank" not in state.candidates) == name.endswith("-no-lowrank")
    assert state.error_feedback == (not name.endswith("-no-ef"))
    assert (state._attached == "sgd") == ("+m" in name)
    assert (state._lr_source is not None) == ("+m" in name or name.endswith("+lr"))  # attaching follows the rate
    # -w32 sends the warm-up exact; plain +m takes attach_optimizer's default, fp8 once total_steps is given
    assert state._warmup_compression == ("none" if name.endswith("-w32") or "+m" not in name else "fp8")
    state.close()


def test_mode_table_counts_pytorchs_bytes_in_closed_form():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    numel = 64 * 256 + 256 + 256 * 10 + 10
    assert hetcomm.modes.get("fp32").torch_bytes(model, 4) == 2 * 3 * numel * 4 // 4
    assert hetcomm.modes.get("torch-fp16").torch_bytes(model, 4) == 2 * 3 * numel * 2 // 4
    # PowerSGD rank 4: P and Q of the 256 x 64 weight ((256 + 64) x 4 = 1280 floats) and of the 10 x 256 one
    # ((10 + 256) x 4 = 1064, worth it: 2 x 1064 < 2560); biases dense
    powersgd = 2 * 3 * (1280 + 256 + 1064 + 10) * 4 // 4
    assert hetcomm.modes.get("torch-powersgd").torch_bytes(model, 4) == powersgd
    # over a run: its first 2 steps are dense
    dense = 2 * 3 * numel * 4 // 4
    assert hetcomm.modes.get("torch-powersgd").torch_bytes(model, 4, steps=1) == dense
    assert hetcomm.modes.get("torch-powersgd").torch_bytes(model, 4, steps=10) == (2 * dense + 8 * powersgd) / 10
    assert hetcomm.modes.get("fp32").torch_bytes(model, 4, steps=10) == dense
    assert hetcomm.modes.ring_bytes(numel, 1) == 0
    with pytest.raises(ValueError, match="HookState.stats"):
        hetcomm.modes.get("onebit").torch_bytes(model, 4)


def test_a_rank_suffix_sets_lowrank_and_powersgds_rank_a_chunk_onebits_and_a_share_topks():
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    # rank 16: P and Q of the 256 x 64 weight, (256 + 64) x 16 = 5120 floats < 16384 / 2; the 10 x 256 one
    # ((10 + 256) x 10 = 2660, its rank capped at 10) is not worth it (2 x 2660 > 2560): dense, as the biases
    assert hetcomm.modes.get("torch-powersgd-r16").torch_bytes(model, 4) == 2 * 3 * (5120 + 256 + 2560 + 10) * 4 // 4
    mode = hetcomm.modes.get("torch-powersgd-r16")
    assert mode.comm_hook()[0].matrix_approximation_rank == 16 and mode.name == "torch-powersgd-r16"
    m = hetcomm.modes.get("lowrank-r16+m")
    assert m.attach and m.options == {"compression": "lowrank", "matrix_approximation_rank": 16}
    m = hetcomm.modes.get("onebit-c256+m")
    assert m.attach and m.name == "onebit-c256+m" and m.options == {"compression": "onebit", "chunk_size": 256}
    state = hetcomm.modes.get("fp8-c64").comm_hook()[0]
    assert state.chunk_size == 64 and state.compression == "fp8"
    state.close()
    for bad in ("onebit-c100", "int3-c16", "fp8-c0"):  # named by the mode's name, before any HookState
        with pytest.raises(ValueError, match=f"mode '{bad}': the elements per scale after -c: chunk_size must be "
                                             "None or a positive multiple of 32"):
            hetcomm.modes.get(bad)
    with pytest.raises(ValueError, match="chunk_size must be None or a positive multiple of 32"):
        hetcomm.HookState(compression="int3", chunk_size=16)
    state = hetcomm.modes.get("lowrank-r8").comm_hook()[0]
    assert state.matrix_approximation_rank == 8 and state.compression == "lowrank"
    state.close()
    m = hetcomm.modes.get("topk-k30+m")
    assert m.attach and m.options == {"compression": "topk", "topk_ratio": 0.03}
    state = m.comm_hook()[0]
    assert state.topk_ratio == 0.03 and state.compression == "topk"
    state.close()
    for bad, rule in (("lowrank-r0", "rank after -r must be >= 1"), ("torch-powersgd-r8+m", "no \\+m form"),
                      ("onebit-r8", "-rN is for lowrank"), ("lowrank-c256", "-cN for onebit, fp8 and int3"),
                      ("topk-c256", "-kN for topk"), ("onebit-k30", "-kN for topk"),
                      ("topk-k0", "per mille after -k must be in 1..1000"), ("topk-k1001", "in 1..1000"),
                      ("fp8-c256-no-ef", "must be one of")):
        with pytest.raises(ValueError, match=rule):
            hetcomm.modes.get(bad)
    with pytest.raises(ValueError, match="mode must be one of fp32; got 'lowrank-r8'"):
        hetcomm.modes.get("lowrank-r8", choices=["fp32"])


def test_an_algorithm_suffix_sets_a_hetcomm_modes_algorithm():
    m = hetcomm.modes.get("onebit-c64+m-p5@hierarchical")
    assert (m.name, m.attach, m.warmup_fraction, m.options) == (
        "onebit-c64+m-p5@hierarchical", True, 0.05, {"compression": "onebit", "chunk_size": 64,
                                                     "algorithm": "hierarchical"})
    state = hetcomm.modes.get("fp8@ring").comm_hook()[0]
    assert (state.compression, state.algorithm) == ("fp8", "ring")
    state.close()
    with pytest.raises(ValueError, match="algorithm must be 'native', 'hierarchical' or 'auto' with compression="):
        hetcomm.modes.get("lowrank@ring").comm_hook()
    for bad, rule in (("torch-powersgd@ring", "@ALGO is for hetcomm's modes; torch-powersgd is PyTorch's hook"),
                      ("fp8@butterfly", "algorithm after @ must be one of auto, native, ring"),
                      ("fp9@ring", "mode 'fp9@ring': mode must be one of"), ("fp8@", "algorithm after @")):
        with pytest.raises(ValueError, match=rule):
            hetcomm.modes.get(bad)


def test_a_start_suffix_sets_a_hetcomm_modes_start_iter():
    m = hetcomm.modes.get("lowrank-r8-s0@native")
    assert (m.name, m.options) == ("lowrank-r8-s0@native", {"compression": "lowrank", "matrix_approximation_rank": 8,
                                                           "start_iter": 0, "algorithm": "native"})
    state = hetcomm.modes.get("topk-s0").comm_hook()[0]
    assert (state.compression, state.start_iter) == ("topk", 0)
    state.close()
    for bad, rule in (("torch-powersgd-s0", "-sN .* is for hetcomm's modes"),
                      ("auto-s0", "start_iter must be >= 1 with compression='auto'")):
        with pytest.raises(ValueError, match=rule):
            hetcomm.modes.get(bad).comm_hook()


def test_a_wire_suffix_sets_a_lowrank_modes_factors_wire():
    m = hetcomm.modes.get("lowrank-r8+m-fp32@native")
    assert (m.name, m.attach, m.options) == ("lowrank-r8+m-fp32@native", True, {
        "compression": "lowrank", "matrix_approximation_rank": 8, "lowrank_wire": "fp32", "algorithm": "native"})
    for name, wire in (("lowrank-fp32", "fp32"), ("lowrank-bf16", "bf16"), ("lowrank-fp8", "fp8"), ("lowrank", None)):
        state = hetcomm.modes.get(name).comm_hook()[0]
        assert (state.compression, state.lowrank_wire) == ("lowrank", wire), name
        state.close()
    state = hetcomm.HookState("lowrank")
    assert state.lowrank_wire is None and hetcomm.plan.lowrank_wire_of(state) == "bf16"  # the default, one node
    assert hetcomm.modes.get("auto-bf16").options == {"compression": "auto", "lowrank_wire": "bf16"}  # auto's lowrank
    for bad in ("fp8-bf16", "torch-powersgd-bf16", "onebit-fp32", "none-fp32", "int3-fp8"):
        with pytest.raises(ValueError, match=r"-(bf16|fp32|fp8) \(the factors' wire\) is for hetcomm's lowrank and"):
            hetcomm.modes.get(bad)


def test_mode_table_plain_modes_are_hookstates_with_defaults():
    assert set(hetcomm.modes.HETCOMM) == {"none", "fp16", "bf16", "auto-precision", "fp8", "int3", "onebit", "topk",
                                          "lowrank", "auto"}
    assert not any(hetcomm.modes.get(n).plain for n in ("onebit+m", "topk-no-ef", "auto-no-lowrank", "torch-powersgd",
                                                        "fp32"))


def test_mode_table_names_its_choices():
    with pytest.raises(ValueError, match="mode must be one of .*onebit.*got 'onebits'"):
        hetcomm.modes.get("onebits")
    with pytest.raises(ValueError, match="mode must be one of fp32, onebit; got 'topk'"):
        hetcomm.modes.get("topk", ["fp32", "onebit"])
    with pytest.raises(ValueError, match="PyTorch's hook.*algorithm"):
        hetcomm.modes.get("torch-powersgd").comm_hook(algorithm="ring")
    with pytest.raises(ValueError, match="pass the optimizer"):
        hetcomm.modes.get("onebit+m").register(None)


def test_attach_optimizer_exact_every_validates():
    params = [torch.nn.Parameter(torch.zeros(3))]
    for bad in (-1, True, 2.5, "16"):
        with pytest.raises(ValueError, match="exact_every must be an int >= 0 or None"):
            hetcomm.HookState("onebit").attach_optimizer(torch.optim.AdamW(params), exact_every=bad)
    with pytest.raises(ValueError, match="exact_every applies to an attached Adam"):
        hetcomm.HookState("onebit").attach_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), exact_every=8)
    hetcomm.HookState("onebit").attach_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9), exact_every=0)


def test_attach_optimizer_total_steps_warms_up_for_a_fifth_of_the_run():
    params = [torch.nn.Parameter(torch.zeros(3))]

    def sgd():
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    for bad in (0, -5, True, 10.0, "600"):
        with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
            hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=bad)
    state = hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=600)
    assert [s for s in range(300) if not state._compressed_at(s)] == list(range(120))
    # that warm-up goes in fp8 unless asked otherwise; a start_iter of the user's own (no total_steps) stays exact,
    # and so does auto's warm-up when its candidates leave fp8 out
    assert state._warmup_compression == "fp8"
    assert hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=600,
                                                        warmup_compression="none")._warmup_compression == "none"
    assert hetcomm.HookState("onebit", start_iter=50).attach_optimizer(sgd())._warmup_compression == "none"
    dense_auto = hetcomm.HookState("auto", candidates=("none", "bf16")).attach_optimizer(sgd(), total_steps=600)
    assert dense_auto._warmup_compression == "none"
    assert hetcomm.HookState("auto", candidates=("none", "fp8")).attach_optimizer(
        sgd(), total_steps=600)._warmup_compression == "fp8"
    assert hetcomm.HookState("auto", candidates=("none", "bf16")).attach_optimizer(
        sgd(), total_steps=600, warmup_compression="fp8")._warmup_compression == "fp8"  # asked for: kept
    # a later start_iter stays; a short run keeps the default's warm-up (1)
    assert hetcomm.HookState("onebit", start_iter=200).attach_optimizer(sgd(), total_steps=600).start_iter == 200
    assert hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=5).start_iter == 1
    adam = hetcomm.HookState("onebit").attach_optimizer(hetcomm.optim.AdamW(params), total_steps=100)
    assert [s for s in range(40) if not adam._compressed_at(s)] == list(range(22)) + [23, 27, 35]  # start 20: 20 + 2**j - 1, 20 + 16k - 1
    # the mode table passes the run's length through (the bench and the demo use it)
    model = torch.nn.Linear(3, 1)
    assert hetcomm.modes.get("onebit").comm_hook()[2].start_iter == 1  # the default
    with pytest.raises(ValueError, match="total_steps must be an int >= 1"):
        hetcomm.modes.get("onebit+m").register(None, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                               total_steps=0)


def test_attach_optimizer_warmup_fraction_sets_the_warm_ups_share_of_the_run():
    params = [torch.nn.Parameter(torch.zeros(3))]

    def sgd():
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)

    for bad in (0, 0.0, 1, 1.0, -0.1, 1.5, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="warmup_fraction must be a number in \\(0, 1\\)"):
            hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=600, warmup_fraction=bad)
    with pytest.raises(ValueError, match="warmup_fraction is a share of total_steps: pass total_steps"):
        hetcomm.HookState("onebit").attach_optimizer(sgd(), warmup_fraction=0.05)
    for fraction, steps, start in ((0.05, 600, 30), (0.1, 400, 40), (0.5, 90, 45), (0.05, 20, 1), (0.29, 100, 29),
                                   (0.07, 50, 3)):
        state = hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=steps, warmup_fraction=fraction)
        assert [s for s in range(steps) if not state._compressed_at(s)] == list(range(start))
        assert state._warmup_compression == "fp8" and state._warmup_fraction == fraction
    # None is the default fifth; a later start_iter of the user's own stays
    assert hetcomm.HookState("onebit").attach_optimizer(sgd(), total_steps=600, warmup_fraction=None).start_iter \
        == int(hetcomm.attach.WARMUP_FRACTION * 600) == 120
    assert hetcomm.HookState("onebit", start_iter=50).attach_optimizer(
        sgd(), total_steps=600, warmup_fraction=0.05).start_iter == 50
    # the mode table's -pN: N % of the run, after +m only
    m = hetcomm.modes.get("onebit-c64+m-w32-p5")
    assert (m.warmup_fraction, m.warmup, m.options) == (0.05, "none", {"compression": "onebit", "chunk_size": 64})
    model = torch.nn.Linear(3, 1)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = hetcomm.modes.get("topk+m-p10").register(ddp, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                                     total_steps=300)
    assert state.start_iter == 30 and state._warmup_fraction == 0.1 and state._warmup_compression == "fp8"
    state.close()
    for bad, rule in (("onebit-p5", "-pN .* is for \\+m modes"), ("onebit+m-p0", "percent after -p must be in 1..99"),
                      ("onebit+m-p100", "in 1..99"), ("onebits+m-p5", "mode 'onebits\\+m-p5': mode must be one of")):
        with pytest.raises(ValueError, match=rule):
            hetcomm.modes.get(bad)


@pytest.mark.parametrize("start,every", [(2, None), (2, 0), (5, 16), (3, 12), (2, 1)])
def test_exact_steps_with_an_adam_are_the_doublings_and_every_exact_every_th(start, every):
    params = [torch.nn.Parameter(torch.zeros(3))]
    state = hetcomm.HookState("onebit", start_iter=start).attach_optimizer(
        hetcomm.optim.AdamW(params), **({} if every is None else dict(exact_every=every)))
    period = 16 if every is None else every
    horizon = 300
    exact = {start + 2 ** j - 1 for j in range(10)}
    if period:
        exact |= {start + k * period - 1 for k in range(1, horizon)}
    got = [s for s in range(horizon) if not state._compressed_at(s)]
    assert got == [s for s in range(horizon) if s < start or s in exact]
    sgd = hetcomm.HookState("onebit", start_iter=start).attach_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9))
    assert [s for s in range(horizon) if not sgd._compressed_at(s)] == list(range(start))
