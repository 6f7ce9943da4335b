"""The tcp endpoint against a hostile client that speaks the raw wire protocol.

One real tf_rdma endpoint (task worker:1, TF_RDMA_TRANSPORT=tcp, job secret
"right") runs in a subprocess and waits in `tf_rdma.ops.recv` for one small
tensor from each of several writer tasks (one region per writer, so every test
owns its own region and no test depends on another's outcome). The test
process is the other side: it opens plain TCP sockets to the endpoint and
speaks the protocol of kernels/common/wire.h and the handshake of
kernels/engine/handshake.cc by hand (socket, struct, hmac), then checks what
the endpoint did by reading the endpoint's log and by mapping its receive
regions (/dev/shm/tfrdma.<pid>.<n>) read-only.

`test_valid_write_is_received` proves that this hand-written client speaks the
real protocol (the endpoint's recv returns exactly the bytes it wrote), so the
rejections in the other tests are rejections of the attack, not of a
malformed client.

Writers and their regions (all float32[16] transfers to worker:1):
    worker:0  x0  a correct write                  (test_valid_write_is_received)
    worker:2  x2  write offset beyond the region   (test_out_of_bounds_write...)
    worker:3  x3  payload running past the end
    worker:4  x4  notice word outside the region
    worker:5  x5  offset + length wrapping 2**64
    worker:6  x6  wrong-secret client's target     (test_wrong_secret...)
    worker:7  x7  region of an honest writer       (test_write_to_region_never_given...)
    worker:8  --  no region; an authenticated intruder
    worker:9  --  no region; dials the wrong reader
"""

import json
import mmap
import os
import re
import time

import numpy as np
import pytest

import wire_client
from conftest import base_env, make_cluster
from wire_client import HEADER, MAGIC, WRITE
from tf_rdma.graph_passes import plan as plan_lib

pytestmark = pytest.mark.timeout(90)

SECRET = "the-right-secret-0123"
READER = "/job:worker/task:1"
WRITERS = (0, 2, 3, 4, 5, 6, 7)
N_TASKS = 10
RECV_TIMEOUT_S = 80  # the recvs must outlive the whole module
SOCK_TIMEOUT_S = 10

FAILED_PRECONDITION, PERMISSION_DENIED = 4, 5  # status.h Code


def task(i):
    return f"/job:worker/task:{i}"


PLAN = plan_lib.Plan([
    plan_lib.Transfer(f"x{i}", task(i), READER, "float32", [16])
    for i in WRITERS
])


ENDPOINT_PROGRAM = """
import threading
plan = tf_rdma.Plan.from_json(os.environ["TEST_PLAN"])
ep = start()
keys = [s.key for s in plan.slots if s.dst == ep.task]
lock = threading.Lock()

def emit(obj):
    with lock:
        sys.stdout.write("RESULT " + json.dumps(obj) + "\\n")
        sys.stdout.flush()

def receive(key):
    try:
        t = tf_rdma.ops.recv(plan, key, timeout=float(os.environ["TEST_RECV_TIMEOUT"]))
        out = {"values": t.numpy().tolist()}
        del t  # the last reference: the slot goes back to the writer as a credit
    except Exception as e:  # reported to the test, which decides
        out = {"error": type(e).__name__, "message": str(e)}
    emit(dict(kind="recv", key=key, **out))

for k in keys:
    threading.Thread(target=receive, args=(k,), daemon=True).start()
deadline = time.monotonic() + 60
while True:
    info = tf_rdma.endpoint_info()
    if len(info["region"]) >= len(keys):
        break
    if time.monotonic() > deadline:
        emit({"kind": "error", "info": info})
        sys.exit(3)
    time.sleep(0.01)
emit({"kind": "ready", "port": ep.port, "task": info["task"],
      "transport": info["transport"], "regions": info["region"]})
stop = os.environ["TEST_STOP_FILE"]
while not os.path.exists(stop):
    time.sleep(0.05)
emit({"kind": "stopping"})
ep.close()
sys.stderr.flush()
os._exit(0)
"""


# --------------------------------------------------------------------------- the endpoint


class EndpointProcess(wire_client.TaskProcess):
    """The endpoint subprocess; its stdout and stderr go to files we can poll."""

    def __init__(self, workdir):
        self.cluster = make_cluster(N_TASKS)
        self.stop_file = os.path.join(workdir, "stop")
        env = base_env({
            "TF_RDMA_SECRET": SECRET,
            "TF_RDMA_TRANSPORT": "tcp",
            "TEST_TASK": READER,
            "TEST_CLUSTER": json.dumps(self.cluster),
            "TEST_PLAN": PLAN.to_json(),
            "TEST_STOP_FILE": self.stop_file,
            "TEST_RECV_TIMEOUT": str(RECV_TIMEOUT_S),
        })
        super().__init__(workdir, "endpoint", ENDPOINT_PROGRAM, env)
        ready = self.wait_result(lambda r: r["kind"] in ("ready", "error"), 75)
        assert ready["kind"] == "ready", self.describe()
        self.port = int(ready["port"])
        assert ready["transport"] == "tcp"
        # "name segment bytes", in the engine's region order (= region id).
        self.regions = {}
        self.region_index = {}
        for i, line in enumerate(ready["regions"]):
            name, shm, size = line.rsplit(" ", 2)
            self.regions[name] = (shm, int(size))
            self.region_index[name] = i
        assert set(self.regions) == {s.region for s in PLAN.slots}

    def recv_result(self, key, timeout=20):
        return self.wait_result(
            lambda r: r["kind"] == "recv" and r["key"] == key, timeout)

    def recv_done(self, key):
        return any(r["kind"] == "recv" and r["key"] == key
                   for r in self.results())

    def wait_log(self, pattern, timeout=10):
        """Returns the first stderr line matching `pattern` (a regex)."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            for line in self.stderr().splitlines():
                if rx.search(line):
                    return line
            if time.monotonic() > deadline:
                pytest.fail(f"no endpoint log line matches {pattern!r}\n"
                            + self.describe())
            time.sleep(0.05)

    # -- regions

    def region_bytes(self, key):
        """A copy of the current bytes of the region that holds `key`."""
        shm, size = self.regions[PLAN.slot(key).region]
        with open("/dev/shm" + shm, "rb") as f:
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                return np.frombuffer(m, dtype=np.uint8).copy()

    def assert_region_zero(self, key):
        """Nothing in the region of `key` but its reader's own counts of
        sleepers (wire_client.without_sleepers)."""
        data = np.frombuffer(wire_client.without_sleepers(
            self.region_bytes(key), PLAN.slot(key)), dtype=np.uint8)
        assert data.size == PLAN.slot(key).region_bytes
        nonzero = np.flatnonzero(data)
        assert nonzero.size == 0, (
            f"region of {key} was written: {nonzero.size} non-zero bytes, first "
            f"at {nonzero[:8].tolist()}")

    def region_id(self, key):
        return self.region_index[PLAN.slot(key).region]

    # -- shutdown

    def stop(self):
        super().stop(self.stop_file)


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    ep = EndpointProcess(str(tmp_path_factory.mktemp("tcp_security")))
    try:
        yield ep
    finally:
        ep.stop()


@pytest.fixture
def ep(endpoint):
    endpoint.assert_alive()
    yield endpoint
    endpoint.assert_alive()  # nothing a client sent may take the endpoint down


# --------------------------------------------------------------------------- the raw client


class RawPeer(wire_client.RawPeer):
    """The wire client, aimed at this module's endpoint and plan."""

    def __init__(self, port):
        super().__init__(port, READER, SECRET, timeout=SOCK_TIMEOUT_S)

    def open_frame(self, key, credit_id, credit_size=4096, request=None,
                   **override):
        slot = PLAN.slot(key)
        fields = {
            "name": slot.region,
            "size": slot.region_bytes,
            "plan_hash": PLAN.hash,
            "credit_id": credit_id,
            "credit_size": credit_size,
            "credit_shm": "",
        }
        fields.update(override)
        return self.request_frame(fields, request)

    def open(self, key, credit_id, **override):
        """OPEN_REQUEST for `key`'s region; returns (status code, fields or text)."""
        frame, request = self.open_frame(key, credit_id, **override)
        self.sock.sendall(frame)
        return self.read_reply(request)


def valid_write(peer, key, region_id, values, seq=1):
    slot = PLAN.slot(key)
    return peer.write_frame(region_id, slot.payload_offset(0), values.tobytes(),
                            slot.copy_offset(0), seq)


def assert_regions_untouched(ep, keys):
    for key in keys:
        ep.assert_region_zero(key)


# --------------------------------------------------------------------------- tests


def test_queries_are_answered_and_an_unknown_one_is_refused_in_place(ep):
    """QUERY what=clock gets the endpoint's clock (received <= sent); a
    question the endpoint does not know gets an error reply, and the same
    connection goes on answering (a newer peer may ask more)."""
    with RawPeer(ep.port).connect_as(task(0)) as peer:
        code, reply = peer.query({"what": "clock"})
        assert code == 0, reply
        assert 0 < int(reply["received_ns"]) <= int(reply["sent_ns"]), reply
        code, reply = peer.query({"what": "weather"})
        assert code == 1 and "unknown query 'weather'" in reply, (code, reply)  # InvalidArgument
        code, reply = peer.query({"what": "clock"})
        assert code == 0 and int(reply["sent_ns"]) > 0, reply


def test_valid_write_is_received(ep):
    """The raw client speaks the real protocol: the recv returns its bytes."""
    key, slot = "x0", PLAN.slot("x0")
    values = (np.arange(16, dtype=np.float32) * 1.5 - 7.25).astype(np.float32)
    with RawPeer(ep.port).connect_as(task(0)) as peer:
        code, reply = peer.open(key, credit_id=7)
        assert code == 0, reply
        shm, size = ep.regions[slot.region]
        assert reply["shm"] == shm and int(reply["size"]) == size
        assert int(reply["id"]) == ep.region_id(key)
        assert not ep.recv_done(key)
        peer.sock.sendall(valid_write(peer, key, int(reply["id"]), values))

        got = ep.recv_result(key)
        assert "error" not in got, got
        assert np.array_equal(np.array(got["values"], dtype=np.float32), values)

        # The bytes landed where the plan says, with the step as the notice.
        data = ep.region_bytes(key)
        notice = data[slot.copy_offset(0):slot.copy_offset(0) + 8].view("<u8")[0]
        assert notice == 1
        payload = data[slot.payload_offset(0):slot.payload_offset(0) + slot.nbytes]
        assert payload.tobytes() == values.tobytes()

        # Dropping the received tensor returns the slot: a credit WRITE into
        # the credit region we described (id 7), at copy 0's credit word.
        magic, type_, _, a, b, c, d, e = HEADER.unpack(peer.read_exact(HEADER.size))
        assert (magic, type_) == (MAGIC, WRITE)
        assert (a, b, c, d, e) == (7, 0, 0, slot.credit_offset(0), 1)


def test_wrong_secret_is_denied_and_nothing_is_applied(ep):
    key, slot = "x6", PLAN.slot("x6")
    writer = task(6)
    target_id = ep.region_id(key)
    values = np.full(16, 42.0, dtype=np.float32)

    # 1. HELLO with a proof made with the wrong secret, then read the answer.
    with RawPeer(ep.port) as peer:
        answer = peer.handshake(writer, secret="the-wrong-secret-0123")
        assert answer.startswith("DENIED "), answer
        assert "secret" in answer, answer
        # ... and push an OPEN and a WRITE anyway.
        frame, _ = peer.open_frame(key, credit_id=3)
        peer.send_quietly(frame + valid_write(peer, key, target_id, values))
        peer.assert_closed_by_endpoint()
        assert peer.buf == b"", f"the endpoint answered a denied client: {peer.buf!r}"
        ep.wait_log(rf"rejected connection from 127\.0\.0\.1:{peer.local_port}: "
                    rf".*{re.escape(writer)}.*secret")

    # 2. The same, with OPEN and WRITEs pipelined behind the HELLO so that
    #    they are already in the endpoint's socket when it checks the proof;
    #    WRITEs go to every region id there is (an attacker guesses ids).
    with RawPeer(ep.port) as peer:
        nonce_r = peer.challenge()
        frame, _ = peer.open_frame(key, credit_id=3)
        frames = frame + valid_write(peer, key, target_id, values)
        frames += b"".join(valid_write(peer, key, i, values)
                           for i in range(len(ep.regions)) if i != target_id)
        peer.send_quietly(peer.hello_line(nonce_r, writer, secret="the-wrong-secret-0123") + frames)
        try:
            answer = peer.read_line()
            assert answer.startswith("DENIED ") and "secret" in answer, answer
        except (EOFError, ConnectionResetError):
            pass  # closed with our frames unread: the reset may beat the line
        peer.assert_closed_by_endpoint()
        ep.wait_log(rf"rejected connection from 127\.0\.0\.1:{peer.local_port}: "
                    rf".*secret")

    # 3. A client that skips the handshake and sends a frame straight away
    #    (ended by a newline, so the endpoint reads it as its HELLO line).
    with RawPeer(ep.port) as peer:
        peer.challenge()
        peer.send_quietly(valid_write(peer, key, target_id, values) + b"\n")
        try:
            answer = peer.read_line()
            assert answer.startswith("DENIED malformed HELLO"), answer
        except (EOFError, ConnectionResetError):
            pass
        peer.assert_closed_by_endpoint()
        ep.wait_log(rf"rejected connection from 127\.0\.0\.1:{peer.local_port}: "
                    rf"malformed HELLO")

    # 4. A recorded proof (made with the right secret, for another challenge)
    #    does not open a new connection: no replay.
    with RawPeer(ep.port) as peer:
        peer.challenge()
        stale = peer.hello_line("ab" * 32, writer)
        peer.send_quietly(stale + frame + valid_write(peer, key, target_id, values))
        try:
            answer = peer.read_line()
            assert answer.startswith("DENIED ") and "secret" in answer, answer
        except (EOFError, ConnectionResetError):
            pass
        peer.assert_closed_by_endpoint()
        ep.wait_log(rf"rejected connection from 127\.0\.0\.1:{peer.local_port}: "
                    rf".*secret")

    # Nothing was written, no connection was set up for the writer, and its
    # recv is still waiting.
    assert_regions_untouched(ep, [s.key for s in PLAN.slots if s.key != "x0"])
    assert not re.search(rf"{re.escape(writer)} -> {re.escape(READER)} uses",
                         ep.stderr()), ep.describe()
    assert not ep.recv_done(key), ep.describe()

    # The denied OPENs did not claim the region: the real writer still can,
    # and gets the id the attacks were aimed at.
    with RawPeer(ep.port).connect_as(writer) as peer:
        code, reply = peer.open(key, credit_id=3)
        assert code == 0, reply
        assert int(reply["id"]) == target_id
    ep.assert_region_zero(key)


BAD_WRITES = {
    # key: (offset, payload bytes on the wire, claimed nbytes, notice offset)
    "x2": lambda s: (s.region_bytes + 64, 16, 16, s.copy_offset(0)),
    "x3": lambda s: (s.region_bytes - 32, 64, 64, s.copy_offset(0)),
    "x4": lambda s: (s.payload_offset(0), 64, 64, s.region_bytes),
    "x5": lambda s: (s.payload_offset(0), 64, 2**64 - 32, s.copy_offset(0)),
}


@pytest.mark.parametrize("key", sorted(BAD_WRITES), ids=[
    "offset_beyond_region", "payload_past_end", "notice_outside",
    "length_wraps_around"])
def test_out_of_bounds_write_is_rejected(ep, key):
    slot = PLAN.slot(key)
    writer = slot.src
    offset, wire_bytes, nbytes, notice = BAD_WRITES[key](slot)
    with RawPeer(ep.port).connect_as(writer) as peer:
        code, reply = peer.open(key, credit_id=1)
        assert code == 0, reply
        region_id = int(reply["id"])
        peer.sock.sendall(peer.write_frame(region_id, offset, b"\xff" * wire_bytes,
                                           notice, 1, nbytes=nbytes))
        peer.assert_closed_by_endpoint()
    shm, size = ep.regions[slot.region]
    ep.wait_log(rf"rejected write from {re.escape(writer)}: write of {nbytes} "
                rf"bytes at offset {offset} \(notice at {notice}\) is outside "
                rf"region {re.escape(shm)} of {size} bytes")
    ep.assert_region_zero(key)
    # The recv waiting on that writer fails loudly, naming tensor and peer.
    got = ep.recv_result(key)
    assert got.get("error") == "UnavailableError", got
    assert f"tensor '{key}'" in got["message"] and writer in got["message"], got
    assert "outside region" in got["message"], got


def test_write_to_region_never_given_is_rejected(ep):
    key = "x7"
    values = np.full(16, -1.0, dtype=np.float32)
    # An honest writer opens its region and keeps the connection.
    with RawPeer(ep.port).connect_as(task(7)) as honest:
        code, reply = honest.open(key, credit_id=2)
        assert code == 0, reply
        given = int(reply["id"])

        # An authenticated peer that never opened it cannot write into it ...
        for bad_id in (given, 999):
            with RawPeer(ep.port).connect_as(task(8)) as intruder:
                intruder.sock.sendall(valid_write(intruder, key, bad_id, values))
                intruder.assert_closed_by_endpoint()
            ep.wait_log(rf"rejected write from {re.escape(task(8))}: write to "
                        rf"region id {bad_id}, which this peer was never given")
        ep.assert_region_zero(key)
        assert not ep.recv_done(key)

        # ... and the honest writer cannot write into a region it was not given.
        other = ep.region_id("x6")
        honest.sock.sendall(valid_write(honest, "x6", other, values))
        honest.assert_closed_by_endpoint()
        ep.wait_log(rf"rejected write from {re.escape(task(7))}: write to "
                    rf"region id {other}, which this peer was never given")
    ep.assert_region_zero("x6")
    ep.assert_region_zero(key)
    got = ep.recv_result(key)
    assert got.get("error") == "UnavailableError", got


@pytest.mark.parametrize("reader", [task(0), task(5), "/job:ps/task:1"])
def test_hello_for_another_reader_is_denied(ep, reader):
    writer = task(9)
    with RawPeer(ep.port) as peer:
        # The proof is right for the HELLO as sent; only the reader is wrong.
        answer = peer.handshake(writer, reader=reader)
        assert answer == f"DENIED this endpoint is {READER}, not {reader}", answer
        peer.assert_closed_by_endpoint()
        ep.wait_log(rf"rejected connection from 127\.0\.0\.1:{peer.local_port}: "
                    rf"{re.escape(writer)} dialled {re.escape(reader)} but "
                    rf"reached {re.escape(READER)}")
    assert not re.search(rf"{re.escape(writer)} -> {re.escape(READER)} uses",
                         ep.stderr())


def test_open_of_another_writers_region_is_refused(ep):
    """An authenticated peer cannot claim a region the plan gives to another:
    the region's name says whose it is, whatever hash or size is asked for."""
    key, slot = "x2", PLAN.slot("x2")
    intruder = task(8)
    with RawPeer(ep.port).connect_as(intruder) as peer:
        for override in ({}, {"plan_hash": "0" * 64},
                         {"size": 2 * slot.region_bytes}):
            code, text = peer.open(key, credit_id=4, **override)
            assert code == PERMISSION_DENIED, text
            assert "belongs to another pair of tasks" in text, text
            assert slot.region in text and intruder in text, text
        ep.wait_log(rf"refused region for {re.escape(intruder)}: .*belongs to "
                    rf"another pair of tasks")

        # A refused OPEN leaves the connection up but grants nothing.
        peer.sock.sendall(valid_write(peer, key, ep.region_id(key),
                                      np.ones(16, np.float32)))
        peer.assert_closed_by_endpoint()
        ep.wait_log(rf"rejected write from {re.escape(intruder)}: write to "
                    rf"region id {ep.region_id(key)}, which this peer was never given")
    ep.assert_region_zero(key)


@pytest.mark.parametrize("offered, answer", [
    ("verbs", "DENIED no common transport: {w} allows verbs, {r} allows tcp"),
    ("verbs,tcp", "WELCOME tcp"),
])
def test_transport_negotiation_skips_what_this_endpoint_lacks(ep, offered, answer):
    """A writer that prefers verbs gets the first transport both allow, or a
    denial naming both lists (this endpoint allows only tcp)."""
    writer = task(8)
    with RawPeer(ep.port) as peer:
        nonce_r = peer.challenge()
        peer.sock.sendall(peer.hello_line(nonce_r, writer, transports=offered))
        line = peer.read_line()
        expected = answer.format(w=writer, r=READER)
        assert line.startswith(expected), line
