"""A short fuzzing run of tests/fuzz/wire_fuzz.cc in every `make test`.

`make fuzz FUZZ_INSTALL=0` builds the target with the sanitizers: with
libFuzzer where clang is installed (`make fuzz` alone installs it), else with
g++ and tests/fuzz/standalone_main.cc. The seeds in tests/fuzz/seeds include
the inputs of issue 13's findings (an OPEN size of 2^64 + 4096 that used to
wrap to 4096, copies of 2^58 bytes x 64 that used to wrap past the region's
end): the target's 128-bit oracles abort on them with the old parsers, so
this run fails if either bug comes back, and on anything new the mutations
find.
"""

import os
import subprocess

import pytest

from conftest import REPO

pytestmark = pytest.mark.timeout(600)


def test_wire_fuzz_short_run():
    proc = subprocess.run(
        ["make", "-s", "fuzz", "FUZZ_INSTALL=0", "FUZZ_SECONDS=20",
         "FUZZ_RUNS=500000"],
        cwd=REPO, capture_output=True, text=True, timeout=540)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "ORACLE MISMATCH" not in out and "ERROR: AddressSanitizer" not in out, out[-5000:]
    assert ("no failure" in out) or ("Done" in out and "libFuzzer" in out), out[-3000:]
