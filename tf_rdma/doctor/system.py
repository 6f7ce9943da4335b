"""What every tf_rdma transport needs of this machine.

* **op library** (:func:`op_library`): whether tf_rdma's op library is there
  and loads into the installed TensorFlow (``import tf_rdma`` does not load
  it, so the doctor runs, and says so, when it is missing or built for
  another TensorFlow).
* **memlock** (:func:`memlock`): ``RLIMIT_MEMLOCK`` (``ulimit -l``) against
  the bytes a plan needs to register (``--plan-bytes``).
* **/dev/shm** (:func:`dev_shm`): its size and free space against the same
  bytes: every tf_rdma region is a ``/dev/shm`` segment, whatever the
  transport.
"""

import os
import resource

from tf_rdma.errors import ConfigError, LibraryError

__all__ = ["DEV_SHM", "read_text", "op_library", "memlock", "dev_shm"]

DEV_SHM = "/dev/shm"


def read_text(path):
    """The text of a small file (of /proc, /sys), stripped; None when unreadable."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


# --------------------------------------------------------------------------- op library


def op_library():
    """Says whether the op library is present and loads into TensorFlow.

    Returns:
        A dict with ``path``, ``present``, ``built_for`` (the TensorFlow
        version recorded at build time, or None), ``tensorflow`` (the
        installed version, or None when it does not import), ``loads`` and
        ``error`` (what went wrong and what to run, else None).
    """
    from tf_rdma import _loader  # pylint: disable=import-outside-toplevel

    path = _loader.library_path()
    entry = {"path": path, "present": os.path.exists(path),
             "built_for": _loader.built_for(path), "tensorflow": None,
             "loads": False, "error": None}
    try:
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        entry["tensorflow"] = tf.__version__
        _loader.load()
        entry["loads"] = True
    except LibraryError as err:
        entry["error"] = str(err)
    except ImportError as err:
        entry["error"] = f"TensorFlow does not import: {err}"
    return entry


# --------------------------------------------------------------------------- memlock


def memlock(plan_bytes=0):
    """Compares ``RLIMIT_MEMLOCK`` with the bytes a plan needs to register.

    Args:
        plan_bytes: Bytes the plans in use register (0: not checked).

    Returns:
        A dict with ``soft`` and ``hard`` (bytes, or None for unlimited),
        ``soft_text`` (``"unlimited"`` or e.g. ``"8388608 bytes (8 MiB)"``),
        ``plan_bytes``, ``sufficient`` (True, False, or None when not checked)
        and ``advice`` (what to do when it is not sufficient, else None).

    Raises:
        ConfigError: ``plan_bytes`` is not a non-negative integer.
    """
    if isinstance(plan_bytes, bool) or not isinstance(plan_bytes, int) or plan_bytes < 0:
        raise ConfigError(f"plan_bytes={plan_bytes!r} is not a non-negative integer")
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    soft = None if soft == resource.RLIM_INFINITY else soft
    hard = None if hard == resource.RLIM_INFINITY else hard

    def text(v):
        return "unlimited" if v is None else f"{v} bytes ({v / (1 << 20):g} MiB)"

    sufficient = None
    advice = None
    if plan_bytes:
        sufficient = soft is None or soft >= plan_bytes
        if not sufficient:
            advice = (f"the plan registers {plan_bytes} bytes but `ulimit -l` allows {text(soft)}: "
                      "raise it (ulimit -l unlimited, LimitMEMLOCK=infinity for systemd, "
                      "--ulimit memlock=-1 for docker, memlock in /etc/security/limits.conf) "
                      "or run with CAP_IPC_LOCK")
    return {"soft": soft, "hard": hard, "soft_text": text(soft), "hard_text": text(hard),
            "plan_bytes": plan_bytes, "sufficient": sufficient, "advice": advice}


# --------------------------------------------------------------------------- /dev/shm


def dev_shm(plan_bytes=0, path=DEV_SHM):
    """Compares the free space of ``/dev/shm`` with the bytes a plan needs.

    Every region is a segment in ``/dev/shm`` whatever the transport, reserved
    in full when it is created; a container's default (Docker: 64 MiB) holds
    few plans. ``plan_bytes`` is the memlock check's figure, a fair
    upper bound of what a task's regions take.

    Args:
        plan_bytes: Bytes the plans in use take (0: not checked).
        path: The file system to look at (``/dev/shm``).

    Returns:
        A dict with ``path``, ``present``, ``total`` and ``free`` (bytes, None
        when absent), ``tf_rdma_bytes`` and ``tf_rdma_segments`` (what
        tf_rdma segments hold there now), ``plan_bytes``, ``sufficient``
        (True, False, or None when not checked) and ``advice``.

    Raises:
        ConfigError: ``plan_bytes`` is not a non-negative integer.
    """
    if isinstance(plan_bytes, bool) or not isinstance(plan_bytes, int) or plan_bytes < 0:
        raise ConfigError(f"plan_bytes={plan_bytes!r} is not a non-negative integer")
    total = free = None
    try:
        fs = os.statvfs(path)
        total, free = fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize
    except OSError:
        pass
    segments, used = 0, 0
    for name in (os.listdir(path) if total is not None else []):
        if name.startswith("tfrdma."):
            try:
                used += os.stat(os.path.join(path, name)).st_blocks * 512
                segments += 1
            except OSError:
                continue
    sufficient = advice = None
    if plan_bytes:
        sufficient = free is not None and free >= plan_bytes
        if not sufficient:
            have = "is absent" if free is None else f"has {free} bytes free of {total}"
            advice = (f"the plan needs {plan_bytes} bytes of shared memory but {path} {have}: "
                      "give it more (docker run --shm-size=2g; Kubernetes: an emptyDir with "
                      "medium: Memory mounted on /dev/shm); another transport does not help, "
                      "every region lives there")
    return {"path": path, "present": total is not None, "total": total, "free": free,
            "tf_rdma_bytes": used, "tf_rdma_segments": segments, "plan_bytes": plan_bytes,
            "sufficient": sufficient, "advice": advice}
