"""A /dev/shm too small for a plan is a clear error, never a SIGBUS.

Every region is a /dev/shm segment whatever the transport (region.h), and a
container's /dev/shm is often small (Docker's default is 64 MiB). The
segments used to be sized with ftruncate and mapped with MAP_POPULATE, whose
failures the kernel ignores: the first touch of an unbacked page killed the
process with SIGBUS mid-copy. Region::Create now reserves every page with
posix_fallocate and fails with ResourceExhausted naming /dev/shm, its free
space, the bytes asked for and what to do.

The tasks run in a mount namespace of their own whose /dev/shm is a 64 MiB
tmpfs (`unshare --mount`, then `nsenter` for each task), so the rest of the
machine is untouched:

- a 96 MiB tensor over shm and over tcp: both tasks fail with the error,
  and then a 16 MiB tensor between the same endpoints, in the same
  namespace, arrives intact (the check refuses only what does not fit);
- a /dev/shm already full when the tasks start: the small regions (a
  writer's credit region included) fail the same way;
- a peer with the secret asks for a 128 MiB region: it gets the error as its
  OPEN reply, and the endpoint stays up and serves a region that fits;
- writers share a budget of /dev/shm (TF_RDMA_REGION_BUDGET, by default
  three quarters of it), one writer at most half of that;
- `tf-rdma doctor`'s /dev/shm section against a small tmpfs.
"""

import os
import subprocess
import tempfile
import time

import pytest

import wire_client
from conftest import (collect, kill_group, make_cluster, mount_namespace,
                      spawn_task)
from tf_rdma.doctor import system
from tf_rdma.errors import ConfigError

pytestmark = pytest.mark.timeout(180)

SHM_MIB = 64
SECRET = "test-secret-of-the-suite"  # conftest.base_env's


@pytest.fixture
def small_dev_shm():
    """A mount namespace whose /dev/shm is a 64 MiB tmpfs.

    Yields the command prefix that runs a program inside it.
    """
    with mount_namespace(f"mount -t tmpfs -o size={SHM_MIB}m tmpfs /dev/shm",
                         "a mount namespace with a small /dev/shm") as prefix:
        yield prefix


TRANSFER = """
n = int(os.environ["TEST_ELEMENTS"])
plan = tf_rdma.Plan([tf_rdma.Transfer("big", "worker:0", "worker:1",
                                      "float32", [n])], name="shm_limits", depth=1)
if os.environ.get("TEST_FILL_SHM") and task == "worker:1":
    # Leave less than a page free before either task makes a region.
    with open("/dev/shm/filler", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, os.statvfs("/dev/shm").f_bavail * 4096 - 1024)
    touch("filled")
if os.environ.get("TEST_FILL_SHM") and task == "worker:0":
    wait_file("filled")
ep = start()
values = tf.range(n, dtype=tf.float32)
if task == "worker:0":
    error = error_of(lambda: tf_rdma.ops.send(values, plan, "big", timeout=15))
    touch("sent")
else:
    got = []
    error = error_of(lambda: got.append(tf_rdma.ops.recv(plan, "big", timeout=15)))
    exact = bool(got) and bool(tf.reduce_all(got[0] == values))
    wait_file("sent")  # the writer hears the reason from this endpoint
out = {"error": error} if task == "worker:0" else {"error": error, "exact": exact}
# TEST_THEN_ELEMENTS: then a tensor of that many elements, on its own plan.
then = int(os.environ.get("TEST_THEN_ELEMENTS", "0"))
if then:
    fits = tf_rdma.Plan([tf_rdma.Transfer("fits", "worker:0", "worker:1",
                                          "float32", [then])],
                        name="shm_limits_fits", depth=1)
    small = tf.range(then, dtype=tf.float32)
    if task == "worker:0":
        out["then_error"] = error_of(
            lambda: tf_rdma.ops.send(small, fits, "fits", timeout=15))
    else:
        got = []
        out["then_error"] = error_of(
            lambda: got.append(tf_rdma.ops.recv(fits, "fits", timeout=15)))
        out["then_exact"] = bool(got) and bool(tf.reduce_all(got[0] == small))
result(out)
"""


def _run_transfer(tmp_path, prefix, transport, elements, fill=False, then=0):
    cluster = make_cluster(2)
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TRANSPORT": transport,
           "TEST_ELEMENTS": str(elements), "TEST_THEN_ELEMENTS": str(then)}
    if fill:
        env["TEST_FILL_SHM"] = "1"
    procs = {t: spawn_task(t, TRANSFER, cluster, env, prefix=prefix)
             for t in ("worker:1", "worker:0")}
    out = collect(procs, timeout=120)
    for r in out.values():
        # -7 is SIGBUS, what a full /dev/shm used to end in.
        assert r.returncode == 0, r.describe()
    return {t: r.result for t, r in out.items()}


def _assert_shm_full(error, task):
    assert error is not None, f"{task}: expected an error, the op succeeded"
    assert error["type"] == "ResourceExhaustedError", (task, error)
    message = error["message"]
    assert "region '" in message, (task, error)  # which region did not fit
    assert "/dev/shm cannot hold a shared-memory region of" in message, (task, error)
    assert "free" in message and "--shm-size" in message, (task, error)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_tensor_larger_than_dev_shm_is_an_error_on_both_tasks(
        small_dev_shm, tmp_path, transport):
    results = _run_transfer(tmp_path, small_dev_shm, transport, 24 << 20,  # 96 MiB
                            then=4 << 20)  # 16 MiB
    _assert_shm_full(results["worker:1"]["error"], "worker:1")
    error = results["worker:0"]["error"]
    # The writer hears the reader's reason in the OPEN reply.
    _assert_shm_full(error, "worker:0")
    assert "/job:worker/task:1" in error["message"], error
    # A tensor that fits arrives intact: the check refuses only what does
    # not fit, and the refusal left nothing behind that takes its room.
    assert results["worker:0"]["then_error"] is None, results
    assert results["worker:1"]["then_error"] is None, results
    assert results["worker:1"]["then_exact"], results


def test_full_dev_shm_fails_small_regions_too(small_dev_shm, tmp_path):
    results = _run_transfer(tmp_path, small_dev_shm, "tcp", 1024, fill=True)
    for task, r in results.items():
        _assert_shm_full(r["error"], task)


ENDPOINT = """
ep = start()
touch("ready", str(ep.port))
wait_file("done", timeout=100)
result({"alive": True})
"""


def _start_endpoint(tmp_path, prefix, tasks):
    """A tcp endpoint (worker:1) of `tasks` tasks in `prefix`; (process, port)."""
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TRANSPORT": "tcp"}
    proc = spawn_task("worker:1", ENDPOINT, make_cluster(tasks), env,
                      prefix=prefix)
    ready = tmp_path / "ready"
    deadline = time.monotonic() + 60
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    if not ready.exists():
        kill_group(proc)
        pytest.fail("endpoint did not start")
    return proc, int(ready.read_text())


def test_peer_asking_for_more_than_dev_shm_holds_gets_an_error(small_dev_shm, tmp_path):
    proc, port = _start_endpoint(tmp_path, small_dev_shm, 2)
    try:
        with wire_client.RawPeer(port, "/job:worker/task:1", SECRET) as peer:
            peer.connect_as("/job:worker/task:0")

            def open_region(name, size, credit_id):
                return peer.open_fields({
                    "name": name, "size": size, "plan_hash": "raw",
                    "credit_id": credit_id, "credit_size": 4096, "credit_shm": ""})

            code, text = open_region("hog", 128 << 20, 1)
            assert code != 0, text
            assert "/dev/shm cannot hold a shared-memory region of 134217728 bytes" in text, text
            code, fields = open_region("fits", 1 << 20, 2)
            assert code == 0, fields
            assert int(fields["size"]) == 1 << 20, fields
        (tmp_path / "done").write_text("1")
        out = collect({"worker:1": proc}, timeout=60)
        assert out["worker:1"].returncode == 0, out["worker:1"].describe()
        assert out["worker:1"].result == {"alive": True}
    finally:
        kill_group(proc)


def test_writers_share_a_region_budget_of_dev_shm(small_dev_shm, tmp_path):
    """The regions written into one endpoint may take three quarters of
    /dev/shm together (48 of 64 MiB), one writer's half of that (24 MiB):
    a writer cannot leave the others a full /dev/shm, and the refusal names
    the budget and what the writer already holds."""
    proc, port = _start_endpoint(tmp_path, small_dev_shm, 5)
    budget = SHM_MIB * 3 // 4 << 20
    # One process per writer task: a new one would be a restart, which
    # releases the old one's regions.
    incarnations = {w: os.urandom(8).hex() for w in range(5)}
    try:
        def open_region(writer, name, size):
            with wire_client.RawPeer(port, "/job:worker/task:1", SECRET,
                                     incarnation=incarnations[writer]) as peer:
                peer.connect_as(f"/job:worker/task:{writer}")
                return peer.open_fields({
                    "name": name, "size": size, "plan_hash": "raw",
                    "credit_id": 1, "credit_size": 4096, "credit_shm": ""})

        assert open_region(0, "w0/a", 16 << 20)[0] == 0
        code, text = open_region(0, "w0/b", 16 << 20)
        assert code != 0, text
        assert (f"would exceed that writer's share of this endpoint's /dev/shm "
                f"budget: its regions here hold {16 << 20} bytes" in text), text
        assert f"half of the budget of {budget} bytes (TF_RDMA_REGION_BUDGET" in text, text
        assert open_region(0, "w0/c", 8 << 20)[0] == 0  # up to its half
        assert open_region(2, "w2/a", 16 << 20)[0] == 0
        assert open_region(3, "w3/a", 8 << 20)[0] == 0  # 48 MiB in all now
        code, text = open_region(4, "w4/a", 1 << 20)
        assert code != 0, text
        assert (f"would exceed this endpoint's /dev/shm budget: the regions "
                f"written here hold {budget} bytes, the budget is {budget}"
                in text), text
        (tmp_path / "done").write_text("1")
        out = collect({"worker:1": proc}, timeout=60)
        assert out["worker:1"].returncode == 0, out["worker:1"].describe()
    finally:
        kill_group(proc)


@pytest.mark.parametrize("transport", ["auto", "shm,tcp"])
def test_one_host_with_a_dev_shm_each_never_picks_shm(small_dev_shm, tmp_path,
                                                       transport):
    """Containers with the host's network share the boot and the network
    namespace but not /dev/shm: the pair must use tcp (the reader, in a
    /dev/shm of its own, says why) and the tensor must arrive exact, where
    shm would fail to open the other's segments."""
    env = {"TEST_SYNC_DIR": str(tmp_path), "TF_RDMA_TRANSPORT": transport,
           "TEST_ELEMENTS": "1024", "TEST_THEN_ELEMENTS": "0"}
    cluster = make_cluster(2)
    procs = {"worker:1": spawn_task("worker:1", TRANSFER, cluster, env,
                                    prefix=small_dev_shm),
             "worker:0": spawn_task("worker:0", TRANSFER, cluster, env)}
    out = collect(procs, timeout=120)
    for r in out.values():
        assert r.returncode == 0, r.describe()
        assert r.result["error"] is None, r.describe()
    assert out["worker:1"].result["exact"], out["worker:1"].describe()
    reader_log = out["worker:1"].stderr
    assert "/job:worker/task:0 -> /job:worker/task:1 uses tcp" in reader_log, reader_log
    assert " uses shm" not in reader_log + out["worker:0"].stderr
    assert "each end has a /dev/shm of its own" in reader_log, reader_log


def test_doctor_compares_dev_shm_with_the_plan():
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    with tempfile.TemporaryDirectory() as mnt:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt],
                                 capture_output=True, text=True)
        if mounted.returncode != 0:
            pytest.skip("cannot mount a tmpfs: " + mounted.stderr.strip())
        try:
            with open(os.path.join(mnt, "tfrdma.1.0"), "wb") as f:
                os.posix_fallocate(f.fileno(), 0, 1 << 20)
            unchecked = system.dev_shm(0, path=mnt)
            assert unchecked["present"] and unchecked["sufficient"] is None
            assert unchecked["total"] == 8 << 20
            assert unchecked["tf_rdma_segments"] == 1
            assert unchecked["tf_rdma_bytes"] == 1 << 20
            assert unchecked["free"] == 7 << 20
            assert system.dev_shm(6 << 20, path=mnt)["sufficient"] is True
            short = system.dev_shm(16 << 20, path=mnt)
            assert short["sufficient"] is False
            assert "16777216 bytes" in short["advice"] and "--shm-size" in short["advice"]
        finally:
            subprocess.run(["umount", mnt], check=True)
    missing = system.dev_shm(1, path="/nonexistent-dev-shm")
    assert not missing["present"] and missing["sufficient"] is False
    with pytest.raises(ConfigError, match="-5"):
        system.dev_shm(-5)
