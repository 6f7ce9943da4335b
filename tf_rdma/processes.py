"""What the launchers share about the processes they start.

``tf-rdma launch`` (one machine) and ``tf-rdma launch --slurm`` (one task
of an srun step) both start ``python -m tf_rdma.server`` processes and a
user's command: the line a server prints once it serves, how long a process
gets between SIGTERM and SIGKILL, a child that dies with its launcher, the
exit status of a child, the path under which a child imports tf_rdma, and
the inter-op threads of a task bound to one CPU.
"""

import ctypes
import os
import signal
import site
import sys

__all__ = ["READY_PREFIX", "TERM_GRACE_S", "parent_death_signal", "exit_status",
           "add_package_to_path", "one_cpu_interop_threads"]

#: The line (prefix) a server prints on stdout once it is serving.
READY_PREFIX = "tf_rdma server ready:"

#: Seconds between SIGTERM and SIGKILL at teardown.
TERM_GRACE_S = 10.0


def parent_death_signal():
    """Returns a preexec_fn that makes a child get SIGTERM when the launcher dies.

    So that a launcher killed with SIGKILL does not leave servers behind. Only
    on Linux; elsewhere None.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec():
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before prctl took effect
            os._exit(1)

    return preexec


def exit_status(returncode):
    """A child's returncode as an exit status (128 + N for signal N)."""
    if returncode is None:
        return 1
    if returncode < 0:
        return 128 - returncode
    return returncode


def add_package_to_path(env):
    """Lets the servers import tf_rdma when it runs from a source tree."""
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        site_dirs = set(site.getsitepackages())
        site_dirs.add(site.getusersitepackages())
    except AttributeError:  # some virtualenv flavours lack these
        site_dirs = set()
    if package_parent in {os.path.abspath(d) for d in site_dirs}:
        return  # installed: the servers find it like any other package
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if package_parent not in paths:
        env["PYTHONPATH"] = os.pathsep.join([package_parent] + paths)


def one_cpu_interop_threads(env, cpus):
    """Gives a task bound to one CPU two inter-op threads (a user's value stands).

    TensorFlow sizes a process's inter-op pool to its CPUs. With one thread,
    the thread that runs the step's compute also runs every other ready op,
    so an op that becomes ready during the backward pass waits until the
    pass is done: a ParameterServerStrategy step never ends (TensorFlow
    2.21, with or without tf_rdma), and RdmaStrategy's gradient buckets are
    all-reduced after the backward pass instead of during it (ResNet-50, 2
    workers each bound to one of 2 vCPUs: 69 to 78% of the step without
    communication with one thread, 91% with two). A second thread costs the
    step without communication a few percent.

    Args:
      env: The task's environment; ``TF_NUM_INTEROP_THREADS`` is set in it
        unless it is set already.
      cpus: The CPUs the task is bound to, or None (unbound: nothing to do).
    """
    if cpus is not None and len(cpus) == 1:
        env.setdefault("TF_NUM_INTEROP_THREADS", "2")
