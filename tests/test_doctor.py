"""Tests of ``tf-rdma doctor``: real runs of the command on this machine.

The command is run as a real subprocess (``python -m tf_rdma.cli doctor``)
three times; what it reports is checked against the machine itself (does
``/sys/class/infiniband`` exist, what is ``RLIMIT_MEMLOCK``). Where this
machine has RDMA devices the "no RDMA" assertions do not apply and are
skipped with that reason. The pure functions (transport choice, memlock,
GID parsing) and the report's schema (checked with tests/schema_check.py)
are tested in-process.
"""

import json
import os
import resource
import subprocess
import time
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from schema_check import validate  # noqa: E402
from tf_rdma import cli  # noqa: E402
from tf_rdma.doctor import rdma, system, transports  # noqa: E402
from tf_rdma.doctor.report import SCHEMA_PATH, SCHEMA_VERSION, build_report  # noqa: E402
from tf_rdma.errors import ConfigError  # noqa: E402

HAS_KERNEL_RDMA = os.path.isdir("/sys/class/infiniband") and bool(os.listdir("/sys/class/infiniband"))
LOCAL_CLUSTER = {"worker": ["localhost:2222", "127.0.0.1:2223"]}
# 192.0.2.0/24 is TEST-NET-1 (RFC 5737): never an address of this machine.
REMOTE_CLUSTER = {"worker": ["localhost:2222", "192.0.2.7:2222"]}


def _schema():
    with open(SCHEMA_PATH, encoding="utf-8") as f:
        return json.load(f)


def _doctor(*args, env_extra=None, timeout=180):
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env.pop("TF_RDMA_TRANSPORT", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "tf_rdma.cli", "doctor", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _pair(report, a, b):
    for pair in report["transports"]["pairs"]:
        if {pair["a"], pair["b"]} == {a, b}:
            return pair
    raise AssertionError(f"no pair {a} <-> {b} in {report['transports']['pairs']!r}")


# --------------------------------------------------------------------------- subprocess runs


@pytest.fixture(scope="module")
def text_run():
    return _doctor("--cluster", json.dumps(LOCAL_CLUSTER), "--task", "worker:0")


@pytest.fixture(scope="module")
def json_run():
    tf_config = {"cluster": REMOTE_CLUSTER, "task": {"type": "worker", "index": 0}}
    return _doctor("--json", "--plan-bytes", str(1 << 40), env_extra={"TF_CONFIG": json.dumps(tf_config)})


@pytest.fixture(scope="module")
def require_run():
    # pyverbs hidden (no dist-packages fallback), tcp forced, --require-rdma.
    return _doctor("--json", "--require-rdma", "--no-dist-packages", "--cluster", json.dumps(LOCAL_CLUSTER),
                   env_extra={"TF_RDMA_TRANSPORT": "tcp"})


def test_text_report_on_this_machine(text_run):
    assert text_run.returncode == 0, text_run.stderr[-3000:]
    out = text_run.stdout
    assert "pyverbs:" in out and "memlock (ulimit -l):" in out
    if not HAS_KERNEL_RDMA:
        # The engine's own verdict (the verbs plugin is built here).
        assert "verbs: not usable (libibverbs cannot list RDMA devices" in out or \
            "verbs: not usable (no RDMA devices" in out, out
    assert "/job:worker/task:0 <-> /job:worker/task:1: shm (both tasks are on loopback" in out
    if HAS_KERNEL_RDMA:
        pytest.skip("this machine has RDMA devices in /sys/class/infiniband: no 'no RDMA' report")
    assert "RDMA: no RDMA devices" in out
    if not os.path.exists("/sys/class/infiniband"):
        assert "/sys/class/infiniband is absent" in out.splitlines()[0], out


def test_json_report_validates_and_matches_this_machine(json_run):
    assert json_run.returncode == 0, json_run.stderr[-3000:]
    report = json.loads(json_run.stdout)
    assert validate(report, _schema()) == []
    assert report["schema_version"] == SCHEMA_VERSION
    # Memlock is what this process inherits from the same shell.
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    mem = report["memlock"]
    if soft == resource.RLIM_INFINITY:
        assert mem["soft"] is None and mem["soft_text"] == "unlimited" and mem["sufficient"] is True
    else:
        assert mem["soft"] == soft and mem["sufficient"] is (soft >= 1 << 40)
    # Transport: TF_CONFIG's task, a remote peer → tcp.
    tr = report["transports"]
    assert tr["cluster_source"] == "TF_CONFIG" and tr["task"] == "/job:worker/task:0"
    pair = _pair(report, "/job:worker/task:0", "/job:worker/task:1")
    assert pair["transport"] == "tcp" and "192.0.2.7" in pair["reason"]
    assert tr["verbs"]["available"] is False
    sc = report["kernel"]["sys_class_infiniband"]
    assert sc["present"] == os.path.isdir("/sys/class/infiniband")
    if HAS_KERNEL_RDMA:
        pytest.skip("this machine has RDMA devices: the 'no RDMA' assertions do not apply")
    assert report["rdma"]["usable"] is False and report["devices"] == []
    assert report["self_test"]["ran"] is False
    if not sc["present"]:
        assert "/sys/class/infiniband is absent" in report["rdma"]["reason"]
        assert report["kernel"]["reason"].startswith("the kernel has no InfiniBand/RDMA support")


def test_softnic_is_reported_as_emulated():
    # softnic (tests/softnic/) through pyverbs: a device the engine can use,
    # which the report must never pass off as hardware.
    from conftest import SOFTNIC_DIR, softnic_env  # pylint: disable=import-outside-toplevel

    if not os.path.exists(os.path.join(SOFTNIC_DIR, "libibverbs.so.1")):
        pytest.fail("softnic is not built: `make install` builds it (make softnic)")
    env = softnic_env()
    run = _doctor("--json", "--cluster", json.dumps(LOCAL_CLUSTER), "--task", "worker:0",
                  env_extra={"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert validate(report, _schema()) == []
    if not report["pyverbs"]["importable"]:
        pytest.skip(f"pyverbs does not import here: {report['pyverbs']['error']}")
    assert [d["name"] for d in report["devices"]] == ["softnic0"]
    assert report["devices"][0]["emulated"] is True
    gids = {g["index"]: g["type"] for g in report["devices"][0]["ports"][0]["gids"]}
    assert gids[3] == "RoCE v2" and gids[2] == "RoCE v1"  # softnic's table: v1, v2 per address
    assert report["transports"]["verbs"]["available"] is True
    text = _doctor("--cluster", json.dumps(LOCAL_CLUSTER), "--task", "worker:0",
                   env_extra={"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})
    assert "softnic0" in text.stdout and "EMULATED" in text.stdout, text.stdout


def test_require_rdma_without_pyverbs_and_forced_tcp(require_run):
    report = json.loads(require_run.stdout)
    assert validate(report, _schema()) == []
    assert _pair(report, "/job:worker/task:0", "/job:worker/task:1")["transport"] == "tcp"
    assert report["transports"]["setting"] == "tcp"
    pv = report["pyverbs"]
    if pv["source"] != "environment":
        # Only the distribution's copy exists, and the fallback is off: not importable, said why.
        assert pv["importable"] is False and pv["error"] and "pyverbs" in pv["error"]
    if report["rdma"]["usable"]:
        pytest.skip("this machine has a usable RDMA port: --require-rdma succeeds")
    assert require_run.returncode == 1, require_run.stderr[-3000:]


# --------------------------------------------------------------------------- in-process


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--plan-bytes", "lots"])
    assert info.value.code == 2
    assert "'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        cli.main(["doctor", "--cluster", '{"worker": ["a:1"]}', "--task", "ps:0"])
    assert info.value.code == 2
    assert "ps:0" in capsys.readouterr().err


NO_VERBS = {"available": False, "device": None, "reason": "no RDMA devices"}
MLX = {"available": True, "device": "mlx5_0 port 1, RoCE, RoCE v2 GID 3 (10.1.1.1), MTU 4096",
       "reason": None}


def test_transport_choice_rules():
    local = {"localhost", "myhost", "10.1.1.1"}
    two = json.dumps({"worker": ["myhost:1", "10.1.1.1:2"], "ps": ["192.0.2.9:3"]})
    result = transports.transport_choice(two, env={}, local=local, verbs=NO_VERBS)
    assert _pair({"transports": result}, "/job:worker/task:0", "/job:worker/task:1")["transport"] == "shm"
    assert _pair({"transports": result}, "/job:worker/task:0", "/job:ps/task:0")["transport"] == "tcp"
    forced = transports.transport_choice(two, env={"TF_RDMA_TRANSPORT": "shm"}, local=local, verbs=NO_VERBS)
    remote = _pair({"transports": forced}, "/job:worker/task:1", "/job:ps/task:0")
    assert remote["transport"] is None and "no common transport" in remote["reason"]
    # verbs first where usable, in the order TF_RDMA_TRANSPORT gives.
    rdma = transports.transport_choice(two, env={}, local=local, verbs=MLX)
    assert {p["transport"] for p in rdma["pairs"]} == {"verbs"}
    assert "mlx5_0" in rdma["pairs"][0]["reason"]
    shm_first = transports.transport_choice(two, env={"TF_RDMA_TRANSPORT": "shm,verbs"}, local=local,
                                        verbs=MLX)
    assert _pair({"transports": shm_first}, "/job:worker/task:0", "/job:worker/task:1")["transport"] == "shm"
    assert _pair({"transports": shm_first}, "/job:worker/task:0", "/job:ps/task:0")["transport"] == "verbs"
    # Verbs demanded (no tcp to fall back on) but unusable: the endpoint does not start.
    demanded = transports.transport_choice(two, env={"TF_RDMA_TRANSPORT": "shm,verbs"}, local=local,
                                       verbs=NO_VERBS)
    assert {p["transport"] for p in demanded["pairs"]} == {None}
    assert "asks for verbs, which is not usable here (no RDMA devices)" in demanded["pairs"][0]["reason"]
    # With tcp in the list it falls back like auto.
    fallback = transports.transport_choice(two, env={"TF_RDMA_TRANSPORT": "shm,verbs,tcp"}, local=local,
                                       verbs=NO_VERBS)
    assert _pair({"transports": fallback}, "/job:worker/task:0", "/job:worker/task:1")["transport"] == "shm"
    assert _pair({"transports": fallback}, "/job:worker/task:0", "/job:ps/task:0")["transport"] == "tcp"
    only_me = transports.transport_choice(two, task="/job:ps/task:0", env={}, local=local)
    assert len(only_me["pairs"]) == 2
    assert transports.transport_choice(None, env={}, local=local)["pairs"] == []
    with pytest.raises(ConfigError, match="'bogus'"):
        transports.transport_choice(two, env={"TF_RDMA_TRANSPORT": "bogus"}, local=local)
    with pytest.raises(ConfigError, match="not valid JSON"):
        transports.transport_choice("{nope", env={}, local=local)


def test_memlock_and_gid_helpers():
    assert system.memlock(0)["sufficient"] is None
    with pytest.raises(ConfigError, match="-1"):
        system.memlock(-1)
    assert rdma._gid_ip("0000:0000:0000:0000:0000:ffff:0a00:0001") == "10.0.0.1"
    assert rdma._gid_ip("fe80:0000:0000:0000:0202:c9ff:fe00:0001") == "fe80::202:c9ff:fe00:1"
    assert rdma._gid_ip("0000:0000:0000:0000:0000:0000:0000:0000") is None
    assert rdma._gid_type_name("RoCE v2", "Ethernet") == "RoCE v2"
    assert rdma._gid_type_name("IB/RoCE v1", "Ethernet") == "RoCE v1"
    assert rdma._gid_type_name("IB/RoCE v1", "InfiniBand") == "IB"
    # pyverbs' query_gid_type: enum ibv_gid_type_sysfs (1 is RoCE v2).
    assert rdma._gid_type_name(1, "Ethernet") == "RoCE v2"
    assert rdma._gid_type_name(0, "Ethernet") == "RoCE v1"
    assert rdma._gid_type_name(0, "InfiniBand") == "IB"


def test_validator_rejects_bad_reports():
    schema = _schema()
    report = build_report(env={})
    assert validate(report, schema) == []
    bad = json.loads(json.dumps(report))
    bad["rdma"]["usable"] = "no"
    del bad["memlock"]["soft"]
    bad["extra"] = 1
    errors = validate(bad, schema)
    assert any("$.rdma.usable: 'no'" in e for e in errors)
    assert any("'soft' is missing" in e for e in errors)
    assert any("'extra' is not allowed" in e for e in errors)


def test_plan_transports_predicts_every_pair_of_the_cluster():
    """explain()'s transports: every planned pair of TF_CONFIG's cluster is
    predicted, whatever this process's own task; other pairs say why not."""
    tf_config = {"cluster": {"worker": ["localhost:1", "localhost:2"], "ps": ["192.0.2.9:3"]},
                 "task": {"type": "worker", "index": 0}}
    env = {"TF_CONFIG": json.dumps(tf_config)}
    rows = transports.plan_transports([("worker:1", "ps:0"), ("worker:0", "worker:1"),
                                   ("worker:0", "chief:0")], env=env)
    assert [r["status"] for r in rows] == ["expected", "expected", "unknown"], rows
    assert rows[0]["src"] == "/job:worker/task:1" and rows[0]["dst"] == "/job:ps/task:0"
    assert rows[0]["transport"] in ("tcp", "verbs") and rows[1]["transport"] in ("shm", "verbs")
    assert "192.0.2.9" in rows[0]["reason"] or rows[0]["transport"] == "verbs"
    assert "not in the cluster" in rows[2]["reason"]
    alone = transports.plan_transports([("worker:0", "worker:1")], env={})
    assert alone[0]["status"] == "unknown" and "no cluster" in alone[0]["reason"]


# --------------------------------------------------------------------------- --reach

ENDPOINT_ONLY = """
ep = start()
touch("ready", str(ep.port))
wait_file("done", timeout=120)
"""


def test_reach_says_which_ports_of_each_peer_answer(tmp_path):
    """With a tf_rdma endpoint of worker:1 running and nothing on its gRPC
    port, `--reach` from worker:0 finds the endpoint and not the gRPC
    server, says why, and reports the host identity the handshake uses."""
    from conftest import collect, kill_group, make_cluster, spawn_task

    cluster = make_cluster(2)
    proc = spawn_task("worker:1", ENDPOINT_ONLY, cluster, {"TEST_SYNC_DIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "no endpoint"
            time.sleep(0.1)
        run = _doctor("--json", "--reach", "--cluster", json.dumps(cluster), "--task", "worker:0")
        text = _doctor("--reach", "--cluster", json.dumps(cluster), "--task", "worker:0")
        (tmp_path / "done").write_text("1")
        collect({"worker:1": proc}, timeout=60)
    finally:
        kill_group(proc)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert validate(report, _schema()) == []
    (peer,) = report["transports"]["reach"]
    grpc_address = cluster["worker"][1]
    endpoint_port = int((tmp_path / "ready").read_text())
    assert peer["task"] == "/job:worker/task:1"
    assert peer["endpoint"] == {"address": f"127.0.0.1:{endpoint_port}",
                                "reachable": True, "error": None}, peer
    assert peer["grpc"]["address"] == grpc_address and not peer["grpc"]["reachable"], peer
    assert "refused" in peer["grpc"]["error"].lower(), peer
    st = os.stat("/dev/shm")
    assert report["host"]["dev_shm_id"] == f"{st.st_dev}:{st.st_ino}"
    assert report["host"]["netns"] == os.readlink("/proc/self/ns/net")
    assert (f"/job:worker/task:1: gRPC {grpc_address} NOT reachable" in text.stdout
            and f"tf_rdma 127.0.0.1:{endpoint_port} reachable" in text.stdout), text.stdout
