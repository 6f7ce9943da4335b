"""A tf_rdma writer written from the wire format alone (socket, struct, hmac).

Tests that attack or fuzz an endpoint speak the protocol through `RawPeer`:
the handshake of kernels/engine/handshake.cc and the frames of
kernels/common/wire.h. It is written from those comments, not from the C++
code, so that a test passing through it shows that the documented protocol is
the real one.
"""

import hashlib
import hmac
import os
import re
import socket
import struct

import pytest

VERSION = "TFRDMA/3"
MAGIC = 0x44524654
OPEN_REQUEST, OPEN_REPLY, WRITE, ERROR, QUERY, QUERY_REPLY = 1, 2, 3, 4, 5, 6
HEADER = struct.Struct("<IHH5Q")
assert HEADER.size == 48


def without_sleepers(data, slot, most=8):
    """A region's bytes with the reader's own counts of sleepers zeroed.

    A reader waiting on a copy of `slot` counts itself in that copy's header
    (plan.SLEEPERS_OFFSET, kernels/common/wait.h): its own bytes, which no
    peer writes. Checks that each count is small (at most `most`) and returns
    a copy with them zeroed, so that "nothing was written" can be asserted
    on the rest.
    """
    from tf_rdma.graph_passes import plan as plan_lib

    out = bytearray(data)
    for c in range(slot.depth):
        at = slot.offset + c * slot.stride + plan_lib.SLEEPERS_OFFSET
        count = int.from_bytes(out[at:at + 4], "little")
        assert count <= most, f"copy {c} of {slot.key}: {count} sleepers"
        out[at:at + 4] = bytes(4)
    return bytes(out)


def proof(secret, message):
    return hmac.new(secret.encode(), message.encode(), hashlib.sha256).hexdigest()


def header(type_, a=0, b=0, c=0, d=0, e=0, magic=MAGIC, flags=0):
    return HEADER.pack(magic, type_, flags, a, b, c, d, e)


def encode_fields(fields):
    return "".join(f"{k}={v}\n" for k, v in sorted(fields.items())).encode()


def decode_fields(body):
    return dict(line.split("=", 1) for line in body.splitlines() if "=" in line)


class RawPeer:
    """A writer that speaks the tf_rdma wire protocol from Python.

    Args:
        port: The endpoint's port on 127.0.0.1.
        reader: The endpoint's task.
        secret: The job secret used for proofs unless a call overrides it.
        timeout: Socket timeout in seconds for every read.
        source: Local address to connect from (127.0.0.2, ...: another
            source address on the loopback), or None for the default.
        incarnation: The writer process's incarnation id; peers that stand
            for one process across reconnects pass the same one (a new one
            tells the endpoint that the writer restarted).
        rcvbuf: SO_RCVBUF to set before connecting (a small one makes the
            endpoint's replies back up quickly), or None.
    """

    def __init__(self, port, reader, secret, timeout=10.0, source=None,
                 incarnation=None, rcvbuf=None):
        self.reader, self.secret, self.timeout = reader, secret, timeout
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            if rcvbuf is not None:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            if source is not None:
                self.sock.bind((source, 0))
            self.sock.settimeout(timeout)
            self.sock.connect(("127.0.0.1", port))
        except BaseException:
            self.sock.close()
            raise
        self.local_port = self.sock.getsockname()[1]
        self.buf = b""
        self.next_request = 1
        self.incarnation = incarnation or os.urandom(8).hex()
        self.nonce_r = self.nonce_w = None

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _fill(self):
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("connection closed by the endpoint")
        self.buf += chunk

    def read_line(self):
        while b"\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()

    def read_exact(self, n):
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def challenge(self):
        line = self.read_line()
        parts = line.split(" ")
        assert len(parts) == 3 and parts[:2] == [VERSION, "CHALLENGE"], line
        assert re.fullmatch(r"[0-9a-f]{64}", parts[2]), line
        self.nonce_r = parts[2]
        return parts[2]

    def hello_line(self, nonce_r, writer, reader=None, secret=None,
                   transports="tcp", host="rawclient", sent_instead=None):
        """The HELLO line; `sent_instead` ({field index: text}) replaces
        fields of the line after the proof was computed over the originals
        (0 writer, 1 reader, 2 host, 3 transports, 4 incarnation, 5 nonce)."""
        reader = self.reader if reader is None else reader
        secret = self.secret if secret is None else secret
        self.nonce_w = os.urandom(32).hex()
        fields = [writer, reader, host, transports, self.incarnation, self.nonce_w]
        p = proof(secret, "|".join(["hello", nonce_r] + fields))
        for index, text in (sent_instead or {}).items():
            fields[index] = text
        return ("HELLO " + " ".join(fields + [p]) + "\n").encode()

    def handshake(self, writer, reader=None, secret=None, then=b"", **hello):
        """Challenge, HELLO (+ `then`, pipelined); returns the answer line."""
        nonce_r = self.challenge()
        self.sock.sendall(self.hello_line(nonce_r, writer, reader, secret, **hello)
                          + then)
        return self.read_line()

    def connect_as(self, writer, transport="tcp"):
        """A full, correct handshake; checks the endpoint's proof too."""
        answer = self.handshake(writer)
        if not answer.startswith("WELCOME "):
            raise ConnectionRefusedError(f"{writer} was refused: {answer}")
        parts = answer.split(" ")
        assert len(parts) == 4 and parts[:2] == ["WELCOME", transport], answer
        expected = proof(self.secret, "|".join(
            ["welcome", self.nonce_w, self.nonce_r, writer, self.reader,
             transport, parts[2]]))
        assert hmac.compare_digest(parts[3], expected), (
            "the endpoint's WELCOME proof does not check out")
        self.peer_incarnation = parts[2]
        return self

    def request_frame(self, fields, request=None, type_=OPEN_REQUEST):
        """An OPEN_REQUEST (or QUERY) frame for `fields`; returns (bytes,
        request id)."""
        body = encode_fields(fields)
        if request is None:
            request = self.next_request
            self.next_request += 1
        return header(type_, a=request, b=len(body)) + body, request

    def read_frame(self):
        """Reads one frame; returns (header fields, body bytes)."""
        fields = HEADER.unpack(self.read_exact(HEADER.size))
        return fields, self.read_exact(fields[4])

    def read_reply(self, request, type_=OPEN_REPLY):
        """Reads one OPEN_REPLY (or QUERY_REPLY); returns (status code, fields
        or error text).

        The endpoint may ask this client questions meanwhile (QUERY frames:
        the stall inspector asks a writer it waits for where it is); each
        is refused with an error reply, as a peer that knows no questions
        would, and reading goes on.
        """
        while True:
            magic, type_got, _, a, b, c, _, _ = HEADER.unpack(
                self.read_exact(HEADER.size))
            if (magic, type_got) != (MAGIC, QUERY):
                break
            self.read_exact(b)
            why = b"this raw test client answers no questions"
            self.sock.sendall(header(QUERY_REPLY, a=a, b=len(why), c=1) + why)
        assert (magic, type_got, a) == (MAGIC, type_, request), (magic, type_got, a)
        body = self.read_exact(b).decode(errors="replace")
        return (c, body) if c != 0 else (c, decode_fields(body))

    def open_fields(self, fields):
        """Sends an OPEN_REQUEST and waits for its reply (see read_reply)."""
        frame, request = self.request_frame(fields)
        self.sock.sendall(frame)
        return self.read_reply(request)

    def query(self, fields):
        """Sends a QUERY and waits for its reply (see read_reply)."""
        frame, request = self.request_frame(fields, type_=QUERY)
        self.sock.sendall(frame)
        return self.read_reply(request, QUERY_REPLY)

    def write_frame(self, region_id, offset, payload, notice, seq, nbytes=None):
        n = len(payload) if nbytes is None else nbytes
        return header(WRITE, a=region_id, b=offset, c=n, d=notice, e=seq) + payload

    def send_quietly(self, data):
        """Sends; a peer that already closed is fine (that is the point)."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def assert_closed_by_endpoint(self):
        """The endpoint must close the connection (EOF or reset), not hang."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                self.buf += chunk
        except ConnectionResetError:
            return
        except socket.timeout:
            pytest.fail(f"the endpoint kept the connection open for "
                        f"{self.timeout} s after it should have closed it")


# --------------------------------------------------------------------------- a live endpoint
#
# Tests that attack an endpoint from outside need it in a process of its own
# (its fds, threads, cgroup and /dev/shm segments are what they measure), and
# a real tf_rdma writer beside it whose transfers must keep working.

# The endpoint under attack (PRELUDE first): receives every key of TEST_ONCE
# once and every key of TEST_LOOP over and over, reporting each tensor as a
# RESULT line; answers "info.<n>" files in TEST_SYNC_DIR with its
# endpoint_info() and "offsets.<n>" files with its clock offsets (which ask
# every connected peer, QUERY frames, on a thread of their own); stops when
# TEST_STOP_FILE appears.
ENDPOINT_PROGRAM = """
import ctypes
import threading
from tf_rdma import _loader
plan = tf_rdma.Plan.from_json(os.environ["TEST_PLAN"])
ep = start()
once = json.loads(os.environ["TEST_ONCE"])
loop = json.loads(os.environ["TEST_LOOP"])
recv_timeout = float(os.environ["TEST_RECV_TIMEOUT"])
lock = threading.Lock()

def emit(obj):
    with lock:
        sys.stdout.write("RESULT " + json.dumps(obj) + "\\n")
        sys.stdout.flush()

def receive(key, repeat):
    step = 0
    while True:
        step += 1
        try:
            t = tf_rdma.ops.recv(plan, key, timeout=recv_timeout)
            out = {"values": t.numpy().tolist()}
            del t  # the slot goes back to the writer as a credit
        except Exception as e:  # reported to the test, which decides
            emit({"kind": "recv", "key": key, "step": step,
                  "error": type(e).__name__, "message": str(e)})
            return
        emit(dict(kind="recv", key=key, step=step, at=time.monotonic(), **out))
        if not repeat:
            return

def clock_offsets(n):
    buf = ctypes.create_string_buffer(1 << 16)
    t0 = time.monotonic()
    _loader.load().c.tfrdma_clock_offsets(2, 3000, buf, len(buf))
    emit({"kind": "offsets", "n": n, "elapsed_s": time.monotonic() - t0,
          "offsets": json.loads(buf.value.decode())})

for k in once + loop:
    threading.Thread(target=receive, args=(k, k in loop), daemon=True).start()
deadline = time.monotonic() + 90
want = len({plan.slot(k).region for k in once + loop})
while len(tf_rdma.endpoint_info()["region"]) < want:
    if time.monotonic() > deadline:
        emit({"kind": "error", "info": tf_rdma.endpoint_info()})
        sys.exit(3)
    time.sleep(0.01)
info = tf_rdma.endpoint_info()
emit({"kind": "ready", "port": ep.port, "pid": os.getpid(),
      "transport": info["transport"], "regions": info["region"]})
stop = os.environ["TEST_STOP_FILE"]
answered = asked = 0
while not os.path.exists(stop):
    if os.path.exists(os.path.join(SYNC_DIR, "info.%d" % (answered + 1))):
        answered += 1
        emit({"kind": "info", "n": answered, "info": tf_rdma.endpoint_info()})
    if os.path.exists(os.path.join(SYNC_DIR, "offsets.%d" % (asked + 1))):
        asked += 1
        threading.Thread(target=clock_offsets, args=(asked,), daemon=True).start()
    time.sleep(0.02)
ep.close()
sys.stderr.flush()
os._exit(0)
"""

# A legitimate tf_rdma writer (PRELUDE first): on each "batch.<n>" file in
# TEST_SYNC_DIR (its text: how many tensors), sends that many float32[16]
# tensors of TEST_KEY, step s carrying legit_values(s), and reports the
# batch's time (or the error).
WRITER_PROGRAM = """
plan = tf_rdma.Plan.from_json(os.environ["TEST_PLAN"])
key = os.environ["TEST_KEY"]
send_timeout = float(os.environ["TEST_SEND_TIMEOUT"])
ep = start()
result({"kind": "ready", "pid": os.getpid()})
stop = os.environ["TEST_STOP_FILE"]
step = batch = 0
while not os.path.exists(stop):
    path = os.path.join(SYNC_DIR, "batch.%d" % (batch + 1))
    if not os.path.exists(path):
        time.sleep(0.02)
        continue
    batch += 1
    with open(path) as f:
        count = int(f.read())
    t0 = time.monotonic()
    report = {"kind": "sent", "batch": batch, "first_step": step + 1}
    try:
        for _ in range(count):
            step += 1
            values = np.arange(16, dtype=np.float32) + np.float32(100 * step)
            tf_rdma.ops.send(tf.constant(values), plan, key, timeout=send_timeout)
    except Exception as e:  # reported to the test, which decides
        report.update(error=type(e).__name__, message=str(e))
    report["elapsed_s"] = time.monotonic() - t0
    result(report)
ep.close()
os._exit(0)
"""


def legit_values(step):
    """The float32[16] values the legitimate writer sends at `step`."""
    return [float(v) for v in range(100 * step, 100 * step + 16)]


class TaskProcess:
    """A PRELUDE program in its own process group; output goes to files.

    Args:
        workdir: Directory for the output files and sync files.
        name: Short name for those files.
        program: The program, run after conftest's PRELUDE.
        env: The full environment (TEST_TASK, TEST_CLUSTER, ... included).
        nofile: RLIMIT_NOFILE (soft and hard) for the process, or None.
    """

    def __init__(self, workdir, name, program, env, nofile=None):
        import resource
        import subprocess
        import sys
        import textwrap

        from conftest import PRELUDE

        self.workdir, self.name = workdir, name
        self.stdout_path = os.path.join(workdir, name + ".out")
        self.stderr_path = os.path.join(workdir, name + ".err")

        def limit():
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        code = PRELUDE + textwrap.dedent(program)
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code], env=env,
                                         stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL,
                                         preexec_fn=limit,
                                         start_new_session=True)
        self.pid = self.proc.pid

    def stdout(self):
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stderr(self):
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def stderr_bytes(self):
        with open(self.stderr_path, "rb") as f:
            return f.read()

    def results(self):
        import json

        # Complete lines only: the process may be writing the last one.
        text = self.stdout()
        text = text[:text.rfind("\n") + 1]
        return [json.loads(line[len("RESULT "):])
                for line in text.splitlines()
                if line.startswith("RESULT ")]

    def describe(self):
        return (f"--- {self.name} pid {self.pid}, exit {self.proc.poll()}\n"
                f"stdout (tail):\n{self.stdout()[-2000:]}\n"
                f"stderr (tail):\n{self.stderr()[-4000:]}")

    def wait_result(self, pred, timeout):
        """The first RESULT for which `pred` is true; fails after `timeout` s."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            for r in self.results():
                if pred(r):
                    return r
            if self.proc.poll() is not None:
                for r in self.results():
                    if pred(r):
                        return r
                pytest.fail(f"{self.name} exited early\n" + self.describe())
            if time.monotonic() > deadline:
                pytest.fail(f"{self.name} printed no matching RESULT within "
                            f"{timeout} s\n" + self.describe())
            time.sleep(0.05)

    def assert_alive(self):
        assert self.proc.poll() is None, f"{self.name} died\n" + self.describe()

    def stop(self, stop_file):
        import subprocess

        with open(stop_file, "w"):
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.pid, 9)
            except ProcessLookupError:
                pass
            self.proc.wait()
        for name in os.listdir("/dev/shm"):  # a killed process leaves these
            if name.startswith(f"tfrdma.{self.pid}."):
                try:
                    os.unlink("/dev/shm/" + name)
                except FileNotFoundError:
                    pass


class LiveEndpoint:
    """A tcp endpoint under attack plus a legitimate writer sending to it.

    The endpoint (task `reader`) receives `loop_key` from the writer (task
    `writer`) over and over and every key of `once_keys` once; the test
    process is everyone else: raw peers that speak the wire protocol.

    Args:
        workdir: Directory for output and sync files.
        cluster: The cluster ({"worker": [...]}).
        plan: The tf_rdma Plan both processes run.
        secret: The job secret.
        reader, writer: The endpoint's task and the legitimate writer's.
        loop_key: The writer's key.
        once_keys: Keys the endpoint receives once (from raw peers).
        timeout_s: TF_RDMA_TIMEOUT of both processes.
        nofile: The endpoint's RLIMIT_NOFILE, or None.
    """

    def __init__(self, workdir, cluster, plan, secret, reader, writer, loop_key,
                 once_keys=(), timeout_s=20, nofile=None):
        import json

        from conftest import base_env

        self.plan, self.secret, self.reader, self.writer_task = (
            plan, secret, reader, writer)
        self.loop_key = loop_key
        self.sync_dir = workdir
        self.stop_file = os.path.join(workdir, "stop")
        self.batches = self.infos = self.offsets_asked = 0
        self.steps_sent = 0

        def env(task, extra):
            e = base_env({
                "TF_RDMA_SECRET": secret,
                "TF_RDMA_TRANSPORT": "tcp",
                "TF_RDMA_TIMEOUT": str(timeout_s),
                "TEST_TASK": task,
                "TEST_CLUSTER": json.dumps(cluster),
                "TEST_PLAN": plan.to_json(),
                "TEST_SYNC_DIR": workdir,
                "TEST_STOP_FILE": self.stop_file,
            })
            e.update(extra)
            return e

        self.endpoint = TaskProcess(workdir, "endpoint", ENDPOINT_PROGRAM, env(
            reader, {"TEST_ONCE": json.dumps(list(once_keys)),
                     "TEST_LOOP": json.dumps([loop_key]),
                     "TEST_RECV_TIMEOUT": "600"}), nofile=nofile)
        self.writer = TaskProcess(workdir, "writer", WRITER_PROGRAM, env(
            writer, {"TEST_KEY": loop_key,
                     "TEST_SEND_TIMEOUT": str(timeout_s)}))
        try:
            ready = self.endpoint.wait_result(
                lambda r: r["kind"] in ("ready", "error"), 120)
            assert ready["kind"] == "ready", self.endpoint.describe()
            assert ready["transport"] == "tcp"
            self.port, self.pid = int(ready["port"]), int(ready["pid"])
            assert self.pid == self.endpoint.pid
            # "name segment bytes" in region id order.
            self.regions = {}
            for i, line in enumerate(ready["regions"]):
                name, shm, size = line.rsplit(" ", 2)
                self.regions[name] = (i, shm, int(size))
            self.writer.wait_result(lambda r: r["kind"] == "ready", 120)
        except BaseException:
            self.stop()
            raise

    def stop(self):
        self.writer.stop(self.stop_file)
        self.endpoint.stop(self.stop_file)

    def describe(self):
        return self.endpoint.describe() + "\n" + self.writer.describe()

    def assert_alive(self):
        self.endpoint.assert_alive()
        self.writer.assert_alive()

    # -- the legitimate writer

    def start_batch(self, count):
        """Asks the legitimate writer to send `count` tensors; returns the batch."""
        self.batches += 1
        path = os.path.join(self.sync_dir, f"batch.{self.batches}")
        with open(path + ".tmp", "w") as f:
            f.write(str(count))
        os.rename(path + ".tmp", path)
        first = self.steps_sent + 1
        self.steps_sent += count
        return self.batches, first, count

    def finish_batch(self, batch, timeout=60):
        """Waits for a batch; checks every value; returns the writer's seconds."""
        number, first, count = batch
        sent = self.writer.wait_result(
            lambda r: r["kind"] == "sent" and r["batch"] == number, timeout)
        assert "error" not in sent, f"legitimate send failed: {sent}\n" + self.describe()
        assert sent["first_step"] == first, sent
        for step in range(first, first + count):
            got = self.endpoint.wait_result(
                lambda r: r["kind"] == "recv" and r["key"] == self.loop_key and
                r["step"] == step, timeout)
            assert "error" not in got, got
            assert got["values"] == legit_values(step), (step, got["values"])
        return sent["elapsed_s"]

    def legit_transfer(self, count=3, timeout=60):
        """A batch of the legitimate writer, start to finish; returns seconds."""
        return self.finish_batch(self.start_batch(count), timeout)

    # -- state of the endpoint process

    def info(self, timeout=20):
        """The endpoint's endpoint_info(), asked for through a sync file."""
        self.infos += 1
        n = self.infos
        with open(os.path.join(self.sync_dir, f"info.{n}"), "w"):
            pass
        return self.endpoint.wait_result(
            lambda r: r["kind"] == "info" and r["n"] == n, timeout)["info"]

    def ask_clock_offsets(self):
        """Makes the endpoint ask every connected peer for its clock (two
        QUERY frames each, 3 s apiece); returns a handle for `clock_offsets`."""
        self.offsets_asked += 1
        with open(os.path.join(self.sync_dir, f"offsets.{self.offsets_asked}"), "w"):
            pass
        return self.offsets_asked

    def clock_offsets(self, n, timeout=20):
        """The endpoint's answer to ask_clock_offsets `n`: {"elapsed_s",
        "offsets"}."""
        return self.endpoint.wait_result(
            lambda r: r["kind"] == "offsets" and r["n"] == n, timeout)

    def fds(self):
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def threads(self):
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def shm_bytes(self):
        """Bytes of the endpoint's segments in /dev/shm (their sizes)."""
        total = 0
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"tfrdma.{self.pid}."):
                try:
                    total += os.stat("/dev/shm/" + name).st_size
                except FileNotFoundError:
                    pass
        return total

    def segment(self, shm, size):
        """A copy of a segment's bytes (mapped read-only)."""
        import mmap

        with open("/dev/shm" + shm, "rb") as f:
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                return bytes(m)

    def peer(self, **kwargs):
        """A RawPeer aimed at this endpoint (not yet past the handshake)."""
        kwargs.setdefault("timeout", 10.0)
        return RawPeer(self.port, self.reader, self.secret, **kwargs)


def idle_connection(port, source=None, timeout=5.0):
    """A plain TCP connection to the endpoint that sends nothing."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    if source is not None:
        sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def first_bytes_or_close(sock, timeout):
    """What the endpoint does first: ("line", text), ("closed", None) or
    ("silent", None) when nothing happens within `timeout` s."""
    import select

    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        return "silent", None
    try:
        data = sock.recv(4096)
    except (ConnectionResetError, socket.timeout):
        return "closed", None
    if not data:
        return "closed", None
    return "line", data.decode(errors="replace")


def closed_within(sock, timeout):
    """True if the endpoint closes `sock` (EOF or reset) within `timeout` s
    (what arrives meanwhile is read and dropped)."""
    import select
    import time

    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([sock], [], [], left)
        if not ready:
            return False
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
