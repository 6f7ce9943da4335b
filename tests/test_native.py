"""The engine's rules without TensorFlow: tf_rdma._native.

``_native.choose_transport`` is kernels/common/transport_choice.h's
ChooseTransport, the rule the engine's handshake and start-up log apply; the
cases below are those of tests/cpp/engine_unittest.cc ("transport_choice_*"),
so the two languages are checked against the same answers.
``_native.remove_stale_segments`` is region.h's collector, which the
launcher runs after its processes exit.
"""

import fcntl
import os

import pytest

from tf_rdma import _native
from tf_rdma.errors import ConfigError, LibraryError

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets

# Pids that cannot run (above pid_max): these names belong to the test only.
NOBODY = 99999999
OTHER = 99999998


def identified(task, allowed, verbs, boot, netns, shm="12:1", **more):
    """An end as the handshake knows it."""
    return dict(task=task, allowed=allowed, verbs=verbs, boot_id=boot, netns=netns,
                shm_id=shm, **more)


def at(task, host, kind, allowed="auto", verbs=False, **more):
    """An end as a prediction knows it (``allowed`` None: as the chooser's)."""
    return dict(task=task, host=host, host_kind=kind, allowed=allowed, verbs=verbs, **more)


def test_same_host_by_boot_id_and_netns():
    writer = identified("w", "shm,tcp", False, "boot1", "net:[1]", host="10.0.0.9",
                        host_kind="remote")
    c = _native.choose_transport(identified("r", "auto", False, "boot1", "net:[1]"), writer)
    assert c["transport"] == "shm" and c["same_host"] and c["fallback"] is None
    assert "same boot id and network namespace" in c["host_reason"]
    assert c["shared_shm"] and c["reason"] == c["host_reason"] + ", and one /dev/shm"


def test_one_host_needs_one_dev_shm():
    reader = identified("r", "auto", False, "boot1", "net:[1]", shm="12:1")
    c = _native.choose_transport(reader, identified("w", "auto", False, "boot1", "net:[1]",
                                                    shm="40:1"))
    assert c["transport"] == "tcp" and c["same_host"] and not c["shared_shm"]
    assert "each end has a /dev/shm of its own" in c["reason"]
    c = _native.choose_transport(reader, identified("w", "shm", False, "boot1", "net:[1]",
                                                    shm="40:1"))
    assert c["transport"] is None and "one host, but not one /dev/shm" in c["reason"]


def test_different_netns_or_boot():
    reader = identified("r", "auto", False, "boot1", "net:[1]", host_kind="loopback")
    c = _native.choose_transport(
        reader, identified("w", "auto", False, "boot1", "net:[2]", host_kind="loopback"))
    assert c["transport"] == "tcp" and not c["same_host"]
    assert "different network namespaces" in c["host_reason"]
    c = _native.choose_transport(reader, identified("w", "auto", False, "boot2", "net:[1]"))
    assert c["transport"] == "tcp" and "boot ids differ" in c["host_reason"]


@pytest.mark.parametrize("host, kind, same, why", [
    ("127.0.0.1", "loopback", True, "addresses of this host"),
    ("10.1.1.1", "local", True, "addresses of this host"),
    ("192.0.2.9", "remote", False, "different hosts: b is on 192.0.2.9 (not this machine)"),
])
def test_address_only_prediction(host, kind, same, why):
    c = _native.choose_transport(at("a", "", "local"), at("b", host, kind, allowed=None))
    assert c["same_host"] is same
    assert c["transport"] == ("shm" if same else "tcp")
    assert why in c["host_reason"]
    # One host by the addresses says nothing of /dev/shm: the prediction
    # names what the handshake does where each end has its own.
    assert c["fallback"] == ("tcp" if same else None)
    assert ("which the handshake checks" in c["reason"]) is same, c["reason"]


def test_address_rule_details():
    c = _native.choose_transport(at("a", "localhost", "loopback"),
                                 at("b", "127.0.0.2", "loopback"))
    assert "both tasks are on loopback addresses" in c["host_reason"]
    c = _native.choose_transport(at("a", "Node7", "remote"), at("b", "node7", "remote"))
    assert c["transport"] == "shm" and "both tasks are on host Node7" in c["host_reason"]
    c = _native.choose_transport(at("a", "node7", "remote"), at("b", "node8", "remote"))
    assert not c["same_host"] and "a is on node7, b is on node8" in c["host_reason"]
    # One end identified is not enough: the addresses decide.
    known = identified("a", "auto", False, "boot1", "net:[1]", host_kind="local")
    c = _native.choose_transport(known, at("b", "192.0.2.9", "remote", allowed=None))
    assert not c["same_host"] and "not this machine" in c["host_reason"]


def test_hosts_are_judged_here_without_a_kind():
    c = _native.choose_transport({"task": "a", "allowed": "auto", "verbs": False,
                                  "host": "127.0.0.1"},
                                 {"task": "b", "host": "localhost"})
    assert c["transport"] == "shm"
    assert c["host_reason"] == "both tasks are on loopback addresses of this host"


def test_verbs_allowed_and_unavailable():
    r = identified("r", "auto", True, "b", "n", verbs_detail="mlx5_0 port 1")
    c = _native.choose_transport(r, identified("w", "verbs,shm,tcp", True, "b", "n"))
    assert c["transport"] == "verbs" and c["fallback"] is None
    assert "both ends have a usable RDMA device (mlx5_0" in c["reason"]
    # The peer has none: the next transport that fits.
    assert _native.choose_transport(
        r, identified("w", "shm,tcp", False, "b", "n"))["transport"] == "shm"
    # This end has none: verbs is skipped although the peer offers it.
    r["verbs"] = False
    assert _native.choose_transport(
        r, identified("w", "auto", True, "b", "other"))["transport"] == "tcp"
    # A prediction: the peer's device is not known.
    me = at("a", "", "local", verbs=True, verbs_detail="mlx5_0 port 1")
    c = _native.choose_transport(me, at("b", "192.0.2.9", "remote", allowed=None, verbs=None))
    assert (c["transport"], c["fallback"]) == ("verbs", "tcp")
    assert ("RDMA device mlx5_0 port 1 (when the other end has a usable device too; "
            "else tcp)") in c["reason"]
    c = _native.choose_transport(me, at("b", "127.0.0.1", "loopback", allowed=None, verbs=None))
    assert c["fallback"] == "shm"
    # Verbs without tcp where verbs is not usable: the endpoint does not start.
    strict = at("a", "", "local", allowed="shm,verbs", verbs_detail="no RDMA devices")
    c = _native.choose_transport(strict, at("b", "127.0.0.1", "loopback", allowed=None))
    assert c["transport"] is None
    assert ("TF_RDMA_TRANSPORT=shm,verbs asks for verbs, which is not usable here "
            "(no RDMA devices)") in c["reason"]
    strict["allowed"] = ["shm", "verbs", "tcp"]
    c = _native.choose_transport(strict, at("b", "192.0.2.9", "remote", allowed=None))
    assert c["transport"] == "tcp"


def test_allowed_list_order():
    r = identified("r", "tcp,shm", False, "b", "n")
    w = identified("w", "shm,tcp", False, "b", "n")
    c = _native.choose_transport(r, w)
    assert c["transport"] == "tcp" and "tcp comes before shm" in c["reason"]
    assert _native.choose_transport(w, r)["transport"] == "shm"
    c = _native.choose_transport(identified("r", "tcp", False, "b", "n"), w)
    assert "shm is not among the transports both ends allow" in c["reason"]
    c = _native.choose_transport(identified("/job:w/task:1", "verbs,tcp", False, "b", "n"),
                                 identified("/job:w/task:0", "verbs", True, "b2", "n"))
    assert c["transport"] is None
    assert c["reason"] == ("no common transport: /job:w/task:0 allows verbs, "
                           "/job:w/task:1 allows tcp (different hosts)")


def test_bad_input_is_a_config_error():
    with pytest.raises(ConfigError, match="'rdma' is not auto or a list"):
        _native.choose_transport({"allowed": "rdma"}, {})
    with pytest.raises(ConfigError, match="'shm,shm' is not auto or a list"):
        _native.choose_transport({"allowed": "auto"}, {"allowed": "shm,shm"})
    with pytest.raises(ConfigError, match="host kind 'mars'"):
        _native.choose_transport({"allowed": "auto", "host_kind": "mars"}, {})
    with pytest.raises(ConfigError, match="unknown key"):
        _native.choose_transport({"allowed": "auto", "hots": "x"}, {})


# TF_RDMA_TRANSPORT is parsed in Python (settings: stripped and lower-cased,
# refused before any endpoint starts) and in C++ (the engine, which gets
# Python's normalized value, and the peers' lists in a HELLO). What Python
# refuses the C++ refuses; what it accepts, normalized, the C++ reads alike.
@pytest.mark.parametrize("value", [
    "auto", "verbs", "shm", "tcp", "shm,tcp", "tcp,shm", "verbs,shm,tcp", "tcp,verbs",
    "", "rdma", "shm,shm", "shm,,tcp", "SHM", "shm tcp", "auto,shm", ",shm", "shm,"])
def test_transport_setting_parsers_agree(value):
    from tf_rdma import settings  # pylint: disable=import-outside-toplevel

    def chosen_by_the_engine(setting):
        # Every transport is usable and the peer allows all three: the
        # chooser's first allowed transport is chosen.
        try:
            return _native.choose_transport(identified("r", setting, True, "b", "n"),
                                            identified("w", "auto", True, "b", "n"))["transport"]
        except ConfigError:
            return None

    try:
        normalized = settings.transport(env={"TF_RDMA_TRANSPORT": value})
    except ConfigError:
        assert chosen_by_the_engine(value) is None, value
        return
    assert chosen_by_the_engine(normalized) == settings.allowed_transports(normalized)[0]


def make_segment(name, size=4096):
    path = f"/dev/shm/{name}"
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_remove_stale_segments_keeps_locked_and_non_regular_entries():
    stale = make_segment(f"tfrdma.{NOBODY}.1", size=8192)
    locked = make_segment(f"tfrdma.{NOBODY}.2")
    other_owner = make_segment(f"tfrdma.{OTHER}.1")
    directory = f"/dev/shm/tfrdma.{NOBODY}.3"
    fifo = f"/dev/shm/tfrdma.{NOBODY}.4"
    os.mkdir(directory)
    os.mkfifo(fifo)
    holder = open(locked, "rb+")  # a live owner's lock (region.h)
    try:
        fcntl.flock(holder, fcntl.LOCK_SH)
        got = _native.remove_stale_segments(owner_pids=[NOBODY])
        assert got == {"removed": [f"tfrdma.{NOBODY}.1"], "bytes": 8192, "errors": []}
        assert not os.path.exists(stale)
        assert os.path.exists(locked), "removed a segment whose owner lives"
        assert os.path.isdir(directory) and os.path.exists(fifo), "removed a non-segment"
        assert os.path.exists(other_owner), "removed another owner's segment"
        assert _native.remove_stale_segments(owner_pids=[]) == {
            "removed": [], "bytes": 0, "errors": []}
        holder.close()
        # Once its owner is gone it is stale too; without pids, every owner's.
        got = _native.remove_stale_segments()
        assert {f"tfrdma.{NOBODY}.2", f"tfrdma.{OTHER}.1"} <= set(got["removed"])
        assert not os.path.exists(locked) and not os.path.exists(other_owner)
    finally:
        holder.close()
        for path in (stale, locked, other_owner, fifo):
            if os.path.lexists(path):
                os.unlink(path)
        os.rmdir(directory)


def test_a_missing_library_is_a_library_error(monkeypatch, tmp_path):
    monkeypatch.setattr(_native, "_library", None)
    monkeypatch.setattr(_native, "library_path", lambda: str(tmp_path / _native.LIBRARY_FILE))
    with pytest.raises(LibraryError, match="native library is missing"):
        _native.choose_transport({"allowed": "auto"}, {})
    with pytest.raises(LibraryError, match="native library is missing"):
        _native.remove_stale_segments()
