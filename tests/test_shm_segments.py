"""Shared-memory segments left by dead processes (kernels/common/region.h).

A segment's owner holds a shared flock on it while it lives; the collection
that every endpoint runs when it starts (and
``tf_rdma.server.remove_stale_segments``) removes the segments nobody holds.
The lock decides, not the pid in the name: pids are reused. The collection
of a killed peer's segments by a live process is tested with the killed
scenario in tests/test_failures.py.
"""

import fcntl
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import run_tasks, shm_segments
from tf_rdma import server

pytestmark = pytest.mark.timeout(120)

# A pid that cannot be running (above pid_max), so that these names belong
# to nobody but the test.
NOBODY = 99999999


def make_segment(name, size=4096):
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_collection_removes_unlocked_segments_and_keeps_locked_ones():
    locked = make_segment(f"tfrdma.{NOBODY}.0")
    stale = make_segment(f"tfrdma.{NOBODY}.1", size=8192)
    other = make_segment(f"not_tfrdma.{NOBODY}.2")
    # A live owner: another process holds the lock (as an engine does for
    # every region it creates), whatever the pid in the name says.
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, sys
            f = open({locked!r}, "rb+")
            fcntl.flock(f, fcntl.LOCK_SH)
            print("locked", flush=True)
            sys.stdin.read()  # until the test closes our stdin
        """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        count, nbytes = server.remove_stale_segments()
        assert not os.path.exists(stale)
        assert count >= 1 and nbytes >= 8192
        assert os.path.exists(locked), "removed a segment whose owner lives"
        assert os.path.exists(other), "removed a file that is not tf_rdma's"
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # Once its owner is gone the segment is stale too.
    server.remove_stale_segments()
    assert not os.path.exists(locked)
    os.unlink(other)


def test_an_endpoint_collects_when_it_starts():
    stale = make_segment(f"tfrdma.{NOBODY}.7", size=3 * 4096)
    lookalike = make_segment(f"tfrdma.{NOBODY}.notes")  # not a segment name
    try:
        out = run_tasks({"worker:0": """
            ep = start()
            result({"pid": os.getpid()})
        """})
        assert not os.path.exists(stale)
        assert os.path.exists(lookalike)
        log = out["worker:0"].stderr
        assert "that processes which died had left in /dev/shm" in log, log
    finally:
        os.unlink(lookalike)


def test_names_taken_by_a_live_segment_are_skipped(tmp_path):
    # worker:1 takes the first names its regions would get (as a segment of
    # a process that had the same pid and still has an owner would): its
    # regions must go to the next free names and the transfer must work.
    program = """
        import fcntl
        held = []
        if task == "worker:1":
            for n in range(3):
                path = "/dev/shm/tfrdma.%d.%d" % (os.getpid(), n)
                f = open(path, "wb+")
                f.truncate(4096)
                fcntl.flock(f, fcntl.LOCK_SH)
                held.append(f)
        plan = tf_rdma.Plan([tf_rdma.Transfer("x", "worker:0", "worker:1",
                                              "int32", [5])], name="taken")
        ep = start()
        if task == "worker:0":
            tf_rdma.ops.send(tf.range(5), plan, "x")
            result({"pid": os.getpid()})
        else:
            got = tf_rdma.ops.recv(plan, "x").numpy().tolist()
            prefix = "tfrdma.%d." % os.getpid()
            names = sorted(int(n[len(prefix):]) for n in os.listdir("/dev/shm")
                           if n.startswith(prefix))
            result({"pid": os.getpid(), "got": got, "numbers": names})
            for f in held:
                os.unlink(f.name)
    """
    out = run_tasks({"worker:0": program, "worker:1": program},
                    env={"TF_RDMA_TRANSPORT": "shm"})
    r = out["worker:1"].result
    assert r["got"] == [0, 1, 2, 3, 4]
    # Its own regions came after the three taken names.
    assert r["numbers"][:3] == [0, 1, 2] and len(r["numbers"]) > 3, r
    assert shm_segments(pids=[res.result["pid"] for res in out.values()]) == []
