"""The arithmetic of bench/p2p.py's report: sizes, marginal hops, checks;
and the label of its verbs numbers over the emulated NIC.

Speed targets live in bench/, not in timed tests: these check that what it
prints is computed right from the measurements it is given. The bench runs
here only for the label of verbs over softnic (one 4 KiB size, one run):
its results must be `tf_rdma-verbs-emulated`, never `tf_rdma-verbs`.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import BENCH, REPO, load_bench, softnic_missing, verbs_missing

KiB = 1024
MiB = 1024 * KiB
_PATH = os.path.join(BENCH, "p2p.py")


@pytest.fixture(scope="module")
def p2p():
    return load_bench("p2p.py")


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
    line, hop = p2p.check_lines(results, marginals)
    assert line.startswith("4 KiB shm vs grpc: 1.2x (target >= 10x): MISSED")
    # The call's dispatch is 2.44 ms - 40 us = 2.4 ms; / 8 = 300 us per hop
    # at best; 500 / 300 = 1.7x at most.
    assert "a call costs 2.40 ms before its hop" in line
    assert "even a free hop costs 300.0 us: at most 1.7x" in line
    assert "marginal hop (no dispatch): 40.0 us vs 200.0 us, 5.0x" in line
    # Issue 17's hop target, without a measured floor: no bound.
    assert hop == ("4 KiB shm marginal hop (H = 8): 40.0 us (target <= "
                   "10.0 us): MISSED")


def test_the_hop_target_is_bounded_by_the_hop_floor(p2p):
    marginals = [{"system": "tf_rdma-shm", "size_bytes": 4 * KiB, "hops": 64,
                  "marginal_hop_s": 25e-6}]
    floor = [{"system": "tf_rdma-shm", "size_bytes": 4 * KiB, "hops": 64,
              "send_s": 4e-6, "recv_s": 14e-6},
             {"system": "tf_rdma-tcp", "size_bytes": 4 * KiB, "hops": 64,
              "send_s": 1e-6, "recv_s": 1e-6}]
    (line,) = p2p.check_lines([], marginals, floor)
    assert line == ("4 KiB shm marginal hop (H = 64): 25.0 us (target <= "
                    "10.0 us): MISSED; bound: a hop's send and recv with "
                    "nothing to wait for cost 4.0 us + 14.0 us = 18.0 us in "
                    "this executor (the marginal op of a chain of 64 each)")
    # A floor under the target is no bound: what is left is the waiting.
    floor[0]["recv_s"] = 3e-6
    (line,) = p2p.check_lines([], marginals, floor)
    assert line.endswith("MISSED; a hop's send and recv with nothing to wait "
                         "for cost 4.0 us + 3.0 us = 7.0 us in this executor "
                         "(the marginal op of a chain of 64 each), so 18.0 us "
                         "of the hop is its wait for the data and the "
                         "hand-offs between threads")
    fast = [dict(marginals[0], marginal_hop_s=9e-6)]
    (line,) = p2p.check_lines([], fast, floor)
    assert line.endswith("(target <= 10.0 us): met")


def _timeline(task, events):
    """A tf_rdma.timeline.read dict: events (name, key, step, ts_us, dur_us,
    tid)."""
    return {"task": task, "events": [
        {"ph": "X", "name": "tf_rdma." + name, "ts": ts, "dur": dur,
         "tid": tid, "args": {"key": key, "step": step}}
        for name, key, step, ts, dur, tid in events]}


def test_hop_split_cuts_each_hop_on_one_clock_per_task(p2p):
    # A chain of H = 4 (hops 0 and 1 measured: each needs hop i + 2's send)
    # in call 7. Task 0's clock is 1000 us ahead of task 1's: only
    # differences on one task count. Hop 0: task 0 sends at 0 (2 us), task
    # 1's recv completes at 5 (its thread 11) and its send of hop 1 starts
    # at 6 on thread 11: hand-off 1 us. Hop 1: task 1 sends at 6 (3 us),
    # task 0's recv completes at 1012 on the poller (thread 99), hop 2's
    # send starts at 1020 on thread 10: hand-off 8 us. Round trips: hop 0
    # 0 -> 1020 on task 0 (20 us), hop 1 6 -> 16 on task 1 (10 us).
    t0 = _timeline("/job:worker/task:0", [
        ("send", "hop0", 7, 1000, 2, 10), ("recv", "hop1", 7, 1004, 8, 99),
        ("send", "hop2", 7, 1020, 4, 10), ("recv", "hop3", 7, 1025, 1, 10),
        # The floor's chain (another call): all sends on task 0, skipped.
        ("send", "hop0", 8, 2000, 1, 10), ("send", "hop1", 8, 2001, 1, 10),
        ("send", "hop2", 8, 2002, 1, 10),
        # A warm-up call before call 7 (its hops take 100 us): left out.
        ("send", "hop0", 5, 0, 100, 10), ("recv", "hop1", 5, 100, 100, 10),
        ("send", "hop2", 5, 300, 100, 10), ("recv", "hop3", 5, 400, 100, 10)])
    t1 = _timeline("/job:worker/task:1", [
        ("recv", "hop0", 7, 0, 5, 11), ("send", "hop1", 7, 6, 3, 11),
        ("recv", "hop2", 7, 14, 1, 11), ("send", "hop3", 7, 16, 2, 11),
        ("recv", "hop0", 8, 3000, 1, 11), ("recv", "hop1", 8, 3001, 1, 11),
        ("recv", "hop0", 5, -1000, 100, 11),
        ("send", "hop1", 5, -900, 100, 11),
        ("recv", "hop2", 5, -800, 100, 11),
        ("send", "hop3", 5, -700, 100, 11)])
    split = p2p.hop_split([t0, t1], 4, skip=1)
    assert split["hops"] == 2
    assert split["calls"] == 1
    # Call 7's chain on task 0: hop 0's send at 1000 to hop 3's recv's end
    # at 1026, over 4 hops.
    assert split["chain_hop_s"] == pytest.approx(6.5e-6)
    assert split["hop_s"] == pytest.approx(7.5e-6)  # (20 + 10) / 2 / 2
    assert split["send_s"] == pytest.approx(2.5e-6)  # (2 + 3) / 2
    assert split["handoff_s"] == pytest.approx(4.5e-6)  # (1 + 8) / 2
    assert split["wait_s"] == pytest.approx(0.5e-6)
    assert split["same_thread"] == 0.5
    assert split["same_thread_s"] == pytest.approx(1e-6)
    assert split["other_thread_s"] == pytest.approx(8e-6)
    # Without the skip, the warm-up call's slow hops count too.
    assert p2p.hop_split([t0, t1], 4, skip=0)["send_s"] > 50e-6
    # No whole chain call: no split.
    assert p2p.hop_split([t0], 4) is None


def test_a_missed_hop_says_where_its_time_went(p2p):
    marginals = [{"system": "tf_rdma-shm", "size_bytes": 4 * KiB, "hops": 64,
                  "marginal_hop_s": 25e-6}]
    split = {"hops": 620, "calls": 10, "hop_s": 24e-6, "hop_median_s": 6e-6,
             "chain_hop_s": 8e-6, "send_s": 5e-6, "wait_s": 7e-6,
             "handoff_s": 12e-6, "same_thread": 0.9, "same_thread_s": 6e-6,
             "other_thread_s": 66e-6}
    (line,) = p2p.check_lines([], marginals, (), split)
    assert line.endswith(
        "MISSED; where a traced run's hops went (TF_RDMA_TIMELINE_EVENTS=ops, "
        "means over 620 hops of 10 calls after the warm-up: 24.0 us a hop, "
        "median 6.0 us; a call's whole chain over H: 8.0 us a hop, the "
        "median call): the send op "
        "5.0 us, from its end to the recv's completion on the peer 7.0 us, "
        "from there to the next send 12.0 us (TensorFlow's hand-off: 90% of "
        "the recvs completed on the thread that ran the next send, 6.0 us "
        "after them; the others, completed on another thread (the "
        "poller's), 66.0 us)")
    fast = [dict(marginals[0], marginal_hop_s=9e-6)]
    (line,) = p2p.check_lines([], fast, (), split)
    assert line.endswith("(target <= 10.0 us): met")


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


def test_a_missed_64m_grpc_ratio_prints_the_copys_bound(p2p):
    """Where shm misses 5x gRPC at 64 MiB, the line says how far a hop that
    cost only its copy (memcpy through the chain's buffers) would get."""
    results = [entry("tf_rdma-shm", "p2p", 64 * MiB, 9e-3),
               entry("grpc", "p2p", 64 * MiB, 30e-3),
               entry("memcpy", "p2p", 64 * MiB, 7.5e-3)]
    line = p2p.check_lines(results)[0]
    assert ": MISSED; a hop is at least one copy" in line, line
    assert "at most 4.0x here" in line, line
    fast = [dict(r, median_s=5e-3) if r["system"] == "tf_rdma-shm" else r
            for r in results]
    line = p2p.check_lines(fast)[0]
    assert line.endswith(": met"), line


def test_the_memcpy_verdict_is_against_the_chains_buffers_not_one(p2p):
    """The shm bandwidth line is judged against memcpy along the chain's
    buffers; memcpy from one buffer into one other is printed after it."""
    results = [entry("tf_rdma-shm", "p2p", 64 * MiB, 10e-3),
               entry("memcpy", "p2p", 64 * MiB, 7e-3),
               entry("memcpy-one-buffer", "p2p", 64 * MiB, 4e-3)]
    (line,) = p2p.check_lines(results)
    verdict, one_buffer = line.split("; ", 1)
    assert "= 70% of memcpy" in verdict and verdict.endswith(": met"), line
    assert "one buffer into one other" in one_buffer, line
    assert "(40%)" in one_buffer, line


def test_the_memcpy_baseline_copies_along_the_chains_buffers(p2p):
    """measure_memcpy times real copies, along H x depth buffers or one:
    one positive time per run, at a size timed in batches and a large
    one (it raises if a buffer did not end up holding the source)."""
    for size in (4 * KiB, 4 * MiB):
        for hops, depth in ((4, 2), (1, 1)):
            times = p2p.measure_memcpy(size, 3, hops, depth)
            assert len(times) == 3 and all(t > 0 for t in times), times


def test_tcp_is_checked_against_the_raw_socket_and_tabled(p2p, capsys):
    """The tcp line: socket time / tcp time against 90%; the p2p table gets
    a "tcp % socket" column (the socket has no p2p-call view)."""
    def results(tcp_s):
        return [entry("tf_rdma-tcp", "p2p", 64 * MiB, tcp_s),
                entry("socket", "p2p", 64 * MiB, 16e-3),
                entry("tf_rdma-tcp", "p2p-call", 64 * MiB, tcp_s * 2)]
    met = p2p.check_lines(results(17e-3))
    assert len(met) == 1 and "= 94% of a raw loopback socket" in met[0], met
    assert met[0].endswith(": met"), met
    missed = p2p.check_lines(results(21e-3))
    assert "= 76% of" in missed[0] and missed[0].endswith(": MISSED"), missed
    p2p.print_tables(results(20e-3), [64 * MiB])
    out = capsys.readouterr().out
    per_hop, per_call = out.split("p2p-call:")
    assert "tcp % socket" in per_hop and "80%" in per_hop, out
    assert "socket" not in per_call, out


def test_the_tcp_verdict_is_against_the_chains_buffers_not_one(p2p):
    """With both socket baselines measured, the verdict is taken against
    the socket that lands every hop in a buffer of its own (as the chain's
    slots); the one-buffer socket is printed after it, not judged."""
    results = [entry("tf_rdma-tcp", "p2p", 64 * MiB, 17e-3),
               entry("socket", "p2p", 64 * MiB, 16e-3),
               entry("socket-one-buffer", "p2p", 64 * MiB, 13e-3)]
    (line,) = p2p.check_lines(results)
    verdict, one_buffer = line.split("; ", 1)
    assert "= 94% of a raw loopback socket" in verdict, line
    assert verdict.endswith(": met"), line
    assert "one buffer a side" in one_buffer and "(76%)" in one_buffer, line
    swapped = [dict(r, median_s={"socket": 13e-3, "socket-one-buffer": 16e-3
                                 }.get(r["system"], r["median_s"]))
               for r in results]
    (line,) = p2p.check_lines(swapped)
    assert line.split("; ", 1)[0].endswith(": MISSED"), line


def test_the_socket_chain_moves_the_bytes_it_times(p2p):
    """bench/_harness/socket_chain.py really moves the bytes: a chain of
    even and of odd length over loopback, through the chain's buffers
    (depth 1 and 2) and through one, returns one positive time per run (an
    odd chain ends at the peer, which acknowledges; an even one checks the
    bytes that came back)."""
    for size, hops in ((64 * KiB + 3, 4), (1000, 3)):
        for depth, reuse in ((1, False), (2, False), (2, True)):
            times = p2p.measure_socket_chain(size, hops, runs=3, warmup=1,
                                             depth=depth,
                                             reuse_one_buffer=reuse)
            assert len(times) == 3 and all(t > 0 for t in times), times


def test_the_socket_chain_lands_hops_as_the_plan_lands_them(p2p):
    """A side receives hop i of chain r into buffer (r mod depth, i // 2):
    a distinct buffer per hop it receives and per copy of the depth, the
    same one again `depth` chains later; one buffer for every hop when
    asked to reuse one."""
    # bench/_harness/socket_chain.py, as p2p.py imported it.
    Landing = sys.modules[p2p.measure_socket_chain.__module__].Landing
    # The echo side of a chain of 4 receives hops 0 and 2.
    landing = Landing(16, receives=2, depth=2, reuse_one_buffer=False)
    seen = [landing.buffer(r, i) for r in (0, 1) for i in (0, 2)]
    assert len({id(v) for v in seen}) == 4
    assert landing.buffer(2, 2) is landing.buffer(0, 2)
    one = Landing(16, receives=2, depth=2, reuse_one_buffer=True)
    assert len({id(one.buffer(r, i)) for r in range(3) for i in (0, 2)}) == 1


# --- verbs: hardware or softnic, and the label that says which ---
#
# bench/p2p.py --transports verbs runs over softnic (the emulated NIC) where
# no RDMA device is usable. Its numbers must never pass for hardware ones:
# the system is tf_rdma-verbs-emulated, in the JSON and in the printed
# report, and the label comes from the libibverbs the running servers
# loaded, not from what the bench chose.

SOFTNIC_LIB = os.path.join(REPO, "build", "softnic", "libibverbs.so.1")


def _system_libibverbs():
    found = [p for p in glob.glob("/usr/lib/*/libibverbs.so.1*") +
             glob.glob("/usr/lib*/libibverbs.so.1*") if os.path.isfile(p)]
    return found[0] if found else None


def test_system_names_say_emulated_only_for_verbs_over_softnic(p2p):
    nic = p2p.nic
    assert nic.system_name("verbs", False) == "tf_rdma-verbs"
    assert nic.system_name("verbs", True) == "tf_rdma-verbs-emulated"
    assert nic.system_name("shm", True) == "tf_rdma-shm"
    assert nic.is_emulated_system("tf_rdma-verbs-emulated")
    assert not nic.is_emulated_system("tf_rdma-verbs")
    assert "tf_rdma-verbs-emulated" in p2p.SYSTEMS
    assert p2p.emulated_lines([], None) == []
    (line,) = p2p.emulated_lines(["tf_rdma-verbs-emulated"], None)
    assert "EMULATED RDMA NIC" in line
    assert "nothing about RDMA hardware" in line


def test_softnic_is_told_from_rdma_cores_libibverbs_by_its_mark(p2p):
    nic = p2p.nic
    maps = ("7f00-7f10 r-xp 00000000 08:01 42   /opt/x/libibverbs.so.1\n"
            "7f10-7f20 r--p 00010000 08:01 42   /opt/x/libibverbs.so.1\n"
            "7f20-7f30 r-xp 00000000 08:01 43   /usr/lib/libmlx5.so.1.24\n"
            "7f30-7f40 rw-p 00000000 00:00 0 \n")
    assert nic.libibverbs_paths(maps) == ["/opt/x/libibverbs.so.1"]
    if not os.path.exists(SOFTNIC_LIB):
        pytest.skip(f"softnic is not built ({SOFTNIC_LIB}; `make softnic`)")
    with open(SOFTNIC_LIB, "rb") as f:
        assert nic.is_softnic(f.read())
    system = _system_libibverbs()
    if system is not None:
        with open(system, "rb") as f:
            assert not nic.is_softnic(f.read()), system


def test_nic_selection_falls_back_to_softnic_only_in_auto(p2p):
    nic = p2p.nic
    logged = []
    if not os.path.exists(nic.SOFTNIC_LIB):
        pytest.skip(f"softnic is not built ({nic.SOFTNIC_LIB}; `make softnic`)")
    none = {"available": False, "reason": "no RDMA here", "libibverbs": [],
            "emulated": False}
    real = {"available": True, "device": "mlx5_0 port 1, RoCE",
            "libibverbs": ["/usr/lib/libibverbs.so.1"], "emulated": False}
    by_hand = dict(real, device="softnic0 port 1",
                   libibverbs=[nic.SOFTNIC_LIB], emulated=True)
    base = {"LD_LIBRARY_PATH": f"/opt/a{os.pathsep}{nic.SOFTNIC_DIR}"}

    env, sel = nic.select("auto", base, logged.append, lambda e: none)
    assert env["LD_LIBRARY_PATH"].split(os.pathsep) == [nic.SOFTNIC_DIR,
                                                        "/opt/a"]
    assert sel["chosen"] == "emulated" and "no RDMA here" in sel["why"]
    assert any("NO usable RDMA device" in m and "EMULATED" in m
               for m in logged)

    env, sel = nic.select("auto", base, logged.append, lambda e: real)
    assert env == base and sel["chosen"] == "hardware"
    env, sel = nic.select("auto", base, logged.append, lambda e: by_hand)
    assert env == base and sel["chosen"] == "emulated"

    def never(e):
        raise AssertionError("hardware and emulated do not probe")
    env, sel = nic.select("hardware", base, logged.append, never)
    assert env["LD_LIBRARY_PATH"] == "/opt/a" and sel["chosen"] == "hardware"
    env, sel = nic.select("hardware", {"LD_LIBRARY_PATH": nic.SOFTNIC_DIR},
                          logged.append, never)
    assert "LD_LIBRARY_PATH" not in env
    env, sel = nic.select("emulated", {}, logged.append, never)
    assert env["LD_LIBRARY_PATH"] == nic.SOFTNIC_DIR
    with pytest.raises(ValueError, match="--nic"):
        nic.select("maybe", {}, logged.append, never)


def test_the_servers_answer_decides_the_label(p2p, tmp_path):
    """servers_nic reads each server's map and library through ops placed on
    it; a fake tf here serves files of this host."""
    nic = p2p.nic
    if not os.path.exists(SOFTNIC_LIB):
        pytest.skip(f"softnic is not built ({SOFTNIC_LIB}; `make softnic`)")
    hardware = tmp_path / "hw" / "libibverbs.so.1"
    hardware.parent.mkdir()
    hardware.write_bytes(b"\x7fELF...\0ibv_open_device\0")
    maps = {"/job:worker/task:0": f"7f00-7f10 r-xp 0 0:0 1 {SOFTNIC_LIB}\n",
            "/job:worker/task:1": f"7f00-7f10 r-xp 0 0:0 1 {hardware}\n"}

    class FakeTf:
        task = None

        class _Device:
            def __init__(self, tf, task):
                self.tf, self.task = tf, task

            def __enter__(self):
                self.tf.task = self.task

            def __exit__(self, *exc):
                self.tf.task = None

        def device(self, task):
            return self._Device(self, task)

        @property
        def io(self):
            return self

        def read_file(self, path):
            assert self.task is not None, "read outside tf.device"
            if path == "/proc/self/maps":
                data = maps[self.task].encode()
            else:
                with open(path, "rb") as f:
                    data = f.read()
            return type("T", (), {"numpy": lambda _: data})()

    got = nic.servers_nic(FakeTf(), list(maps))
    assert got["emulated"] is True
    assert [s["emulated"] for s in got["servers"]] == [True, False]
    maps["/job:worker/task:0"] = maps["/job:worker/task:1"]
    assert nic.servers_nic(FakeTf(), list(maps))["emulated"] is False
    maps["/job:worker/task:1"] = "7f00-7f10 r-xp 0 0:0 1 /usr/lib/libc.so.6\n"
    with pytest.raises(RuntimeError, match="task:1 has no libibverbs"):
        nic.servers_nic(FakeTf(), list(maps))


def _run_bench(args, env, timeout=300):
    return subprocess.run([sys.executable, _PATH, *args], env=env,
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def _bench_env(extra_library_path=None):
    env = dict(os.environ)
    kept = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep)
            if p and os.path.realpath(p) != os.path.realpath(
                os.path.dirname(SOFTNIC_LIB))]
    if extra_library_path:
        kept.insert(0, extra_library_path)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    return env


@pytest.fixture
def softnic_usable():
    missing = softnic_missing()
    if missing is not None:
        if os.environ.get("TF_RDMA_TEST_VERBS") == "1":
            pytest.fail(f"TF_RDMA_TEST_VERBS=1 but {missing}")
        pytest.skip(missing)


@pytest.mark.timeout(300)
def test_verbs_over_softnic_is_labelled_emulated(softnic_usable, tmp_path):
    # Where no RDMA device is usable (this repository's CI), the default
    # --nic auto must fall back to softnic; on an RDMA host, ask for it.
    no_device = verbs_missing() is not None
    out = tmp_path / "p2p.json"
    proc = _run_bench(["--transports", "verbs", "--sizes", "4K", "--runs", "1",
                       "--nic", "auto" if no_device else "emulated",
                       "--timeout", "200", "--json", str(out)], _bench_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-5000:]
    doc = json.loads(out.read_text())
    systems = {r["system"] for r in doc["results"]}
    assert systems == {"tf_rdma-verbs-emulated", "memcpy",
                       "memcpy-one-buffer"}, systems
    ops = {r["op"] for r in doc["results"]
           if r["system"] == "tf_rdma-verbs-emulated"}
    assert ops == {"p2p", "p2p-call"}
    verbs_nic = doc["config"]["verbs_nic"]
    assert verbs_nic["emulated"] is True
    assert verbs_nic["selection"]["chosen"] == "emulated"
    assert [s["emulated"] for s in verbs_nic["servers"]] == [True, True]
    # The printed report: the label in the tables, and the note, loudly.
    assert "tf_rdma-verbs-emulated (med)" in proc.stdout
    assert "tf_rdma-verbs (med)" not in proc.stdout
    assert "*** tf_rdma-verbs-emulated: EMULATED RDMA NIC" in proc.stdout
    assert "say nothing about RDMA hardware" in proc.stdout
    if no_device:
        assert "NO usable RDMA device here" in proc.stderr
        assert "running the verbs cluster over softnic" in proc.stderr


@pytest.mark.timeout(300)
def test_softnic_never_passes_for_hardware(softnic_usable, tmp_path):
    # A copy of softnic that the bench does not know of, on the library
    # path, with --nic hardware: the servers say they loaded softnic, so the
    # run's verbs results are dropped, never labelled tf_rdma-verbs.
    copy = tmp_path / "lib"
    copy.mkdir()
    shutil.copy(SOFTNIC_LIB, copy / "libibverbs.so.1")
    out = tmp_path / "p2p.json"
    env = _bench_env(str(copy))
    proc = _run_bench(["--transports", "verbs", "--sizes", "4K", "--runs", "1",
                       "--nic", "hardware", "--timeout", "200",
                       "--json", str(out)], env)
    assert proc.returncode == 1, proc.stdout + proc.stderr[-5000:]
    assert "--nic hardware, but the servers loaded softnic" in proc.stderr, \
        proc.stderr[-6000:]
    doc = json.loads(out.read_text())
    assert not [r for r in doc["results"]
                if r["system"].startswith("tf_rdma-verbs")], doc["results"]
    assert doc["config"]["verbs_nic"]["emulated"] is True
