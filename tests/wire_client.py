"""A tf_rdma writer written from the wire format alone (socket, struct, hmac).

Tests that attack or fuzz an endpoint speak the protocol through `RawPeer`:
the handshake of kernels/engine/engine.cc ("Bootstrap handshake") and the
frames of kernels/engine/wire.h. It is written from those comments, not from
the C++ code, so that a test passing through it shows that the documented
protocol is the real one.
"""

import hashlib
import hmac
import os
import re
import socket
import struct

import pytest

VERSION = "TFRDMA/2"
MAGIC = 0x44524654
OPEN_REQUEST, OPEN_REPLY, WRITE, ERROR = 1, 2, 3, 4
HEADER = struct.Struct("<IHH5Q")
assert HEADER.size == 48


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
    """

    def __init__(self, port, reader, secret, timeout=10.0):
        self.reader, self.secret, self.timeout = reader, secret, timeout
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.local_port = self.sock.getsockname()[1]
        self.buf = b""
        self.next_request = 1
        self.incarnation = os.urandom(8).hex()
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
                   transports="tcp", host="rawclient"):
        reader = self.reader if reader is None else reader
        secret = self.secret if secret is None else secret
        self.nonce_w = os.urandom(32).hex()
        fields = [writer, reader, host, transports, self.incarnation, self.nonce_w]
        p = proof(secret, "|".join(["hello", nonce_r] + fields))
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
        parts = answer.split(" ")
        assert len(parts) == 4 and parts[:2] == ["WELCOME", transport], answer
        expected = proof(self.secret, "|".join(
            ["welcome", self.nonce_w, self.nonce_r, writer, self.reader,
             transport, parts[2]]))
        assert hmac.compare_digest(parts[3], expected), (
            "the endpoint's WELCOME proof does not check out")
        self.peer_incarnation = parts[2]
        return self

    def request_frame(self, fields, request=None):
        """An OPEN_REQUEST frame for `fields`; returns (bytes, request id)."""
        body = encode_fields(fields)
        if request is None:
            request = self.next_request
            self.next_request += 1
        return header(OPEN_REQUEST, a=request, b=len(body)) + body, request

    def read_reply(self, request):
        """Reads one OPEN_REPLY; returns (status code, fields or error text)."""
        magic, type_, _, a, b, c, _, _ = HEADER.unpack(self.read_exact(HEADER.size))
        assert (magic, type_, a) == (MAGIC, OPEN_REPLY, request), (magic, type_, a)
        body = self.read_exact(b).decode()
        return (c, body) if c != 0 else (c, decode_fields(body))

    def open_fields(self, fields):
        """Sends an OPEN_REQUEST and waits for its reply (see read_reply)."""
        frame, request = self.request_frame(fields)
        self.sock.sendall(frame)
        return self.read_reply(request)

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
