"""``tf-rdma inspect --cluster``: in-process local servers for a script's tasks.

A training script often creates its variables at import time under
``tf.device("/job:ps/task:0")``. In a plain process that fails ("unknown
device"): eager TensorFlow knows only its own ``/job:localhost``. To inspect
such a script as it is, ``tf-rdma inspect`` first starts one
``tf.distribute.Server`` per task of the cluster *inside its own process*,
each on a free port of 127.0.0.1, and connects to them with
``tf.config.experimental_connect_to_cluster`` (the client itself stays
``/job:localhost``, the default ``--caller-device``). The script's variables
are then created on those servers, and the function traced afterwards sees
them on the devices the script asked for.

The tasks come from ``--cluster JOB:COUNT,...`` (e.g. ``worker:2,ps:1``:
``/job:worker/task:0``, ``/job:worker/task:1``, ``/job:ps/task:0``) or,
without the flag, from ``TF_CONFIG``'s ``"cluster"`` when it is set: its job
names and task indices are used, never its addresses (nothing outside this
process is contacted). ``--cluster none`` ignores ``TF_CONFIG``.

The servers are plain TensorFlow servers, without tf_rdma endpoints: inspect
only traces, it never runs a step. They live until the process exits.
"""

import os
import re

__all__ = ["CLUSTER_FORM", "ClusterError", "parse_cluster", "cluster_from_env",
           "start_local_cluster", "task_names"]


class ClusterError(Exception):
    """TF_CONFIG is not a usable cluster, or a local server did not start.

    :func:`tf_rdma.inspect.load.start_cluster` reports it as an
    ``InspectError`` (one line, exit status 1).
    """

#: The form of ``--cluster``, quoted in its error messages.
CLUSTER_FORM = "JOB:COUNT[,JOB:COUNT...], e.g. worker:2,ps:1"

_ITEM_RE = re.compile(r"(?P<job>[^:]*):(?P<count>.*)\Z")
_JOB_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*\Z")
_MAX_TASKS = 64  # Per job: more servers in one process is surely a typo.
#: The client's own job (tf.config.experimental_connect_to_cluster adds it).
CLIENT_JOB = "localhost"


def parse_cluster(text):
    """Parses ``--cluster``: ``"worker:2,ps:1"`` -> ``{"worker": [0, 1], "ps": [0]}``.

    ``"none"`` (any case) gives ``{}``: no servers, and ``TF_CONFIG`` ignored.

    Raises:
      ValueError: the text is not of the form :data:`CLUSTER_FORM`; the
        message quotes the bad part and the expected form.
    """
    if text.strip().lower() == "none":
        return {}
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or not all(items):
        raise ValueError(f"{text!r} has an empty entry; expected {CLUSTER_FORM}")
    jobs = {}
    for item in items:
        m = _ITEM_RE.match(item)
        if m is None:
            raise ValueError(f"{item!r} in {text!r} is not JOB:COUNT; expected "
                             f"{CLUSTER_FORM}")
        job, count = m.group("job").strip(), m.group("count").strip()
        if not _JOB_RE.match(job):
            raise ValueError(
                f"job {job!r} in {text!r} is not a job name (a letter, then "
                f"letters, digits or '_'); expected {CLUSTER_FORM}")
        if job == CLIENT_JOB:
            raise ValueError(
                f"job {job!r} in {text!r} is the inspecting client's own job; "
                f"name the script's jobs, e.g. worker:2,ps:1")
        if job in jobs:
            raise ValueError(f"job {job!r} appears twice in {text!r}; expected "
                             f"{CLUSTER_FORM}")
        if not count.isdigit() or not 1 <= int(count) <= _MAX_TASKS:
            raise ValueError(
                f"task count {count!r} of job {job!r} in {text!r} is not an "
                f"integer from 1 to {_MAX_TASKS}; expected {CLUSTER_FORM}")
        jobs[job] = list(range(int(count)))
    return jobs


def cluster_from_env(env=None):
    """The jobs and task indices of ``TF_CONFIG``'s cluster, or None if unset.

    Returns:
      ``{job: [index, ...]}`` (a sparse job keeps its indices), or ``None``
      when ``TF_CONFIG`` is not set or empty.

    Raises:
      ClusterError: ``TF_CONFIG`` is set but not a valid cluster (the message
        is :func:`tf_rdma.cluster.cluster_from_tf_config`'s), or names the
        job ``localhost``.
    """
    from tf_rdma import cluster as cluster_lib  # pylint: disable=import-outside-toplevel
    from tf_rdma.errors import ConfigError  # pylint: disable=import-outside-toplevel

    env = os.environ if env is None else env
    if not env.get(cluster_lib.TF_CONFIG_ENV, "").strip():
        return None
    try:
        cluster = cluster_lib.cluster_from_tf_config(env)
    except ConfigError as err:
        raise ClusterError(
            f"{err} (inspect starts local servers for the tasks of TF_CONFIG's "
            f"cluster; give --cluster {CLUSTER_FORM.split(', e.g. ')[1]} or "
            f"--cluster none instead)") from err
    jobs = {}
    for job, tasks in cluster.items():
        if job == CLIENT_JOB:
            raise ClusterError(
                f"TF_CONFIG's cluster has a job {job!r}, the inspecting "
                f"client's own job; give --cluster with the other jobs "
                f"(e.g. worker:2,ps:1) or --cluster none")
        jobs[job] = sorted(tasks) if isinstance(tasks, dict) else list(range(len(tasks)))
    return jobs


def task_names(jobs):
    """``{"worker": [0, 1]}`` -> ``["worker:0", "worker:1"]`` (jobs sorted)."""
    return [f"{job}:{i}" for job in sorted(jobs) for i in jobs[job]]


def start_local_cluster(jobs):
    """Starts a server per task in this process and connects to them.

    Args:
      jobs: ``{job: [task index, ...]}`` as :func:`parse_cluster` returns.

    Returns:
      The ``tf.train.ClusterSpec`` of the servers (127.0.0.1, free ports).

    Raises:
      ClusterError: a server could not start or the connection failed.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tf_rdma import cluster as cluster_lib  # pylint: disable=import-outside-toplevel

    count = sum(len(v) for v in jobs.values())
    try:
        ports = iter(cluster_lib.free_ports(count))
    except OSError as err:
        raise ClusterError(f"cannot find {count} free local ports for "
                           f"--cluster: {err}") from err
    spec = {job: {i: f"127.0.0.1:{next(ports)}" for i in indices}
            for job, indices in jobs.items()}
    cluster_spec = tf.train.ClusterSpec(spec)
    for job, indices in jobs.items():
        for i in indices:
            try:
                tf.distribute.Server(cluster_spec, job_name=job, task_index=i,
                                     protocol="grpc", start=True)
            except Exception as err:  # pylint: disable=broad-except
                raise ClusterError(
                    f"cannot start a local server for {job}:{i} at "
                    f"{spec[job][i]}: {type(err).__name__}: "
                    f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}"
                ) from err
    try:
        tf.config.experimental_connect_to_cluster(cluster_spec,
                                                  job_name=CLIENT_JOB)
    except Exception as err:  # pylint: disable=broad-except
        raise ClusterError(f"cannot connect to the local servers: "
                           f"{type(err).__name__}: {err}") from err
    return cluster_spec
