"""A raw loopback TCP socket moving the same chain of hops as bench/p2p.py.

What. Two processes joined by one TCP connection on 127.0.0.1, tuned as the
tcp transport tunes its sockets (TCP_NODELAY, 4 MiB send and receive
buffers: kernels/common/wire.cc TuneSocket). A chain of H hops moves `size`
bytes back and forth: each side receives the whole tensor into a buffer it
allocated once (``recv_into``) before it sends it on, as a hop of the
tf_rdma chain receives its slot before the next hop's send. The time per
hop is the chain's time divided by H.

Why. It is the ceiling of the tcp transport on the same machine: the kernel's
loopback copy in and out of the socket buffers, with nothing of tf_rdma or
TensorFlow around it. "tcp % socket" in p2p's tables says how much of that
the transport keeps (docs/benchmarks.md). The Python loop costs about a
microsecond per call of sendall/recv_into: noise from 64 KiB on, a visible
part of a 4 KiB hop (the socket line there is a ceiling with Python's
overhead in it, not a bare socket's).

Cost: one fork (the orchestrator has not imported TensorFlow) and 2 x size
bytes of buffers.
"""

import multiprocessing
import socket
import time

SOCKET_BUFFER = 4 << 20  # as TuneSocket


def _tune(sock):
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)


def _receive(sock, view):
    got, size = 0, len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("socket chain: the peer closed mid-hop")
        got += n


def _hop(sock, view, sends):
    if sends:
        sock.sendall(view)
    else:
        _receive(sock, view)


def _echo(port, size, hops, chains):
    """The other end: plays the odd hops of every chain (receives the even)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        _tune(sock)
        view = memoryview(bytearray(size))
        for _ in range(chains):
            for i in range(hops):
                _hop(sock, view, sends=i % 2 == 1)
            if hops % 2 == 1:  # the chain ended here: tell the timer
                sock.sendall(b"\1")


def measure_socket_chain(size, hops, runs, warmup=2):
    """Per-hop seconds of `runs` chains of `hops` transfers of `size` bytes.

    Raises:
      RuntimeError: The bytes that came back differ from those sent.
    """
    chains = warmup + runs
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        ctx = multiprocessing.get_context("fork")
        peer = ctx.Process(target=_echo, args=(port, size, hops, chains),
                           daemon=True)
        peer.start()
        try:
            server.settimeout(30)
            sock, _ = server.accept()
            with sock:
                sock.settimeout(120)
                _tune(sock)
                pattern = bytes(range(251)) * (size // 251 + 1)
                buf = bytearray(pattern[:size])
                view = memoryview(buf)
                times = []
                for r in range(chains):
                    t0 = time.perf_counter()
                    for i in range(hops):
                        _hop(sock, view, sends=i % 2 == 0)
                    if hops % 2 == 1:
                        _receive(sock, memoryview(bytearray(1)))
                    dt = time.perf_counter() - t0
                    if r >= warmup:
                        times.append(dt / hops)
                if hops % 2 == 0 and buf != pattern[:size]:
                    raise RuntimeError("socket chain: the bytes that came "
                                       "back differ from those sent")
        finally:
            peer.join(timeout=30)
            if peer.is_alive():
                peer.kill()
    return times
