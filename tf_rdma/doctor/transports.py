"""Which transport tf_rdma picks for each pair of tasks of a cluster, and why.

:func:`transport_choice` predicts the engine's choice for every pair of a
ClusterSpec (``--cluster`` or ``TF_CONFIG``) from this host's verbs status
(asked of the engine, :func:`engine_verbs_status`, which loads the op
library and so TensorFlow) and the tasks' addresses; :func:`plan_transports`
answers the same for the task pairs of a plan, using what this process's
endpoint has already connected (``RewrittenFunction.explain`` prints it).
"""

import fcntl
import ipaddress
import json
import os
import socket
import struct

from tf_rdma import _native
from tf_rdma import cluster as cluster_lib
from tf_rdma import settings
from tf_rdma.doctor.system import read_text
from tf_rdma.errors import ConfigError, LibraryError

__all__ = ["local_addresses", "engine_verbs_status", "transport_choice",
           "plan_transports", "host_identity", "reachability"]

#: Seconds one reachability probe (a TCP connect) may take.
REACH_TIMEOUT_S = 3.0


def host_identity():
    """What the engine's handshake compares to decide one host and one /dev/shm.

    Returns:
        ``{"boot_id", "netns", "dev_shm_id"}``: the kernel's boot id, the
        network namespace (``net:[4026531840]``) and the device and inode
        numbers of /dev/shm (``"<device>:<inode>"``); each "" where it
        cannot be read. Two tasks with the same boot id and namespace are on
        one host; with the same /dev/shm too, they use shm
        (kernels/common/transport_choice.h).
    """
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = ""
    try:
        st = os.stat("/dev/shm")
        shm_id = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm_id = ""
    return {"boot_id": (read_text("/proc/sys/kernel/random/boot_id") or "").strip(),
            "netns": netns, "dev_shm_id": shm_id}


def _probe(address):
    """Tries a TCP connection to ``host:port``; ``{"address", "reachable", "error"}``."""
    host, port = cluster_lib.split_address(address)
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=REACH_TIMEOUT_S):
            return {"address": address, "reachable": True, "error": None}
    except OSError as e:
        error = e.strerror or type(e).__name__
        if isinstance(e, socket.timeout):
            error = f"no answer within {REACH_TIMEOUT_S:g} s"
        return {"address": address, "reachable": False, "error": error}


def reachability(cluster, me=None, env=None):
    """Connects to every task's gRPC port and tf_rdma endpoint port.

    Args:
        cluster: The cluster (dict job → addresses).
        me: This task (``/job:J/task:T``), which is not probed; None probes
            every task.
        env: The environment, for the endpoint addresses (TF_RDMA_PORT_OFFSET,
            TF_RDMA_ENDPOINTS; default ``os.environ``).

    Returns:
        One ``{"task", "grpc", "endpoint"}`` per probed task, in the
        cluster's order; ``grpc`` and ``endpoint`` are ``{"address",
        "reachable", "error"}``. The probes run at once, each bounded by
        :data:`REACH_TIMEOUT_S`.
    """
    import concurrent.futures  # pylint: disable=import-outside-toplevel

    endpoints = cluster_lib.endpoints(cluster, env=env)
    tasks = [(cluster_lib.canonical_task(job, index), address)
             for job, index, address in cluster_lib.iter_tasks(cluster)]
    tasks = [(t, a) for t, a in tasks if t != me]
    addresses = [a for _, a in tasks] + [endpoints[t] for t, _ in tasks]
    if not addresses:
        return []
    with concurrent.futures.ThreadPoolExecutor(min(32, len(addresses))) as pool:
        probes = list(pool.map(_probe, addresses))
    n = len(tasks)
    return [{"task": t, "grpc": probes[i], "endpoint": probes[n + i]}
            for i, (t, _) in enumerate(tasks)]


def _interface_ipv4_addresses():
    """Returns the IPv4 addresses of this machine's interfaces (SIOCGIFADDR)."""
    result = set()
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return result
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
                result.add(socket.inet_ntoa(packed[20:24]))
            except OSError:
                continue
    return result


def _interface_ipv6_addresses():
    result = set()
    text = read_text("/proc/net/if_inet6") or ""
    for line in text.splitlines():
        hexaddr = line.split()[0] if line.split() else ""
        if len(hexaddr) == 32:
            result.add(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    return result


def local_addresses():
    """Returns the names and addresses under which this machine is reachable.

    Returns:
        A set of lower-case host names and IP address strings: the host
        name, the fully qualified name, ``localhost``, and every interface
        address.
    """
    names = {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}
    names |= _interface_ipv4_addresses() | _interface_ipv6_addresses()
    return names


def _host_kind(host, local):
    """Classifies a task's host: ``"loopback"``, ``"local"`` or ``"remote"``."""
    h = host.strip("[]").lower()
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        ip = None
    if h == "localhost" or (ip is not None and ip.is_loopback):
        return "loopback"
    if h in local:
        return "local"
    if ip is None:
        # A host name that is not ours by name: resolve it and compare addresses.
        try:
            infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return "remote"
        resolved = {info[4][0] for info in infos}
        if resolved and all(ipaddress.ip_address(a).is_loopback for a in resolved):
            return "loopback"
        if resolved & local:
            return "local"
    return "remote"


def _load_cluster(cluster_json, env):
    """Returns ``(cluster, source)`` from --cluster, else TF_CONFIG, else ``(None, None)``."""
    if cluster_json:
        try:
            data = json.loads(cluster_json)
        except ValueError as err:
            raise ConfigError(f"--cluster {cluster_json!r} is not valid JSON: {err}") from None
        if isinstance(data, dict) and "cluster" in data:
            data = data["cluster"]
        return cluster_lib._normalize_cluster(data, "--cluster"), "--cluster"
    if (env.get(cluster_lib.TF_CONFIG_ENV) or "").strip():
        return cluster_lib.cluster_from_tf_config(env), cluster_lib.TF_CONFIG_ENV
    return None, None


def engine_verbs_status(env=None, host=None):
    """Asks the engine whether verbs is usable here (:func:`tf_rdma.server.verbs_status`).

    Where the op library itself cannot load, verbs counts as unusable and
    the reason says why.

    Args:
        env: The environment (TF_RDMA_VERBS_*; default ``os.environ``).
        host: The task's host, whose address picks the device and GID.
    """
    from tf_rdma import server  # pylint: disable=import-outside-toplevel

    try:
        return server.verbs_status(env, host)
    except LibraryError as err:
        return {"available": False, "device": None,
                "reason": f"the op library does not load, so the engine was not asked: {err}"}


def transport_choice(cluster_json=None, task=None, env=None, verbs=None, local=None,
                     reach=False):
    """Says which transport tf_rdma picks for each pair of tasks, and why.

    The engine decides at the hello between two tasks: the first transport
    of ``TF_RDMA_TRANSPORT`` (``auto``: verbs, shm, tcp) that both ends
    allow and that fits the pair — verbs when both ends have a usable RDMA
    device, shm when both run on one host (same boot and network namespace),
    tcp always. The doctor predicts it with the engine's own rule
    (kernels/common/transport_choice.h, through :mod:`tf_rdma._native`) from
    this host's verbs status and the addresses, as the engine's start-up log
    does: two tasks are on one host when both are loopback addresses, both
    are addresses or names of this machine, or they have the same host
    string. Another task's RDMA device is not known here: a verbs choice
    says what the pair falls back to without one.

    Args:
        cluster_json: A ClusterSpec as JSON (``{"worker": [...]}`` or a whole
            TF_CONFIG); default: ``TF_CONFIG`` from ``env``.
        task: This task (``"worker:0"``, ``"/job:worker/task:0"``); default:
            TF_CONFIG's task; None: every pair of tasks is reported.
        env: The environment (default ``os.environ``).
        verbs: ``{"available", "device", "reason"}`` for this host; default:
            :func:`engine_verbs_status` (with this task's host, if known).
        local: Names/addresses of this machine (default :func:`local_addresses`).
        reach: Also connect to every other task's gRPC and endpoint ports
            (:func:`reachability`).

    Returns:
        A dict with ``setting`` (``auto`` or a list such as ``shm,tcp``),
        ``cluster_source``, ``task``, ``tasks`` (``{"task", "address",
        "host_kind"}``), ``pairs`` (``{"a", "b", "transport", "reason"}``,
        ``transport`` None when the pair cannot connect), ``verbs`` and
        ``reach`` (:func:`reachability`'s list, or None when not asked or
        without a cluster).

    Raises:
        ConfigError: The cluster, task or a TF_RDMA_* setting is not valid;
            the message names the bad value.
    """
    env = os.environ if env is None else env
    setting = settings.transport(env=env)
    result = {"setting": setting, "cluster_source": None, "task": None, "tasks": [], "pairs": [],
              "verbs": verbs, "reach": None}
    cluster, source = _load_cluster(cluster_json, env)
    if cluster is None:
        if task:
            raise ConfigError(f"--task {task!r} given without a cluster: pass --cluster or set TF_CONFIG")
        if verbs is None:
            result["verbs"] = engine_verbs_status(env)
        return result
    result["cluster_source"] = source
    local = local_addresses() if local is None else local
    tasks = []
    for job, index, address in cluster_lib.iter_tasks(cluster):
        host, _ = cluster_lib.split_address(address)
        tasks.append({"task": cluster_lib.canonical_task(job, index), "address": address,
                      "host": host, "host_kind": _host_kind(host, local)})
    names = [t["task"] for t in tasks]
    me = None
    if task:
        me = cluster_lib.canonical_task(task)
        if me not in names:
            raise ConfigError(f"--task {task!r}: the cluster has no task {me} "
                              f"(it has {', '.join(names)})")
    elif source == cluster_lib.TF_CONFIG_ENV and not cluster_json:
        mine = cluster_lib.task_from_tf_config(env)
        me = cluster_lib.canonical_task(*mine) if mine else None
    result["task"] = me
    result["tasks"] = [{k: t[k] for k in ("task", "address", "host_kind")} for t in tasks]
    if verbs is None:
        # This task's host picks the device and GID, as its endpoint would.
        host = next((t["host"] for t in tasks if t["task"] == me), None)
        verbs = result["verbs"] = engine_verbs_status(env, host)
    forced = "" if setting == "auto" else f" (TF_RDMA_TRANSPORT={setting})"
    verbs_detail = verbs["device"] if verbs["available"] else verbs["reason"]
    for i, a in enumerate(tasks):
        for b in tasks[i + 1:]:
            if me is not None and me not in (a["task"], b["task"]):
                continue
            # The engine's own rule (kernels/common/transport_choice.h): a
            # chooses, b's settings are assumed the same and its RDMA device
            # unknown; one host is judged from the addresses.
            choice = _native.choose_transport(
                {"task": a["task"], "allowed": setting, "verbs": bool(verbs["available"]),
                 "verbs_detail": verbs_detail, "host": a["host"], "host_kind": a["host_kind"]},
                {"task": b["task"], "host": b["host"], "host_kind": b["host_kind"]})
            reason = choice["reason"] + (forced if choice["transport"] else "")
            result["pairs"].append({"a": a["task"], "b": b["task"],
                                    "transport": choice["transport"], "reason": reason})
    if reach:
        result["reach"] = reachability(cluster, me, env)
    return result


def plan_transports(pairs, cluster=None, env=None):
    """Says which transport carries each (src, dst) task pair of a plan.

    A pair that this process's endpoint has already connected reports the
    transport it uses; any other pair reports the transport the engine is
    expected to choose (:func:`transport_choice`) in ``cluster``. With an
    endpoint running, its own settings and verbs status are used; otherwise
    the environment's.

    Args:
        pairs: ``(src, dst)`` task names, e.g. from a Plan's transfers.
        cluster: The cluster (dict job → addresses, or a
            ``tf.train.ClusterSpec``); default: TF_CONFIG's, when set.
        env: The environment (default ``os.environ``).

    Returns:
        One ``{"src", "dst", "transport", "status", "reason"}`` per pair, in
        order; ``status`` is ``connected``, ``expected`` or ``unknown``,
        ``transport`` None unless known.

    Raises:
        ConfigError: A setting or the cluster is not valid.
    """
    from tf_rdma import server  # pylint: disable=import-outside-toplevel

    env = dict(os.environ if env is None else env)
    connected, verbs = {}, None
    if server.endpoint_running():
        info = server.endpoint_info()
        env["TF_RDMA_TRANSPORT"] = info["transport"]
        unusable = info["verbs"].startswith("unusable: ")
        verbs = {"available": not unusable,
                 "device": None if unusable else info["verbs"],
                 "reason": info["verbs"][len("unusable: "):] if unusable else None}
        for pair in info["pairs"]:
            connected[(pair["writer"], pair["reader"])] = pair["transport"]
    if cluster is None and (env.get(cluster_lib.TF_CONFIG_ENV) or "").strip():
        cluster = cluster_lib.cluster_from_tf_config(env)
    if hasattr(cluster, "as_dict"):
        cluster = cluster.as_dict()
    expected = {}
    if cluster is not None:
        choice = transport_choice(json.dumps(cluster), None, env, verbs=verbs)
        for p in choice["pairs"]:
            expected[(p["a"], p["b"])] = expected[(p["b"], p["a"])] = p
    out = []
    for src, dst in pairs:
        src, dst = cluster_lib.canonical_task(src), cluster_lib.canonical_task(dst)
        row = {"src": src, "dst": dst, "transport": None, "status": "unknown",
               "reason": ("not connected from this process, and no cluster to predict from "
                          "(set TF_CONFIG or pass the cluster)") if cluster is None else
                         "a task of this pair is not in the cluster"}
        if (src, dst) in connected:
            row.update(transport=connected[(src, dst)], status="connected",
                       reason="this process's endpoint uses it")
        elif (src, dst) in expected:
            p = expected[(src, dst)]
            row.update(transport=p["transport"], status="expected", reason=p["reason"])
        out.append(row)
    return out

