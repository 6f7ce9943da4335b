"""The arithmetic of bench/p2p.py's report: sizes, marginal hops, checks.

The benchmark itself is not run here (speed targets live in bench/, not in
timed tests); these check that what it prints is computed right from the
measurements it is given.
"""

import argparse
import importlib.util
import os

import pytest

KiB = 1024
MiB = 1024 * KiB
_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "bench")
_PATH = os.path.join(_BENCH, "p2p.py")


@pytest.fixture(scope="module")
def p2p():
    spec = importlib.util.spec_from_file_location("bench_p2p", _PATH)
    module = importlib.util.module_from_spec(spec)
    # bench/p2p.py imports bench/_harness, which `python bench/p2p.py` finds
    # next to the script (bench/ is then first on sys.path).
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(_BENCH)
        spec.loader.exec_module(module)
    return module


def entry(system, op, size, median):
    return {"system": system, "op": op, "size_bytes": size, "P": 2,
            "median_s": median, "min_s": median, "runs": 5}


def test_parse_size_accepts_units_and_names_bad_values(p2p):
    assert p2p.parse_size("4K") == 4096
    assert p2p.parse_size("64KiB") == 64 * KiB
    assert p2p.parse_size("16M") == 16 * MiB
    for bad in ("4X", "-4", "6", ""):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            p2p.parse_size(bad)


def test_marginal_hop_removes_the_dispatch(p2p):
    # A call = 2 ms of dispatch + hops x hop cost.
    results = [entry("grpc", "p2p", 4 * KiB, (2e-3 + 8 * 200e-6) / 8),
               entry("grpc", "p2p-call", 4 * KiB, 2e-3 + 200e-6),
               entry("tf_rdma-shm", "p2p", 4 * KiB, (2e-3 + 8 * 20e-6) / 8),
               entry("tf_rdma-shm", "p2p-call", 4 * KiB, 2e-3 + 20e-6),
               # No single-call view: no marginal.
               entry("tf_rdma-tcp", "p2p", 4 * KiB, 1e-3),
               # H = 1: no marginal either.
               entry("grpc", "p2p", MiB, 3e-3),
               entry("grpc", "p2p-call", MiB, 3e-3)]
    got = {(m["system"], m["size_bytes"]): m
           for m in p2p.marginal_hops(results, {4 * KiB: 8, MiB: 1})}
    assert set(got) == {("grpc", 4 * KiB), ("tf_rdma-shm", 4 * KiB)}
    assert got[("grpc", 4 * KiB)]["marginal_hop_s"] == pytest.approx(200e-6)
    assert got[("tf_rdma-shm", 4 * KiB)]["marginal_hop_s"] == pytest.approx(
        20e-6)
    assert got[("grpc", 4 * KiB)]["hops"] == 8


def test_4k_check_gives_the_dispatch_ceiling_and_the_marginal_ratio(p2p):
    results = [entry("grpc", "p2p", 4 * KiB, 500e-6),
               entry("tf_rdma-shm", "p2p", 4 * KiB, 400e-6),
               entry("tf_rdma-shm", "p2p-call", 4 * KiB, 2.44e-3)]
    marginals = [{"system": "grpc", "size_bytes": 4 * KiB, "hops": 8,
                  "marginal_hop_s": 200e-6},
                 {"system": "tf_rdma-shm", "size_bytes": 4 * KiB, "hops": 8,
                  "marginal_hop_s": 40e-6}]
    (line,) = p2p.check_lines(results, marginals)
    assert line.startswith("4 KiB shm vs grpc: 1.2x (target >= 10x): MISSED")
    # The call's dispatch is 2.44 ms - 40 us = 2.4 ms; / 8 = 300 us per hop
    # at best; 500 / 300 = 1.7x at most.
    assert "a call costs 2.40 ms before its hop" in line
    assert "even a free hop costs 300.0 us: at most 1.7x" in line
    assert "marginal hop (no dispatch): 40.0 us vs 200.0 us, 5.0x" in line


def test_checks_say_met_only_when_the_measurements_meet_the_targets(p2p):
    fast = [entry("grpc", "p2p", 64 * MiB, 100e-3),
            entry("tf_rdma-shm", "p2p", 64 * MiB, 10e-3),
            entry("memcpy", "p2p", 64 * MiB, 8e-3),
            entry("grpc", "p2p", 4 * KiB, 1e-3),
            entry("tf_rdma-shm", "p2p", 4 * KiB, 50e-6)]
    lines = p2p.check_lines(fast)
    assert len(lines) == 3
    assert all(line.split(";")[0].endswith(": met") for line in lines), lines
    slow = [dict(r, median_s=r["median_s"] * (20 if r["system"] ==
                                               "tf_rdma-shm" else 1))
            for r in fast]
    assert all(": MISSED" in line for line in p2p.check_lines(slow))
