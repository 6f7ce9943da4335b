"""How the verbs transport moves bytes (docs/verbs.md, "A write").

Two real processes over verbs (an RDMA port where the host has one, else
softnic, the emulated NIC) and the pair counters of endpoint_info():

- a large static tensor sent step after step is written in place (zero-copy,
  through implicit on-demand paging) once the pair is up, and is staged
  (copied into the registered staging area) with TF_RDMA_VERBS_ODP=off (one
  cluster: two senders, one with each setting, to one receiver);
- writes from several threads to one peer are in flight together rather
  than one round trip after another (one cluster: a sender with the
  default settings and one with the smallest queue and staged payloads);
- bench/verbs_path.py, which measures both, labels emulated numbers.

Every received tensor is checked bit for bit against what was sent.
"""

import json
import os
import subprocess
import sys

import pytest

from conftest import (REPO, base_env, collect, make_cluster, require_verbs,
                      spawn_task, verbs_missing)

pytestmark = pytest.mark.timeout(300)

STATIC_ELEMENTS = 2 * 1024 * 1024  # float32: 8 MiB
STATIC_STEPS = 5
THREADS = 4
THREAD_STEPS = 25
THREAD_ELEMENTS = 64 * 1024  # float32: 256 KiB

STATIC = """
SENDERS, RECEIVER = {"worker:0": "w", "worker:2": "v"}, "worker:1"
plan = tf_rdma.Plan([tf_rdma.Transfer(key, sender, RECEIVER, "float32",
                                      [STATIC_ELEMENTS])
                     for sender, key in SENDERS.items()], name="static", depth=1)
ep = start()

def counters():
    info = tf_rdma.endpoint_info()
    [pair] = [p for p in info["pairs"] if p["writer"] == info["task"]]
    return pair["counters"]

value = tf.constant(np.arange(STATIC_ELEMENTS, dtype=np.float32) * 0.5 + 1.0)
if task in SENDERS:
    key = SENDERS[task]
    tf_rdma.ops.send(value, plan, key)  # warm-up: connects, binds the slot
    before = counters()
    for _ in range(STATIC_STEPS - 1):
        tf_rdma.ops.send(value, plan, key)
    result({"device": tf_rdma.endpoint_info()["verbs"], "before": before,
            "after": counters()})
else:
    same = {key: [] for key in SENDERS.values()}
    for _ in range(STATIC_STEPS):
        for key in same:
            same[key].append(bool(np.array_equal(
                tf_rdma.ops.recv(plan, key).numpy(), value.numpy())))
    result({"same": same})
"""


@pytest.fixture(scope="module")
def static_runs():
    """One cluster, two senders of the same static tensor to worker:1:
    worker:0 with the default settings, worker:2 with TF_RDMA_VERBS_ODP=off
    (the setting is the sender's own). Returns {"auto" | "off": (the
    sender's verbs device, the deltas of its pair counters after warm-up)}."""
    require_verbs()
    program = (f"STATIC_ELEMENTS = {STATIC_ELEMENTS}\n"
               f"STATIC_STEPS = {STATIC_STEPS}\n" + STATIC)
    cluster = make_cluster(3)
    env = {"TF_RDMA_TRANSPORT": "verbs", "TF_RDMA_TIMEOUT": "30"}
    task_env = {"worker:0": env, "worker:1": env,
                "worker:2": {**env, "TF_RDMA_VERBS_ODP": "off"}}
    procs = {t: spawn_task(t, program, cluster, e) for t, e in task_env.items()}
    out = collect(procs, timeout=180)
    bad = [r for r in out.values() if r.returncode != 0]
    assert not bad, "task failed\n" + "\n".join(r.describe() for r in out.values())
    same = out["worker:1"].result["same"]
    assert same == {"w": [True] * STATIC_STEPS, "v": [True] * STATIC_STEPS}, same
    runs = {}
    for setting, sender in (("auto", "worker:0"), ("off", "worker:2")):
        res = out[sender].result
        runs[setting] = (res["device"], {
            k: res["after"][k] - res["before"][k]
            for k in ("writes", "bytes_in_place", "bytes_staged", "bytes_inline")})
    return runs


def test_static_tensor_is_written_in_place_after_warm_up(static_runs):
    device, delta = static_runs["auto"]
    if "on-demand paging implicit" not in device:
        pytest.skip(f"the device has no implicit on-demand paging: {device}")
    nbytes = STATIC_ELEMENTS * 4
    # Each step writes the tensor from where TensorFlow holds it: no byte
    # is copied into the staging area, every payload byte is read in place.
    assert delta["bytes_staged"] == 0, delta
    assert delta["bytes_in_place"] == (STATIC_STEPS - 1) * nbytes, delta
    assert delta["writes"] >= STATIC_STEPS - 1, delta


def test_without_on_demand_paging_tensors_are_staged(static_runs):
    device, delta = static_runs["off"]
    assert "on-demand paging off" in device, device
    nbytes = STATIC_ELEMENTS * 4
    assert delta["bytes_in_place"] == 0, delta
    assert delta["bytes_staged"] == (STATIC_STEPS - 1) * nbytes, delta


THREADED = """
import threading
SENDERS, RECEIVER = {"worker:0": "in_place", "worker:2": "staged"}, "worker:1"
plans = {(sender, i): (tf_rdma.Plan(
             [tf_rdma.Transfer(f"{name}{i}", sender, RECEIVER, "float32",
                               [THREAD_ELEMENTS])], name=f"{name}{i}", depth=2),
                        f"{name}{i}")
         for sender, name in SENDERS.items() for i in range(THREADS)}
ep = start()

def value(i, step):
    return tf.fill([THREAD_ELEMENTS], float(1000 * i + step))

errors = []
def run(sender, i):
    plan, key = plans[(sender, i)]
    try:
        for step in range(THREAD_STEPS):
            if task == sender:
                tf_rdma.ops.send(value(i, step), plan, key)
            else:
                got = tf_rdma.ops.recv(plan, key).numpy()
                if not np.array_equal(got, value(i, step).numpy()):
                    errors.append(f"{key} step {step}: {got[:3]}")
    except Exception as e:  # reported, checked by the test
        errors.append(f"{key}: {e}")

# A sender runs its THREADS threads; the receiver one per thread of each.
threads = [threading.Thread(target=run, args=(sender, i))
           for sender in SENDERS for i in range(THREADS)
           if task in (sender, RECEIVER)]
for t in threads:
    t.start()
for t in threads:
    t.join()
info = tf_rdma.endpoint_info()
pairs = [p for p in info["pairs"] if p["writer"] == info["task"]]
result({"errors": errors, "counters": pairs[0]["counters"] if pairs else None})
"""


@pytest.fixture(scope="module")
def threaded_run():
    """One cluster, two senders to worker:1, each from THREADS threads:
    worker:0 with the default settings ("in_place"), worker:2 with the
    smallest send queue and staged payloads ("staged_queue_of_4": writers
    wait for room and for staging chunks while others' requests are in
    flight; both settings are the writer's own). Returns {setting: the
    sender's pair counters}, after checking every received tensor."""
    require_verbs()
    program = (f"THREADS = {THREADS}\nTHREAD_STEPS = {THREAD_STEPS}\n"
               f"THREAD_ELEMENTS = {THREAD_ELEMENTS}\n" + THREADED)
    # softnic's responder holds each message 2 ms (a long round trip), so
    # that writes serialized one after another could not go unnoticed.
    env = {"TF_RDMA_TRANSPORT": "verbs", "TF_RDMA_TIMEOUT": "60",
           "TF_RDMA_SOFTNIC_DELAY_US": "2000"}
    task_env = {"worker:0": env, "worker:1": env,
                "worker:2": {**env, "TF_RDMA_VERBS_QUEUE_DEPTH": "4",
                             "TF_RDMA_VERBS_ODP": "off"}}
    cluster = make_cluster(3)
    procs = {t: spawn_task(t, program, cluster, e) for t, e in task_env.items()}
    out = collect(procs, timeout=240)
    bad = [r for r in out.values() if r.returncode != 0]
    assert not bad, "task failed\n" + "\n".join(r.describe() for r in out.values())
    for res in out.values():
        assert res.result["errors"] == [], res.describe()
    return {"in_place": out["worker:0"].result["counters"],
            "staged_queue_of_4": out["worker:2"].result["counters"]}


@pytest.mark.parametrize("setting", ["in_place", "staged_queue_of_4"])
def test_writes_from_threads_are_in_flight_together(threaded_run, setting):
    counters = threaded_run[setting]
    assert counters["writes"] >= THREADS * THREAD_STEPS
    assert counters["max_writes_in_flight"] >= 2, counters
    if setting == "in_place":
        # Selective signalling: notices and the occasional request ask for a
        # completion, payload writes the NIC reads in place do not.
        assert counters["signaled"] < counters["requests"], counters
        assert counters["bytes_staged"] == 0, counters
    else:
        assert counters["bytes_in_place"] == 0, counters
        assert counters["bytes_staged"] >= THREADS * THREAD_STEPS * THREAD_ELEMENTS * 4


def test_bench_labels_emulated_numbers(tmp_path):
    """bench/verbs_path.py runs (small) and never passes softnic off as hardware."""
    require_verbs()
    emulated = verbs_missing() is not None
    out = tmp_path / "verbs_path.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "verbs_path.py"),
         "--only", "in-flight", "--threads", "1", "--writes", "3",
         "--delay-us", "0", "--json", str(out)],
        env=base_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    systems = {r["system"] for r in doc["results"]}
    assert systems == {"tf_rdma-verbs-emulated" if emulated else "tf_rdma-verbs"}
    assert [r["threads"] for r in doc["results"]] == [1]
    assert all(r["counters"]["writes"] >= 3 for r in doc["results"]), doc
    assert ("EMULATED" in proc.stdout) == emulated, proc.stdout
