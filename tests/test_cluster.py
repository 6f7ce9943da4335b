"""Unit tests of tf_rdma.cluster: task names, the address rule, overrides, TF_CONFIG, free ports."""

import ast
import json
import socket
from pathlib import Path

import pytest

from tf_rdma import cluster as C
from tf_rdma.errors import ConfigError, PlanError
from tf_rdma.graph_passes import plan as plan_lib

pytestmark = [pytest.mark.fast, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parent.parent


def tf_config(cluster, task=None):
    config = {"cluster": cluster}
    if task is not None:
        config["task"] = task
    return {"TF_CONFIG": json.dumps(config)}


# --------------------------------------------------------------------------- module hygiene


def _imported_modules(path):
    """Yields (module, imported name or None) for every import statement in a source file."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.module, alias.name


def _source_of(module):
    """The file of a tf_rdma module in this tree, or None.

    tf_rdma.graph_passes is the tree's graph_passes/ (setup.py's package_dir).
    """
    parts = module.split(".")
    if parts[:2] == ["tf_rdma", "graph_passes"]:
        parts = parts[1:]
    base = REPO.joinpath(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def test_module_imports_no_tensorflow():
    # Read from the source: tf_rdma.cluster and the tf_rdma modules it imports
    # have no import of tensorflow, so launchers and tools can use them bare.
    seen, todo, imports = set(), ["tf_rdma.cluster"], {}
    while todo:
        module = todo.pop()
        path = _source_of(module)
        if module in seen or path is None:
            continue
        seen.add(module)
        for name, member in _imported_modules(path):
            imports.setdefault(module, set()).add(name)
            if name.startswith("tf_rdma."):
                todo += [name] + ([f"{name}.{member}"] if member else [])
    assert {"tf_rdma.cluster", "tf_rdma.errors", "tf_rdma.graph_passes.plan"} <= seen, seen
    offenders = {m: sorted(n for n in names if n.split(".")[0] == "tensorflow")
                 for m, names in imports.items()}
    assert not any(offenders.values()), offenders


# --------------------------------------------------------------------------- task names


@pytest.mark.parametrize(
    "name",
    [
        "/job:worker/task:3",
        "job:worker/task:3",
        "/job:worker/replica:0/task:3",
        "/job:worker/replica:0/task:3/device:CPU:0",
        "worker:3",
        "worker/3",
        " worker:3 ",
    ],
)
def test_task_name_forms(name):
    assert C.canonical_task(name) == "/job:worker/task:3"
    assert C.parse_task(name) == ("worker", 3)


def test_canonical_task_from_job_and_index():
    assert C.canonical_task("worker", 1) == "/job:worker/task:1"
    assert C.canonical_task("ps", "0") == "/job:ps/task:0"
    assert C.parse_task("/job:chief/task:0") == ("chief", 0)


@pytest.mark.parametrize(
    "args",
    [("worker", -1), ("worker", True), ("worker", 1.5), ("1worker", 0), ("wor-ker", 0), ("", 0),
     ("worker",), ("/job:worker",), ("worker:x",), ("/job:/task:1",), ("1worker/1",), (7,)],
)
def test_canonical_task_rejects(args):
    with pytest.raises(ConfigError) as err:
        C.canonical_task(*args)
    assert repr(args[0]) in str(err.value)


@pytest.mark.parametrize(
    "name",
    ["/job:ps/replica:0/task:0/device:GPU:1", "job:w_2/task:10", "/job:worker/replica:2/task:0",
     "1worker:0", "/job:worker/task:-1"],
)
def test_task_grammar_is_the_plans(name):
    # One grammar: the plan's; cluster errors carry the plan's message.
    try:
        expected = plan_lib.canonical_task(name)
    except PlanError as err:
        with pytest.raises(ConfigError) as cluster_err:
            C.canonical_task(name)
        assert str(cluster_err.value) == str(err)
    else:
        assert C.canonical_task(name) == expected


# --------------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "address, expected",
    [
        ("localhost:2222", ("localhost", 2222)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("host.example.com:65535", ("host.example.com", 65535)),
        ("[::1]:2222", ("::1", 2222)),
        ("[fd00::5:1]:80", ("fd00::5:1", 80)),
    ],
)
def test_split_address(address, expected):
    assert C.split_address(address) == expected
    host, port = expected
    assert C.split_address(C.join_address(host, port)) == expected


def test_join_address_brackets_ipv6():
    assert C.join_address("::1", 3222) == "[::1]:3222"
    assert C.join_address("10.0.0.1", 3222) == "10.0.0.1:3222"


@pytest.mark.parametrize(
    "address",
    ["localhost", "localhost:", ":2222", "host:port", "host:0", "host:65536", "::1:2222",
     "[::1]2222", "[::1", "[]:2222", "host:-1", "host: 22", 2222],
)
def test_split_address_rejects_and_names_it(address):
    with pytest.raises(ConfigError) as err:
        C.split_address(address)
    assert repr(address) in str(err.value)
    assert isinstance(err.value, ValueError)  # callers that catch ValueError keep working


# --------------------------------------------------------------------------- the address rule


def test_endpoints_default_rule():
    cluster = {"worker": ["10.0.0.1:2222", "10.0.0.2:2222"], "ps": ["[fd00::9]:5000"]}
    assert C.endpoints(cluster, env={}) == {
        "/job:worker/task:0": "10.0.0.1:3222",
        "/job:worker/task:1": "10.0.0.2:3222",
        "/job:ps/task:0": "[fd00::9]:6000",
    }


def test_endpoints_offset_from_env():
    cluster = {"worker": ["localhost:2222"]}
    assert C.endpoints(cluster, env={"TF_RDMA_PORT_OFFSET": "7"}) == {
        "/job:worker/task:0": "localhost:2229"
    }


def test_endpoints_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("TF_RDMA_PORT_OFFSET", "5")
    monkeypatch.delenv("TF_RDMA_ENDPOINTS", raising=False)
    assert C.endpoints({"worker": ["h:100"]}) == {"/job:worker/task:0": "h:105"}


@pytest.mark.parametrize(
    "env, expected",
    [({}, 1000), ({"TF_RDMA_PORT_OFFSET": ""}, 1000), ({"TF_RDMA_PORT_OFFSET": " 10 "}, 10),
     ({"TF_RDMA_PORT_OFFSET": "1"}, 1), ({"TF_RDMA_PORT_OFFSET": "64511"}, 64511)],
)
def test_port_offset(env, expected):
    assert C.DEFAULT_PORT_OFFSET == 1000
    assert C.port_offset(env) == expected


@pytest.mark.parametrize("value", ["0", "-1", "64512", "abc", "1.5", "0x10"])
def test_bad_offset_is_config_error_quoting_value(value):
    with pytest.raises(ConfigError) as err:
        C.port_offset({"TF_RDMA_PORT_OFFSET": value})
    assert "TF_RDMA_PORT_OFFSET" in str(err.value)
    assert repr(value) in str(err.value)


def test_endpoint_port_overflow_names_task_address_offset_and_fix():
    cluster = {"worker": ["h0:2222", "h1:65000"]}
    with pytest.raises(ConfigError) as err:
        C.endpoints(cluster, env={})
    message = str(err.value)
    assert "/job:worker/task:1" in message
    assert "h1:65000" in message
    assert "1000" in message
    assert "TF_RDMA_PORT_OFFSET" in message and "TF_RDMA_ENDPOINTS" in message


def test_endpoint_port_at_limit_is_fine():
    assert C.endpoints({"worker": ["h:64535"]}, env={}) == {"/job:worker/task:0": "h:65535"}


def test_override_replaces_rule_for_named_tasks_only():
    cluster = {"worker": ["h0:2222", "h1:65000"], "ps": ["[::1]:4000"]}
    env = {
        "TF_RDMA_ENDPOINTS": json.dumps(
            {"worker:1": "10.1.1.1:7000", "/job:ps/replica:0/task:0": "[::1]:7001"}
        )
    }
    assert C.endpoints(cluster, env=env) == {
        "/job:worker/task:0": "h0:3222",
        "/job:worker/task:1": "10.1.1.1:7000",
        "/job:ps/task:0": "[::1]:7001",
    }


def test_overrides_parsed_and_canonical():
    env = {"TF_RDMA_ENDPOINTS": '{"/job:worker/task:0": "a:1", "worker/0": "a:1"}'}
    assert C.endpoint_overrides(env) == {"/job:worker/task:0": "a:1"}
    assert C.endpoint_overrides({}) == {}
    assert C.endpoint_overrides({"TF_RDMA_ENDPOINTS": "  "}) == {}


@pytest.mark.parametrize(
    "value, quoted",
    [
        ("{not json", "{not json"),
        ('["a:1"]', '["a:1"]'),
        ('{"worker:0": 7000}', "7000"),
        ('{"worker:0": "nohost"}', "nohost"),
        ('{"bad name": "a:1"}', "bad name"),
        ('{"worker:0": "a:1", "/job:worker/task:0": "b:2"}', "b:2"),
    ],
)
def test_bad_overrides(value, quoted):
    with pytest.raises(ConfigError) as err:
        C.endpoint_overrides({"TF_RDMA_ENDPOINTS": value})
    assert "TF_RDMA_ENDPOINTS" in str(err.value)
    assert quoted in str(err.value)


def test_override_for_unknown_task_is_error():
    env = {"TF_RDMA_ENDPOINTS": '{"worker:5": "a:1"}'}
    with pytest.raises(ConfigError) as err:
        C.endpoints({"worker": ["h:1"]}, env=env)
    assert "/job:worker/task:5" in str(err.value)


def test_endpoint_colliding_with_other_task_is_error():
    # worker 0's endpoint (2222 + 1000) is worker 1's gRPC port on the same host.
    cluster = {"worker": ["h:2222", "h:3222"]}
    with pytest.raises(ConfigError) as err:
        C.endpoints(cluster, env={})
    message = str(err.value)
    assert "h:3222" in message
    assert "/job:worker/task:0" in message and "/job:worker/task:1" in message
    # On different hosts the same ports are fine.
    C.endpoints({"worker": ["h0:2222", "h1:3222"]}, env={})


def test_duplicate_override_endpoints_are_error():
    env = {"TF_RDMA_ENDPOINTS": '{"worker:0": "a:7000", "worker:1": "a:7000"}'}
    with pytest.raises(ConfigError):
        C.endpoints({"worker": ["h:1", "h:2"]}, env=env)


def test_endpoints_names_bad_address_and_task():
    with pytest.raises(ConfigError) as err:
        C.endpoints({"worker": ["h:1", "h"]}, env={})
    assert "/job:worker/task:1" in str(err.value) and "'h'" in str(err.value)


def test_endpoints_sparse_and_cluster_spec_like():
    cluster = {"worker": {1: "h:2001", "3": "h:2003"}}
    assert C.endpoints(cluster, env={}) == {
        "/job:worker/task:1": "h:3001",
        "/job:worker/task:3": "h:3003",
    }

    class FakeSpec:
        def as_dict(self):
            return {"worker": ["h:100"]}

    assert C.endpoints(FakeSpec(), env={}) == {"/job:worker/task:0": "h:1100"}


def test_iter_tasks_order():
    tasks = list(C.iter_tasks({"worker": ["a:1", "b:2"], "ps": {2: "c:3", 0: "d:4"}}))
    assert tasks == [("worker", 0, "a:1"), ("worker", 1, "b:2"), ("ps", 0, "d:4"), ("ps", 2, "c:3")]


# --------------------------------------------------------------------------- TF_CONFIG


def test_cluster_and_task_from_tf_config():
    env = tf_config(
        {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}, {"type": "worker", "index": 1}
    )
    assert C.cluster_from_tf_config(env) == {"chief": ["c:1"], "worker": ["w0:1", "w1:1"]}
    assert C.task_from_tf_config(env) == ("worker", 1)


def test_tf_config_sparse_job():
    env = tf_config({"worker": {"1": "w1:1", "4": "w4:1"}, "ps": ["p:1"]}, {"type": "worker", "index": 4})
    cluster = C.cluster_from_tf_config(env)
    assert cluster == {"worker": {1: "w1:1", 4: "w4:1"}, "ps": ["p:1"]}
    assert C.task_from_tf_config(env) == ("worker", 4)
    assert set(C.endpoints(cluster, env={})) == {
        "/job:worker/task:1", "/job:worker/task:4", "/job:ps/task:0"
    }


def test_tf_config_without_task_is_client():
    env = tf_config({"worker": ["w:1"]})
    assert C.task_from_tf_config(env) is None
    assert C.task_from_tf_config(tf_config({"worker": ["w:1"]}, {})) is None


def test_tf_config_task_index_defaults_to_zero_and_accepts_digits():
    assert C.task_from_tf_config(tf_config({"chief": ["c:1"]}, {"type": "chief"})) == ("chief", 0)
    assert C.task_from_tf_config(
        tf_config({"worker": ["a:1", "b:1"]}, {"type": "worker", "index": "1"})
    ) == ("worker", 1)


def test_tf_config_evaluator_outside_cluster_is_allowed():
    env = tf_config({"worker": ["w:1"]}, {"type": "evaluator", "index": 0})
    assert C.task_from_tf_config(env) == ("evaluator", 0)


def test_tf_config_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["w:1"]}}))
    assert C.cluster_from_tf_config() == {"worker": ["w:1"]}


def test_tf_config_missing():
    for func in (C.cluster_from_tf_config, C.task_from_tf_config):
        with pytest.raises(ConfigError) as err:
            func({})
        assert "TF_CONFIG is not set" in str(err.value)


@pytest.mark.parametrize(
    "raw, quoted",
    [
        ("{oops", "{oops"),
        ("[1, 2]", "[1, 2]"),
        ('{"task": {"type": "worker"}}', "cluster"),
        ('{"cluster": {}}', "{}"),
        ('{"cluster": {"worker": []}}', "worker"),
        ('{"cluster": {"worker": "w:1"}}', "w:1"),
        ('{"cluster": {"worker": ["w:1", "nope"]}}', "nope"),
        ('{"cluster": {"worker": {"x": "w:1"}}}', "'x'"),
        ('{"cluster": {"bad-job": ["w:1"]}}', "bad-job"),
    ],
)
def test_cluster_from_bad_tf_config(raw, quoted):
    with pytest.raises(ConfigError) as err:
        C.cluster_from_tf_config({"TF_CONFIG": raw})
    assert "TF_CONFIG" in str(err.value)
    assert quoted in str(err.value)


@pytest.mark.parametrize(
    "task, quoted",
    [
        ("worker", "'worker'"),
        ({"index": 0}, "type"),
        ({"type": "worker", "index": -1}, "-1"),
        ({"type": "worker", "index": "x"}, "'x'"),
        ({"type": "worker", "index": 2}, "2"),
        ({"type": "1x", "index": 0}, "1x"),
    ],
)
def test_bad_task_in_tf_config(task, quoted):
    with pytest.raises(ConfigError) as err:
        C.task_from_tf_config(tf_config({"worker": ["a:1", "b:1"]}, task))
    assert quoted in str(err.value)


# --------------------------------------------------------------------------- free ports


def _can_bind(port, host="127.0.0.1"):
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


# 1 and 1000: ports drawn at random; 64000: few candidates, each tried once.
@pytest.mark.parametrize("offset", [1, 1000, 64000])
def test_free_ports_properties(offset):
    ports = C.free_ports(8, offset)
    assert len(ports) == 8
    assert len(set(ports)) == 8
    endpoint_ports = {p + offset for p in ports}
    assert not set(ports) & endpoint_ports
    for port in ports:
        assert 1024 <= port and port + offset <= 65535
        assert _can_bind(port) and _can_bind(port + offset)


def test_free_ports_largest_offset():
    # Only port 1024 (endpoint 65535) fits; asking for more is an OSError, quickly.
    if not (_can_bind(1024) and _can_bind(65535)):
        pytest.skip("port 1024 or 65535 is taken on this machine")
    assert C.free_ports(1, 64511) == [1024]
    with pytest.raises(OSError) as err:
        C.free_ports(2, 64511)
    assert "1 of 2" in str(err.value)


def test_free_ports_default_offset_from_env():
    ports = C.free_ports(2, env={"TF_RDMA_PORT_OFFSET": "3"})
    assert all(_can_bind(p + 3) for p in ports)


def test_free_ports_zero_and_bad_arguments():
    assert C.free_ports(0, 1000) == []
    with pytest.raises(ConfigError):
        C.free_ports(-1, 1000)
    with pytest.raises(ConfigError):
        C.free_ports(1, 0)
    with pytest.raises(ConfigError):
        C.free_ports(1, 70000)


def test_free_ports_avoids_taken_endpoint_port():
    # Hold 50 of the 512 candidates of offset 64000 (ports 1024..1535, each
    # tried once); none of them may be returned as p or as p + offset.
    offset = 64000
    held = []
    try:
        for port in range(1024, 1536, 10):
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                sock.close()
                continue
            sock.listen()
            held.append(sock)
        assert len(held) >= 20, "too few of ports 1024..1535 are free here"
        taken = {s.getsockname()[1] for s in held}
        ports = C.free_ports(20, offset)
        assert not set(ports) & taken
        assert not {p + offset for p in ports} & taken
    finally:
        for sock in held:
            sock.close()


@pytest.mark.parametrize("offset", [1, 1000])
def test_free_ports_stay_out_of_the_ephemeral_range(offset):
    # Outgoing connections get their local ports from that range: a port
    # picked there could be a connection's before its server binds it.
    given = C._ephemeral_ports()
    if given is None:
        pytest.skip("this system does not say its ephemeral port range")
    first, last = given
    for port in C.free_ports(40, offset):
        assert not first <= port <= last, (port, given)
        assert not first <= port + offset <= last, (port + offset, given)


def test_ephemeral_ports_reads_the_kernels_range(tmp_path):
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    assert C._ephemeral_ports(str(path)) == (32768, 60999)
    for text in ("", "32768", "60999 32768", "0 100", "1 70000", "a b"):
        path.write_text(text)
        assert C._ephemeral_ports(str(path)) is None, text
    assert C._ephemeral_ports(str(tmp_path / "absent")) is None


def test_free_ports_bad_host_is_config_error():
    with pytest.raises(ConfigError) as err:
        C.free_ports(1, 1000, host="192.0.2.123")  # TEST-NET-1: not an address of this machine
    assert "192.0.2.123" in str(err.value)


def test_free_ports_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 support in this Python")
    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this machine")
    ports = C.free_ports(2, 1000, host="::1")
    assert len(set(ports)) == 2
