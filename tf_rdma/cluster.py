"""Where every task of a cluster listens: its gRPC address and its tf_rdma endpoint.

Every TensorFlow task of a tf_rdma cluster runs a :class:`tf_rdma.Server`. That
server listens on two addresses:

* its **gRPC address**, the one given in the cluster spec (``TF_CONFIG`` or a
  ``tf.train.ClusterSpec``), which TensorFlow uses for function dispatch and
  control;
* its **tf_rdma endpoint**, a TCP listener of the tf_rdma engine, used for the
  authenticated bootstrap between peers and, where neither RDMA nor shared
  memory is available, for the tensor data itself.

Nobody has to write the endpoints down: they follow from the cluster spec by
one rule.

**The address rule.** A task's endpoint is on the same host as its gRPC
address, at port *gRPC port + offset*. The offset is 1000 by default
(:data:`DEFAULT_PORT_OFFSET`); set the environment variable
``TF_RDMA_PORT_OFFSET`` (an integer from 1 to 64511) to change it. For
example, with the default offset the task ``/job:worker/task:1`` at
``10.0.0.2:2222`` has its endpoint at ``10.0.0.2:3222``, and a task at
``[fd00::5]:2222`` has it at ``[fd00::5]:3222``. Every process of a cluster
must see the same offset, so set it in the environment of all of them (or of
none).

**Overrides.** Where the rule does not fit (a port above 65535, a port that
is taken, a task behind a NAT or a proxy), set ``TF_RDMA_ENDPOINTS`` to a JSON
object that maps task names to ``"host:port"`` endpoints; the tasks it names
use exactly those addresses and the others keep the rule::

    TF_RDMA_ENDPOINTS='{"/job:worker/task:0": "10.0.0.1:7000", "ps:0": "[fd00::9]:7001"}'

A task name may be written ``/job:worker/task:0``, ``/job:worker/replica:0/task:0``,
``worker:0`` or ``worker/0`` (the grammar of
:func:`tf_rdma.graph_passes.plan.canonical_task`, plus ``worker/0``). Naming a
task that is not in the cluster is an error, so that a typo does not go
unnoticed. As with the offset, every process of the cluster must see the same
overrides.

The rule is checked when the endpoints are computed: a port above 65535, or an
endpoint that coincides with another task's gRPC address or endpoint on the
same host, is a :class:`~tf_rdma.errors.ConfigError` that names the task and
says how to fix it.

This module is plain Python: it neither imports TensorFlow nor starts
anything, so it is safe to use from launchers and tools.
"""

import errno
import json
import os
import random
import re
import socket

from tf_rdma.errors import ConfigError, PlanError
from tf_rdma.graph_passes import plan as plan_lib

__all__ = [
    "DEFAULT_PORT_OFFSET",
    "PORT_OFFSET_ENV",
    "ENDPOINTS_ENV",
    "TF_CONFIG_ENV",
    "canonical_task",
    "parse_task",
    "split_address",
    "join_address",
    "port_offset",
    "endpoint_overrides",
    "iter_tasks",
    "cluster_from_tf_config",
    "task_from_tf_config",
    "endpoints",
    "free_ports",
]

#: Port offset of a task's tf_rdma endpoint from its gRPC port, unless
#: ``TF_RDMA_PORT_OFFSET`` says otherwise.
DEFAULT_PORT_OFFSET = 1000

#: Environment variable that sets the port offset.
PORT_OFFSET_ENV = "TF_RDMA_PORT_OFFSET"

#: Environment variable with per-task endpoint overrides (a JSON object).
ENDPOINTS_ENV = "TF_RDMA_ENDPOINTS"

#: TensorFlow's own cluster configuration variable.
TF_CONFIG_ENV = "TF_CONFIG"

_MAX_PORT = 65535
_MAX_OFFSET = _MAX_PORT - 1024  # 64511: the smallest unprivileged port plus this still fits.


# --------------------------------------------------------------------------- task names

# The task-name grammar is the plan's (tf_rdma.graph_passes.plan.canonical_task);
# this module adds one spelling to it, "worker/1", rewritten to "worker:1" first.
_SLASH_FORM = re.compile(r"(?P<job>[^/:]+)/(?P<index>[0-9]+)\Z")


def _is_job(job):
    """True if ``job`` is a valid job name, by the plan's task-name grammar."""
    if not isinstance(job, str):
        return False
    try:
        return plan_lib.canonical_task(f"{job}:0") == f"/job:{job}/task:0"
    except PlanError:
        return False


def _check_job(job, what):
    if not _is_job(job):
        raise ConfigError(
            f"{what}: job name {job!r} is not valid: a job name starts with a letter "
            "and has only letters, digits and '_'"
        )
    return job


def _check_index(index, what):
    if isinstance(index, bool):
        raise ConfigError(f"{what}: task index {index!r} is not an integer")
    if isinstance(index, str) and index.strip().isdigit():
        index = int(index.strip())
    if not isinstance(index, int):
        raise ConfigError(f"{what}: task index {index!r} is not an integer")
    if index < 0:
        raise ConfigError(f"{what}: task index {index} is negative")
    return index


def canonical_task(job, index=None):
    """Returns the canonical name of a task, ``"/job:{job}/task:{index}"``.

    Args:
        job: The job name, such as ``"worker"``. When ``index`` is omitted,
            ``job`` is instead a whole task name in one of the forms that
            :func:`parse_task` accepts.
        index: The task index within the job (an int, or a string of digits).

    Returns:
        The canonical task name, for example ``"/job:worker/task:1"``.

    Raises:
        ConfigError: The job name or the index is not valid, or the task name
            is in none of the accepted forms.
    """
    if index is None:
        job, index = parse_task(job)
    what = f"task {job!r}/{index!r}"
    job = _check_job(job, what)
    index = _check_index(index, what)
    return f"/job:{job}/task:{index}"


def parse_task(name):
    """Splits a task name into its job and index.

    The forms are those of :func:`tf_rdma.graph_passes.plan.canonical_task`
    (``"/job:worker/task:1"``, ``"/job:worker/replica:0/task:1"``, with or
    without a ``/device:CPU:0`` suffix, ``"job:worker/task:1"``,
    ``"worker:1"``) plus ``"worker/1"``; surrounding whitespace is ignored.

    Args:
        name: A task name, such as ``"/job:worker/task:1"`` or ``"worker:1"``.

    Returns:
        A ``(job, index)`` pair, for example ``("worker", 1)``.

    Raises:
        ConfigError: ``name`` is in none of the accepted forms (the message is
            the plan's).
    """
    text = name.strip() if isinstance(name, str) else name
    if isinstance(text, str):
        match = _SLASH_FORM.match(text)
        if match and _is_job(match["job"]):
            text = f"{match['job']}:{match['index']}"
    try:
        canonical = plan_lib.canonical_task(text)
    except PlanError as err:
        raise ConfigError(str(err)) from None
    job, index = canonical[len("/job:") :].split("/task:")
    return job, int(index)


# --------------------------------------------------------------------------- addresses


def split_address(address):
    """Splits a ``"host:port"`` address into host and port.

    IPv6 hosts are written in brackets, ``"[::1]:2222"``; the brackets are not
    part of the returned host.

    Args:
        address: The address, such as ``"localhost:2222"``, ``"10.0.0.1:2222"``
            or ``"[fd00::1]:2222"``.

    Returns:
        A ``(host, port)`` pair with ``port`` an int from 1 to 65535, for
        example ``("::1", 2222)``.

    Raises:
        ConfigError: The address has no host or no port, the port is not a
            number from 1 to 65535, or an IPv6 host is not in brackets. The
            message quotes the address.
    """
    if not isinstance(address, str):
        raise ConfigError(f"address {address!r} is not a string of the form 'host:port'")
    text = address.strip()
    if text.startswith("["):
        close = text.find("]")
        if close < 0 or not text[close + 1 :].startswith(":"):
            raise ConfigError(
                f"address {address!r} is not valid: write an IPv6 address as '[host]:port', "
                "for example '[::1]:2222'"
            )
        host, port_text = text[1:close], text[close + 2 :]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ConfigError(f"address {address!r} has no port: write it as 'host:port'")
        if ":" in host:
            raise ConfigError(
                f"address {address!r} is not valid: put an IPv6 host in brackets, "
                f"for example '[{host}]:{port_text}'"
            )
    if not host:
        raise ConfigError(f"address {address!r} has no host: write it as 'host:port'")
    if not port_text.isdigit():
        raise ConfigError(f"address {address!r} has no valid port: {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= _MAX_PORT:
        raise ConfigError(f"address {address!r}: port {port} is not in 1..{_MAX_PORT}")
    return host, port


def join_address(host, port):
    """Joins a host and a port into an address, bracketing IPv6 hosts.

    Args:
        host: A host name or IP address (IPv6 without brackets).
        port: The port number.

    Returns:
        ``"host:port"``, or ``"[host]:port"`` when ``host`` contains a colon.
    """
    if ":" in host and not host.startswith("["):
        return f"[{host}]:{port}"
    return f"{host}:{port}"


# --------------------------------------------------------------------------- settings


def port_offset(env=None):
    """Returns the endpoint port offset in effect.

    Args:
        env: The environment to read (default ``os.environ``).

    Returns:
        The value of ``TF_RDMA_PORT_OFFSET`` when it is set (and not empty),
        else :data:`DEFAULT_PORT_OFFSET`.

    Raises:
        ConfigError: ``TF_RDMA_PORT_OFFSET`` is not an integer from 1 to 64511.
    """
    env = os.environ if env is None else env
    raw = env.get(PORT_OFFSET_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_PORT_OFFSET
    text = raw.strip()
    try:
        value = int(text, 10)
    except ValueError:
        value = None
    if value is None or not 1 <= value <= _MAX_OFFSET:
        raise ConfigError(
            f"{PORT_OFFSET_ENV}={raw!r} is not valid: it must be an integer from 1 to {_MAX_OFFSET} "
            f"(the default is {DEFAULT_PORT_OFFSET})"
        )
    return value


def endpoint_overrides(env=None):
    """Returns the endpoint overrides given in ``TF_RDMA_ENDPOINTS``.

    Args:
        env: The environment to read (default ``os.environ``).

    Returns:
        A dict from canonical task name to ``"host:port"``; empty when the
        variable is not set or empty.

    Raises:
        ConfigError: The variable is not a JSON object of task name to
            ``"host:port"`` strings, a task name or an address in it is not
            valid, or two spellings of one task give different addresses.
    """
    env = os.environ if env is None else env
    raw = env.get(ENDPOINTS_ENV)
    if raw is None or not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError as err:
        raise ConfigError(f"{ENDPOINTS_ENV}={raw!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{ENDPOINTS_ENV}={raw!r} is not a JSON object: write it as "
            '\'{"/job:worker/task:0": "host:port", ...}\''
        )
    result = {}
    for name, address in data.items():
        try:
            task = canonical_task(name)
        except ConfigError as err:
            raise ConfigError(f"{ENDPOINTS_ENV}: {err}") from None
        if not isinstance(address, str):
            raise ConfigError(
                f"{ENDPOINTS_ENV}: the endpoint of {name!r} is {address!r}, not a 'host:port' string"
            )
        try:
            host, port = split_address(address)
        except ConfigError as err:
            raise ConfigError(f"{ENDPOINTS_ENV}: endpoint of {name!r}: {err}") from None
        address = join_address(host, port)
        if task in result and result[task] != address:
            raise ConfigError(
                f"{ENDPOINTS_ENV} gives task {task} two endpoints: {result[task]!r} and {address!r}"
            )
        result[task] = address
    return result


# --------------------------------------------------------------------------- cluster specs


def _as_dict(cluster):
    # Accept a tf.train.ClusterSpec (or anything with as_dict) without importing TensorFlow.
    if hasattr(cluster, "as_dict") and not isinstance(cluster, dict):
        cluster = cluster.as_dict()
    if not isinstance(cluster, dict):
        raise ConfigError(
            f"cluster {cluster!r} is not a mapping of job name to a list of 'host:port' addresses"
        )
    return cluster


def iter_tasks(cluster):
    """Yields every task of a cluster, in job order and then index order.

    Args:
        cluster: A dict from job name to a list of addresses (task ``i`` at
            position ``i``) or to a dict of index to address (a sparse job),
            or a ``tf.train.ClusterSpec``.

    Yields:
        ``(job, index, address)`` triples.

    Raises:
        ConfigError: A job is neither a list nor a dict, or a job name or an
            index is not valid.
    """
    cluster = _as_dict(cluster)
    for job, tasks in cluster.items():
        _check_job(job, f"cluster job {job!r}")
        if isinstance(tasks, dict):
            indexed = []
            for index, address in tasks.items():
                indexed.append((_check_index(index, f"cluster job {job!r}"), address))
            indexed.sort(key=lambda pair: pair[0])
        elif isinstance(tasks, (list, tuple)):
            indexed = list(enumerate(tasks))
        else:
            raise ConfigError(
                f"cluster job {job!r} is {tasks!r}: it must be a list of 'host:port' addresses "
                "or a dict from task index to address"
            )
        for index, address in indexed:
            yield job, index, address


def _load_tf_config(env):
    env = os.environ if env is None else env
    raw = env.get(TF_CONFIG_ENV)
    if raw is None or not raw.strip():
        raise ConfigError(
            f"{TF_CONFIG_ENV} is not set: set it to a JSON object such as "
            '\'{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
            '"task": {"type": "worker", "index": 0}}\''
        )
    try:
        config = json.loads(raw)
    except ValueError as err:
        raise ConfigError(f"{TF_CONFIG_ENV}={raw!r} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{TF_CONFIG_ENV}={raw!r} is not a JSON object")
    return config, raw


def _normalize_cluster(cluster, where):
    """Checks a cluster dict and returns a copy with clean job values."""
    if not isinstance(cluster, dict) or not cluster:
        raise ConfigError(
            f"{where}: the cluster is {cluster!r}; it must be a non-empty object from job name "
            "to a list of 'host:port' addresses"
        )
    result = {}
    for job, tasks in cluster.items():
        if isinstance(tasks, dict):
            result[job] = {}
        elif isinstance(tasks, (list, tuple)):
            result[job] = []
        else:
            raise ConfigError(
                f"{where}: job {job!r} is {tasks!r}; it must be a list of 'host:port' addresses "
                "or an object from task index to address"
            )
        if not tasks:
            raise ConfigError(f"{where}: job {job!r} has no tasks")
    try:
        for job, index, address in iter_tasks(cluster):
            task = canonical_task(job, index)
            try:
                split_address(address)
            except ConfigError as err:
                raise ConfigError(f"task {task}: {err}") from None
            if isinstance(result[job], dict):
                result[job][index] = address
            else:
                result[job].append(address)
    except ConfigError as err:
        raise ConfigError(f"{where}: {err}") from None
    return result


def cluster_from_tf_config(env=None):
    """Returns the cluster described by ``TF_CONFIG``.

    Args:
        env: The environment to read (default ``os.environ``).

    Returns:
        A dict from job name to the list of its task addresses, task ``i`` at
        position ``i``. A job that ``TF_CONFIG`` gives as an object from index
        to address (a sparse job) comes back as a dict from int index to
        address, so that the indices stay what they were; both forms are
        accepted by ``tf.train.ClusterSpec`` and by :func:`endpoints`.

    Raises:
        ConfigError: ``TF_CONFIG`` is not set, is not a JSON object, has no
            ``"cluster"``, or a job, index or address in it is not valid. The
            message quotes the offending part.
    """
    config, raw = _load_tf_config(env)
    if "cluster" not in config:
        raise ConfigError(f'{TF_CONFIG_ENV}={raw!r} has no "cluster"')
    return _normalize_cluster(config["cluster"], TF_CONFIG_ENV)


def task_from_tf_config(env=None):
    """Returns the task that ``TF_CONFIG`` says this process is.

    Args:
        env: The environment to read (default ``os.environ``).

    Returns:
        A ``(job, index)`` pair, or ``None`` when ``TF_CONFIG`` has no
        ``"task"`` (the process is a client, not a task of the cluster).

    Raises:
        ConfigError: ``TF_CONFIG`` is not set or not a JSON object, the
            ``"task"`` entry has no valid ``"type"`` or ``"index"``, or the
            index is beyond the tasks that the cluster lists for that job.
    """
    config, raw = _load_tf_config(env)
    task = config.get("task")
    if task is None or task == {}:
        return None
    if not isinstance(task, dict):
        raise ConfigError(f'{TF_CONFIG_ENV}: "task" is {task!r}, not an object')
    where = f'{TF_CONFIG_ENV}: "task" {task!r}'
    if "type" not in task:
        raise ConfigError(f'{where} has no "type"')
    job = _check_job(task["type"], where)
    index = _check_index(task.get("index", 0), where)
    cluster = config.get("cluster")
    if isinstance(cluster, dict) and job in cluster:
        tasks = cluster[job]
        known = (
            {_check_index(i, where) for i in tasks}
            if isinstance(tasks, dict)
            else set(range(len(tasks))) if isinstance(tasks, (list, tuple)) else None
        )
        if known is not None and index not in known:
            raise ConfigError(
                f"{where}: the cluster has no task {index} in job {job!r} "
                f"(it lists {sorted(known)})"
            )
    return job, index


# --------------------------------------------------------------------------- endpoints


def endpoints(cluster, env=None):
    """Returns the tf_rdma endpoint of every task of a cluster.

    The endpoint of a task is on the host of its gRPC address at the gRPC port
    plus the port offset (``TF_RDMA_PORT_OFFSET``, default 1000), unless
    ``TF_RDMA_ENDPOINTS`` gives it explicitly. See the module documentation.

    Args:
        cluster: A dict from job name to a list of addresses (or to a dict of
            index to address), such as :func:`cluster_from_tf_config` returns,
            or a ``tf.train.ClusterSpec``.
        env: The environment to read the settings from (default ``os.environ``).

    Returns:
        A dict from canonical task name (``"/job:worker/task:0"``) to the
        ``"host:port"`` address of its endpoint.

    Raises:
        ConfigError: A setting or an address is not valid, an endpoint port
            would be above 65535, ``TF_RDMA_ENDPOINTS`` names a task that is not
            in the cluster, or two tasks would share an address. The message
            names the task and says how to fix it.
    """
    env = os.environ if env is None else env
    offset = port_offset(env)
    overrides = endpoint_overrides(env)

    tasks = []
    for job, index, address in iter_tasks(cluster):
        task = canonical_task(job, index)
        try:
            host, port = split_address(address)
        except ConfigError as err:
            raise ConfigError(f"task {task}: {err}") from None
        tasks.append((task, address, host, port))

    known = {task for task, _, _, _ in tasks}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(
            f"{ENDPOINTS_ENV} names {', '.join(unknown)}, which the cluster does not have "
            f"(its tasks are {', '.join(sorted(known))})"
        )

    result = {}
    for task, address, host, port in tasks:
        if task in overrides:
            result[task] = overrides[task]
            continue
        if port + offset > _MAX_PORT:
            raise ConfigError(
                f"task {task} at gRPC address {address!r}: its tf_rdma endpoint would be at port "
                f"{port} + {offset} = {port + offset}, above {_MAX_PORT}. Set {PORT_OFFSET_ENV} "
                f"to a smaller offset, or give this task's endpoint explicitly in {ENDPOINTS_ENV}, "
                f"for example {ENDPOINTS_ENV}='{{\"{task}\": \"{join_address(host, 'PORT')}\"}}'"
            )
        result[task] = join_address(host, port + offset)

    # Two tasks on one address would make one of the servers fail to start,
    # or worse, talk to the wrong peer: say so now, with both names.
    owners = {}
    for task, address, host, port in tasks:
        owners.setdefault((host, port), []).append(f"gRPC address of {task}")
    for task, endpoint in result.items():
        owners.setdefault(split_address(endpoint), []).append(f"endpoint of {task}")
    for (host, port), users in owners.items():
        if len(users) > 1:
            raise ConfigError(
                f"address {join_address(host, port)!r} is both the {' and the '.join(users)}. "
                f"Change the cluster's ports, set {PORT_OFFSET_ENV} (now {offset}) so that no "
                f"endpoint lands on another task's port, or set {ENDPOINTS_ENV}"
            )
    return result


# --------------------------------------------------------------------------- free ports


def _bind_test(family, host, port):
    """Returns a socket bound to (host, port), or None when the port is taken."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        if err.errno in (errno.EADDRINUSE, errno.EACCES):
            return None
        # The host itself is the problem (not an address of this machine, or
        # not resolvable): no other port would do better.
        raise ConfigError(f"cannot listen on host {host!r}: {err}") from None
    return sock


def _ephemeral_ports(path="/proc/sys/net/ipv4/ip_local_port_range"):
    """The range of ports the kernel gives outgoing connections.

    Args:
        path: Where the kernel says it (Linux's ``ip_local_port_range``).

    Returns:
        ``(first, last)``, both included, or None where the file is absent
        or does not hold two ports in order.
    """
    try:
        with open(path) as f:
            first, last = (int(word) for word in f.read().split())
    except (OSError, ValueError):
        return None
    return (first, last) if 0 < first <= last <= _MAX_PORT else None


def free_ports(n, offset=None, host="127.0.0.1", env=None):
    """Picks gRPC ports whose endpoint ports are free as well.

    For each returned port ``p`` both ``p`` and ``p + offset`` could be bound
    on ``host`` when they were picked. No port is returned twice, and no
    ``p`` equals any ``q + offset``, so the 2n ports are all distinct. The
    ports are released before returning: another process can still take one
    before the servers bind it, which a launcher reports as a server that
    failed to start. To make that rare, neither port is in the range the
    kernel takes the local ports of outgoing connections from (Linux's
    ``ip_local_port_range``) unless too few ports are left outside it: a
    connection any process opens meanwhile (a gRPC channel, a peer's dial)
    could otherwise be given the very port a server is about to bind.

    Args:
        n: How many gRPC ports to pick.
        offset: The endpoint port offset; default: :func:`port_offset` of ``env``.
        host: The address to bind-test on (default ``"127.0.0.1"``).
        env: The environment to read the offset from (default ``os.environ``).

    Returns:
        A list of ``n`` port numbers.

    Raises:
        ConfigError: ``n`` is negative, the offset is not in 1..64511, or
            ``host`` is not an address this machine can listen on.
        OSError: Not enough free port pairs were found.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"free_ports: n={n!r} is not a non-negative integer")
    if offset is None:
        offset = port_offset(env)
    if isinstance(offset, bool) or not isinstance(offset, int) or not 1 <= offset <= _MAX_OFFSET:
        raise ConfigError(f"free_ports: offset={offset!r} is not an integer from 1 to {_MAX_OFFSET}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = host.strip("[]")

    # Random ports above the usual well-known services, kept below
    # 65535 - offset so that the endpoint fits, and outside the ephemeral
    # range where enough are left there.
    high = _MAX_PORT - offset
    enough = 4 * n + 64
    low = 20000 if high - 20000 >= enough else 1024
    pool = range(low, high + 1)
    ephemeral = _ephemeral_ports()
    if ephemeral is not None:
        given_from, given_to = ephemeral
        quiet = [p for p in pool
                 if not (given_from <= p <= given_to
                         or given_from <= p + offset <= given_to)]
        if len(quiet) >= enough:
            pool = quiet
    rng = random.SystemRandom()
    if len(pool) < 4096:
        # Few candidates (a large offset): try each of them once, in random order.
        candidates = list(pool)
        rng.shuffle(candidates)
    else:
        candidates = (rng.choice(pool) for _ in range(200 * n + 1000))
    held = []  # sockets kept bound until all ports are picked
    taken = set()
    ports = []
    try:
        for port in candidates:
            if len(ports) == n:
                break
            if port in taken or port + offset in taken:
                continue
            first = _bind_test(family, bind_host, port)
            if first is None:
                continue
            second = _bind_test(family, bind_host, port + offset)
            if second is None:
                first.close()
                continue
            held += [first, second]
            taken.update((port, port + offset))
            ports.append(port)
        if len(ports) < n:
            raise OSError(
                f"free_ports: found only {len(ports)} of {n} free port pairs "
                f"(port, port + {offset}) on {host} among {len(pool)} candidates "
                f"from {pool[0]} to {pool[-1]}"
            )
    finally:
        for sock in held:
            sock.close()
    return ports
