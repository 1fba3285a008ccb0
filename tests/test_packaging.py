"""The source distribution: what `pip install hetcomm-<version>.tar.gz` builds from."""

import os
import subprocess
import sys
import tarfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_sdist_holds_every_source_and_test_and_none_of_the_measurements(tmp_path):
    pytest.importorskip("scikit_build_core")
    tracked = subprocess.run(["git", "ls-files", "csrc", "hetcomm", "tests", "examples", "bench"], cwd=ROOT,
                             capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout: the tracked files are unknown")
    code = f"from scikit_build_core.build import build_sdist; print(build_sdist({str(tmp_path)!r}))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    path = tmp_path / out.stdout.strip().splitlines()[-1]
    with tarfile.open(path) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    files = [f for f in tracked.stdout.splitlines() if f]
    results = [f for f in files if f.startswith(("bench/results/", "bench/gpu/results/"))]
    wanted = set(files) - set(results)
    assert {"CMakeLists.txt", "pyproject.toml", "README.md"} <= names
    assert not wanted - names, sorted(wanted - names)[:20]  # every source, test, example and benchmark script
    assert results and not set(results) & names  # the measurements' files stay in the repository
    assert os.path.getsize(path) < 5 * 2 ** 20
