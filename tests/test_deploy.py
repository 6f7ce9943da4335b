"""The deployment recipes in deploy/ agree with tf_rdma's own settings.

No container runtime or Kubernetes runs here; what can drift without one
is checked against the code: every TF_RDMA_* variable a manifest sets is a
setting tf_rdma reads, with a valid value; the job secret comes from a
Kubernetes Secret, never a literal; every tf_rdma task exposes its gRPC port
and its endpoint port (that port plus TF_RDMA_PORT_OFFSET, as
tf_rdma.cluster computes it); /dev/shm is a memory emptyDir; the tasks may
lock memory for the NIC; the host-network variant spreads its pods one per
node; and the image installs the TensorFlow the Makefile tests with.
"""

import pathlib
import re

import pytest
import yaml

from tf_rdma import cluster as cluster_lib, settings

pytestmark = pytest.mark.fast  # in `make test-fast`: no processes, no sockets

REPO = pathlib.Path(__file__).resolve().parent.parent
KUBERNETES = REPO / "deploy" / "kubernetes"
JOBS = sorted(KUBERNETES.glob("tfjob-*.yaml"))
TF_RDMA_COMMAND = ["python", "-m", "tf_rdma.server"]
RDMA_RESOURCE = "rdma/hca_shared_devices_a"


def containers(job):
    """(replica type, pod spec, container) of every replica spec of a TFJob."""
    for kind, spec in job["spec"]["tfReplicaSpecs"].items():
        for c in spec["template"]["spec"]["containers"]:
            yield kind, spec["template"]["spec"], c


def runs_an_endpoint(kind):
    """Whether the container's task runs a tf_rdma endpoint: the ps and
    worker servers, and every worker of an SPMD (RdmaStrategy) job; the
    chief of a parameter-server job is the coordinator, which runs none."""
    return kind != "Chief"


def test_there_are_recipes():
    assert {p.name for p in JOBS} >= {
        "tfjob-ps.yaml", "tfjob-rdma-strategy.yaml",
        "tfjob-rdma-strategy-hostnetwork.yaml"}, JOBS


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.name)
def test_a_tfjob_matches_the_settings(path):
    job = yaml.safe_load(path.read_text())
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "TFJob"
    known = {s.name for s in settings.SETTINGS}
    for kind, pod, c in containers(job):
        assert c["name"] == "tensorflow", (kind, "the operator's container name")
        env = {e["name"]: e for e in c.get("env", [])}
        for name, e in env.items():
            if name.startswith("TF_RDMA_"):
                assert name in known, f"{path.name} {kind}: {name} is no setting"
        secret = env["TF_RDMA_SECRET"]
        assert "value" not in secret, f"{path.name} {kind}: a literal secret"
        assert secret["valueFrom"]["secretKeyRef"] == {
            "name": "tf-rdma-secret", "key": "secret"}, secret
        if "TF_RDMA_TRANSPORT" in env:
            settings.transport(env["TF_RDMA_TRANSPORT"]["value"])  # valid
        offset_env = {"TF_RDMA_PORT_OFFSET": env["TF_RDMA_PORT_OFFSET"]["value"]} \
            if "TF_RDMA_PORT_OFFSET" in env else {}
        offset = cluster_lib.port_offset(offset_env)
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        grpc = ports["tfjob-port"]
        if not runs_an_endpoint(kind):
            continue
        # The endpoint's port is where tf_rdma.cluster puts it.
        address = cluster_lib.endpoints({"worker": [f"pod:{grpc}"]}, env=offset_env)
        assert ports["tf-rdma"] == int(address["/job:worker/task:0"].rsplit(":", 1)[1])
        assert ports["tf-rdma"] == grpc + offset
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        assert c["resources"]["limits"][RDMA_RESOURCE] >= 1
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        shm = volumes[mounts["/dev/shm"]]
        assert shm["emptyDir"]["medium"] == "Memory", shm
        assert shm["emptyDir"]["sizeLimit"], shm
        if kind in ("PS", "Worker") and "tfjob-ps" in path.name:
            assert c["command"] == TF_RDMA_COMMAND, (kind, c["command"])


def test_the_host_network_variant_spreads_its_pods():
    job = yaml.safe_load((KUBERNETES / "tfjob-rdma-strategy-hostnetwork.yaml").read_text())
    for kind, pod, _ in containers(job):
        assert pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        rule, = pod["affinity"]["podAntiAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]
        assert rule["topologyKey"] == "kubernetes.io/hostname"
        labels = job["spec"]["tfReplicaSpecs"][kind]["template"]["metadata"]["labels"]
        assert rule["labelSelector"]["matchLabels"] == labels


def test_the_secret_template_holds_no_secret():
    secret = yaml.safe_load((KUBERNETES / "secret.yaml").read_text())
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "tf-rdma-secret"
    assert secret["stringData"]["secret"].startswith("REPLACE-"), secret


def test_the_image_installs_the_tensorflow_under_test():
    makefile = (REPO / "Makefile").read_text()
    tested = re.search(r"^TF_PACKAGE \?= (\S+)$", makefile, re.M).group(1)
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert f"ARG TF_PACKAGE={tested}" in dockerfile
    for package in ("libibverbs-dev", "ibverbs-providers", "rdma-core"):
        assert package in dockerfile, package
    assert "--no-build-isolation" in dockerfile
