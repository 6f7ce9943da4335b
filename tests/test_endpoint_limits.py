"""The endpoint's bounds hold against hostile clients, seen from outside.

One real tf_rdma endpoint (task worker:1, TF_RDMA_TRANSPORT=tcp) runs in a
process of its own, next to a real tf_rdma writer (worker:0) that sends it
small tensors on request (`legit` below). The test process is every other
party: plain sockets on 127.0.0.1 (and 127.0.0.2..7 as other source
addresses) that speak the protocol through wire_client.RawPeer, or only
pretend to. Each test attacks one of its bounds and then checks, by the
endpoint's process state (/proc/<pid>/fd, its threads, its /dev/shm
segments, its cgroup), its log and a legitimate transfer, that the bound
held and nothing else suffered:

- rejection logs are escaped, cut and rate-limited (20 lines per 10 s, then
  a summary that accounts for every rejection);
- slow-loris: the per-source handshake cap closes the excess at once, the
  whole-handshake deadline closes trickling connections at ~10 s, and other
  sources are served meanwhile;
- the global cap of 64 concurrent handshakes across source addresses,
  shared fairly: a full endpoint cuts short the oldest handshake of the
  source holding the most for a newcomer with fewer (or from the cluster's
  hosts), so a flood that reopens its connections keeps no writer out;
- a peer stalled mid-WRITE and a peer that never reads its OPEN replies
  hold only their own connections;
- an unrequested OPEN_REPLY closes its connection; 200 connection cycles
  leave the fd and thread counts where they were;
- a reply of the wrong type to the endpoint's own QUERY closes that
  connection and hangs nothing; one writer task holds at most 8
  authenticated connections; a second process claiming a connected task is
  refused; QUERY frames are answered at a bounded rate; "lost connection"
  lines are rate-limited per peer;
- the per-writer region limit, OPEN sizes near 2^64, a large region made
  without holding up other writers, a WRITE to region id + 2^32, a HELLO
  whose proof covers other fields than those sent;
- thread-creation failure under a pids cgroup closes connections, never the
  process (last: it moves the endpoint between cgroups).

What test_tcp_security.py already proves (wrong secret, out-of-bounds
writes, regions never given, another writer's region, transport
negotiation) is not repeated here. "Fresh" legitimate transfers (`probe`)
use a new connection and handshake each, through RawPeer, whose equivalence
with the real writer test_tcp_security.test_valid_write_is_received shows.
"""

import os
import re
import select
import threading
import time

import numpy as np
import pytest

import wire_client
from conftest import make_cluster
from wire_client import (OPEN_REPLY, QUERY, QUERY_REPLY, closed_within,
                         first_bytes_or_close, header, idle_connection)
from tf_rdma.graph_passes import plan as plan_lib

pytestmark = pytest.mark.timeout(120)

SECRET = "limits-secret-0123456789"
READER = "/job:worker/task:1"
LEGIT_WRITER = "/job:worker/task:0"
N_PROBES = 16
PROBE_BASE = 10  # probe i is written by task PROBE_BASE + i
FLAPPING = f"/job:worker/task:{PROBE_BASE + N_PROBES}"  # loses connections
STEADY = f"/job:worker/task:{PROBE_BASE + N_PROBES + 1}"  # loses one
N_TASKS = PROBE_BASE + N_PROBES + 2
TIMEOUT_S = 20  # TF_RDMA_TIMEOUT of the endpoint and the legitimate writer
ENDPOINT_NOFILE = 1024  # per-writer region limit: max(64, min(1024, 1024 // 4))

# Engine constants (kernels/engine/handshake.cc, engine_internal.h) the tests
# check against.
MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_SOURCE = 16
MAX_CONNECTIONS_PER_PEER = 8  # engine_internal.h
MAX_QUERIES_PER_SECOND = 1000
HANDSHAKE_DEADLINE_S = 10
LOG_BURST = 20
LOG_WINDOW_S = 10

INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED = 1, 4, 7  # status.h


def task(i):
    return f"/job:worker/task:{i}"


PLAN = plan_lib.Plan(
    [plan_lib.Transfer("legit", LEGIT_WRITER, READER, "float32", [16])] +
    [plan_lib.Transfer(f"probe{i}", task(PROBE_BASE + i), READER, "float32", [16])
     for i in range(N_PROBES)],
    name="limits")


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("endpoint_limits"))
    endpoint = wire_client.LiveEndpoint(
        workdir, make_cluster(N_TASKS), PLAN, SECRET, READER, LEGIT_WRITER,
        "legit", once_keys=[f"probe{i}" for i in range(N_PROBES)],
        timeout_s=TIMEOUT_S, nofile=ENDPOINT_NOFILE)
    try:
        endpoint.legit_transfer(2, timeout=90)  # the writer has connected
        yield endpoint
    finally:
        endpoint.stop()


@pytest.fixture
def ep(live):
    live.assert_alive()
    yield live
    live.assert_alive()  # nothing a client sent may take the endpoint down


_probes_used = []


def probe_transfer(live, source=None):
    """A legitimate transfer over a fresh connection (a new handshake).

    Writes one float32[16] tensor of the next unused probe key as its writer
    would and waits until the endpoint's recv returns exactly those values.

    Returns:
        Seconds from connecting to the endpoint's report.
    """
    index = len(_probes_used)
    assert index < N_PROBES, "add probe keys to PLAN"
    key = f"probe{index}"
    slot = PLAN.slot(key)
    values = (np.arange(16, dtype=np.float32) * 0.25 + index).astype(np.float32)
    t0 = time.monotonic()
    with live.peer(source=source).connect_as(slot.src) as peer:
        code, reply = peer.open_fields(dict(
            name=slot.region, size=slot.region_bytes, plan_hash=PLAN.hash,
            credit_id=1, credit_size=4096, credit_shm=""))
        assert code == 0, reply
        peer.sock.sendall(peer.write_frame(
            int(reply["id"]), slot.payload_offset(0), values.tobytes(),
            slot.copy_offset(0), 1))
        got = live.endpoint.wait_result(
            lambda r: r["kind"] == "recv" and r["key"] == key, 30)
    _probes_used.append(index)
    assert "error" not in got, got
    assert got["values"] == values.tolist(), got
    return time.monotonic() - t0


def raw_open_fields(name, size=4096, plan_hash="p" * 64, **extra):
    fields = dict(name=name, size=size, plan_hash=plan_hash, credit_id=1,
                  credit_size=4096, credit_shm="")
    fields.update(extra)
    return fields


# --------------------------------------------------------------------------- log hygiene

LIMITED = re.compile(r"^tf_rdma\[[^\]]*\]: (rejected connection|refused connection|"
                     r"rejected write|refused region|rejected notice|"
                     r"cannot start an engine thread)")
SUMMARY = re.compile(r"^tf_rdma\[[^\]]*\]: (\d+) more rejected connections? in the "
                     r"last 10 s")
CONTROL = re.compile(rb"[\x00-\x09\x0b-\x1f\x7f-\xff]")
MAX_LOG_LINE = 800  # "a few hundred bytes": escaped, cut peer text included

RNG = np.random.default_rng(13)


def junk(n, spaces=False):
    """`n` bytes of control characters, escapes and text, no newline."""
    alphabet = [b for b in range(1, 256) if b != 10 and (spaces or b != 32)]
    return bytes(RNG.choice(alphabet, size=n).astype(np.uint8))


def wait_for_quiet_log_window(live):
    """Waits until the rate limiter's window has surely rolled over: the last
    rate-limited line (if any) was written more than LOG_WINDOW_S ago."""
    lines = live.endpoint.stderr().splitlines()
    if any(LIMITED.search(l) or SUMMARY.search(l) for l in lines):
        quiet_at = os.stat(live.endpoint.stderr_path).st_mtime + LOG_WINDOW_S + 0.5
        time.sleep(max(0.0, quiet_at - time.time()))


def send_junk_handshake(live, kind):
    """One connection rejected during its handshake; `kind` picks how."""
    with live.peer(timeout=10) as peer:
        nonce_r = peer.challenge()
        if kind == 0:  # 5 KB first line: longer than the engine reads
            line = b"\x1b[2J\x07HELLO " + junk(5000, spaces=True) + b"\n"
        elif kind == 1:  # 3 KB line that is no HELLO
            line = b"HELLO \x1b]0;pwned\x07" + junk(3000, spaces=True) + b"\n"
        elif kind == 2:  # a HELLO of 8 fields, junk writer, proof wrong
            fields = [junk(900), READER.encode(), b"h", b"tcp", b"i" * 16,
                      b"n" * 64, b"0" * 64]
            line = b"HELLO " + b" ".join(fields) + b"\n"
        else:  # a right proof over a junk writer, reader or transport list:
            # rejected after the proof (the line and its proof are UTF-8)
            field = {3: "writer", 4: "reader", 5: "transports"}[kind]
            args = dict(writer=task(2), reader=READER, transports="tcp")
            args[field] = junk(900).decode("latin-1")
            line = peer.hello_line(nonce_r, **args)
        peer.send_quietly(line)
        assert closed_within(peer.sock, 10), f"kind {kind}: connection kept open"


def test_rejection_log_is_escaped_cut_and_rate_limited(ep):
    """200 rejected handshakes and 20 refused OPENs, all carrying control
    characters and kilobytes of junk: the log gets at most 20 rate-limited
    lines per 10 s window plus a summary that counts the rest, every byte
    of it printable, no line longer than a few hundred bytes."""
    wait_for_quiet_log_window(ep)
    start = len(ep.endpoint.stderr_bytes())
    t0 = time.monotonic()
    n_handshakes, n_opens = 200, 20
    for i in range(n_handshakes):
        send_junk_handshake(ep, i % 6)
    with ep.peer().connect_as(task(2)) as peer:
        code, reply = peer.open_fields(raw_open_fields("hygiene", plan_hash="a" * 64))
        assert code == 0, reply
        for i in range(n_opens // 2):
            # The region exists with another plan hash; the size is no number.
            bad_hash = (b"\x1b[31m" + junk(3000, spaces=True)).decode("latin-1")
            code, _ = peer.open_fields(raw_open_fields("hygiene", plan_hash=bad_hash))
            assert code == FAILED_PRECONDITION
            bad_size = "\x1b[2J\x07" + junk(60).decode("latin-1")
            code, _ = peer.open_fields(raw_open_fields("hygiene", size=bad_size))
            assert code == INVALID_ARGUMENT
    burst_s = time.monotonic() - t0
    expected = n_handshakes + n_opens

    # Every rejection is either a line or counted in a summary (which comes
    # when the window ends, within LOG_WINDOW_S).
    deadline = time.monotonic() + LOG_WINDOW_S + 5
    while True:
        new = ep.endpoint.stderr_bytes()[start:]
        lines = new.decode("latin-1").splitlines()
        limited = [l for l in lines if LIMITED.search(l)]
        summaries = [int(SUMMARY.search(l).group(1)) for l in lines if SUMMARY.search(l)]
        if len(limited) + sum(summaries) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(limited) + sum(summaries) == expected, (
        f"{len(limited)} lines + {summaries} summarised != {expected} rejections\n"
        + new.decode("latin-1")[-3000:])
    # At most LOG_BURST lines in each window (windows end with a summary);
    # the burst took burst_s, so it touched at most this many windows.
    windows, count = [], 0
    for l in lines:
        if SUMMARY.search(l):
            windows.append(count)
            count = 0
        elif LIMITED.search(l):
            count += 1
    windows.append(count)
    assert max(windows) <= LOG_BURST, windows
    assert len(limited) <= LOG_BURST * (1 + int(burst_s // LOG_WINDOW_S) + 1), (
        len(limited), burst_s)
    assert summaries, "no summary line for the suppressed rejections"
    # Nothing raw from the peers: no control or non-ASCII byte, no long line.
    bad = CONTROL.search(new)
    assert bad is None, (f"raw byte {bad.group()!r} in the log: "
                         f"{new[max(0, bad.start() - 200):bad.start() + 50]!r}")
    longest = max(lines, key=len)
    assert len(longest) <= MAX_LOG_LINE, f"{len(longest)}-byte log line: {longest[:300]}..."
    # Escaped, not dropped: the peers' bytes show up as \xNN.
    assert re.search(r"\\x1b", new.decode()), new.decode()[-2000:]


# --------------------------------------------------------------------------- slow-loris


class Trickler:
    """Sends one byte a second to each socket until the endpoint closes it;
    records when (seconds after `t0`)."""

    def __init__(self, socks, t0):
        self.socks, self.t0 = dict(enumerate(socks)), t0
        self.closed_at = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        text = b"HELLO " + task(2).encode() + b" " + READER.encode() + b" " * 200
        tick = 0
        while not self.stop.is_set() and len(self.closed_at) < len(self.socks):
            if time.monotonic() - self.t0 > 3 * HANDSHAKE_DEADLINE_S:
                return
            for i, s in self.socks.items():
                if i in self.closed_at:
                    continue
                try:
                    s.send(text[tick % len(text):tick % len(text) + 1])
                except OSError:
                    self.closed_at[i] = time.monotonic() - self.t0
            tick += 1
            next_tick = time.monotonic() + 1.0
            while time.monotonic() < next_tick and not self.stop.is_set():
                open_socks = [s for i, s in self.socks.items() if i not in self.closed_at]
                if not open_socks:
                    return
                ready, _, _ = select.select(open_socks, [], [],
                                            max(0.0, next_tick - time.monotonic()))
                for s in ready:
                    i = next(i for i, x in self.socks.items() if x is s)
                    try:
                        data = s.recv(4096)
                    except OSError:
                        data = b""
                    if not data:
                        self.closed_at[i] = time.monotonic() - self.t0


def test_slow_loris_is_capped_per_source_and_cut_at_the_deadline(ep):
    """20 connections from 127.0.0.1 that trickle a HELLO a byte a second:
    16 get a challenge, 4 are closed at once; the 16 are closed by the
    whole-handshake deadline (~10 s), however they trickle. Meanwhile another
    source is served at once and the connected writer's transfers go on;
    afterwards a fresh handshake from 127.0.0.1 works."""
    time.sleep(0.3)  # handshakes of earlier tests have ended
    n = MAX_HANDSHAKES_PER_SOURCE + 4
    t0 = time.monotonic()
    socks = [idle_connection(ep.port) for _ in range(n)]
    try:
        outcomes = [first_bytes_or_close(s, 5) for s in socks]
        decided_s = time.monotonic() - t0
        challenged = [s for s, (what, text) in zip(socks, outcomes)
                      if what == "line" and text.startswith("TFRDMA/3 CHALLENGE ")]
        closed = [s for s, (what, _) in zip(socks, outcomes) if what == "closed"]
        assert (len(challenged), len(closed)) == (MAX_HANDSHAKES_PER_SOURCE, 4), outcomes
        assert decided_s < 5, decided_s
        trickler = Trickler(challenged, t0)

        # While 127.0.0.1 is at its cap: one more from there is closed at once,
        # a fresh writer from 127.0.0.2 and the connected writer are served.
        time.sleep(1.5)
        extra = idle_connection(ep.port)
        assert first_bytes_or_close(extra, 5)[0] == "closed"
        extra.close()
        assert probe_transfer(ep, source="127.0.0.2") < 5
        assert ep.legit_transfer(3) < 5
        assert len(trickler.closed_at) == 0, trickler.closed_at  # still trickling

        trickler.thread.join(3 * HANDSHAKE_DEADLINE_S + 5)
        assert len(trickler.closed_at) == len(challenged), (
            f"still open after {time.monotonic() - t0:.1f} s: "
            f"{len(challenged) - len(trickler.closed_at)} trickling connections")
        times = sorted(trickler.closed_at.values())
        assert HANDSHAKE_DEADLINE_S - 1.5 <= times[0], times
        assert times[-1] <= HANDSHAKE_DEADLINE_S + 3, times
    finally:
        for s in socks:
            s.close()
    assert probe_transfer(ep) < 5  # from 127.0.0.1 again


# --------------------------------------------------------------------------- global cap


def open_after_settling(socks, settle_s=1.0):
    """The sockets the endpoint still holds open once nothing has happened
    for `settle_s` seconds (each one's first bytes are read and dropped)."""
    closed = set()
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < settle_s:
        live = [s for s in socks if s not in closed]
        ready, _, _ = select.select(live, [], [], 0.1)
        for sock in ready:
            try:
                data = sock.recv(4096)
            except ConnectionResetError:
                data = b""
            if not data:
                closed.add(sock)
                quiet_since = time.monotonic()
    return [s for s in socks if s not in closed]


def test_handshakes_are_capped_at_64_and_shared_fairly(ep):
    """80 idle handshakes, 16 from each of 127.0.0.2..6: at most 64 are held
    at once, and the fifth source, arriving last, takes its fair share from
    the others (the oldest of the source holding the most is cut short)
    instead of being closed at once: every source ends with 12 or 13. While
    they are held, fresh writers from an address not seen yet and from the
    cluster's own host connect and transfer, and so does the connected
    writer."""
    time.sleep(0.3)
    refused_before = int(ep.info()["refused_connections"])
    sources = [f"127.0.0.{i}" for i in range(2, 7)]
    socks = [idle_connection(ep.port, source=src)
             for src in sources for _ in range(MAX_HANDSHAKES_PER_SOURCE)]
    try:
        held = open_after_settling(socks)
        assert len(held) == MAX_HANDSHAKES, len(held)
        per_source = {src: sum(1 for s in held if s.getsockname()[0] == src)
                      for src in sources}
        assert all(12 <= n <= 13 for n in per_source.values()), per_source
        refused = int(ep.info()["refused_connections"]) - refused_before
        assert refused == len(socks) - MAX_HANDSHAKES, refused
        assert probe_transfer(ep, source="127.0.0.7") < 5
        assert probe_transfer(ep) < 5  # 127.0.0.1: the cluster's host
        assert ep.legit_transfer(3) < 5
        ep.endpoint.assert_alive()
    finally:
        for s in socks:
            s.close()


class ReopeningFlood:
    """`per_source` idle connections from each of `sources`, each opened
    again as soon as the endpoint closes it, on a thread of its own."""

    def __init__(self, port, sources, per_source):
        self.port, self.opened = port, 0
        self.socks = [idle_connection(port, source=src)
                      for src in sources for _ in range(per_source)]
        self.stopping = False
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stopping:
            ready, _, _ = select.select(self.socks, [], [], 0.05)
            for sock in ready:
                try:
                    data = sock.recv(4096)
                except ConnectionResetError:
                    data = b""
                if data:
                    continue
                source = sock.getsockname()[0]
                sock.close()
                self.socks[self.socks.index(sock)] = idle_connection(
                    self.port, source=source)
                self.opened += 1

    def stop(self):
        self.stopping = True
        self.thread.join(5)
        for sock in self.socks:
            sock.close()


def test_a_reopening_flood_from_many_sources_keeps_no_writer_out(ep):
    """Connections from 8 addresses that hold every handshake slot and open
    again as soon as one closes: fresh writers from the cluster's host and
    from another address still connect, each within a few seconds, again
    and again, and the connected writer's transfers go on."""
    time.sleep(0.3)
    flood = ReopeningFlood(ep.port, [f"127.0.0.{i}" for i in range(10, 18)],
                           MAX_HANDSHAKES // 8)
    try:
        time.sleep(1.0)
        for source in (None, "127.0.0.7", None):
            assert probe_transfer(ep, source=source) < 5
        assert ep.legit_transfer(3) < 5
        ep.endpoint.assert_alive()
    finally:
        flood.stop()


# --------------------------------------------------------------------------- isolation


def test_stalled_peers_do_not_delay_the_legitimate_writer(ep):
    """A peer that sends half a WRITE and stops, and a peer that floods OPEN
    requests without reading a reply (its socket full, the endpoint's reply
    blocked), each hold only their own connection: the legitimate writer's
    tensors arrive as fast as before, far within the 20 s timeout that the
    stalled connections still have to run."""
    baseline = ep.legit_transfer(10)
    with ep.peer().connect_as(task(3)) as halfway, \
            ep.peer(rcvbuf=4096).connect_as(task(4)) as deaf:
        code, reply = halfway.open_fields(raw_open_fields("halfway"))
        assert code == 0, reply
        halfway.sock.sendall(halfway.write_frame(
            int(reply["id"]), 0, b"\x5a" * 100, 4096 - 8, 1, nbytes=1024))

        # A region whose OPEN is refused with a 1000-character reason: every
        # reply is ~1 KB, so the endpoint's send buffer fills up quickly.
        code, _ = deaf.open_fields(raw_open_fields("deaf", refusal="r" * 1000))
        assert code == FAILED_PRECONDITION
        frame, _ = deaf.request_frame(raw_open_fields("deaf"), request=99)
        deaf.sock.setblocking(False)
        chunk = frame * 64
        pending, stalled_since, sent = chunk, None, 0
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline, f"{sent} bytes of OPENs still accepted"
            try:
                n = deaf.sock.send(pending)
                sent += n
                pending = pending[n:] or chunk
                stalled_since = None
            except BlockingIOError:
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since > 1.0:
                    break
                time.sleep(0.05)

        t0 = time.monotonic()
        stalled = ep.legit_transfer(10)
        assert stalled < max(3 * baseline, 3.0), (stalled, baseline)
        assert time.monotonic() - t0 < TIMEOUT_S / 2
        # Both were still held: the endpoint had closed neither.
        assert not closed_within(halfway.sock, 0.05)
        with pytest.raises(BlockingIOError):
            deaf.sock.send(chunk)
    # Closing them releases their threads (the next tests count threads).


# --------------------------------------------------------------------------- replies, fds


def test_unrequested_open_reply_closes_and_fds_return_to_baseline(ep):
    """An OPEN_REPLY nobody asked for closes that connection; 200 cycles of
    connect, handshake (or denial) and close, some ended by such replies,
    leave the endpoint's fd and thread counts where they were."""
    writer = task(6)
    incarnation = os.urandom(8).hex()
    reply_body = b"shm=/x\nsize=4096\nid=0\n"

    def cycle(kind, i):
        with ep.peer(incarnation=incarnation) as peer:
            if kind == 3:
                assert peer.handshake(writer, secret="not-the-secret-000").startswith("DENIED")
                assert closed_within(peer.sock, 10)
                return
            peer.connect_as(writer)
            if kind == 1:
                peer.sock.sendall(header(OPEN_REPLY, a=5000 + i, b=len(reply_body))
                                  + reply_body)
                assert closed_within(peer.sock, 10), "unrequested reply was taken"
            elif kind == 2:
                code, reply = peer.open_fields(raw_open_fields("cycling"))
                assert code == 0, reply

    for kind in range(4):  # warm-up: the region exists, pools have started
        cycle(kind, kind)
    assert re.search(rf"lost connection {re.escape(writer)} -> {re.escape(READER)}: "
                     rf"OPEN reply 5001 answers no outstanding request",
                     ep.endpoint.stderr()), ep.describe()
    time.sleep(0.5)
    fds, threads = ep.fds(), ep.threads()
    for i in range(200):
        cycle(i % 4, 1000 + i)
    deadline = time.monotonic() + 10
    while (ep.fds() > fds + 2 or ep.threads() > threads + 3) and \
            time.monotonic() < deadline:
        time.sleep(0.1)
    assert ep.fds() <= fds + 2, (fds, ep.fds(), sorted(os.listdir(f"/proc/{ep.pid}/fd")))
    assert ep.threads() <= threads + 3, (threads, ep.threads())
    assert probe_transfer(ep) < 5


def test_a_reply_of_the_wrong_type_ends_its_connection_not_the_endpoint(ep):
    """A peer that answers the endpoint's QUERY with another frame type (an
    OPEN_REPLY with the query's id) loses its connection; the endpoint's
    question ends at once, and its waits, transfers and queries go on."""
    writer = task(7)
    with ep.peer().connect_as(writer) as peer:
        asked = ep.ask_clock_offsets()
        (magic, type_, _, request, _, _, _, _), _ = peer.read_frame()
        assert (magic, type_) == (wire_client.MAGIC, wire_client.QUERY)
        body = b"id=0\nsize=4096\n"
        peer.sock.sendall(header(OPEN_REPLY, a=request, b=len(body)) + body)
        assert closed_within(peer.sock, 10), "the wrong reply was taken"
        answer = ep.clock_offsets(asked)
    assert answer["elapsed_s"] < 5, answer
    assert "error" in answer["offsets"]["peers"][writer], answer
    assert re.search(rf"lost connection {re.escape(writer)} -> {re.escape(READER)}: "
                     r"reply of frame type 2 to request \d+ \(expected 6\)",
                     ep.endpoint.stderr()), ep.describe()
    # The endpoint still answers: its other peers' clocks, a fresh writer,
    # the legitimate writer.
    again = ep.clock_offsets(ep.ask_clock_offsets())
    assert again["elapsed_s"] < 5, again
    assert "offset_ns" in again["offsets"]["peers"][LEGIT_WRITER], again
    assert probe_transfer(ep) < 5
    ep.legit_transfer(2, timeout=30)


def test_one_writer_holds_at_most_8_connections(ep):
    """A holder of the secret that opens authenticated connection after
    connection as one task gets 8 (a reader thread and an fd each); the 9th
    is denied, naming the limit; once one closes, a new one gets in."""
    # One process (incarnation): a new one would make the endpoint close
    # the old one's connections, as a restarted writer's.
    writer, incarnation = task(9), os.urandom(8).hex()
    time.sleep(0.3)
    threads = ep.threads()
    peers = []
    try:
        for _ in range(MAX_CONNECTIONS_PER_PEER):
            peers.append(ep.peer(incarnation=incarnation).connect_as(writer))
        with ep.peer(incarnation=incarnation) as extra:
            answer = extra.handshake(writer)
        assert answer.startswith("DENIED ") and "the most allowed" in answer, answer
        assert ep.threads() <= threads + MAX_CONNECTIONS_PER_PEER + 3, (
            threads, ep.threads())
        peers.pop().close()
        deadline = time.monotonic() + 5
        while True:
            try:
                peers.append(ep.peer(incarnation=incarnation).connect_as(writer))
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline, "the closed one was not let go"
                time.sleep(0.1)
    finally:
        for peer in peers:
            peer.close()
    assert probe_transfer(ep) < 5


def lost_lines(log, peer):
    """(lines, suppressed) of `peer`'s lost connections in `log`."""
    lines = re.findall(rf"^tf_rdma\[[^\]]*\]: lost connection {re.escape(peer)} -> ",
                       log, re.M)
    suppressed = [int(n) for n in re.findall(
        rf"(\d+) more lost connections? in the last 10 s \(last: lost "
        rf"connection {re.escape(peer)} -> ", log)]
    return len(lines), sum(suppressed)


def test_lost_connections_are_logged_at_a_bounded_rate_per_peer(ep):
    """A secret holder whose connections come and go (40 in a few seconds)
    gets at most 20 "lost connection" lines per 10 s and a line that counts
    the rest; another peer's loss meanwhile is logged at once."""
    start = len(ep.endpoint.stderr())
    n = 40
    incarnation = os.urandom(8).hex()
    for _ in range(n):
        ep.peer(incarnation=incarnation).connect_as(FLAPPING).close()
        time.sleep(0.05)  # gone before the next: 8 connections at most
    deadline = time.monotonic() + 10
    while lost_lines(ep.endpoint.stderr()[start:], FLAPPING)[0] < LOG_BURST:
        assert time.monotonic() < deadline, ep.describe()
        time.sleep(0.1)
    ep.peer().connect_as(STEADY).close()
    deadline = time.monotonic() + 5
    while not lost_lines(ep.endpoint.stderr()[start:], STEADY)[0]:
        assert time.monotonic() < deadline, "the other peer's loss went unlogged"
        time.sleep(0.1)
    # The count of the rest comes when the window ends.
    deadline = time.monotonic() + LOG_WINDOW_S + 5
    while sum(lost_lines(ep.endpoint.stderr()[start:], FLAPPING)) < n:
        assert time.monotonic() < deadline, ep.endpoint.stderr()[start:][-3000:]
        time.sleep(0.2)
    lines, suppressed = lost_lines(ep.endpoint.stderr()[start:], FLAPPING)
    assert lines <= LOG_BURST and lines + suppressed == n, (lines, suppressed)


def test_a_second_process_claiming_a_connected_task_is_refused(ep):
    """A holder of the secret that claims the connected legitimate writer's
    task with an incarnation of its own is refused: the endpoint asks the
    connected one, which answers. The writer's transfers go on; nothing
    takes it for a restarted process (whose regions would be refused for
    good)."""
    t0 = time.monotonic()
    with ep.peer() as impostor:
        answer = impostor.handshake(LEGIT_WRITER)
    assert answer.startswith("DENIED ") and "another process of" in answer, answer
    assert time.monotonic() - t0 < 5
    assert ep.legit_transfer(3) < 5
    assert f"{LEGIT_WRITER} restarted" not in ep.endpoint.stderr(), ep.describe()


def test_queries_are_answered_at_a_bounded_rate(ep):
    """3,000 QUERY frames sent at once on one connection are all answered,
    at most 1,000 a second (the last after 2 s or more: the connection's
    reader thread waits, no core spins), and the legitimate writer's
    transfers go on meanwhile."""
    n = 3 * MAX_QUERIES_PER_SECOND
    with ep.peer().connect_as(task(2)) as peer:
        frames, ids = [], []
        for _ in range(n):
            frame, request = peer.request_frame({"what": "clock"}, type_=QUERY)
            frames.append(frame)
            ids.append(request)
        t0 = time.monotonic()
        cpu0 = endpoint_cpu_s(ep)
        sender = threading.Thread(target=peer.sock.sendall, args=(b"".join(frames),))
        sender.start()
        during = None
        for i, request in enumerate(ids):
            code, reply = peer.read_reply(request, QUERY_REPLY)
            assert code == 0, reply
            if i == MAX_QUERIES_PER_SECOND + 10:
                t1 = time.monotonic()
                ep.legit_transfer(3)
                during = time.monotonic() - t1
        elapsed = time.monotonic() - t0
        cpu = endpoint_cpu_s(ep) - cpu0
        sender.join(10)
    assert elapsed >= (n / MAX_QUERIES_PER_SECOND) - 1 - 0.2, elapsed
    assert during is not None and during < 2, during
    assert cpu < 0.5 * elapsed, (cpu, elapsed)


def endpoint_cpu_s(ep):
    """CPU seconds the endpoint's process has used (user + system)."""
    with open(f"/proc/{ep.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- OPEN bounds


def region_limit(pid):
    with open(f"/proc/{pid}/limits") as f:
        soft = int(re.search(r"Max open files\s+(\d+)", f.read()).group(1))
    return max(64, min(1024, soft // 4))


def test_region_limit_bounds_fds_and_shm_across_reconnects(ep):
    """A writer with the secret that opens region after region gets an
    error at the limit (min(1024, NOFILE/4)); reconnecting does not reset
    it; the endpoint's /dev/shm bytes and fds grow by the limit's worth and
    no more; closing is fine and fresh handshakes still work. A new process
    of the writer task (a restart) has the old one's regions refused and
    released: segments and fds return to where they were, the new process
    opens regions of its own, and the old names stay refused."""
    limit = region_limit(ep.pid)
    assert limit == max(64, min(1024, ENDPOINT_NOFILE // 4))
    writer, incarnation = task(5), os.urandom(8).hex()
    shm0, fds0 = ep.shm_bytes(), ep.fds()
    with ep.peer(incarnation=incarnation).connect_as(writer) as peer:
        for i in range(limit):
            code, reply = peer.open_fields(raw_open_fields(f"hoard/{i}"))
            assert code == 0, (i, reply)
        code, text = peer.open_fields(raw_open_fields(f"hoard/{limit}"))
        assert code == FAILED_PRECONDITION, text
        assert f"has already opened {limit} regions" in text, text
        code, reply = peer.open_fields(raw_open_fields("hoard/0"))  # not new
        assert code == 0, reply
    assert ep.shm_bytes() - shm0 == limit * 4096
    for attempt in range(2):  # a new connection of the process: no new budget
        with ep.peer(incarnation=incarnation).connect_as(writer) as peer:
            code, text = peer.open_fields(raw_open_fields(f"hoard/more{attempt}"))
            assert code == FAILED_PRECONDITION, (attempt, text)
            assert "regions" in text, text
    assert ep.shm_bytes() - shm0 == limit * 4096
    assert ep.fds() - fds0 <= limit + 4, (fds0, ep.fds())
    with ep.peer().connect_as(writer) as peer:  # a new process of the task
        deadline = time.monotonic() + TIMEOUT_S + 10
        while ep.shm_bytes() > shm0 or ep.fds() > fds0 + 4:
            assert time.monotonic() < deadline, (shm0, ep.shm_bytes(), fds0, ep.fds())
            time.sleep(0.2)
        code, text = peer.open_fields(raw_open_fields("hoard/0"))
        assert code == FAILED_PRECONDITION, text
        assert f"{writer} restarted" in text, text
        code, reply = peer.open_fields(raw_open_fields("hoard/new"))
        assert code == 0, reply
    assert probe_transfer(ep) < 5


def test_open_sizes_near_2_64_are_refused(ep):
    """OPEN sizes that overflow, wrap or exceed /dev/shm create no region."""
    fs = os.statvfs("/dev/shm")
    too_big = (2 * fs.f_blocks * fs.f_frsize // 4096 + 1) * 4096
    cases = {
        str(2**64 - 4096): None, str(2**64 - 1): None, str(2**63): None,
        str(2**63 + 4096): None, str(2**64): INVALID_ARGUMENT,
        str(2**64 + 4096): INVALID_ARGUMENT, str(10**20): INVALID_ARGUMENT,
        "0": None, "04096": INVALID_ARGUMENT, "+4096": INVALID_ARGUMENT,
        "4096 ": INVALID_ARGUMENT, "-4096": INVALID_ARGUMENT,
        str(too_big): RESOURCE_EXHAUSTED,
    }
    regions0, shm0 = len(ep.info()["region"]), ep.shm_bytes()
    with ep.peer().connect_as(task(7)) as peer:
        for i, (size, expected_code) in enumerate(cases.items()):
            code, text = peer.open_fields(raw_open_fields(f"huge/{i}", size=size))
            assert code != 0, (size, text)
            if expected_code is not None:
                assert code == expected_code, (size, code, text)
            if expected_code == RESOURCE_EXHAUSTED:
                assert "/dev/shm" in text, text
        for field, value in (("credit_size", str(2**64)), ("credit_id", str(2**32))):
            code, text = peer.open_fields(raw_open_fields("huge/credit", **{field: value}))
            assert code == INVALID_ARGUMENT, (field, text)
    assert len(ep.info()["region"]) == regions0
    assert ep.shm_bytes() == shm0


def test_a_large_region_is_made_without_stalling_other_transfers(ep):
    """A writer's OPEN of a 2 GiB region (about 1.4 s to reserve and
    populate here) does not hold up the other writers: the legitimate
    writer's tensors arrive meanwhile as fast as before."""
    baseline = min(timed_legit_transfer(ep) for _ in range(3))
    opened = {}

    def open_large():
        with ep.peer().connect_as(task(8)) as peer:
            t0 = time.monotonic()
            opened["reply"] = peer.open_fields(raw_open_fields("large", size=2 << 30))
            opened["s"] = time.monotonic() - t0

    thread = threading.Thread(target=open_large)
    thread.start()
    try:
        time.sleep(0.3)  # the endpoint is making the region
        during = [timed_legit_transfer(ep) for _ in range(2)]
    finally:
        thread.join(60)
    code, reply = opened["reply"]
    assert code == 0, reply
    assert opened["s"] > max(during) + 0.3, (opened, during)
    assert max(during) < max(0.5, 5 * baseline), (during, baseline)


def timed_legit_transfer(ep):
    """Seconds from asking the legitimate writer for 3 tensors until the
    endpoint has reported all of them."""
    t0 = time.monotonic()
    ep.legit_transfer(3)
    return time.monotonic() - t0


def test_write_to_region_id_plus_2_32_is_rejected(ep):
    """WRITE's 64-bit region id is not cut to 32 bits: id + 2^32 names no
    region; the region the cut would name keeps its zero bytes, while the
    same write to the real id lands."""
    writer, incarnation = task(7), os.urandom(8).hex()
    with ep.peer(incarnation=incarnation).connect_as(writer) as peer:
        code, reply = peer.open_fields(raw_open_fields("wrap-target"))
        assert code == 0, reply
        region_id, shm, size = int(reply["id"]), reply["shm"], int(reply["size"])
        peer.sock.sendall(peer.write_frame(region_id + 2**32, 0, b"\xab" * 64,
                                           4096 - 8, 7))
        assert closed_within(peer.sock, 10), "write to id + 2^32 was taken"
    assert ep.segment(shm, size) == bytes(size)
    line = rf"rejected write from {re.escape(writer)}: write to region id {region_id + 2**32},"
    deadline = time.monotonic() + 12  # a line, or the window's summary
    while not re.search(line, ep.endpoint.stderr()):
        assert time.monotonic() < deadline, ep.describe()
        time.sleep(0.1)
    with ep.peer(incarnation=incarnation).connect_as(writer) as peer:
        code, reply = peer.open_fields(raw_open_fields("wrap-target"))
        assert code == 0 and int(reply["id"]) == region_id, reply
        peer.sock.sendall(peer.write_frame(region_id, 0, b"\xab" * 64, 4096 - 8, 7))
        code, reply = peer.open_fields(raw_open_fields("wrap-target"))  # in order
        assert code == 0, reply
    data = ep.segment(shm, size)
    assert data[:64] == b"\xab" * 64 and data[-8:] == (7).to_bytes(8, "little")


def test_a_writer_that_dials_again_takes_its_region_over(ep):
    """A writer process that dials again while the endpoint still holds its
    old connection (the endpoint has not yet seen that close) gets its
    region on the new connection at once, not "already has a connected
    writer": the same task and incarnation prove the old connection dead,
    and the endpoint closes it. The region stays its writer task's."""
    writer, incarnation = task(8), os.urandom(8).hex()
    fields = raw_open_fields("redialled")
    with ep.peer(incarnation=incarnation).connect_as(writer) as old:
        code, reply = old.open_fields(fields)
        assert code == 0, reply
        region_id = int(reply["id"])
        with ep.peer(incarnation=incarnation).connect_as(writer) as new:
            code, reply = new.open_fields(fields)  # no retry: at once
            assert code == 0, reply
            assert int(reply["id"]) == region_id, reply
            assert closed_within(old.sock, 10), "the old connection stayed open"
            line = (rf"lost connection {re.escape(writer)} -> {re.escape(READER)}: "
                    rf"{re.escape(writer)} dialled again; its new connection "
                    rf"replaces this one")
            deadline = time.monotonic() + 10
            while not re.search(line, ep.endpoint.stderr()):
                assert time.monotonic() < deadline, ep.describe()
                time.sleep(0.05)
            with ep.peer().connect_as(task(2)) as other:  # still not theirs
                code, text = other.open_fields(fields)
                assert code == FAILED_PRECONDITION, text
                assert f"written by {writer}, now asked for" in text, text
            # The new connection holds the region and still works.
            code, reply = new.open_fields(fields)
            assert code == 0 and int(reply["id"]) == region_id, reply
    assert probe_transfer(ep) < 5


@pytest.mark.parametrize("index, sent", [
    (0, task(8)),                  # writer: another task of the cluster
    (1, task(3)),                  # reader
    (2, "another-host"),           # host id (steers shm vs tcp)
    (3, "tcp"),                    # transports (proof was over "verbs")
    (4, "f" * 16),                 # writer's incarnation (fakes a restart)
    (5, "e" * 64),                 # writer's nonce
], ids=["writer", "reader", "host", "transports", "incarnation", "nonce"])
def test_hello_proof_covers_every_field(ep, index, sent):
    """A HELLO whose fields differ from those its proof was made over is
    denied as a failed proof, whichever field differs (a party in the middle
    cannot steer the transport or fake a restart)."""
    transports = "verbs" if index == 3 else "tcp"
    with ep.peer() as peer:
        nonce_r = peer.challenge()
        peer.sock.sendall(peer.hello_line(nonce_r, task(9), transports=transports,
                                          sent_instead={index: sent}))
        answer = peer.read_line()
        assert answer == "DENIED secret proof does not match", answer
        assert closed_within(peer.sock, 10)
    with ep.peer() as peer:  # the same HELLO, untampered, is welcome
        peer.connect_as(task(9))


# --------------------------------------------------------------------------- pids cgroup

PIDS_ROOT = "/sys/fs/cgroup/pids"


@pytest.fixture
def pids_cgroup(ep):
    """A child of the cgroup v1 pids controller holding the endpoint process;
    moves it back and removes the child afterwards."""
    path = os.path.join(PIDS_ROOT, f"tf_rdma_limits_{os.getpid()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(ep.pid))
    except OSError as e:
        if os.path.isdir(path):
            os.rmdir(path)
        pytest.skip(f"cannot put the endpoint in a pids cgroup under {PIDS_ROOT}: {e}")
    try:
        yield path
    finally:
        set_pids_max(path, "max")
        with open(os.path.join(PIDS_ROOT, "cgroup.procs"), "w") as f:
            f.write(str(ep.pid))
        for _ in range(50):
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.1)


def set_pids_max(path, value):
    with open(os.path.join(path, "pids.max"), "w") as f:
        f.write(str(value))


def pids_current(path):
    with open(os.path.join(path, "pids.current")) as f:
        return int(f.read())


def test_thread_creation_failure_closes_connections_not_the_process(ep, pids_cgroup):
    """Under a pids limit a few threads above the endpoint's count, 30 idle
    connections: the few that get a thread are challenged, the rest are
    closed and logged; with room for the handshake's thread but not the
    connection's reader thread, an authenticated writer is closed after its
    WELCOME. The process lives through it (no SIGABRT) and, with the limit
    lifted, transfers over old and new connections work."""
    headroom = 4
    # The thread failures' lines must find room in the log's window (the
    # test looks for one of them, or the summary that names the last).
    wait_for_quiet_log_window(ep)
    set_pids_max(pids_cgroup, pids_current(pids_cgroup) + headroom)
    socks = [idle_connection(ep.port, source=f"127.0.0.{2 + i % 2}") for i in range(30)]
    try:
        outcomes = [first_bytes_or_close(s, 5)[0] for s in socks]
        assert outcomes.count("line") <= headroom, outcomes
        assert outcomes.count("closed") >= len(socks) - headroom, outcomes
        ep.endpoint.assert_alive()
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + LOG_WINDOW_S + 3  # a line, or in the summary
    while "cannot start a thread for it" not in ep.endpoint.stderr():
        assert time.monotonic() < deadline, ep.describe()
        time.sleep(0.1)

    # Room for exactly one more thread: the handshake's.
    time.sleep(0.5)  # the threads of the closed handshakes have ended
    set_pids_max(pids_cgroup, pids_current(pids_cgroup) + 1)
    with ep.peer() as peer:
        answer = peer.handshake(task(9))
        assert answer.startswith("WELCOME "), answer
        assert closed_within(peer.sock, 10), "a connection without a reader thread"
    ep.endpoint.assert_alive()
    assert "cannot start the connection's reader thread" in ep.endpoint.stderr(), (
        ep.describe())

    set_pids_max(pids_cgroup, "max")
    assert ep.legit_transfer(3) < 5
    assert probe_transfer(ep) < 5
    assert "terminate called" not in ep.endpoint.stderr()


# --------------------------------------------------------------------------- last: all regions


def test_writers_together_open_at_most_half_the_fds_in_regions(ep):
    """Writers with the secret that each open regions up to their own limit
    (a quarter of NOFILE) stop, all together, at half of it: the endpoint
    keeps descriptors to accept connections, and the connected writer's
    transfers go on. Last: it leaves the endpoint at that limit."""
    limit = region_limit(ep.pid)
    total = sum(1 for name in ep.info()["region"])
    refused = None
    with ep.peer().connect_as(task(3)) as first, ep.peer().connect_as(task(4)) as second:
        for i in range(2 * limit):
            peer = first if i < limit else second
            code, text = peer.open_fields(raw_open_fields(f"all/{i}"))
            if code != 0:
                refused = (i, code, text)
                break
    assert refused is not None, "no limit for all writers together"
    i, code, text = refused
    assert code == FAILED_PRECONDITION, refused
    assert "the most allowed for all of them" in text, text
    assert ep.fds() < ENDPOINT_NOFILE - limit, ep.fds()
    with ep.peer().connect_as(task(9)):  # connections are still accepted
        pass
    assert ep.legit_transfer(3) < 5
    assert i + total >= 2 * limit - 64, (i, total)  # this endpoint's own count too
