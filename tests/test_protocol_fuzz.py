"""A protocol fuzzer against a live endpoint: it stays up, writes nothing
out of bounds, and legitimate transfers go on with exact values.

A real tf_rdma endpoint (worker:1, tcp) runs in its own process, and a real
tf_rdma writer (worker:0) sends it float32[16] tensors in batches all through
the run. The test process proves the secret as two other tasks (worker:2 and
worker:3, through wire_client.RawPeer), opens canary regions of its own, and
sends a seeded, bounded stream of mutated frames: WRITEs with offsets,
lengths and notice words around every bound and near 2^64, to region ids it
was never given (another writer's, id + 2^32, random 64-bit ones), with
bodies cut short; OPEN requests with sizes and ids near their bounds, names
of 1024/1025 bytes, bodies of 64 KiB and one byte more, junk fields; QUERY
frames with junk fields and bodies; OPEN replies nobody asked for, ERROR
frames, unknown types, bad magic, random headers, headers cut short; and the
endpoint's own QUERY (its clock offsets ask every connected peer) answered
with a frame of another type or another request's id.

Every frame's fate is predicted from the documented bounds (kernels/common/
wire.h): a WRITE the endpoint must take keeps the connection, a QUERY is
answered on it, anything it must refuse closes it (a wrong answer to its own
question also ends that question at once) (the fuzzer then reconnects and opens its regions
again). Every byte a taken WRITE carries is a function of its position in
the region (payload and notice word alike), and every refused frame carries
0xEE bytes, so after the run each canary region must hold, byte for byte:
the pattern where a complete write landed, the pattern or zero where a write
was cut short, and zero everywhere else. The endpoint's own region that the
fuzzer was never given must be all zeros, and every tensor of the legitimate
writer must arrive with exactly the values sent.
"""

import os
import random
import time

import pytest

import wire_client
from conftest import make_cluster
from wire_client import (ERROR, HEADER, MAGIC, OPEN_REPLY, OPEN_REQUEST, QUERY,
                         QUERY_REPLY, WRITE, closed_within, encode_fields, header)
from tf_rdma.graph_passes import plan as plan_lib

pytestmark = pytest.mark.timeout(240)

SEED = 20131
N_FRAMES = 2000
LEGIT_EVERY = 100  # frames between batches of the legitimate writer
SECRET = "fuzz-secret-0123456789ab"
READER = "/job:worker/task:1"
LEGIT_WRITER = "/job:worker/task:0"
MAX_BODY = 64 * 1024  # kMaxBodyBytes
MAX_NAME = 1024  # kMaxRegionNameBytes
NOTICE_ZONE = 256  # the last bytes of each canary region take the notices
U64 = 2**64
INVALID_ARGUMENT = 1  # status.h: an unknown query

PLAN = plan_lib.Plan([
    plan_lib.Transfer("legit", LEGIT_WRITER, READER, "float32", [16]),
    plan_lib.Transfer("quiet", "/job:worker/task:2", READER, "float32", [16]),
], name="fuzz")

# Canary regions: name -> (owner, size). "fz/still" is opened, never written.
CANARIES = {
    "fz/a0": ("/job:worker/task:2", 4096),
    "fz/a1": ("/job:worker/task:2", 8192),
    "fz/a2": ("/job:worker/task:2", 65536),
    "fz/still": ("/job:worker/task:2", 4096),
    "fz/b0": ("/job:worker/task:3", 4096),
}
TARGETS = ("fz/a0", "fz/a1", "fz/a2", "fz/b0")


def pattern_byte(name, i):
    """The byte every taken write puts at offset `i` of canary `name` (never
    0 and never 0xEE, the refused frames' filler)."""
    salt = sum(name.encode())
    return 1 + (i * 7 + salt) % 200


def pattern(name, offset, n):
    return bytes(pattern_byte(name, i) for i in range(offset, offset + n))


def write_fits(offset, nbytes, notice, size):
    """wire.h's CheckWriteBounds, in exact integer arithmetic."""
    return (offset + nbytes <= size and notice % 8 == 0 and notice + 8 <= size)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("protocol_fuzz"))
    endpoint = wire_client.LiveEndpoint(
        workdir, make_cluster(4), PLAN, SECRET, READER, LEGIT_WRITER, "legit",
        once_keys=["quiet"], timeout_s=20)
    try:
        endpoint.legit_transfer(2, timeout=90)
        yield endpoint
    finally:
        endpoint.stop()


class Identity:
    """One fuzzing writer task: its connection (re-made after each close)
    and the region ids that connection was given."""

    def __init__(self, live, task):
        self.live, self.task = live, task
        self.incarnation = os.urandom(8).hex()
        self.peer = None
        self.ids = {}  # canary name -> region id on the current connection
        self.reconnects = 0

    def own(self):
        return [n for n, (owner, _) in CANARIES.items() if owner == self.task]

    def connection(self):
        if self.peer is None:
            self.peer = self.live.peer(incarnation=self.incarnation).connect_as(self.task)
            self.reconnects += 1
            for name in self.own():
                code, reply = self.peer.open_fields(self.open_fields(name))
                assert code == 0, (self.task, name, reply)
                self.ids[name] = int(reply["id"])
        return self.peer

    def open_fields(self, name, **extra):
        fields = dict(name=name, size=CANARIES[name][1], plan_hash="f" * 64,
                      credit_id=1, credit_size=4096, credit_shm="")
        fields.update(extra)
        return fields

    def sync(self):
        """A round trip: every frame sent before it has been handled."""
        code, reply = self.connection().open_fields(self.open_fields(self.own()[0]))
        assert code == 0, reply

    def drop(self):
        if self.peer is not None:
            self.peer.close()
            self.peer = None


class Fuzzer:
    """Generates, sends and checks the frames; keeps the canaries' model."""

    def __init__(self, live, rng):
        self.live, self.rng = live, rng
        self.a = Identity(live, "/job:worker/task:2")
        self.b = Identity(live, "/job:worker/task:3")
        self.written = {n: bytearray(CANARIES[n][1]) for n in CANARIES}  # complete
        self.maybe = {n: bytearray(CANARIES[n][1]) for n in CANARIES}  # cut short
        self.counts = {}
        self.recent = []
        self.new_names = [f"fz/new{k}" for k in range(24)]
        fs = os.statvfs("/dev/shm")
        self.too_big = (2 * fs.f_blocks * fs.f_frsize // 4096 + 1) * 4096

    # -- helpers

    def note(self, kind, what):
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.recent = (self.recent + [f"{kind}: {what}"])[-12:]

    def expect_closed(self, who, data):
        """Sends a frame the endpoint must refuse; it must close the connection."""
        who.sync()  # what came before was taken (else this fails, not later)
        who.peer.send_quietly(data)
        assert closed_within(who.peer.sock, 10), (
            f"the endpoint kept a connection open after a frame it must refuse\n"
            + "\n".join(self.recent))
        who.drop()

    def pick_target(self):
        name = self.rng.choice(TARGETS)
        who = self.b if name == "fz/b0" else self.a
        return who, name, CANARIES[name][1]

    def taken_write(self, who, name, offset, n, notice, cut=None):
        """A WRITE inside the region: the pattern, also in the notice word."""
        peer = who.connection()
        seq = int.from_bytes(pattern(name, notice, 8), "little")
        frame = peer.write_frame(who.ids[name], offset, pattern(name, offset, n),
                                 notice, seq)
        if cut is None:
            peer.sock.sendall(frame)
            self.written[name][offset:offset + n] = b"\1" * n
            self.written[name][notice:notice + 8] = b"\1" * 8
        else:  # the body stops `cut` bytes short; the fuzzer hangs up
            peer.send_quietly(frame[:len(frame) - cut])
            self.maybe[name][offset:offset + n] = b"\1" * n
            who.drop()

    # -- frame kinds

    def write_inside(self):
        who, name, size = self.pick_target()
        n = self.rng.choice([0, 1, 7, 8, 64, self.rng.randrange(size - NOTICE_ZONE + 1)])
        offset = self.rng.randrange(size - NOTICE_ZONE - n + 1)
        notice = size - NOTICE_ZONE + 8 * self.rng.randrange(NOTICE_ZONE // 8)
        self.note("write_inside", (name, offset, n, notice))
        self.taken_write(who, name, offset, n, notice)

    def write_at_bounds(self):
        who, name, size = self.pick_target()
        r = self.rng
        offset = r.choice([0, size - NOTICE_ZONE - 1, size - 8, size - 1, size,
                           size + 1, 2**32, 2**63, U64 - 1, U64 - 8, U64 - size,
                           r.randrange(U64)])
        n = r.choice([0, 1, 8, 64, max(0, size - offset), size - offset + 1,
                      (U64 - offset) % U64, (U64 - offset + 1) % U64, U64 - 1,
                      2**63, 2**32 + 64]) % U64
        notice = r.choice([size - 8, size - 7, size - 4, size, size + 8,
                           U64 - 8, U64 - 1, 2**63, size - NOTICE_ZONE])
        fits = write_fits(offset, n, notice, size)
        self.note("write_at_bounds", (name, offset, n, notice, fits))
        if fits:  # the pattern, wherever in the region it lands
            self.taken_write(who, name, offset, n, notice)
        else:
            frame = who.connection().write_frame(
                who.ids[name], offset, b"\xee" * min(n, 64), notice,
                0xEEEEEEEEEEEEEEEE, nbytes=n)
            self.expect_closed(who, frame)

    def write_wrong_region(self):
        who = self.rng.choice([self.a, self.b])
        other = self.b if who is self.a else self.a
        peer = who.connection()
        other.connection()
        quiet_id = self.live.regions[PLAN.slot("quiet").region][0]
        own = self.rng.choice(list(who.ids.values()))
        region_id = self.rng.choice([
            own + 2**32, own + 2**33, own | (1 << 63), U64 - 1, 2**32 - 1,
            quiet_id, quiet_id + 2**32, self.rng.choice(list(other.ids.values())),
            self.rng.randrange(2**32, U64), self.rng.randrange(1000, 2**32 - 1)])
        self.note("write_wrong_region", (who.task, region_id))
        assert region_id not in who.ids.values()
        frame = peer.write_frame(region_id, 0, b"\xee" * 64, 0, 0xEEEEEEEEEEEEEEEE)
        self.expect_closed(who, frame)

    def write_cut_short(self):
        who, name, size = self.pick_target()
        n = self.rng.randrange(1, size - NOTICE_ZONE + 1)
        offset = self.rng.randrange(size - NOTICE_ZONE - n + 1)
        cut = self.rng.randrange(1, n + 1)
        self.note("write_cut_short", (name, offset, n, cut))
        who.sync()
        self.taken_write(who, name, offset, n, size - 8, cut=cut)

    def header_cut_short(self):
        who = self.rng.choice([self.a, self.b])
        who.sync()
        data = header(self.rng.choice([WRITE, OPEN_REQUEST]), a=1, b=64, c=64)
        data = data[:self.rng.randrange(1, HEADER.size)]
        self.note("header_cut_short", len(data))
        who.peer.send_quietly(data)
        who.drop()

    def open_mutated(self):
        r = self.rng
        who = r.choice([self.a, self.b])
        peer = who.connection()
        # No size between 8 KiB and twice /dev/shm's size: the endpoint would
        # reserve it (a peer with the secret can have it fill /dev/shm).
        numbers = [str(v) for v in (0, 1, 4095, 4096, 8192, 2**32 - 1,
                                    2**63, U64 - 4096, U64 - 1, U64, U64 + 4096,
                                    self.too_big)]
        numbers += ["", "-1", "+4096", "04096", "4096 ", " 4096", "1e4", "0x1000",
                    "4096\x00", "9" * 25]
        name = r.choice(self.new_names + [
            "n" * MAX_NAME, "n" * (MAX_NAME + 1), "",
            f"p/{who.task}->{READER}", f"p/{READER}->{who.task}",
            f"p/{LEGIT_WRITER}->{READER}", PLAN.slot("legit").region,
            f"coll:x:{LEGIT_WRITER}>{READER}", "\x1b[2J\x07\x7f\xff"])
        fields = dict(name=name, size=r.choice(numbers), plan_hash=r.choice(
                          ["f" * 64, "", "\x01" * 70, "h" * 5000]),
                      credit_id=r.choice(numbers), credit_size=r.choice(numbers),
                      credit_shm=r.choice(["", "/nonexistent", "x" * 300]))
        for key in r.sample(sorted(fields), r.randrange(3)):
            del fields[key]
        if r.random() < 0.2:
            fields["junk" + str(r.randrange(10))] = "=" * r.randrange(100)
        body = encode_fields(fields)
        size_choice = r.random()
        if size_choice < 0.1:
            body = body + b"z=" + b"z" * (MAX_BODY - len(body) - 3) + b"\n"  # at the bound
        elif size_choice < 0.2:
            body = body + b"z=" + b"z" * (MAX_BODY - len(body) - 2) + b"\n"  # one over
        elif size_choice < 0.3:
            body = bytes(r.randrange(256) for _ in range(r.randrange(200)))
        self.note("open_mutated", (len(body), {k: str(v)[:30] for k, v in fields.items()}))
        request = peer.next_request
        peer.next_request += 1
        frame = header(OPEN_REQUEST, a=request, b=len(body)) + body
        if len(body) > MAX_BODY:
            self.expect_closed(who, frame)
            return
        peer.sock.sendall(frame)
        code, reply = peer.read_reply(request)
        if code == 0:
            # Only a page-multiple size that /dev/shm can hold, in canonical
            # form, gives a region, of that size.
            assert fields.get("size") in ("4096", "8192"), (fields, reply)
            assert int(reply["size"]) == int(fields["size"]), (fields, reply)

    def control_frame(self):
        r = self.rng
        who = r.choice([self.a, self.b])
        peer = who.connection()
        body = b"shm=/x\nsize=4096\nid=0\n"
        kind = r.randrange(5)
        if kind == 0:
            data = header(OPEN_REPLY, a=r.randrange(U64), b=len(body)) + body
        elif kind == 1:
            data = header(ERROR, b=len(body)) + body
        elif kind == 2:
            # Unknown types, and a QUERY_REPLY to no question.
            data = header(r.choice([0, QUERY_REPLY, 7, 255, 65535]), a=1, b=0)
        elif kind == 3:
            data = header(WRITE, magic=r.choice([0, MAGIC ^ 1, 0xFFFFFFFF]))
        else:
            data = bytes(r.randrange(256) for _ in range(HEADER.size))
            if data[:4] == MAGIC.to_bytes(4, "little"):
                data = b"\0" + data[1:]
        self.note("control_frame", (kind, data[:8].hex()))
        del peer
        self.expect_closed(who, data)

    def query_frame(self):
        """A QUERY with junk fields or a junk body: answered (an error for
        what the endpoint does not know), and the connection goes on."""
        r = self.rng
        who = r.choice([self.a, self.b])
        peer = who.connection()
        kind = r.randrange(3)
        if kind == 0:
            fields = {"what": r.choice(["clock", "position", "", "what?" * 50]),
                      "slot": "x" * r.randrange(300), "side": r.choice(["send", "recv", ""]),
                      "tensor": str(r.randrange(U64))}
            frame, request = peer.request_frame(fields, type_=QUERY)
        else:
            body = (bytes(r.randrange(256) for _ in range(r.randrange(2000))) if kind == 1
                    else b"what=clock\n" * r.randrange(1, 5000))
            request = peer.next_request
            peer.next_request += 1
            frame = header(QUERY, a=request, b=len(body)) + body
        self.note("query_frame", (kind, len(frame)))
        peer.sock.sendall(frame)
        code, _ = peer.read_reply(request, QUERY_REPLY)
        assert code in (0, INVALID_ARGUMENT), code
        who.sync()

    def answer_query_wrongly(self):
        """The endpoint's own question answered with a frame of another
        type or another request's id: that connection closes, and the
        question ends at once with an error for that peer."""
        r = self.rng
        self.b.drop()  # the endpoint asks `a` (and the legitimate writer)
        peer = self.a.connection()
        asked = self.live.ask_clock_offsets()
        (magic, type_, _, request, _, _, _, _), _ = peer.read_frame()
        assert (magic, type_) == (MAGIC, QUERY), (magic, type_)
        body = b"received_ns=1\nsent_ns=2\n"
        kind = r.randrange(4)
        if kind == 0:
            data = header(OPEN_REPLY, a=request, b=len(body)) + body
        elif kind == 1:
            data = header(QUERY_REPLY, a=request ^ (1 << r.randrange(64)), b=len(body)) + body
        elif kind == 2:
            data = header(ERROR, b=len(body)) + body
        else:
            data = header(r.choice([0, 7, 255, 65535]), a=request, b=0)
        self.note("answer_query_wrongly", (kind, data[:8].hex()))
        peer.send_quietly(data)
        assert closed_within(peer.sock, 10), "the endpoint took a wrong answer"
        self.a.drop()
        answer = self.live.clock_offsets(asked)
        assert answer["elapsed_s"] < 5, answer
        assert "error" in answer["offsets"]["peers"][self.a.task], answer

    KINDS = [("write_inside", 25), ("write_at_bounds", 20), ("write_wrong_region", 10),
             ("write_cut_short", 5), ("header_cut_short", 3), ("open_mutated", 22),
             ("control_frame", 15), ("query_frame", 5), ("answer_query_wrongly", 2)]

    def step(self):
        names, weights = zip(*self.KINDS)
        getattr(self, self.rng.choices(names, weights)[0])()

    # -- the verdict

    def check_canaries(self):
        for name, (_, size) in CANARIES.items():
            who = self.b if CANARIES[name][0] == self.b.task else self.a
            who.connection()
            code, reply = who.peer.open_fields(who.open_fields(name))
            assert code == 0, reply
            data = self.live.segment(reply["shm"], size)
            written, maybe = self.written[name], self.maybe[name]
            bad = []
            for i, byte in enumerate(data):
                want = pattern_byte(name, i)
                if written[i]:
                    ok = byte == want
                elif maybe[i]:
                    ok = byte in (0, want)
                else:
                    ok = byte == 0
                if not ok:
                    bad.append((i, byte))
            assert not bad, (f"canary {name}: {len(bad)} bytes wrong, first "
                             f"(offset, byte) {bad[:8]}")


def test_fuzzed_frames_change_nothing_outside_their_bounds(live):
    """N_FRAMES seeded mutated frames, a legitimate batch every LEGIT_EVERY:
    the endpoint lives, each frame is taken or refused as the bounds say,
    the canaries hold exactly what was legitimately written, the region
    never given stays zero, and every legitimate tensor is exact."""
    rng = random.Random(SEED)
    fuzzer = Fuzzer(live, rng)
    fuzzer.a.connection()
    fuzzer.b.connection()
    t0 = time.monotonic()
    batches = []
    for i in range(N_FRAMES):
        if i % LEGIT_EVERY == 0:
            batches.append(live.start_batch(3))
        try:
            fuzzer.step()
        except (AssertionError, OSError, EOFError) as e:
            raise AssertionError(f"frame {i}: {e!r}\nlast frames:\n" +
                                 "\n".join(fuzzer.recent)) from e
        if i % 200 == 0:
            live.endpoint.assert_alive()
    fuzzer.a.sync()
    fuzzer.b.sync()
    fuzz_s = time.monotonic() - t0
    live.assert_alive()
    for batch in batches:
        assert live.finish_batch(batch, timeout=60) < 10
    fuzzer.check_canaries()
    _, shm, size = live.regions[PLAN.slot("quiet").region]
    quiet = wire_client.without_sleepers(live.segment(shm, size),
                                         PLAN.slot("quiet"))
    assert quiet == bytes(size), "a region never given was written"
    assert live.legit_transfer(3) < 5
    connections = fuzzer.a.reconnects + fuzzer.b.reconnects
    print(f"fuzz: {N_FRAMES} frames in {fuzz_s:.1f} s, {connections} "
          f"connections; kinds {fuzzer.counts}")
    assert all(fuzzer.counts.get(k, 0) > 0 for k, _ in Fuzzer.KINDS), fuzzer.counts
