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


def pytest_collection_modifyitems(config, items):
    # Tests marked cuda (outside the device fixture) skip cleanly without a GPU.
    for item in items:
        if "cuda" in item.keywords and "device" not in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skipif("not __import__('tests.conftest').conftest._cuda_usable()",
                                               reason="needs a CUDA build of hetcomm and a visible GPU"))
