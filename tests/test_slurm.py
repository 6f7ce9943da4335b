"""``tf-rdma launch --slurm`` under a real Slurm, and its reading of Slurm's environment.

The module fixture starts a one-node Slurm cluster of its own from a scratch
directory: munged, slurmctld and slurmd (Debian's slurm-wlm), as root, with
``proctrack/linuxproc`` and ``task/none`` (no cgroups needed), the node
declared with 8 CPUs so that a step may run more tasks than this machine has
cores. Every Slurm command of the tests runs with ``SLURM_CONF`` pointing at
it. Tests that need it skip, with the reason, where the daemons cannot start
(not root, slurm-wlm not installed).

- SPMD: ``srun -n 2 tf-rdma launch --slurm --spmd`` runs RdmaStrategy Keras
  fit on two workers; their weights equal one process's (atol 1e-5 + rtol
  1e-4, as tests/test_strategy.py argues) and each other's.
- PS: ``srun -n 4 ... --slurm --ps 1 --coordinator`` runs
  examples/ps_strategy.py (chief, one ps, two workers): its losses equal
  plain ParameterServerStrategy's bit for bit, and srun ends with status 0
  because the servers stop when the coordinator's command ends.
- The shipped batch script, deploy/slurm/tf-rdma.sbatch, under ``sbatch
  --wait``: it makes the job's secret and the tasks get one cluster.
- Without Slurm: the host list and tasks-per-node syntaxes, the layout of
  roles and ports, and the errors for a process outside a step, another
  distribution, and a missing secret.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from conftest import REPO, base_env, kill_group
from tf_rdma import cluster as cluster_lib
from tf_rdma import slurm
from tf_rdma.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
SECRET = "slurm-test-secret-0123456789"


def _write_conf(scratch, node, ports):
    conf = os.path.join(scratch, "slurm.conf")
    with open(conf, "w") as f:
        f.write(textwrap.dedent(f"""\
            ClusterName=tfrdmatest
            SlurmctldHost={node}(127.0.0.1)
            SlurmctldPort={ports[0]}
            SlurmdPort={ports[1]}
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={scratch}/munge/munge.socket
            MpiDefault=none
            ProctrackType=proctrack/linuxproc
            TaskPlugin=task/none
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            SlurmdParameters=config_overrides
            ReturnToService=2
            SlurmUser=root
            SlurmdUser=root
            SlurmctldPidFile={scratch}/slurmctld.pid
            SlurmdPidFile={scratch}/slurmd.pid
            SlurmdSpoolDir={scratch}/spool
            StateSaveLocation={scratch}/state
            SlurmctldLogFile={scratch}/slurmctld.log
            SlurmdLogFile={scratch}/slurmd.log
            SchedulerType=sched/builtin
            JobCompType=jobcomp/none
            AccountingStorageType=accounting_storage/none
            NodeName={node} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
            PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
            """))
    return conf


def _tail(path, lines=15):
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError as err:
        return str(err)


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    """The environment of a one-node Slurm cluster started here."""
    if os.geteuid() != 0:
        pytest.skip("the Slurm daemons run as root here (SlurmUser=root)")
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): "
                    f"apt-get install slurm-wlm munge (make test tries once)")
    scratch = str(tmp_path_factory.mktemp("slurm"))
    for d in ("spool", "state", "munge"):
        os.mkdir(os.path.join(scratch, d), 0o700)
    key = os.path.join(scratch, "munge", "munge.key")
    with open(key, "wb") as f:
        f.write(os.urandom(1024))
    os.chmod(key, 0o600)
    node = socket.gethostname()
    conf = _write_conf(scratch, node, cluster_lib.free_ports(2))
    env = dict(os.environ, SLURM_CONF=conf)
    procs = []
    try:
        munge = os.path.join(scratch, "munge")
        procs.append(subprocess.Popen(
            ["munged", "--foreground", "--force", f"--socket={munge}/munge.socket",
             f"--key-file={key}", f"--pid-file={munge}/munged.pid",
             f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True))
        deadline = time.monotonic() + 10
        while not os.path.exists(f"{munge}/munge.socket"):
            if time.monotonic() > deadline or procs[0].poll() is not None:
                pytest.skip(f"munged did not start: {_tail(munge + '/munged.log')}")
            time.sleep(0.1)
        for argv in (["slurmctld", "-D", "-f", conf], ["slurmd", "-D", "-f", conf, "-N", node]):
            procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 30
        state = ""
        while state != "idle":
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                pytest.skip(f"the Slurm daemons did not start (node state {state!r}): "
                            f"{_tail(scratch + '/slurmctld.log')}{_tail(scratch + '/slurmd.log')}")
            time.sleep(0.3)
            r = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True,
                               text=True, timeout=10)
            state = r.stdout.strip()
        yield env
    finally:
        for p in reversed(procs):
            kill_group(p)
            p.wait()


def _srun(slurm_env, ntasks, launch_args, command, timeout=240, extra=None):
    env = base_env(dict(slurm_env, TF_RDMA_SECRET=SECRET, **(extra or {})))
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        ["srun", "-n", str(ntasks), "--label", sys.executable, "-m", "tf_rdma.cli", "launch",
         "--slurm", "--port", str(cluster_lib.free_ports(1)[0]), *launch_args, "--", *command],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


FIT = """
import json, os, sys
import numpy as np
import keras
import tensorflow as tf
from sklearn.datasets import load_digits
x, y = load_digits(return_X_y=True)
x = (x / 16.0).astype("float32")[:640]; y = y.astype("int64")[:640]
if "TF_CONFIG" in os.environ:
    import tf_rdma.distribute
    strategy = tf_rdma.distribute.RdmaStrategy()
    rank = strategy.worker_index
    name = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
else:
    strategy, rank, name = tf.distribute.get_strategy(), 0, "single"
keras.utils.set_random_seed(1 + rank)
with strategy.scope():
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10)])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
hist = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
with open(os.path.join(sys.argv[1], f"{name}.json"), "w") as f:
    json.dump({"loss": hist.history["loss"], "replicas": strategy.num_replicas_in_sync,
               "weights": [w.numpy().tolist() for w in model.trainable_weights]}, f)
"""


def _flat(weights):
    return np.concatenate([np.asarray(w, np.float64).ravel() for w in weights])


def test_spmd_rdma_strategy_under_srun(slurm_env, tmp_path):
    env = base_env()
    env.pop("TF_CONFIG", None)
    single = subprocess.Popen([sys.executable, "-c", FIT, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    r = _srun(slurm_env, 2, ["--spmd"], [sys.executable, "-c", FIT, str(tmp_path)])
    single.communicate(timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "2 tasks on 1 node(s)" in r.stderr, r.stderr[-2000:]
    got = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in (0, 1)}
    assert got[0]["replicas"] == 2 and got[0]["weights"] == got[1]["weights"]
    one = json.loads((tmp_path / "single.json").read_text())
    np.testing.assert_allclose(_flat(got[0]["weights"]), _flat(one["weights"]),
                               atol=1e-5, rtol=1e-4)


def test_parameter_server_example_under_srun(slurm_env, tmp_path):
    report = tmp_path / "ps.json"
    r = _srun(slurm_env, 4, ["--ps", "1", "--coordinator"],
              [sys.executable, "examples/ps_strategy.py", "--quick", "--json", str(report)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    got = json.loads(report.read_text())
    assert got["losses_identical"] and got["ok"], got
    assert sum(got["bytes_sent"].values()) > 0, got
    # Every server rank reported ready, and srun ended: the servers stopped.
    for task in ("ps:0", "worker:0", "worker:1"):
        assert f"tf_rdma server ready: /job:{task.split(':')[0]}/task:" in r.stdout, r.stdout


def test_shipped_sbatch_script(slurm_env, tmp_path):
    out = tmp_path / "job.out"
    show = ("import json, os; c = json.loads(os.environ['TF_CONFIG']); "
            "print('CLUSTER', json.dumps(c['cluster']), c['task']['index'], "
            "len(os.environ['TF_RDMA_SECRET']))")
    env = base_env(slurm_env)
    env.pop("TF_RDMA_SECRET", None)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env["PATH"]  # tf-rdma
    r = subprocess.run(
        ["sbatch", "--wait", "-n", "2", "-o", str(out),
         os.path.join(REPO, "deploy", "slurm", "tf-rdma.sbatch"), "--spmd",
         "--port", str(cluster_lib.free_ports(1)[0]), "--", sys.executable, "-c", show],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    text = out.read_text() if out.exists() else ""
    assert r.returncode == 0, r.stderr + text
    lines = sorted(line.split(": ", 1)[1] for line in text.splitlines()
                   if ": CLUSTER " in line)
    assert len(lines) == 2, text
    clusters = {line.split(" ", 1)[1].rsplit(" ", 2)[0] for line in lines}
    assert len(clusters) == 1, lines  # one cluster for both tasks
    assert [line.rsplit(" ", 2)[1:] for line in lines] == [["0", "32"], ["1", "32"]]  # token_hex(16)


# --------------------------------------------------------------------------- without Slurm


@pytest.mark.parametrize("text, names", [
    ("vm", ["vm"]),
    ("node[01-03,07],login1", ["node01", "node02", "node03", "node07", "login1"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("gpu-[009-011]", ["gpu-009", "gpu-010", "gpu-011"]),
])
def test_expand_hostlist(text, names):
    assert slurm.expand_hostlist(text) == names
    scontrol = shutil.which("scontrol")
    if scontrol:  # Slurm's own expansion agrees (it needs no daemon for this)
        r = subprocess.run([scontrol, "show", "hostnames", text], capture_output=True,
                           text=True, timeout=10)
        if r.returncode == 0:
            assert r.stdout.split() == names


@pytest.mark.parametrize("text", ["", "n[1-", "n1]", "n[3-1]", "n[a]", "a,,b"])
def test_bad_hostlist_names_it(text):
    with pytest.raises(ConfigError, match="host list"):
        slurm.expand_hostlist(text)


def test_tasks_per_node():
    assert slurm.tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert slurm.tasks_per_node("4") == [4]
    with pytest.raises(ConfigError, match="'2x' is not N or N"):
        slurm.tasks_per_node("2x")


def _step(rank, nodes="n[1-2]", per_node="2(x2)", **extra):
    env = {"SLURM_STEP_NODELIST": nodes, "SLURM_STEP_TASKS_PER_NODE": per_node,
           "SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": str(rank),
           "SLURM_LOCALID": str(rank % 2), "SLURMD_NODENAME": f"n{rank // 2 + 1}"}
    env.update(extra)
    return slurm.SlurmStep.from_environ(env)


def test_layout_of_a_ps_step_and_an_spmd_step():
    step = _step(3)
    cluster, roles = slurm.layout(step, num_ps=1, coordinator=True, port=7000)
    assert cluster == {"chief": ["n1:7000"], "ps": ["n1:7001"],
                       "worker": ["n2:7000", "n2:7001"]}
    assert roles[3] == ("worker", 1)
    cluster, roles = slurm.layout(step, num_ps=1, port=7000)
    assert "chief" not in cluster and roles[0] == ("client", 0)
    cluster, _ = slurm.layout(step, spmd=True, port=7000)
    assert cluster == {"worker": ["n1:7000", "n1:7001", "n2:7000", "n2:7001"]}
    with pytest.raises(ConfigError, match="need 5; run srun with -n 5"):
        slurm.layout(step, num_ps=3, port=7000)


def test_placement_that_is_not_block_is_refused():
    with pytest.raises(ConfigError, match="--distribution=block"):
        _step(1, SLURMD_NODENAME="n2")  # cyclic: rank 1 on the second node
    with pytest.raises(ConfigError, match="SLURM_DISTRIBUTION='cyclic'"):
        _step(0, SLURM_DISTRIBUTION="cyclic")


def test_errors_outside_a_step_and_without_a_secret(tmp_path):
    env = {k: v for k, v in base_env().items() if not k.startswith("SLURM")}
    cmd = [sys.executable, "-m", "tf_rdma.cli", "launch", "--slurm", "--spmd", "--", "true"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "not inside a Slurm job step" in r.stderr, r.stderr
    env.update(SLURM_STEP_NODELIST="vm", SLURM_STEP_TASKS_PER_NODE="1", SLURM_PROCID="0",
               SLURM_STEP_NUM_TASKS="1", SLURM_LOCALID="0")
    env.pop("TF_RDMA_SECRET")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "export TF_RDMA_SECRET" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "tf_rdma.cli", "launch", "--port", "9000",
                        "-n", "1", "--", "true"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--port sets the ports of a --slurm cluster" in r.stderr
