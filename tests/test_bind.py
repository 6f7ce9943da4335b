"""Where an endpoint listens, and the addresses its peers dial.

An endpoint listens on every interface by default (TF_RDMA_BIND=`*`), IPv4
and IPv6 on one socket, as TensorFlow's gRPC server does, and its peers dial
the address the cluster names for it; TF_RDMA_BIND=<host> restricts it. So
a task named by an address that is not an interface of its own (a NAT, a
Kubernetes Service), or by a name whose record appears only after the task
starts, still gets its peers. Real endpoints in their own processes:

- every interface: the endpoint of a task named 127.0.0.1 takes connections
  on 127.0.0.2 and ::1 too, and a transfer between two tasks is exact;
  with TF_RDMA_BIND=127.0.0.1, 127.0.0.2 is refused;
- a cluster on the IPv6 loopback ([::1]:port), over tcp and shm;
- a peer named by a host name that resolves only 3 s after the tasks start
  (a mount namespace with an /etc/hosts of its own, appended to later): the
  writer dials it again until it resolves, within its timeout.
"""

import shutil
import socket
import time

import pytest

from conftest import collect, kill_group, make_cluster, mount_namespace, spawn_task
from tf_rdma import cluster as cluster_lib

pytestmark = pytest.mark.timeout(180)

TRANSFER = """
plan = tf_rdma.Plan([tf_rdma.Transfer("t", "worker:0", "worker:1", "float32",
                                      [4096])], name="bind")
ep = start()
touch(f"port.{task.replace(':', '_')}", str(ep.port))
values = tf.range(4096, dtype=tf.float32) * 0.5
t0 = time.monotonic()
if task == "worker:0":
    error = error_of(lambda: tf_rdma.ops.send(values, plan, "t"))
    out = {"error": error}
else:
    got = []
    error = error_of(lambda: got.append(tf_rdma.ops.recv(plan, "t")))
    out = {"error": error,
           "exact": bool(got) and bool(tf.reduce_all(got[0] == values))}
out["seconds"] = time.monotonic() - t0
wait_file("done", timeout=120)
result(out)
"""


def _reachable(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect((host, port))
            return True
        except OSError:
            return False


def _run(tmp_path, cluster, env=None, prefix=(), probe=None):
    """Runs TRANSFER on worker:0 and worker:1; `probe(ports)` runs while both
    endpoints listen. Returns the results and the reader's log."""
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TIMEOUT": "30", **(env or {})}
    procs = {t: spawn_task(t, TRANSFER, cluster, env, prefix=prefix)
             for t in ("worker:1", "worker:0")}
    try:
        if probe is not None:
            deadline = time.monotonic() + 60
            paths = [tmp_path / f"port.worker_{i}" for i in (0, 1)]
            while not all(p.exists() for p in paths):
                assert time.monotonic() < deadline, "the endpoints did not start"
                assert all(p.poll() is None for p in procs.values()), \
                    "a task ended before its endpoint listened"
                time.sleep(0.1)
            probe([int(p.read_text()) for p in paths])
        (tmp_path / "done").write_text("1")
        out = collect(procs, timeout=150)
    finally:
        for p in procs.values():
            kill_group(p)
    for r in out.values():
        assert r.returncode == 0, r.describe()
        assert r.result["error"] is None, r.describe()
    assert out["worker:1"].result["exact"], out["worker:1"].describe()
    return {t: r.result for t, r in out.items()}, out["worker:1"].stderr


def test_the_endpoint_listens_on_every_interface(tmp_path):
    seen = {}

    def probe(ports):
        seen["127.0.0.2"] = _reachable("127.0.0.2", ports[1])
        seen["::1"] = _reachable("::1", ports[1])

    _run(tmp_path, make_cluster(2), {"TF_RDMA_TRANSPORT": "tcp"}, probe=probe)
    assert seen == {"127.0.0.2": True, "::1": True}, seen


def test_tf_rdma_bind_restricts_it(tmp_path):
    seen = {}

    def probe(ports):
        seen["127.0.0.1"] = _reachable("127.0.0.1", ports[1])
        seen["127.0.0.2"] = _reachable("127.0.0.2", ports[1])

    _run(tmp_path, make_cluster(2),
         {"TF_RDMA_TRANSPORT": "tcp", "TF_RDMA_BIND": "127.0.0.1"}, probe=probe)
    assert seen == {"127.0.0.1": True, "127.0.0.2": False}, seen


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_cluster_on_the_ipv6_loopback(tmp_path, transport):
    if not _reachable_ipv6():
        pytest.skip("this host has no IPv6 loopback (::1)")
    cluster = {"worker": [f"[::1]:{p}" for p in cluster_lib.free_ports(2)]}
    _, log = _run(tmp_path, cluster, {"TF_RDMA_TRANSPORT": transport})
    assert f"/job:worker/task:0 -> /job:worker/task:1 uses {transport}" in log, log


def _reachable_ipv6():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.fixture
def private_etc_hosts(tmp_path):
    """A mount namespace whose /etc/hosts is a file of the test's; yields
    (command prefix, path of that file)."""
    hosts = tmp_path / "hosts"
    shutil.copyfile("/etc/hosts", hosts)
    with mount_namespace(f"mount --bind {hosts} /etc/hosts",
                         "a mount namespace with an /etc/hosts of its own") as prefix:
        yield prefix, hosts


def test_a_peer_name_that_resolves_late_is_dialled_until_it_does(
        tmp_path, private_etc_hosts):
    prefix, hosts = private_etc_hosts
    name = "tf-rdma-late-host.test"
    ports = cluster_lib.free_ports(2)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}", f"{name}:{ports[1]}"]}
    delay_s = 3.0

    def publish_later(_):
        time.sleep(delay_s)
        with open(hosts, "a") as f:  # the same inode: the bind mount sees it
            f.write(f"127.0.0.1 {name}\n")

    results, _ = _run(tmp_path, cluster, {"TF_RDMA_TRANSPORT": "tcp"},
                      prefix=prefix, probe=publish_later)
    assert results["worker:0"]["seconds"] >= delay_s - 0.5, results
