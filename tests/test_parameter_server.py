"""TensorFlow 2 parameter-server training through tf_rdma, against plain PSS.

A cluster of tf_rdma servers (2 workers, 2 ps) and a coordinator process
(task chief:0) that runs tests/ps_cases.py: each case trains a model with
``ParameterServerStrategy`` + ``ClusterCoordinator``, once with the plain
``tf.function`` step (TensorFlow's own path, the oracle) and once with the
same step through ``tf_rdma.rewrite``, and reports whether losses and final
weights are the same bit for bit, which workers ran the rewritten step and
what every task's tf_rdma counters moved. One cluster and one coordinator
process per transport: shm runs every case, tcp and verbs (the emulated NIC
where there is no RDMA device) the MLP and the asynchronous case. A second
shm cluster with 4 workers runs the asynchronous case.
"""

import os
import sys

import pytest

from conftest import LiveCluster, REPO, shm_segments, use_transport

pytestmark = pytest.mark.timeout(600)

OP_TIMEOUT_S = 30
PROGRAM = os.path.join(REPO, "tests", "ps_cases.py")
ALL_CASES = ["mlp", "keras_adam", "sharded_fixed", "sharded_min_size",
             "keras_fit", "async", "applications"]
CASES = {"shm": ALL_CASES, "tcp": ["mlp", "async"], "verbs": ["mlp", "async"]}
CHIEF = "/job:chief/task:0"


def run_cases(jobs, transport, cases, tmp_path_factory):
    """Starts the cluster, runs the cases in one coordinator; their RESULTs."""
    use_transport(transport)
    log_dir = str(tmp_path_factory.mktemp(f"ps_{transport}"))
    cluster = LiveCluster(jobs, log_dir, env={"TF_RDMA_TRANSPORT": transport},
                          op_timeout=OP_TIMEOUT_S, coordinator=True)
    cluster.start()
    try:
        proc, found = cluster.run_client(
            None, argv=[PROGRAM, *cases], timeout=420,
            env={"TEST_OP_TIMEOUT": str(OP_TIMEOUT_S),
                 "TF_USE_LEGACY_KERAS": "1"})
        threads = {name: engine_threads(p.pid)
                   for name, p in cluster.procs.items()}
    finally:
        codes = cluster.stop()
    sys.stderr.write(proc.stderr[-3000:])
    by_case = {r["case"]: r for r in found}
    by_case["_run"] = {"returncode": proc.returncode, "stderr": proc.stderr[-4000:],
                       "logs": cluster.logs()[-3000:], "stop_codes": codes,
                       "segments": shm_segments(pids=cluster.pids),
                       "engine_threads": threads,
                       "workers": jobs["worker"]}
    return by_case


#: futex_waitv's number (the same on every Linux architecture): where an
#: engine thread sleeps while it waits for a recv's data.
FUTEX_WAITV = "449"


def engine_threads(pid):
    """(threads of the tf_rdma engine's pool in process `pid`, those of
    them waiting for data now: in futex_waitv; an idle pool thread sleeps
    in futex)."""
    threads = waiting = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "tfrdma-engine":
                    continue
            threads += 1
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                waiting += f.read().split()[0] == FUTEX_WAITV
        except (OSError, IndexError):
            pass  # the thread ended
    return threads, waiting


@pytest.fixture(scope="module", params=sorted(CASES))
def outcome(request, tmp_path_factory):
    transport = request.param
    return transport, run_cases({"worker": 2, "ps": 2}, transport,
                                CASES[transport], tmp_path_factory)


# The cases that run on shm only (the data path of the others is the same).
on_shm = pytest.mark.parametrize("outcome", ["shm"], indirect=True)


def case_of(outcome, name):
    _, by_case = outcome
    run = by_case["_run"]
    assert name in by_case, (
        f"no RESULT for {name} (coordinator exited {run['returncode']}):\n"
        f"{run['stderr']}\nservers:\n{run['logs']}")
    found = by_case[name]
    assert "error" not in found, found["error"]
    return found


def workers(n):
    return [f"/job:worker/task:{i}" for i in range(n)]


def check_sync(found):
    """Bit for bit plain PSS; the step ran on workers, tensors moved."""
    assert found["losses_identical"], found
    assert found["weights_identical"], found
    assert found["last_loss"] < found["first_loss"], found
    assert found["client_tasks"] == [CHIEF]
    assert found["callers"] and set(found["callers"]) <= set(workers(2)), found
    # Nothing stayed on gRPC: no op runs on the coordinator.
    assert found["kept"] == [], found["kept"]


def check_moved_as_planned(found):
    """Every planned byte moved through tf_rdma, nothing else did: each step
    moved its caller's plan (the plans of the workers are the same size)."""
    sizes = set(found["planned_bytes_per_step"].values())
    assert len(sizes) == 1 and sizes.pop() > 0
    per_step = next(iter(found["planned_bytes_per_step"].values()))
    assert sum(found["sent"].values()) == found["steps"] * per_step, found["sent"]


def test_sync_mlp_equals_plain_ps_strategy(outcome):
    found = case_of(outcome, "mlp")
    check_sync(found)
    check_moved_as_planned(found)


@on_shm
def test_sync_keras_adam_equals_plain_with_slots_on_the_ps(outcome):
    found = case_of(outcome, "keras_adam")
    check_sync(found)
    check_moved_as_planned(found)
    assert found["variable_devices"], found
    assert all("/job:ps/" in d for d in found["variable_devices"]), found


@on_shm
@pytest.mark.parametrize("name", ["sharded_fixed", "sharded_min_size"])
def test_sharded_variables_and_embedding_equal_plain(outcome, name):
    found = case_of(outcome, name)
    check_sync(found)
    assert found["table_shards"] == 2, found
    # The looked-up rows and their gradients cross on the dynamic path...
    assert any("embedding_lookup" in k or "Gather" in k
               for k in found["dynamic_keys"]), found["dynamic_keys"]
    # ...and a step moves far less than the table: 32 ids of 64-byte rows
    # there and back, plus the dense weights and their gradients.
    assert found["bytes_per_step"] > found["static_bytes_per_step"]
    row_traffic = found["bytes_per_step"] - found["static_bytes_per_step"]
    assert row_traffic <= 32 * (64 + 8) * 2 * 2, found
    assert found["table_bytes"] >= 100 * row_traffic, found


@on_shm
@pytest.mark.parametrize("model", ["mobilenet_v2", "resnet50", "vgg16", "lstm",
                                   "transformer"])
def test_real_networks_equal_plain(outcome, model):
    """Keras 2 applications, a recurrent and an attention model (three
    steps each, random labels: the loss need not fall)."""
    found = case_of(outcome, f"app_{model}")
    assert found["losses_identical"] and found["weights_identical"], found
    assert found["client_tasks"] == [CHIEF] and found["kept"] == [], found
    assert found["callers"] and set(found["callers"]) <= set(workers(2)), found
    if model not in ("lstm", "transformer"):
        check_moved_as_planned(found)
        return
    # The embedding's looked-up rows and their gradients move on the dynamic
    # path, beyond the plans' static bytes: at most a batch of 8 x 20 ids
    # of 64 float32 each way (ps_cases.APP_BATCH; the networks' test size:
    # 20 tokens, width 64), with their ids.
    planned = found["steps"] * next(iter(found["planned_bytes_per_step"].values()))
    sent = sum(found["sent"].values())
    assert planned < sent <= planned + found["steps"] * 2 * 8 * 20 * (64 * 4 + 8), found


@on_shm
def test_no_recv_wait_outlives_its_recv(outcome):
    """After every case, the real networks' among them (hundreds of matched
    recvs a step, more than the poller watches, so it hands waits to
    engine threads, and sending threads that help take many of them), the
    servers' engine threads wait for nothing: a handed-off wait ends once
    another waiter took its recv, instead of waiting for the deadline on a
    copy that was consumed (such waits once piled up by the hundreds and,
    woken by every write to their slots, took the CPUs)."""
    threads = outcome[1]["_run"]["engine_threads"]
    assert threads and any(n for n, _ in threads.values()), threads
    assert all(waiting == 0 for _, waiting in threads.values()), threads


@on_shm
def test_keras2_fit_runs_its_steps_through_tf_rdma(outcome):
    found = case_of(outcome, "keras_fit")
    assert found["rewritten"], found
    assert found["losses"][-1] < found["losses"][0], found["losses"]
    assert found["callers"] == workers(2), found
    assert found["kept"] == [], found["kept"]
    for w in workers(2):
        assert found["sent"][w] > 0, (w, found["sent"])


def check_async(found, n_workers):
    assert found["steps"] == found["counter"] > 0, found
    # Every call received its own tensors: the echo through the ps matched.
    assert found["mismatches"] == 0, found
    assert found["last_losses"] < found["first_losses"], found
    assert found["callers"] == workers(n_workers), found
    for w in workers(n_workers):
        assert found["sent"][w] > 0 and found["received"][w] > 0, (w, found)


def test_async_steps_on_every_worker(outcome):
    check_async(case_of(outcome, "async"), 2)


def test_cluster_stopped_clean(outcome):
    _, by_case = outcome
    run = by_case["_run"]
    assert run["returncode"] == 0, run["stderr"]
    assert all(code == 0 for code in run["stop_codes"].values()), run
    assert run["segments"] == [], run["segments"]


def test_async_steps_on_four_workers(tmp_path_factory):
    by_case = run_cases({"worker": 4, "ps": 2}, "shm", ["async"],
                        tmp_path_factory)
    run = by_case["_run"]
    assert "async" in by_case, run
    assert "error" not in by_case["async"], by_case["async"]["error"]
    check_async(by_case["async"], 4)
    assert run["segments"] == [], run["segments"]
