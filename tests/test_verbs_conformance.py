"""The verbs conformance suite: the semantics tf_rdma's verbs plugin relies on,
checked with plain libibverbs calls against softnic (the emulated RDMA NIC,
tests/softnic/) in every `make test`, and against the real libibverbs and
device when TF_RDMA_TEST_VERBS=1 (an RDMA host). The same driver binary runs
both ways (tests/conformance/verbs_check.c), so on the first RDMA host this
suite shows that the emulator is honest, or exactly where it is not.

One test per semantic, each in real processes with a hard timeout:
devices/ports/GIDs/limits, memory registration, the RC state machine,
inline data, unsignaled WRs and a full send queue, implicit on-demand paging
(a WRITE from a buffer never registered, and from one remapped), completion
channels with epoll, a payload read when the WR executes (not when posted),
WRITE-before-SEND ordering across processes, remote access errors
(wrong rkey, out of range, no REMOTE_WRITE), RNR, a dead peer. The tests of
softnic's fault knobs (TF_RDMA_SOFTNIC_*) and of its IB mode run only on the
emulator.

Two-process checks meet through this test: each side prints its address
("ADDR ...", and the target its region, "MR ...") and reads the other's from
stdin; "KILL" asks for the target's death, "GO" lines pace the steps.
"""

import os
import select
import shutil
import signal
import subprocess
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOFTNIC_DIR = os.path.join(ROOT, "build", "softnic")
CHECK = os.path.join(SOFTNIC_DIR, "verbs_check")
HARDWARE = os.environ.get("TF_RDMA_TEST_VERBS") == "1"

pytestmark = pytest.mark.timeout(60)

emulator_only = pytest.mark.skipif(HARDWARE, reason="a softnic knob: TF_RDMA_TEST_VERBS=1 runs on a real device")


@pytest.fixture(scope="module", autouse=True)
def driver():
    """Builds softnic and the driver (make softnic: quick when up to date)."""
    if not os.path.exists("/usr/include/infiniband/verbs.h"):
        if HARDWARE:
            pytest.fail("TF_RDMA_TEST_VERBS=1 but <infiniband/verbs.h> is missing (libibverbs-dev)")
        pytest.skip("<infiniband/verbs.h> is missing (libibverbs-dev): neither softnic nor the driver builds")
    proc = subprocess.run(["make", "-s", "softnic"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and os.path.exists(CHECK), proc.stdout + proc.stderr


@pytest.fixture
def env():
    """The driver's environment: softnic first on the library path, with a
    directory of its own, unless this is a hardware run."""
    out = dict(os.environ)
    directory = None
    if HARDWARE:
        # The real library, even where softnic is on the inherited path.
        kept = [d for d in out.get("LD_LIBRARY_PATH", "").split(os.pathsep)
                if d and os.path.realpath(d) != os.path.realpath(SOFTNIC_DIR)]
        out["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    else:
        library_path = out.get("LD_LIBRARY_PATH")
        out["LD_LIBRARY_PATH"] = SOFTNIC_DIR + (":" + library_path if library_path else "")
        directory = tempfile.mkdtemp(prefix="snc", dir="/tmp")
        out["TF_RDMA_SOFTNIC_DIR"] = directory
    yield out
    if directory:
        shutil.rmtree(directory, ignore_errors=True)


def device_options():
    """The device, port and GID the plugin's settings name, for the driver."""
    names = {"TF_RDMA_VERBS_DEVICE": "device", "TF_RDMA_VERBS_PORT": "port",
             "TF_RDMA_VERBS_GID_INDEX": "gid_index"}
    return [f"{option}={os.environ[variable]}" for variable, option in names.items()
            if os.environ.get(variable) not in (None, "", "0", "-1")]


def facts_of(text):
    out = {}
    for line in text.splitlines():
        if line.startswith("FACT "):
            key, _, value = line[5:].partition("=")
            out[key] = value
    return out


def run_check(env, check, *options, timeout=30):
    """Runs a single-process check; returns its facts."""
    proc = subprocess.run([CHECK, check, *options, *device_options()], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0 and "OK" in proc.stdout.split(), \
        f"verbs_check {check} {' '.join(options)}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return facts_of(proc.stdout)


class Duo:
    """A target and an initiator process of one check, relayed by this test."""

    def __init__(self, env, check, *options, target_env=None, initiator_env=None, kill=True):
        def start(role, extra):
            process_env = dict(env, **(extra or {}))
            return subprocess.Popen([CHECK, check, role, *options, *device_options()], env=process_env,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        self.target = start("target", target_env)
        self.initiator = start("initiator", initiator_env)
        self.output = {"target": [], "initiator": []}
        self.kill = kill  # on "KILL": SIGKILL the target (else only go on)

    def _send(self, proc, line):
        try:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def run(self, timeout=30):
        """Relays until both exit; returns (initiator facts, target facts)."""
        procs = {"target": self.target, "initiator": self.initiator}
        other = {"target": self.initiator, "initiator": self.target}
        # Raw reads, split into lines here: a buffered readline() could keep a
        # second line where select() no longer sees it.
        open_pipes = {p.stdout.fileno(): name for name, p in procs.items()}
        pending = {name: b"" for name in procs}
        deadline = time.monotonic() + timeout
        try:
            while open_pipes:
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"the check did not finish within {timeout} s\n{self.describe()}")
                ready, _, _ = select.select(list(open_pipes), [], [], left)
                for fd in ready:
                    name = open_pipes[fd]
                    chunk = os.read(fd, 65536)
                    if not chunk:
                        del open_pipes[fd]
                        if name == "initiator" and self.target.poll() is None:
                            self._send(self.target, "GO")
                        continue
                    pending[name] += chunk
                    *lines, pending[name] = pending[name].split(b"\n")
                    for raw in lines:
                        self._relay(name, raw.decode(errors="replace"), other)
            for proc in procs.values():
                proc.wait(max(1, deadline - time.monotonic()))
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        return facts_of("\n".join(self.output["initiator"])), facts_of("\n".join(self.output["target"]))

    def _relay(self, name, line, other):
        self.output[name].append(line)
        if line.startswith(("ADDR", "MR", "READY")):
            self._send(other[name], line)
        elif line == "KILL":
            if self.kill:
                os.killpg(self.target.pid, signal.SIGKILL)
                self.target.wait(10)
            self._send(self.initiator, "GO")

    def describe(self):
        text = []
        for name, proc in (("target", self.target), ("initiator", self.initiator)):
            err = proc.stderr.read().decode(errors="replace") if proc.poll() is not None else "(running)"
            text.append(f"--- {name} rc={proc.returncode}\n" + "\n".join(self.output[name]) + "\n" + err)
        return "\n".join(text)

    def check(self, target_ok=True, timeout=30):
        initiator, target = self.run(timeout)
        assert self.initiator.returncode == 0, self.describe()
        if target_ok:
            assert self.target.returncode == 0, self.describe()
        return initiator, target


# ---------------------------------------------------------------------------
# Devices, memory, queue pairs.


def test_device_port_gid_and_limits(env):
    facts = run_check(env, "device")
    assert int(facts["max_qp_wr"]) >= 128 and int(facts["max_cqe"]) >= 128, facts
    assert int(facts["max_inline_data"]) >= 24, facts  # the plugin's notice fits
    if HARDWARE:
        assert "emulated" not in facts["fw_ver"], f"TF_RDMA_TEST_VERBS=1 but the device is softnic: {facts}"
    else:
        # What `tf-rdma doctor` can tell an emulated device by.
        assert facts["name"] == "softnic0", facts
        assert "emulated" in facts["fw_ver"], facts
        assert facts["link"] == "roce" and facts["roce_v2_ipv4_gid"].endswith(":127.0.0.1"), facts
        assert facts["active_mtu"] == "4096", facts


@emulator_only
def test_infiniband_mode_has_a_lid(env):
    facts = run_check(dict(env, TF_RDMA_SOFTNIC_LINK="ib", TF_RDMA_SOFTNIC_LID="7"), "device")
    assert facts["link"] == "ib" and facts["lid"] == "7", facts


def test_memory_registration(env):
    run_check(env, "mr")


def test_qp_state_machine(env):
    run_check(env, "qp_state")


def test_inline_data(env):
    run_check(env, "inline")


def test_unsignaled_and_full_send_queue(env):
    run_check(env, "unsignaled")


def test_implicit_on_demand_paging(env):
    facts = run_check(env, "odp")
    if not HARDWARE:
        assert facts["implicit_odp"] == "yes", facts  # softnic's default


@emulator_only
def test_knob_odp_off_reports_no_on_demand_paging(env):
    facts = run_check(dict(env, TF_RDMA_SOFTNIC_ODP="0"), "odp")
    assert facts["implicit_odp"] == "no", facts


def test_completion_channel_with_epoll(env):
    run_check(env, "channel")


# ---------------------------------------------------------------------------
# Across processes.


def test_write_placed_before_send_completion(env):
    initiator, target = Duo(env, "write_send", "bytes=1048576", "rounds=40").check()
    assert target["rounds"] == "40", target


@emulator_only
def test_write_send_over_infiniband_lids(env):
    ib = dict(env, TF_RDMA_SOFTNIC_LINK="ib")
    _, target = Duo(ib, "write_send", "bytes=65536", "rounds=10").check()
    assert target["rounds"] == "10", target


@pytest.mark.parametrize("variant", ["rkey", "range", "access"])
def test_remote_access_error(env, variant):
    initiator, _ = Duo(env, "remote_access", f"variant={variant}").check()
    assert initiator["status"] == "remote access error", initiator


def test_rnr_retries_run_out(env):
    initiator, _ = Duo(env, "rnr", "variant=exceeded", "rnr_retry=2", "min_rnr_timer=1").check()
    assert initiator["status"] == "RNR retry counter exceeded", initiator


def test_rnr_waits_for_a_late_receive(env):
    initiator, _ = Duo(env, "rnr", "variant=late", "rnr_retry=7", "min_rnr_timer=10",
                       "delay_ms=200").check()
    assert initiator["status"] == "success", initiator
    assert float(initiator["seconds"]) >= 0.15, initiator


def test_dead_peer_retry_exceeded(env):
    # timeout 10: 4.096 us * 2^10 = 4.2 ms per try, retry_cnt 3: 4 tries.
    duo = Duo(env, "dead_peer", "timeout=10", "retry_cnt=3")
    initiator, _ = duo.check(target_ok=False)
    assert initiator["status"] == "transport retry counter exceeded", initiator
    expected = 4 * 4.096e-6 * 2 ** 10
    assert expected * 0.5 <= float(initiator["seconds"]) < 10, initiator


# ---------------------------------------------------------------------------
# softnic's own knobs and housekeeping (emulator only).


@emulator_only
def test_knob_corrupt_rkey(env):
    initiator, _ = Duo(env, "remote_access", "variant=none",
                       initiator_env={"TF_RDMA_SOFTNIC_CORRUPT_RKEY": "1"}).check()
    assert initiator["status"] == "remote access error", initiator


@emulator_only
def test_knob_drop_after(env):
    # The first write gets through; the link drops every later message.
    duo = Duo(env, "dead_peer", "timeout=8", "retry_cnt=2",
              initiator_env={"TF_RDMA_SOFTNIC_DROP_AFTER": "1"}, kill=False)
    initiator, _ = duo.check(target_ok=False)
    assert initiator["status"] == "transport retry counter exceeded", initiator


@emulator_only
def test_knob_delay(env):
    initiator, _ = Duo(env, "write_send", "bytes=4096", "rounds=4",
                       target_env={"TF_RDMA_SOFTNIC_DELAY_US": "25000"}).check()
    # Each round is a WRITE and a SEND, each held 25 ms by the responder.
    assert float(initiator["seconds"]) >= 4 * 2 * 0.025 * 0.9, initiator


@emulator_only
def test_knob_send_delay_reads_the_payload_late(env):
    # The payload is read when the WR executes, not when it is posted: a
    # buffer changed before the completion goes out changed.
    facts = run_check(dict(env, TF_RDMA_SOFTNIC_SEND_DELAY_US="20000"), "late_read")
    assert facts["placed"] == "late", facts


@emulator_only
def test_directory_forgets_a_killed_process(env):
    directory = env["TF_RDMA_SOFTNIC_DIR"]
    Duo(env, "dead_peer", "timeout=8", "retry_cnt=1").check(target_ok=False)
    left = [n for n in os.listdir(directory) if not n.startswith(".")]
    assert left, "the killed target left nothing to sweep: the test proves nothing"
    run_check(env, "device")  # joining the fabric sweeps the dead
    assert [n for n in os.listdir(directory) if not n.startswith(".")] == [], os.listdir(directory)
