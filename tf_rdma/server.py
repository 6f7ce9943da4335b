"""A TensorFlow task with a tf_rdma endpoint: tf_rdma.Server, start_endpoint.

Every process that runs tf_rdma ops owns one *endpoint*: the engine's TCP
listener (bootstrap handshake, TCP data path) and its regions. A
:class:`Server` is a ``tf.distribute.Server`` whose process also runs the
endpoint, so that a client connected with
``tf.config.experimental_connect_to_cluster`` can place tf_rdma ops on it.
Processes that are not TensorFlow servers (SPMD programs, tests) call
:func:`start_endpoint` directly.

Run a server from the command line (tf-rdma launch does this)::

    TF_CONFIG='{"cluster": {...}, "task": {"type": "worker", "index": 0}}' \
    TF_RDMA_SECRET=... python -m tf_rdma.server
"""

import argparse
import ctypes
import signal
import sys
import threading

from tf_rdma import _loader, _native, cluster as cluster_lib, settings
from tf_rdma.errors import ConfigError, EndpointError
from tf_rdma.processes import READY_PREFIX

__all__ = ["Endpoint", "Server", "start_endpoint", "endpoint_info"]

_endpoint = None
_endpoint_lock = threading.Lock()


class Endpoint:
    """The tf_rdma endpoint of this process (one per process).

    Use as a context manager, or call :meth:`close`; closing removes the
    process's shared-memory segments. Closing is final for the process.
    """

    def __init__(self, task, address, peers):
        self.task = task
        self.address = address
        self.peers = dict(peers)

    @property
    def port(self):
        """The port the endpoint listens on."""
        return int(endpoint_info().get("listen_port", 0))

    def info(self):
        """Returns the engine's view: task, port, pairs with their transport."""
        return endpoint_info()

    def close(self):
        """Stops the endpoint and removes its segments from /dev/shm."""
        _loader.load().c.tfrdma_stop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Endpoint(task={self.task!r}, address={self.address!r})"


def endpoint_running():
    """True when this process runs a tf_rdma endpoint."""
    return bool(_loader.load().c.tfrdma_started())


def endpoint_info():
    """Returns the running endpoint's state as a dict ("pair" lists connections).

    Keys: task, listen_port (int), transport (the setting),
    refused_connections (int: connections closed before or during their
    handshake, over a limit or denied), collective_spin_us (int: how long a
    collective of at most 1 MiB spins for a block before it sleeps,
    TF_RDMA_COLLECTIVE_SPIN_US with ``auto`` resolved), shares_cores (bool:
    this host runs more of the cluster's tasks than it has CPUs, so a small
    collective's inline poll yields the core between its looks), verbs (the RDMA device, or
    "unusable: <why>"), pairs (a dict ``{writer, reader, transport}`` per
    connection), regions (a dict ``{id, name, segment, bytes}`` per region;
    ``id`` is what a peer's frames name it by), and the same as lines: pair
    (``"writer -> reader transport"``) and region (``"name segment bytes"``).
    """
    info = _loader.read_json("tfrdma_info")
    info["pair"] = [f"{p['writer']} -> {p['reader']} {p['transport']}"
                    for p in info["pairs"]]
    info["region"] = [f"{r['name']} {r['segment']} {r['bytes']}"
                      for r in info["regions"]]
    return info


def remove_stale_segments():
    """Removes the shared memory that dead tf_rdma processes left behind.

    A process killed with SIGKILL cannot remove its segments from
    /dev/shm. Every endpoint does this when it starts; this is the same
    collection on demand (for launchers and test harnesses), without loading
    TensorFlow (:func:`tf_rdma._native.remove_stale_segments`). Only segments
    whose owner process is gone are removed: the owner holds a lock on each
    of its segments while it runs.

    Returns:
        ``(count, bytes)`` of the segments removed.

    Raises:
        LibraryError: The native library cannot be loaded.
    """
    collected = _native.remove_stale_segments()
    return len(collected["removed"]), collected["bytes"]


def verbs_status(env=None, host=None):
    """Says whether the verbs transport is usable in this process, and why not.

    Asks the engine itself: it loads the verbs plugin and opens the RDMA
    device with the TF_RDMA_VERBS_* settings, exactly as a starting endpoint
    does, then closes it.

    Args:
        env: The environment to read TF_RDMA_VERBS_* from (default os.environ).
        host: The host a task's endpoint listens on; its address picks the
            device and GID where several could serve (default: none).

    Returns:
        ``{"available": bool, "device": description or None, "reason": why
        not or None}``.

    Raises:
        ConfigError: A TF_RDMA_VERBS_* value is out of range.
        LibraryError: The op library cannot be loaded.
    """
    lines = settings.verbs_config(env)
    if host:
        lines.append(f"listen={host}:0")
    config = "\n".join(lines).encode()
    out = ctypes.create_string_buffer(4096)
    rc = _loader.load().c.tfrdma_verbs_probe(config, out, len(out))
    text = out.value.decode(errors="replace")
    if rc == 0:
        return {"available": True, "device": text, "reason": None}
    return {"available": False, "device": None, "reason": text}


def _stall_warning_ms():
    """TF_RDMA_STALL_WARNING as the engine's whole milliseconds (0: off)."""
    seconds = settings.stall_warning_seconds()
    return 0 if seconds == 0 else max(1, round(seconds * 1000))


def start_endpoint(task, cluster=None, secret=None, transport=None,
                   timeout=None, listen=None):
    """Starts this process's tf_rdma endpoint.

    Args:
        task: This process's task, e.g. "/job:worker/task:0" or "worker:0".
        cluster: The cluster (dict job → addresses, or tf.train.ClusterSpec);
            default: TF_CONFIG. Peer endpoints follow from it (tf_rdma.cluster).
        secret: The job secret; default TF_RDMA_SECRET.
        transport: "auto", or a comma-separated list of "verbs", "shm",
            "tcp" in order of preference; default TF_RDMA_TRANSPORT or auto.
        timeout: Seconds any op waits for a peer; default TF_RDMA_TIMEOUT or 60.
        listen: "host:port" to listen on; default this task's endpoint address.

    Returns:
        The :class:`Endpoint`.

    Raises:
        ConfigError: A setting is invalid or the task is not in the cluster.
        EndpointError: The endpoint could not start (e.g. the port is taken),
            or this process already runs one as another task.
    """
    global _endpoint
    if cluster is None:
        cluster = cluster_lib.cluster_from_tf_config()
    if hasattr(cluster, "as_dict"):
        cluster = cluster.as_dict()
    task = cluster_lib.canonical_task(task)
    addresses = cluster_lib.endpoints(cluster)
    if task not in addresses:
        raise ConfigError(f"task {task} is not in the cluster "
                          f"({', '.join(sorted(addresses))})")
    lines = [f"task={task}",
             f"listen={listen or addresses[task]}",
             f"secret={settings.secret(secret)}",
             f"transport={settings.transport(transport)}",
             f"timeout_ms={int(settings.timeout_seconds(timeout) * 1000)}",
             f"poll_us={settings.poll_microseconds()}",
             f"collective_spin_us={settings.collective_spin_microseconds()}",
             f"host_cpus={settings.host_cpus()}",
             f"stall_warning_ms={_stall_warning_ms()}",
             f"region_budget={settings.region_budget()}",
             f"bind={settings.bind()}"]
    lines += settings.verbs_config()
    timeline = settings.timeline_dir()
    if timeline:
        lines.append(f"timeline={timeline}")
        lines.append(f"timeline_events={settings.timeline_events()}")
    lines += [f"peer={t} {a}" for t, a in sorted(addresses.items()) if t != task]
    with _endpoint_lock:
        if _endpoint is not None:
            if _endpoint.task == task:
                return _endpoint
            raise EndpointError(f"this process already runs the tf_rdma "
                                f"endpoint of {_endpoint.task}; one endpoint "
                                f"per process")
        err = ctypes.create_string_buffer(4096)
        rc = _loader.load().c.tfrdma_start("\n".join(lines).encode(), err,
                                           len(err))
        if rc != 0:
            message = err.value.decode(errors="replace")
            if rc == 1:  # invalid argument
                raise ConfigError(message)
            raise EndpointError(f"starting the tf_rdma endpoint of {task}: "
                                f"{message}")
        _endpoint = Endpoint(task, listen or addresses[task],
                             {t: a for t, a in addresses.items() if t != task})
        return _endpoint


class Server:
    """A ``tf.distribute.Server`` that also runs the tf_rdma endpoint.

    Args:
        cluster: dict job → addresses or tf.train.ClusterSpec; default TF_CONFIG.
        job_name: This task's job; default from TF_CONFIG.
        task_index: This task's index; default from TF_CONFIG.
        secret, transport, timeout: as for :func:`start_endpoint`.
        config: Optional tf.compat.v1.ConfigProto for the TensorFlow server.

    The server serves until the process exits; :meth:`join` blocks until
    then (and, unlike tf.distribute.Server.join, still lets Python handle
    SIGTERM/SIGINT so the segments are cleaned up).
    """

    def __init__(self, cluster=None, job_name=None, task_index=None,
                 secret=None, transport=None, timeout=None, config=None):
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        if cluster is None:
            cluster = cluster_lib.cluster_from_tf_config()
        if hasattr(cluster, "as_dict"):
            cluster = cluster.as_dict()
        if job_name is None or task_index is None:
            found = cluster_lib.task_from_tf_config()
            if found is None:
                raise ConfigError("no task given and TF_CONFIG names none; "
                                  "pass job_name= and task_index=")
            job_name, task_index = found
        self.task = cluster_lib.canonical_task(job_name, task_index)
        _loader.load()  # the ops must be registered before the server starts
        self.endpoint = start_endpoint(self.task, cluster, secret=secret,
                                       transport=transport, timeout=timeout)
        self._server = tf.distribute.Server(
            tf.train.ClusterSpec(cluster), job_name=job_name,
            task_index=int(task_index), protocol="grpc", config=config,
            start=True)
        self._stopped = threading.Event()

    @property
    def target(self):
        """The gRPC target of this server ("grpc://host:port")."""
        return self._server.target

    def join(self):
        """Blocks until :meth:`stop` or a SIGTERM/SIGINT."""
        while not self._stopped.wait(0.5):
            pass

    def stop(self):
        """Stops the endpoint (removing its segments) and unblocks join()."""
        self.endpoint.close()
        self._stopped.set()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def main(argv=None):
    """`python -m tf_rdma.server [--job J --task I]`: serve until signalled."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_rdma.server",
        description="Run one TensorFlow task with a tf_rdma endpoint. The "
                    "cluster comes from TF_CONFIG; the secret from "
                    "TF_RDMA_SECRET.")
    parser.add_argument("--job", help="job name (default: TF_CONFIG task)")
    parser.add_argument("--task", type=int, help="task index (default: "
                        "TF_CONFIG task)")
    args = parser.parse_args(argv)
    stop = threading.Event()

    def on_signal(signum, frame):  # pylint: disable=unused-argument
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        server = Server(job_name=args.job, task_index=args.task)
    except (ConfigError, EndpointError) as e:
        print(f"tf_rdma server: {e}", file=sys.stderr)
        return 2
    grpc_address = server.target[len("grpc://"):]
    print(f"{READY_PREFIX} {server.task} grpc={grpc_address} "
          f"endpoint={server.endpoint.address}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
