"""Two "hosts" on one machine: network namespaces joined by a veth pair.

Each task runs in its own network namespace (created here, removed in the
fixture's teardown) with an address from TEST-NET-1 (192.0.2.0/24, the
documentation range, used only inside these namespaces). The tasks share
/dev/shm, but different network namespaces count as different hosts, so with
TF_RDMA_TRANSPORT=auto the engine must pick tcp and move the tensors over the
veth, and the bytes must arrive intact in both directions.

Skips, with the reason, where namespaces cannot be made (not root, no `ip`,
no veth support).
"""

import hashlib
import json
import random
import re

import numpy as np
import pytest

from conftest import IP, collect, ip, shm_segments, spawn_task

pytestmark = pytest.mark.timeout(150)

N = 262144  # 1 MiB of float32
STEPS = 3


def tx_bytes(ns, dev):
    out = json.loads(ip("-n", ns, "-j", "-s", "link", "show", "dev", dev).stdout)
    return out[0]["stats64"]["tx"]["bytes"]


def spawn_in_netns(ns, task, program, cluster, env):
    """conftest.spawn_task, but inside network namespace `ns`."""
    return spawn_task(task, program, cluster, env, prefix=[IP, "netns", "exec", ns])


def payload(sender, step):
    rng = np.random.default_rng(1000 * sender + step)
    return rng.standard_normal(N, dtype=np.float32)


PROGRAM = f"""
import hashlib
N, STEPS = {N}, {STEPS}
def payload(sender, step):
    rng = np.random.default_rng(1000 * sender + step)
    return rng.standard_normal(N, dtype=np.float32)
plan = tf_rdma.Plan([
    tf_rdma.Transfer("a2b", "worker:0", "worker:1", "float32", [N]),
    tf_rdma.Transfer("b2a", "worker:1", "worker:0", "float32", [N]),
])
ep = start()
me = int(task.rsplit(":", 1)[1])
out_key, in_key = ("a2b", "b2a") if me == 0 else ("b2a", "a2b")
digests = []
for step in range(1, STEPS + 1):
    tf_rdma.ops.send(tf.constant(payload(me, step)), plan, out_key)
    got = tf_rdma.ops.recv(plan, in_key)
    arr = got.numpy()
    digests.append(hashlib.sha256(arr.tobytes()).hexdigest())
    del arr, got  # frees the slot for step + depth
info = tf_rdma.endpoint_info()
result({{"digests": digests, "pair": sorted(info["pair"]),
         "transport": info["transport"], "pid": os.getpid()}})
"""


def test_tensors_cross_network_namespaces_over_tcp(two_hosts):
    (ns_a, veth_a, addr_a), (ns_b, veth_b, addr_b) = two_hosts
    port = random.randrange(20000, 40000)  # fresh namespaces: every port is free
    cluster = {"worker": [f"{addr_a}:{port}", f"{addr_b}:{port}"]}
    env = {"TF_RDMA_TRANSPORT": "auto", "TF_RDMA_TIMEOUT": "40"}
    tx_before = tx_bytes(ns_a, veth_a), tx_bytes(ns_b, veth_b)
    procs = {
        "worker:0": spawn_in_netns(ns_a, "worker:0", PROGRAM, cluster, env),
        "worker:1": spawn_in_netns(ns_b, "worker:1", PROGRAM, cluster, env),
    }
    try:
        out = collect(procs, timeout=120)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    bad = [r for r in out.values() if r.returncode != 0]
    assert not bad, "task failed\n" + "\n".join(r.describe()
                                                for r in out.values())
    r0, r1 = out["worker:0"].result, out["worker:1"].result

    # Every step's tensor arrived intact, both ways.
    def expected(sender):
        return [hashlib.sha256(payload(sender, s).tobytes()).hexdigest()
                for s in range(1, STEPS + 1)]
    assert r1["digests"] == expected(0), "worker:1 received wrong bytes"
    assert r0["digests"] == expected(1), "worker:0 received wrong bytes"

    # Different network namespaces are different hosts: auto chose tcp,
    # even though both processes could map each other's /dev/shm segments.
    pairs = ["/job:worker/task:0 -> /job:worker/task:1 tcp",
             "/job:worker/task:1 -> /job:worker/task:0 tcp"]
    for r in (r0, r1):
        assert r["transport"] == "auto"
        assert r["pair"] == pairs, r["pair"]
    assert "/job:worker/task:0 -> /job:worker/task:1 uses tcp" in out["worker:0"].stderr
    assert "/job:worker/task:1 -> /job:worker/task:0 uses tcp" in out["worker:1"].stderr
    # The start-up line per pair expected it from the addresses alone.
    assert re.search(rf"pair /job:worker/task:0 <-> /job:worker/task:1 "
                     rf"\({re.escape(addr_b)}:\d+\): tcp \(another host\)",
                     out["worker:0"].stderr), out["worker:0"].stderr

    # ... and the bytes went over the veth pair (3 MiB each way, plus headers).
    sent_a = tx_bytes(ns_a, veth_a) - tx_before[0]
    sent_b = tx_bytes(ns_b, veth_b) - tx_before[1]
    assert sent_a >= STEPS * N * 4, f"only {sent_a} bytes left host a"
    assert sent_b >= STEPS * N * 4, f"only {sent_b} bytes left host b"

    # Clean exits removed their segments.
    assert shm_segments([r0["pid"], r1["pid"]]) == []
