"""A bad network or a paused peer ends in correct results or a clear error.

Two tasks exchange tensors over tcp in both directions for a few steps, each
tensor's SHA-256 checked against what the sender sent, under one condition
at a time:

- between network namespaces (conftest.two_hosts), `tc netem` delay, jitter,
  1% loss and reordering on both veth ends (these skip, with tc's reason,
  where the kernel has no sch_netem);
- between network namespaces, a `tc tbf` bandwidth cap: the tensors arrive
  intact and no faster than the cap allows; with tensors too large for the
  timeout at that rate, every task fails with a DeadlineExceeded error
  naming tensor, peer and step within timeout + 1 s;
- a user-space proxy on every endpoint address (works on any kernel): per
  chunk delay with jitter (results correct), then a partition (the proxy
  stops forwarding; errors within timeout + 1 s);
- a proxy that resets every connection while steps are in flight: the tasks
  go on after the first error, and once a writer dials again every op fails
  at once saying which step never arrived, instead of each waiting out its
  timeout for good;
- a SIGSTOP of one task shorter than the timeout (results correct) and
  longer (the other task's error names the stopped one within
  timeout + 1 s; the stopped one fails when it resumes).

The contract checked in every run (`conftest.assert_exchange_contract`): each task either
finished every step with the right bytes, or its first failing op raised a
DeadlineExceeded or Unavailable error naming the tensor, the peer task and
the step, no later than timeout + 1 s after the op started (for a task that
was itself stopped, after the stop ended).
"""

import os
import random
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest

from conftest import (EXCHANGE, EXCHANGE_TASKS, IP, assert_exchange_contract, collect,
                      kill_group, make_cluster, payload_digest, run_exchange, spawn_task,
                      wait_for_step)
from tf_rdma import cluster as cluster_lib

pytestmark = pytest.mark.timeout(240)

TC = "/usr/sbin/tc"
TASKS = EXCHANGE_TASKS


# --------------------------------------------------------------------------- tc between namespaces


def tc(ns, *args):
    return subprocess.run([IP, "netns", "exec", ns, TC, *args], capture_output=True,
                          text=True, timeout=30)


def shape_both(two_hosts, *qdisc):
    """Puts `qdisc` on both veth ends; skips with tc's reason if it cannot."""
    if not os.path.exists(TC):
        pytest.skip(f"no tc at {TC} (iproute2)")
    for ns, dev, _ in two_hosts:
        r = tc(ns, "qdisc", "add", "dev", dev, "root", *qdisc)
        if r.returncode != 0:
            pytest.skip(f"`tc qdisc add ... {' '.join(qdisc)}` failed here: "
                        f"{r.stderr.strip()}")


def netns_cluster(two_hosts):
    (ns_a, _, addr_a), (ns_b, _, addr_b) = two_hosts
    port = random.randrange(20000, 40000)  # fresh namespaces: every port is free
    cluster = {"worker": [f"{addr_a}:{port}", f"{addr_b}:{port}"]}
    prefixes = {"worker:0": [IP, "netns", "exec", ns_a],
                "worker:1": [IP, "netns", "exec", ns_b]}
    return cluster, prefixes


NETEM = {
    "delay": ("delay", "20ms"),
    "jitter": ("delay", "10ms", "8ms", "distribution", "normal"),
    "loss": ("loss", "1%"),
    "reorder": ("delay", "5ms", "reorder", "25%", "50%"),
}


@pytest.mark.parametrize("condition", sorted(NETEM))
def test_netem(two_hosts, tmp_path, condition):
    shape_both(two_hosts, "netem", *NETEM[condition])
    cluster, prefixes = netns_cluster(two_hosts)
    shape = dict(elements=1 << 18, steps=5, timeout_s=20)
    results = run_exchange(tmp_path, cluster, prefixes=prefixes, **shape)
    assert_exchange_contract(results, **shape)
    for task, r in results.items():
        assert r["failure"] is None, (condition, task, r)


RATE_BYTES_PER_S = 2_000_000  # 16 Mbit/s


def test_bandwidth_cap_slows_but_delivers(two_hosts, tmp_path):
    shape_both(two_hosts, "tbf", "rate", "16mbit", "burst", "32kb", "latency", "400ms")
    cluster, prefixes = netns_cluster(two_hosts)
    shape = dict(elements=1 << 18, steps=5, timeout_s=20)  # 1 MiB a step, each way
    results = run_exchange(tmp_path, cluster, prefixes=prefixes, **shape)
    assert_exchange_contract(results, **shape)
    each_way = shape["steps"] * shape["elements"] * 4
    for task, r in results.items():
        assert r["failure"] is None, (task, r)
        # The cap held: 5 MiB each way cannot cross in less than ~2.6 s.
        assert r["seconds"] >= 0.8 * each_way / RATE_BYTES_PER_S, (task, r["seconds"])


def test_bandwidth_cap_below_what_the_timeout_needs(two_hosts, tmp_path):
    shape_both(two_hosts, "tbf", "rate", "16mbit", "burst", "32kb", "latency", "400ms")
    cluster, prefixes = netns_cluster(two_hosts)
    # 16 MiB each way takes ~8 s at the cap; the timeout is 3 s.
    shape = dict(elements=1 << 22, steps=2, timeout_s=3)
    results = run_exchange(tmp_path, cluster, prefixes=prefixes, **shape)
    assert_exchange_contract(results, **shape, must_fail=TASKS)


# --------------------------------------------------------------------------- a proxy on the path


class DelayProxy:
    """Forwards TCP connections from `listen` to `target`, delaying each chunk.

    Each chunk (up to 16 KiB) waits a random 0..`max_delay_s` before it is
    forwarded, in order, so the stream sees delay with jitter. After
    `partition()` nothing more is forwarded and nothing is closed: to both
    ends the path goes silent, as in a network partition.
    """

    def __init__(self, listen_port, target_port, max_delay_s, seed):
        self.target_port = target_port
        self.max_delay_s = max_delay_s
        self.rng = random.Random(seed)
        self.silent = threading.Event()
        self.closed = threading.Event()
        self.sockets = []
        self.server = socket.create_server(("127.0.0.1", listen_port))
        self.server.settimeout(0.2)
        threading.Thread(target=self._accept, daemon=True).start()

    def partition(self):
        self.silent.set()

    def close(self):
        self.closed.set()
        self.server.close()
        for s in self.sockets:
            s.close()

    def _accept(self):
        while not self.closed.is_set():
            try:
                client, _ = self.server.accept()
            except (socket.timeout, OSError):
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:  # the task is not listening yet: the dialler retries
                client.close()
                continue
            self.sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while not self.closed.is_set():
                chunk = src.recv(16384)
                if not chunk:
                    dst.shutdown(socket.SHUT_WR)
                    return
                time.sleep(self.rng.uniform(0, self.max_delay_s))
                while self.silent.is_set() and not self.closed.is_set():
                    time.sleep(0.05)
                dst.sendall(chunk)
        except OSError:
            return


def proxied_cluster():
    """A cluster whose endpoint addresses are proxies; the tasks listen elsewhere.

    One free_ports call picks the cluster's ports and the tasks' own: ports
    of separate calls may coincide (each is free only until something binds
    it), and a task's port equal to a proxy's fails its endpoint.
    """
    ports = cluster_lib.free_ports(4)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:2]]}
    endpoints = cluster_lib.endpoints(cluster)
    real_ports = ports[2:]  # only their own ports are used
    listen = {t: f"127.0.0.1:{p}" for t, p in zip(TASKS, real_ports)}
    proxy_ports = {t: int(endpoints[f"/job:worker/task:{i}"].rsplit(":", 1)[1])
                   for i, t in enumerate(TASKS)}
    return cluster, listen, proxy_ports, dict(zip(TASKS, real_ports))


@pytest.mark.parametrize("partition", [False, True], ids=["jitter", "partition"])
def test_delay_proxy(tmp_path, partition):
    cluster, listen, proxy_ports, real_ports = proxied_cluster()
    proxies = [DelayProxy(proxy_ports[t], real_ports[t], 0.01, seed=i)
               for i, t in enumerate(TASKS)]
    shape = dict(elements=1 << 16, steps=6, timeout_s=4)

    def cut_after_step_two(procs):
        wait_for_step(tmp_path, procs, TASKS, 2)
        for p in proxies:
            p.partition()
        (tmp_path / "go").write_text("1")

    try:
        results = run_exchange(tmp_path, cluster, listen=listen,
                               during=cut_after_step_two if partition else None,
                               pause_after=2 if partition else 0, **shape)
    finally:
        for p in proxies:
            p.close()
    assert_exchange_contract(results, **shape, must_fail=TASKS if partition else ())
    if partition:
        for r in results.values():
            assert r["failure"]["step"] == 3, r
            assert r["failure"]["type"] == "DeadlineExceededError", r


class ResetProxy(DelayProxy):
    """A DelayProxy that can reset every connection it carries (RST to both
    ends), dropping the chunks it holds: to the tasks, a connection reset
    while steps are in flight."""

    def reset(self):
        held, self.sockets = self.sockets, []
        for s in held:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass


# EXCHANGE's steps, going on after a failure; every op's outcome and time.
GO_ON_PROGRAM = EXCHANGE + """
ops = []
def timed(kind, step, fn):
    t0 = time.monotonic()
    got = []
    error = error_of(lambda: got.append(fn()))
    ops.append({"kind": kind, "step": step, "error": error,
                "seconds": time.monotonic() - t0,
                "digest": hashlib.sha256(got[0].numpy().tobytes()).hexdigest()
                          if got and kind == "recv" else None})
    return error is None
for step in range(1, STEPS + 1):
    value = tf.constant(payload(me, step))
    timed("send", step, lambda: tf_rdma.ops.send(value, plan, out_key))
    timed("recv", step, lambda: tf_rdma.ops.recv(plan, in_key))
    touch(f"{task}-step{step}")
result({"ops": ops})
"""


def test_a_reset_connection_fails_what_it_lost_at_once(tmp_path):
    cluster, listen, proxy_ports, real_ports = proxied_cluster()
    proxies = [ResetProxy(proxy_ports[t], real_ports[t], 0.02, seed=i)
               for i, t in enumerate(TASKS)]
    elements, steps, timeout_s = 1 << 16, 8, 4
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TRANSPORT": "tcp",
           "TF_RDMA_TIMEOUT": str(timeout_s), "TEST_ELEMENTS": str(elements),
           "TEST_STEPS": str(steps)}
    for task, address in listen.items():
        env["TEST_LISTEN_" + task.replace(":", "_")] = address
    procs = {t: spawn_task(t, GO_ON_PROGRAM, cluster, env) for t in TASKS}
    try:
        wait_for_step(tmp_path, procs, TASKS, 3)
        time.sleep(0.01)  # step 4 is on its way
        for p in proxies:
            p.reset()
        out = collect(procs, timeout=150)
    finally:
        for p in proxies:
            p.close()
        for p in procs.values():
            kill_group(p)
    lost = []
    for task, r in out.items():
        assert r.returncode == 0, r.describe()
        me = int(task.rsplit(":", 1)[1])
        ops = r.result["ops"]
        failed = [op for op in ops if op["error"]]
        for op in ops:
            if op["kind"] == "recv" and op["digest"] is not None:
                assert op["digest"] == payload_digest(1 - me, op["step"], elements), (
                    task, op)  # whatever arrived is right
        assert failed, f"{task}: the reset lost nothing? {ops}"
        # The first failure may wait out its timeout; none after it: the
        # writers dialled again and the loss is known on both sides.
        assert failed[0]["seconds"] <= timeout_s + 1.0, (task, failed[0])
        for op in failed[1:]:
            assert op["seconds"] < timeout_s, (task, op)
        lost += [op["error"]["message"] for op in failed
                 if "never arrived" in op["error"]["message"]]
    assert lost, "no error said which step never arrived"
    assert "the connection was lost while the step was in flight" in lost[0], lost[0]


# --------------------------------------------------------------------------- SIGSTOP


@pytest.mark.parametrize("stop_s,timeout_s", [(1.5, 6), (7.0, 3)], ids=["shorter", "longer"])
def test_sigstop(tmp_path, stop_s, timeout_s):
    shape = dict(elements=1 << 16, steps=6, timeout_s=timeout_s)

    def stop_worker_1(procs):
        # Both finished step 2 and wait for "go": worker:1 is stopped (its
        # engine threads too) with "go" already there, so worker:0 goes on
        # into step 3 while worker:1 stays frozen until SIGCONT.
        wait_for_step(tmp_path, procs, TASKS, 2)
        kill_group(procs["worker:1"], signal.SIGSTOP)
        (tmp_path / "go").write_text("1")
        time.sleep(stop_s)
        kill_group(procs["worker:1"], signal.SIGCONT)

    results = run_exchange(tmp_path, make_cluster(2), during=stop_worker_1,
                           pause_after=2, **shape)
    longer = stop_s > timeout_s
    assert_exchange_contract(results, **shape, stopped="worker:1", stop_s=stop_s,
                     must_fail=("worker:0",) if longer else ())
    if not longer:
        for r in results.values():
            assert r["failure"] is None, r

