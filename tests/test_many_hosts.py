"""tf_rdma on three emulated hosts with two tasks each.

A host here is what conftest.emulated_hosts makes: its own network namespace
(an eth0 on a shared bridge), its own mount namespace with a private /dev/shm
and /etc/hosts, its own hostname. The tasks name each other by host name, as
on a real cluster, and nothing tells the engine which tasks share a host: it
finds out in each pair's handshake (boot id, network namespace, /dev/shm).

- `test_rdma_strategy_fit_and_collectives_across_hosts`: six RdmaStrategy
  workers (two per host) Keras-fit an MLP on digits and end with the weights
  one process gets (atol 1e-5 + rtol 1e-4, as tests/test_strategy.py argues),
  then run every collective algorithm and kind against numpy (inputs of small
  integers: exact in any order). Every pair's transport is asserted from
  both ends' logs: shm inside a host, tcp between hosts.
- `test_collectives_over_verbs_between_hosts`: the same collectives with
  TF_RDMA_TRANSPORT=shm,verbs,tcp over the emulated NIC (tests/softnic, whose
  fabric is a directory of Unix sockets that every host's file system sees,
  as a real fabric spans hosts): verbs between hosts, shm inside.
- `test_parameter_server_example_across_hosts`: examples/ps_strategy.py, the
  ParameterServerStrategy example through `@tf_rdma.rewrite`, with its
  coordinator and ps:0 on one host, worker:0 and ps:1 on the next, two
  workers on the last; its losses equal plain PSS's bit for bit, and each
  worker<->ps pair used shm or tcp as its hosts say.
- Failures between hosts (a host's cable unplugged: its veth set down):
  unplugged for a few seconds mid-transfer, every step still arrives intact;
  unplugged for good, both ends fail within TF_RDMA_TIMEOUT with an error
  naming the tensor, the peer and its host.

Skips, with the reason, where the namespaces cannot be made (not root, no
iproute2 or util-linux, no bridge).
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import (EXCHANGE_TASKS, REPO, assert_exchange_contract, base_env,
                      collect, emulated_hosts, make_cluster, pairs_and_transports,
                      require_verbs, run_exchange, spawn_task, stop_servers,
                      wait_for_step)
from tf_rdma.collectives import ALGORITHMS

pytestmark = pytest.mark.timeout(420)

#: Two tasks on each of three hosts.
HOSTS = 3
PER_HOST = 2
WORKERS = HOSTS * PER_HOST
ATOL, RTOL = 1e-5, 1e-4
GLOBAL_BATCH = 48          # 8 a worker
N_TRAIN = 26 * GLOBAL_BATCH
EPOCHS = 2


@pytest.fixture(scope="module")
def hosts():
    with emulated_hosts(HOSTS) as made:
        yield made


def _port_base():
    """A port for this module's clusters: every port is free on a fresh
    host, but the single-process oracle runs on this one."""
    return make_cluster(1)["worker"][0].rsplit(":", 1)[1]


def spmd_cluster(hosts, port):
    """Workers 2h and 2h+1 on host h."""
    return {"worker": [f"{hosts[i // PER_HOST].name}:{int(port) + i % PER_HOST}"
                       for i in range(WORKERS)]}


def host_of(cluster, task):
    """The host name of `task` ("/job:worker/task:3" or "worker:3")."""
    job, index = task.replace("/job:", "").replace("/task:", ":").split(":")
    return cluster[job][int(index)].rsplit(":", 1)[0]


def assert_transports(cluster, logs, between):
    """Every pair the tasks logged used shm inside a host and `between`
    across hosts; both kinds occurred. `logs`: {task: stderr}."""
    seen = {}
    for task, stderr in logs.items():
        for (writer, reader), transport in pairs_and_transports(stderr).items():
            seen.setdefault((writer, reader), set()).add(transport)
    assert seen, "no task logged the transport of a pair"
    kinds = set()
    for (writer, reader), transports in sorted(seen.items()):
        same = host_of(cluster, writer) == host_of(cluster, reader)
        want = "shm" if same else between
        assert transports == {want}, (
            f"{writer} -> {reader} ({'one host' if same else 'two hosts'}) "
            f"used {transports}, expected {want}")
        kinds.add(same)
    assert kinds == {True, False}, f"pairs seen: {sorted(seen)}"


# ---------------------------------------------------------------------------
# RdmaStrategy fit, then the collectives, in the same six workers.

FIT = """
import keras
from sklearn.datasets import load_digits
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32"); y = y.astype("int64")
order = np.random.RandomState(0).permutation(len(x))
x, y = x[order][:%(n)d], y[order][:%(n)d]
if os.environ["MODE"] == "single":
    os.environ.pop("TF_CONFIG", None)
    strategy = tf.distribute.get_strategy()
    rank = 0
else:
    index = int(task.rsplit(":", 1)[1])
    os.environ["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": "worker", "index": index}})
    import tf_rdma.distribute
    strategy = tf_rdma.distribute.RdmaStrategy(bucket_bytes=4096)
    rank = strategy.worker_index
keras.utils.set_random_seed(1 + rank)   # the chief's initial weights win
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)),
                              keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
hist = model.fit(x, y, batch_size=%(gb)d, epochs=%(epochs)d, shuffle=False,
                 verbose=0)
out = {"loss": hist.history["loss"],
       "weights": [w.numpy().tolist() for w in model.trainable_weights]}
if os.environ["MODE"] != "single" and os.environ.get("COLLECTIVES"):
    exec(os.environ["COLLECTIVES"])
    out["collectives"] = run_collectives()
if os.environ["MODE"] != "single":
    out["pairs"] = tf_rdma.endpoint_info()["pair"]
result(out)
""" % {"n": N_TRAIN, "gb": GLOBAL_BATCH, "epochs": EPOCHS}

#: Every algorithm and kind against numpy; the inputs are small integers, so
#: every result is exact whatever the order of the additions.
COLLECTIVES = """
def run_collectives():
    from tf_rdma import collectives as C
    g = C.default_group()
    P, r = g.size, g.rank
    def data(q, n):
        return np.random.default_rng([q, n]).integers(-3, 4, n).astype(np.float32)
    bad, count = [], 0
    for alg in C.ALGORITHMS:
        for n in (7, (1 << 18) + 3):
            xs = [data(q, n) for q in range(P)]
            x = tf.constant(xs[r])
            root = (n + count) % P
            block = 4096 if n < 4096 else 1 << 16
            got = {
                "allreduce": C.all_reduce(x, algorithm=alg, block_bytes=block),
                "reduce": C.reduce(x, root=root, algorithm=alg, block_bytes=block),
                "broadcast": C.broadcast(x, root=root, algorithm=alg,
                                         block_bytes=block),
                "allgather": C.all_gather(x, algorithm=alg, block_bytes=block),
            }
            want = {"allreduce": sum(xs),
                    "reduce": sum(xs) if r == root else xs[r],
                    "broadcast": xs[root], "allgather": np.concatenate(xs)}
            for kind, y in got.items():
                count += 1
                if not np.array_equal(y.numpy(), want[kind]):
                    bad.append([alg, kind, n])
    return {"bad": bad, "count": count, "size": P}
"""


def _flat(weights):
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])


def _run_spmd(hosts, env, timeout, single=False):
    """The six workers (and, with `single`, the one-process oracle) at once:
    (cluster, {name: TaskResult})."""
    cluster = spmd_cluster(hosts, _port_base())
    procs = {}
    for i in range(WORKERS):
        task = f"/job:worker/task:{i}"
        procs[task] = spawn_task(task, FIT, cluster, env,
                                 prefix=hosts[i // PER_HOST].prefix)
    if single:
        procs["single"] = spawn_task("worker:0", FIT, make_cluster(1),
                                     dict(env, MODE="single"))
    out = collect(procs, timeout=timeout)
    bad = [r for r in out.values() if r.returncode != 0]
    if bad:
        pytest.fail("task failed\n" + "\n".join(r.describe() for r in bad))
    return cluster, out


def _check_collectives(results):
    for task, res in results.items():
        c = res["collectives"]
        assert c["size"] == WORKERS, (task, c)
        # every algorithm, two sizes, four kinds
        assert c["count"] == len(ALGORITHMS) * 2 * 4, (task, c)
        assert not c["bad"], (task, c["bad"])


def test_rdma_strategy_fit_and_collectives_across_hosts(hosts):
    env = {"MODE": "rdma", "COLLECTIVES": COLLECTIVES,
           "TF_RDMA_TRANSPORT": "auto", "TF_RDMA_TIMEOUT": "120"}
    cluster, out = _run_spmd(hosts, env, timeout=360, single=True)
    single = out.pop("single").result
    results = {t: r.result for t, r in out.items()}
    first = results["/job:worker/task:0"]
    for task, res in results.items():
        assert res["weights"] == first["weights"], task  # every rank equal
    np.testing.assert_allclose(_flat(first["weights"]), _flat(single["weights"]),
                               atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(first["loss"], single["loss"], rtol=RTOL)
    assert first["loss"][-1] < first["loss"][0]
    _check_collectives(results)
    assert_transports(cluster, {t: r.stderr for t, r in out.items()}, "tcp")


def test_collectives_over_verbs_between_hosts(hosts):
    require_verbs()
    env = {"MODE": "rdma", "COLLECTIVES": COLLECTIVES,
           "TF_RDMA_TRANSPORT": "shm,verbs,tcp", "TF_RDMA_TIMEOUT": "120"}
    cluster, out = _run_spmd(hosts, env, timeout=300)
    results = {t: r.result for t, r in out.items()}
    _check_collectives(results)
    assert_transports(cluster, {t: r.stderr for t, r in out.items()}, "verbs")


# ---------------------------------------------------------------------------
# The parameter-server example: servers on the hosts, its coordinator too.

#: (job, index, host) of each task: two per host.
PS_LAYOUT = [("chief", 0, 0), ("ps", 0, 0), ("worker", 0, 1), ("ps", 1, 1),
             ("worker", 1, 2), ("worker", 2, 2)]


def _start_server(host, cluster, job, index, env):
    e = base_env(env)
    e["TF_CONFIG"] = json.dumps(
        {"cluster": cluster, "task": {"type": job, "index": index}})
    return subprocess.Popen(
        [*host.prefix, sys.executable, "-m", "tf_rdma.server"], env=e,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True)


def _wait_ready(servers, timeout):
    deadline = time.monotonic() + timeout
    for task, proc in servers.items():
        line = ""
        while "tf_rdma server ready" not in line:
            if time.monotonic() > deadline:
                pytest.fail(f"{task} not ready within {timeout} s")
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"{task} died: {proc.stderr.read()[-3000:]}")


def test_parameter_server_example_across_hosts(hosts, tmp_path):
    port = int(_port_base())
    cluster = {}
    for job, index, h in PS_LAYOUT:
        n = sum(1 for _, _, g in PS_LAYOUT[:PS_LAYOUT.index((job, index, h))]
                if g == h)
        cluster.setdefault(job, []).append(f"{hosts[h].name}:{port + n}")
    env = {"TF_RDMA_TRANSPORT": "auto", "TF_RDMA_TIMEOUT": "120"}
    servers = {f"{job}:{index}": _start_server(hosts[h], cluster, job, index, env)
               for job, index, h in PS_LAYOUT if job != "chief"}
    try:
        _wait_ready(servers, timeout=120)
        e = base_env(env)
        e["TF_CONFIG"] = json.dumps(
            {"cluster": cluster, "task": {"type": "chief", "index": 0}})
        report = tmp_path / "ps.json"
        example = subprocess.run(
            [*hosts[0].prefix, sys.executable,
             os.path.join(REPO, "examples", "ps_strategy.py"), "--quick", "--json",
             str(report)],
            env=e, capture_output=True, text=True, timeout=300)
    finally:
        logs = dict(zip(servers, stop_servers(list(servers.values()))))
    assert example.returncode == 0, (example.stdout[-3000:] +
                                     example.stderr[-3000:])
    got = json.loads(report.read_text())
    assert got["losses_identical"] and got["ok"], got
    assert len(got["workers_traced"]) >= 1
    moved = got["bytes_sent"]
    assert sum(moved.values()) > 0, moved
    assert_transports(cluster, {t: err for t, (_, err) in logs.items()}, "tcp")


# ---------------------------------------------------------------------------
# A host's cable unplugged: briefly, and for good.

ELEMENTS, STEPS = 262144, 6  # 1 MiB of float32 each way a step


def _unplug_host_1(hosts, tmp_path, timeout_s, plugged_after):
    """Workers 0 and 1, on hosts 0 and 1, exchange STEPS tensors; after the
    second, host 1's cable is unplugged (and plugged back after
    `plugged_after` seconds; None: never). Their results, checked against
    conftest.assert_exchange_contract."""
    port = int(_port_base())
    cluster = {"worker": [f"{hosts[0].name}:{port}", f"{hosts[1].name}:{port}"]}
    shape = dict(elements=ELEMENTS, steps=STEPS, timeout_s=timeout_s)

    def unplug(procs):
        wait_for_step(tmp_path, procs, EXCHANGE_TASKS, 2)
        hosts[1].set_link(False)
        (tmp_path / "go").write_text("1")
        if plugged_after is not None:
            time.sleep(plugged_after)
            hosts[1].set_link(True)

    try:
        results = run_exchange(tmp_path, cluster, transport="auto", during=unplug,
                               pause_after=2, budget=timeout_s + 90,
                               prefixes={t: hosts[i].prefix
                                         for i, t in enumerate(EXCHANGE_TASKS)}, **shape)
    finally:
        hosts[1].set_link(True)
    assert_exchange_contract(results, **shape,
                             must_fail=EXCHANGE_TASKS if plugged_after is None else ())
    return results


def test_host_unplugged_briefly_loses_nothing(hosts, tmp_path):
    results = _unplug_host_1(hosts, tmp_path, timeout_s=60, plugged_after=3)
    for task, res in results.items():
        assert res["failure"] is None and len(res["digests"]) == STEPS, (task, res)


def test_host_unplugged_for_good_fails_naming_tensor_peer_and_host(hosts, tmp_path):
    results = _unplug_host_1(hosts, tmp_path, timeout_s=8, plugged_after=None)
    for me, task in enumerate(EXCHANGE_TASKS):
        failure = results[task]["failure"]
        assert failure["step"] == 3, (task, failure)
        assert f"on {hosts[1 - me].name}," in failure["message"], (task, failure)
