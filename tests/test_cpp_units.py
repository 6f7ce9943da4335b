"""The C++ unit tests of the engine (tests/cpp/engine_unittest.cc), in
`make test` and `make test-fast`.

`make -s cpp-test` builds the program with g++ from the engine sources the
fuzz target uses (Makefile FUZZ_ENGINE: no TensorFlow) and runs it: the wire
format and socket helpers, regions in /dev/shm and the collection of stale
segments, EngineConfig::Parse, SlotSpec::Validate and the slot/credit layout,
SHA-256/HMAC vectors, the trace hooks, notice waits, the shm/tcp write paths, and
ChooseTransport (which transport a pair uses). The first build takes about
30 s of CPU; later runs reuse the binary until a source changes, and the run
itself takes about a second.

Checked here: the program passed, it ran every TEST of the source file (a
registry that silently lost its tests fails), each one reported OK, and it
left no segment of its own in /dev/shm.
"""

import os
import re
import shutil
import signal
import subprocess

import pytest

from conftest import REPO

pytestmark = [pytest.mark.fast, pytest.mark.timeout(360)]

SOURCE = os.path.join(REPO, "tests", "cpp", "engine_unittest.cc")
BUILD_AND_RUN_TIMEOUT_S = 300


def _declared_tests():
    """The names of the TEST(...) cases in the source (KNOWN_BUG ones are
    not run by default and not counted)."""
    with open(SOURCE) as f:
        return re.findall(r"^TEST\((\w+)\)", f.read(), re.M)


@pytest.fixture(scope="module")
def cpp_test_output():
    for tool in ("g++", "make"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: the C++ unit tests are "
                        f"built with it (`make install` installs g++)")
    proc = subprocess.Popen(
        ["make", "-s", "cpp-test"], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=BUILD_AND_RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # make, g++ and the test program
        out, _ = proc.communicate()
        pytest.fail(f"`make cpp-test` did not finish within "
                    f"{BUILD_AND_RUN_TIMEOUT_S} s; its output:\n"
                    f"{out[-8000:]}")
    return proc.returncode, out


def test_engine_unittest_passes(cpp_test_output):
    returncode, out = cpp_test_output
    assert returncode == 0, f"`make cpp-test` exited {returncode}:\n{out[-12000:]}"
    summary = re.search(r"^engine_unittest: ran (\d+) tests, (\d+) failed",
                        out, re.M)
    assert summary, f"no summary line in the output:\n{out[-6000:]}"
    declared = _declared_tests()
    assert len(declared) >= 40, declared
    assert len(set(declared)) == len(declared), "a TEST name is repeated"
    ran, failed = int(summary.group(1)), int(summary.group(2))
    assert (ran, failed) == (len(declared), 0), (
        f"ran {ran} tests with {failed} failures; the source declares "
        f"{len(declared)}:\n{out[-6000:]}")
    passed = set(re.findall(r"^\[  OK  \] (\w+)", out, re.M))
    missing = [name for name in declared if name not in passed]
    assert not missing, f"not reported OK: {missing}\n{out[-6000:]}"


def test_engine_unittest_leaves_no_segments(cpp_test_output):
    _, out = cpp_test_output
    pid = re.search(r"^engine_unittest: pid (\d+)", out, re.M)
    assert pid, out[-4000:]
    prefix = f"tfrdma.{pid.group(1)}."
    left = sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))
    assert not left, f"segments left in /dev/shm by the C++ tests: {left}"
