"""The property-based fuzz of the C++ bindings (tests/fuzz_bindings.py), in a
child process so that a crash fails this test with the input that caused it."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.reliability


def test_no_input_to_a_bound_function_crashes_or_hangs(tmp_path):
    log = tmp_path / "calls.log"
    env = dict(os.environ, HETCOMM_FUZZ_EXAMPLES="150", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-X", "faulthandler", os.path.join(os.path.dirname(__file__),
                                                                             "fuzz_bindings.py"), str(log)],
                         capture_output=True, text=True, timeout=600, env=env)
    last = log.read_text().splitlines()[-1:] if log.exists() else []
    assert out.returncode == 0 and "fuzz ok" in out.stdout, (
        f"exit {out.returncode}; last call: {last}\n{out.stderr[-3000:]}")
