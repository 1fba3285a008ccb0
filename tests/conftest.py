import os
import tempfile

import pytest
import torch

# Topologies measured by the tests are cached here, not in ~/.cache/hetcomm
# (spawned ranks inherit it; a test may point its ranks elsewhere).
os.environ.setdefault("HETCOMM_CACHE_DIR", tempfile.mkdtemp(prefix="hetcomm-test-cache-"))


def _cuda_usable() -> bool:
    import hetcomm

    return bool(hetcomm.build_info()["cuda"]) and torch.cuda.is_available()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """The same test body on the CPU and, where this build and machine have
    one, on CUDA. Decided when the test runs, never at collection."""
    if request.param == "cuda" and not _cuda_usable():
        pytest.skip("needs a CUDA build of hetcomm (build_info()['cuda']) and a visible GPU")
    return torch.device(request.param)


class Place:
    """Where a distributed test's ranks run: ``cpu-gloo`` (CPU tensors, gloo),
    ``cuda-gloo`` (CUDA tensors through gloo and the process-group transport;
    rank r on GPU r mod the GPU count: with one GPU every rank shares it) or
    ``cuda-nccl`` (one GPU per rank, NCCL)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.device, self.backend = name.split("-")

    def world(self, n: int) -> int:
        """n ranks, or as many as there are GPUs for NCCL (at least 2)."""
        return min(n, torch.cuda.device_count()) if self.backend == "nccl" else n

    def run(self, fn, world: int, *args, **spawn):
        """``fn(rank, world, *args)`` on ``self.world(world)`` ranks of this
        place's backend (``spawn``: run_ranks' timeout, pg_timeout, check)."""
        from .dist_harness import run_ranks

        return run_ranks(fn, self.world(world), *args, backend=self.backend, **spawn)

    def __repr__(self) -> str:
        return self.name


PLACES = ["cpu-gloo", pytest.param("cuda-gloo", marks=pytest.mark.cuda),
          pytest.param("cuda-nccl", marks=pytest.mark.cuda2)]


@pytest.fixture(params=PLACES)
def place(request):
    """A distributed test body on every place its ranks can run (see
    :class:`Place`); the GPU places skip at run time without enough GPUs or a
    CUDA build. Restrict it with ``@pytest.mark.parametrize("place", [...],
    indirect=True)``."""
    p = Place(request.param)
    gpus = 2 if p.backend == "nccl" else 1 if p.device == "cuda" else 0
    if gpus and not (_cuda_usable() and torch.cuda.device_count() >= gpus):
        pytest.skip(f"{p.name} needs a CUDA build of hetcomm and {gpus} visible GPU(s)")
    return p


def pytest_collection_modifyitems(config, items):
    # Tests marked cuda (outside the device fixture) skip cleanly without a GPU.
    for item in items:
        if "cuda" in item.keywords and not {"device", "place"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.skipif("not __import__('tests.conftest').conftest._cuda_usable()",
                                               reason="needs a CUDA build of hetcomm and a visible GPU"))
