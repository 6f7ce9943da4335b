"""The verbs transport on any machine: built, loaded, asked, and refused or
skipped for a reason that is logged and named.

What runs everywhere (this repository's CI has no RDMA NIC):
- the plugin is built next to the op library, exports its entry point and is
  the only library linked to libibverbs;
- the engine's own verdict on verbs (tf_rdma.server.verbs_status) names what
  is missing, including a missing or foreign plugin;
- bad TF_RDMA_VERBS_* values are errors naming the variable and the allowed
  values, both in Python and in the plugin;
- with TF_RDMA_TRANSPORT=auto two real processes fall back to shm, each
  logging the reason once and one line per peer pair at start;
  TF_RDMA_TRANSPORT=verbs (alone or in a list) refuses to start with the
  reason; a list's order is the order of preference.

The verbs data path itself (queue pair connect, writes, notices, credits,
256 MiB, 1,000 steps, a killed peer, collectives) is exercised by the
transport-parametrized tests in test_transfer.py, test_failures.py,
test_smoke.py and test_collectives.py, which skip their verbs cases without
an RDMA port (TF_RDMA_TEST_VERBS=1 turns those skips into failures).
"""

import ctypes
import os
import subprocess

import pytest

from conftest import run_tasks, verbs_missing
from tf_rdma import server, settings
from tf_rdma.errors import ConfigError

pytestmark = pytest.mark.timeout(180)

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tf_rdma")
PLUGIN = os.path.join(PACKAGE, "_tf_rdma_verbs.so")
CORE = os.path.join(PACKAGE, "_tf_rdma_ops.so")
HAS_VERBS = verbs_missing() is None


def _headers_present():
    proc = subprocess.run([os.environ.get("CXX", "g++"), "-E", "-x", "c++", "-"], input="#include <infiniband/verbs.h>\n",
                          capture_output=True, text=True)
    return proc.returncode == 0


def _needed(path):
    """The shared libraries `path` loads (ldd)."""
    out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def test_plugin_is_built_and_only_it_links_libibverbs():
    if not _headers_present():
        pytest.fail("<infiniband/verbs.h> is missing: `make test` installs libibverbs-dev")
    assert os.path.exists(PLUGIN), "setup.py did not build the verbs plugin"
    assert any(name.startswith("libibverbs.so") for name in _needed(PLUGIN))
    assert not any(name.startswith("libibverbs") for name in _needed(CORE)), \
        "the core op library must load on machines without libibverbs"
    plugin = ctypes.CDLL(PLUGIN, mode=os.RTLD_LOCAL | os.RTLD_NOW)
    assert hasattr(plugin, "tf_rdma_verbs_open_v2")


def test_engine_says_why_verbs_is_not_usable():
    status = server.verbs_status(env={})
    if HAS_VERBS:
        assert status["available"] and " port " in status["device"], status
        return
    assert status == {"available": False, "device": None, "reason": status["reason"]}
    reason = status["reason"]
    assert reason, status
    if not os.path.exists("/sys/class/infiniband"):
        # The kernel has no RDMA support: said in so many words.
        assert "RDMA devices" in reason and "/sys/class/infiniband is absent" in reason, reason


def test_missing_or_foreign_plugin_is_named(monkeypatch):
    monkeypatch.setenv("TF_RDMA_VERBS_LIBRARY", "/nonexistent/_tf_rdma_verbs.so")
    status = server.verbs_status(env={})
    assert not status["available"]
    assert "TF_RDMA_VERBS_LIBRARY=/nonexistent/_tf_rdma_verbs.so names no file" in status["reason"]
    # A real shared library that is not the plugin: refused by its entry point's name.
    monkeypatch.setenv("TF_RDMA_VERBS_LIBRARY", CORE)
    status = server.verbs_status(env={})
    assert not status["available"]
    assert "has no tf_rdma_verbs_open_v2" in status["reason"] and "rebuild" in status["reason"]


@pytest.mark.parametrize("variable, value, allowed", [
    ("TF_RDMA_VERBS_MTU", "1000", "256, 512, 1024, 2048, 4096"),
    ("TF_RDMA_VERBS_PORT", "0", "[1, 255]"),
    ("TF_RDMA_VERBS_GID_INDEX", "-1", "[0, 255]"),
    ("TF_RDMA_VERBS_SL", "16", "[0, 15]"),
    ("TF_RDMA_VERBS_TRAFFIC_CLASS", "x", "[0, 255]"),
    ("TF_RDMA_VERBS_TIMEOUT", "32", "[1, 31]"),
    ("TF_RDMA_VERBS_RETRY_COUNT", "8", "[0, 7]"),
    ("TF_RDMA_VERBS_QUEUE_DEPTH", "2", "[4, 32768]"),
    ("TF_RDMA_VERBS_INLINE", "4096", "[0, 1024]"),
    ("TF_RDMA_VERBS_DEVICE", "mlx5 0", "device name"),
])
def test_bad_verbs_settings_name_variable_and_allowed_values(variable, value, allowed):
    with pytest.raises(ConfigError) as info:
        settings.verbs_config(env={variable: value})
    message = str(info.value)
    assert variable in message and repr(value) in message and allowed in message


@pytest.mark.parametrize("line, message", [
    ("verbs_mtu=1000", "TF_RDMA_VERBS_MTU=1000 is not one of 256, 512, 1024, 2048, 4096"),
    ("verbs_queue_depth=2", "TF_RDMA_VERBS_QUEUE_DEPTH=2 is not an integer in [4, 32768]"),
    ("verbs_timeout=0", "TF_RDMA_VERBS_TIMEOUT=0 is not an integer in [1, 31]"),
])
def test_plugin_checks_settings_too(line, message):
    """The plugin checks ranges before it looks for a device (a config that
    bypasses Python still gets an error, never an abort)."""
    from tf_rdma import _loader

    out = ctypes.create_string_buffer(4096)
    rc = _loader.load().c.tfrdma_verbs_probe(line.encode(), out, len(out))
    assert rc == 1  # InvalidArgument
    assert out.value.decode() == message


def test_valid_verbs_settings_reach_the_engine_config():
    env = {"TF_RDMA_VERBS_DEVICE": "mlx5_1", "TF_RDMA_VERBS_MTU": "2048",
           "TF_RDMA_VERBS_GID_INDEX": "3", "TF_RDMA_VERBS_QUEUE_DEPTH": " 64 "}
    assert settings.verbs_config(env=env) == [
        "verbs_device=mlx5_1", "verbs_gid_index=3", "verbs_mtu=2048", "verbs_queue_depth=64"]
    assert settings.transport(env={"TF_RDMA_TRANSPORT": " SHM, Verbs "}) == "shm,verbs"
    assert settings.allowed_transports("auto") == ["verbs", "shm", "tcp"]
    for bad in ("rdma", "shm,shm", "shm,", ""):
        with pytest.raises(ConfigError, match="TF_RDMA_TRANSPORT"):
            settings.transport(env={"TF_RDMA_TRANSPORT": bad})


FALLBACK = """
plan = tf_rdma.Plan([tf_rdma.Transfer("x", "worker:0", "worker:1", "float32", [1024])])
ep = start()
tf_rdma.start_endpoint(task, cluster)  # a second start of the same task: no new log line
if task == "worker:0":
    for step in range(3):
        tf_rdma.ops.send(tf.fill([1024], float(step)), plan, "x")
    info = tf_rdma.endpoint_info()
    result({"pair": info["pair"], "verbs": info["verbs"],
            "spin": info["collective_spin_us"]})
else:
    got = [float(tf_rdma.ops.recv(plan, "x").numpy()[0]) for _ in range(3)]
    info = tf_rdma.endpoint_info()
    result({"got": got, "pair": info["pair"], "verbs": info["verbs"],
            "spin": info["collective_spin_us"]})
"""


def _log_lines(stderr, marker):
    return [line for line in stderr.splitlines() if marker in line]


@pytest.mark.parametrize("setting, expected", [("auto", None), ("tcp,shm", "tcp"),
                                               ("shm,verbs,tcp", "shm")])
def test_fallback_is_logged_once_with_one_line_per_pair(setting, expected):
    out = run_tasks({"worker:0": FALLBACK, "worker:1": FALLBACK},
                    env={"TF_RDMA_TRANSPORT": setting})
    chosen = expected or ("verbs" if HAS_VERBS else "shm")
    assert out["worker:1"].result["got"] == [0.0, 1.0, 2.0]
    for task, peer in (("worker:0", "worker:1"), ("worker:1", "worker:0")):
        res = out[task]
        me, other = f"/job:worker/task:{task[-1]}", f"/job:worker/task:{peer[-1]}"
        # One line per peer pair at start, with the transport it expects.
        pair_lines = _log_lines(res.stderr, f"pair {me} <-> {other} (")
        assert len(pair_lines) == 1, res.stderr
        assert pair_lines[0].endswith(
            f"): {chosen}" + (" (same host), or tcp if the peer has a /dev/shm of its own"
                              if chosen == "shm" else "")) \
            or (chosen == "verbs" and "): verbs (" in pair_lines[0]), pair_lines
        unusable = _log_lines(res.stderr, "verbs is not usable, so pairs use shm or tcp: ")
        if "verbs" in settings.allowed_transports(setting) and not HAS_VERBS:
            assert len(unusable) == 1, res.stderr  # once per process
            assert res.result["verbs"].startswith("unusable: ")
            assert res.result["verbs"][len("unusable: "):] in unusable[0]
        else:
            assert unusable == [], res.stderr
        if "verbs" not in settings.allowed_transports(setting):
            assert res.result["verbs"] == f"unusable: not asked for (TF_RDMA_TRANSPORT={setting})"
    assert out["worker:0"].result["pair"] == [f"/job:worker/task:0 -> /job:worker/task:1 {chosen}"]
    assert f"uses {chosen}" in out["worker:0"].stderr
    # Small collectives spin for their blocks where both tasks have a CPU
    # (TF_RDMA_COLLECTIVE_SPIN_US=auto); a job without collectives is not
    # told about it.
    spins = len(os.sched_getaffinity(0)) >= 2
    for res in out.values():
        assert res.result["spin"] == (500 if spins else 0)
        assert _log_lines(res.stderr, "collectives ") == [], res.stderr


COLLECTIVE = """
ep = start()
from tf_rdma import collectives as C
got = [C.all_reduce(tf.ones([4]), algorithm="oneshot").numpy().tolist()
       for _ in range(2)]
info = tf_rdma.endpoint_info()
result({"got": got, "spin": info["collective_spin_us"],
        "shares_cores": info["shares_cores"]})
"""


@pytest.mark.parametrize("setting", ["auto", "0", "750"])
def test_the_first_collective_logs_how_collectives_wait(setting):
    out = run_tasks({"worker:0": COLLECTIVE, "worker:1": COLLECTIVE},
                    env={"TF_RDMA_COLLECTIVE_SPIN_US": setting})
    auto = 500 if len(os.sched_getaffinity(0)) >= 2 else 0
    spin = auto if setting == "auto" else int(setting)
    cpus = len(os.sched_getaffinity(0))
    why = (f"(2 tasks of the cluster on this host, {cpus} "
           f"CPU{'' if cpus == 1 else 's'})" if setting == "auto"
           else "(TF_RDMA_COLLECTIVE_SPIN_US)")
    host = f"(2 tasks of the cluster on this host, {cpus} CPU{'' if cpus == 1 else 's'})"
    for res in out.values():
        assert res.result["got"] == [[2.0] * 4] * 2
        assert res.result["spin"] == spin
        assert res.result["shares_cores"] == (cpus < 2)
        lines = _log_lines(res.stderr, "collectives ")
        assert len(lines) == 1, res.stderr  # once per process
        how = (f"collectives of up to 1 MiB spin up to {spin} us for each "
               f"block before sleeping" if spin else
               "collectives sleep after a few us without their block")
        if setting != "auto":
            how += f" {why}"
        if cpus < 2:  # two tasks share the one CPU
            how += "; their inline poll yields the core between its looks"
        if setting == "auto" or cpus < 2:
            how += f" {host}"
        if cpus < 2 and os.sysconf("SC_NPROCESSORS_ONLN") > cpus:
            how += _bound_hint(cpus)
        assert lines[0].endswith(how), lines


def _bound_hint(cpus):
    return (f"; this process may use {cpus} of the host's "
            f"{os.sysconf('SC_NPROCESSORS_ONLN')} CPUs: where each task is "
            f"bound to CPUs of its own, set TF_RDMA_HOST_CPUS to the number "
            f"they share")


@pytest.mark.parametrize("host_cpus", [None, "2"])
def test_tasks_bound_by_someone_else_are_told_about_host_cpus(host_cpus):
    """Two tasks that taskset binds to one CPU each cannot tell whether it
    is the same CPU: they poll as tasks that share one and say how to tell
    them otherwise; with TF_RDMA_HOST_CPUS they spin, and say nothing more."""
    if os.sysconf("SC_NPROCESSORS_ONLN") < 2 or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to bind the tasks to")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    env = {"TF_RDMA_COLLECTIVE_SPIN_US": "auto"}
    if host_cpus:
        env["TF_RDMA_HOST_CPUS"] = host_cpus
    out = run_tasks({"worker:0": COLLECTIVE, "worker:1": COLLECTIVE}, env=env,
                    prefixes={"worker:0": ["taskset", "-c", str(first)],
                              "worker:1": ["taskset", "-c", str(second)]})
    for res in out.values():
        assert res.result["got"] == [[2.0] * 4] * 2
        assert res.result["shares_cores"] == (host_cpus is None)
        assert res.result["spin"] == (0 if host_cpus is None else 500)
        line = _log_lines(res.stderr, "collectives ")[0]
        if host_cpus is None:
            assert line.endswith(
                "their inline poll yields the core between its looks (2 tasks "
                "of the cluster on this host, 1 CPU)" + _bound_hint(1)), line
        else:
            assert "TF_RDMA_HOST_CPUS" not in line, line


@pytest.mark.parametrize("host_cpus, spin", [("2", 500), ("1", 0)])
def test_auto_spin_of_tasks_bound_to_their_own_cpus(host_cpus, spin):
    """TF_RDMA_HOST_CPUS (tf-rdma launch sets it when it binds each task to
    its own CPUs): auto compares the host's tasks with the CPUs they share,
    not with the process's own share. Two tasks on one CPU share it: their
    polls yield it (the inline path's sums stay right)."""
    out = run_tasks({"worker:0": COLLECTIVE, "worker:1": COLLECTIVE},
                    env={"TF_RDMA_COLLECTIVE_SPIN_US": "auto",
                         "TF_RDMA_HOST_CPUS": host_cpus})
    why = (f"(2 tasks of the cluster on this host, {host_cpus} "
           f"CPU{'' if host_cpus == '1' else 's'}, each task bound to its own)")
    shared = host_cpus == "1"
    for res in out.values():
        assert res.result["got"] == [[2.0] * 4] * 2
        assert res.result["spin"] == spin
        assert res.result["shares_cores"] == shared
        line = _log_lines(res.stderr, "collectives ")[0]
        assert line.endswith(
            f"; their inline poll yields the core between its looks {why}"
            if shared else f"before sleeping {why}"), res.stderr


REFUSED = """
from tf_rdma.errors import EndpointError
try:
    start()
    result({"started": True})
except EndpointError as e:
    result({"started": False, "error": str(e)})
"""


@pytest.mark.parametrize("setting", ["verbs", "shm,verbs"])
def test_transport_verbs_without_rdma_is_an_error(setting):
    if HAS_VERBS:
        pytest.skip("verbs is usable on this host: TF_RDMA_TRANSPORT=verbs starts")
    out = run_tasks({"worker:0": REFUSED}, cluster={"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                    env={"TF_RDMA_TRANSPORT": setting})
    r = out["worker:0"].result
    assert r["started"] is False
    assert (f"TF_RDMA_TRANSPORT={setting} asks for verbs, but verbs cannot be used here: "
            in r["error"]), r["error"]
    assert "RDMA" in r["error"]
