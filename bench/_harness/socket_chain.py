"""A raw loopback TCP socket moving the same chain of hops as bench/p2p.py.

What. Two processes joined by one TCP connection on 127.0.0.1, tuned as the
tcp transport tunes its sockets (TCP_NODELAY, 4 MiB send and receive
buffers: kernels/common/wire.cc TuneSocket). A chain of H hops moves `size`
bytes back and forth: each side receives the whole tensor (``recv_into``)
before it sends it on, as a hop of the tf_rdma chain receives its slot
before the next hop's send. The time per hop is the chain's time divided by
H.

Where the bytes land. The tf_rdma chain's plan gives every hop a slot of its
own, with `depth` copies that successive calls take in turn, so a side
receives into ceil(H / 2) x depth distinct buffers. By default the socket
chain does the same (hop i of chain r lands in buffer (r mod depth, i // 2)
of the receiving side, allocated once), so that both move the same bytes
through as much memory. ``reuse_one_buffer=True`` receives every hop into
one buffer instead: the least memory a chain can touch. The two differ
where the working set and the last-level cache compare: on a VM with a
300 MiB L3, 64 MiB with H = 4 and depth 2 (256 MiB of receive buffers a
side against 64 MiB) took 18 to 23% longer a hop through the chain's
buffers (docs/benchmarks.md, "tcp against a raw socket").

Why. It is the ceiling of the tcp transport on the same machine: the kernel's
loopback copy in and out of the socket buffers, with nothing of tf_rdma or
TensorFlow around it. "tcp % socket" in p2p's tables says how much of that
the transport keeps (docs/benchmarks.md). The Python loop costs about a
microsecond per call of sendall/recv_into: noise from 64 KiB on, a visible
part of a 4 KiB hop (the socket line there is a ceiling with Python's
overhead in it, not a bare socket's).

Cost: one fork (the orchestrator has not imported TensorFlow) and
(ceil(H / 2) x depth + 1) x size bytes of buffers a side (2 x size with
``reuse_one_buffer``).
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


class Landing:
    """The buffers one side receives its hops into, allocated once: a
    buffer per hop it receives and per copy of the plan's `depth`, or a
    single one for every hop when `reuse_one_buffer`."""

    def __init__(self, size, receives, depth, reuse_one_buffer):
        self.reuse_one_buffer = reuse_one_buffer
        self.receives = receives
        self.depth = depth
        count = 1 if reuse_one_buffer else receives * depth
        self.views = [memoryview(bytearray(size)) for _ in range(count)]

    def buffer(self, chain, hop):
        """Where hop `hop` of chain `chain` lands on this side."""
        if self.reuse_one_buffer:
            return self.views[0]
        return self.views[(chain % self.depth) * self.receives + hop // 2]


def _echo(port, size, hops, chains, depth, reuse_one_buffer):
    """The other end: plays the odd hops of every chain (receives the even)."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        _tune(sock)
        landing = Landing(size, (hops + 1) // 2, depth,
                           reuse_one_buffer)
        for r in range(chains):
            for i in range(hops):
                if i % 2 == 1:
                    sock.sendall(view)
                else:
                    view = landing.buffer(r, i)
                    _receive(sock, view)
            if hops % 2 == 1:  # the chain ended here: tell the timer
                sock.sendall(b"\1")


def measure_socket_chain(size, hops, runs, warmup=2, depth=1,
                         reuse_one_buffer=False):
    """Per-hop seconds of `runs` chains of `hops` transfers of `size` bytes.

    Args:
      size: Bytes a hop moves.
      hops: H, the hops of a chain (one timed sample).
      runs: Chains timed, after `warmup` untimed ones.
      warmup: Chains run first and not timed.
      depth: Copies of each hop's receive buffer that successive chains
        take in turn, as the plan's depth.
      reuse_one_buffer: Receive every hop into one buffer a side instead.

    Raises:
      RuntimeError: The bytes that came back differ from those sent.
    """
    chains = warmup + runs
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        ctx = multiprocessing.get_context("fork")
        peer = ctx.Process(
            target=_echo,
            args=(port, size, hops, chains, depth, reuse_one_buffer),
            daemon=True)
        peer.start()
        try:
            server.settimeout(30)
            sock, _ = server.accept()
            with sock:
                sock.settimeout(120)
                _tune(sock)
                pattern = bytes(range(251)) * (size // 251 + 1)
                source = memoryview(bytearray(pattern[:size]))
                landing = Landing(size, hops // 2, depth,
                                   reuse_one_buffer)
                times = []
                for r in range(chains):
                    view = source
                    t0 = time.perf_counter()
                    for i in range(hops):
                        if i % 2 == 0:
                            sock.sendall(view)
                        else:
                            view = landing.buffer(r, i)
                            _receive(sock, view)
                    if hops % 2 == 1:
                        _receive(sock, memoryview(bytearray(1)))
                    dt = time.perf_counter() - t0
                    if r >= warmup:
                        times.append(dt / hops)
                # The last chain's tensor, back where it started.
                if hops % 2 == 0 and view.tobytes() != pattern[:size]:
                    raise RuntimeError("socket chain: the bytes that came "
                                       "back differ from those sent")
        finally:
            peer.join(timeout=30)
            if peer.is_alive():
                peer.kill()
    return times
