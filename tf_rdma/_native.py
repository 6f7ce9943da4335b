"""The engine's rules for tools that run without TensorFlow.

`tf-rdma doctor`, the launcher and ``explain()`` must not load TensorFlow,
but two of the rules they apply are the engine's, written once in C++
(kernels/common): which transport a pair of tasks uses
(transport_choice.h), and which shared-memory segments dead processes left
behind (region.h). setup.py builds kernels/common a second time, without
TensorFlow, into ``_tf_rdma_native.so`` next to this module; this module
loads it with ctypes on first use and wraps its C interface
(kernels/common/native_c_api.cc).
"""

import ctypes
import json
import os
import threading

from tf_rdma.errors import ConfigError, LibraryError

LIBRARY_FILE = "_tf_rdma_native.so"

_lock = threading.Lock()
_library = None


class _PairEnd(ctypes.Structure):
    """``struct tfrdma_pair_end`` of native_c_api.cc."""

    _fields_ = [("task", ctypes.c_char_p),
                ("allowed", ctypes.c_char_p),
                ("verbs", ctypes.c_int),
                ("verbs_detail", ctypes.c_char_p),
                ("boot_id", ctypes.c_char_p),
                ("netns", ctypes.c_char_p),
                ("host", ctypes.c_char_p),
                ("host_kind", ctypes.c_char_p),
                ("shm_id", ctypes.c_char_p)]


def library_path():
    """Returns the path where the native library must be."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_FILE)


def _load():
    global _library
    with _lock:
        if _library is not None:
            return _library
        path = library_path()
        if not os.path.exists(path):
            raise LibraryError(
                f"tf_rdma's native library is missing (expected {path}); the "
                f"package was installed without building it. Build it from the "
                f"tf-rdma source tree with `pip install --no-build-isolation .` "
                f"(or `make install`); a C++17 compiler (g++) is needed.")
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            raise LibraryError(f"tf_rdma's native library at {path} does not load "
                               f"({e}); rebuild it with `pip install "
                               f"--no-build-isolation .`") from e
        lib.tfrdma_choose_transport.argtypes = [ctypes.POINTER(_PairEnd),
                                                ctypes.POINTER(_PairEnd)]
        lib.tfrdma_choose_transport.restype = ctypes.c_void_p
        lib.tfrdma_remove_stale_segments.argtypes = [ctypes.c_char_p]
        lib.tfrdma_remove_stale_segments.restype = ctypes.c_void_p
        lib.tfrdma_free.argtypes = [ctypes.c_void_p]
        lib.tfrdma_free.restype = None
        _library = lib
        return lib


def _answer(lib, pointer):
    """The JSON an interface function returned, parsed; frees it."""
    if not pointer:
        raise MemoryError("tf_rdma's native library could not allocate its answer")
    try:
        text = ctypes.string_at(pointer).decode("utf-8", errors="replace")
    finally:
        lib.tfrdma_free(pointer)
    return json.loads(text)


def _text(value):
    return None if value is None else str(value).encode("utf-8", errors="replace")


def _pair_end(end, role):
    unknown = set(end) - {"task", "allowed", "verbs", "verbs_detail", "boot_id", "netns",
                          "host", "host_kind", "shm_id"}
    if unknown:
        raise ConfigError(f"choose_transport: unknown key(s) {sorted(unknown)} for the {role}")
    allowed = end.get("allowed")
    if isinstance(allowed, (list, tuple)):
        allowed = ",".join(allowed)
    verbs = end.get("verbs")
    return _PairEnd(task=_text(end.get("task")),
                    allowed=_text(allowed),
                    verbs=-1 if verbs is None else int(bool(verbs)),
                    verbs_detail=_text(end.get("verbs_detail")),
                    boot_id=_text(end.get("boot_id")),
                    netns=_text(end.get("netns")),
                    host=_text(end.get("host")),
                    host_kind=_text(end.get("host_kind")),
                    shm_id=_text(end.get("shm_id")))


def choose_transport(chooser, peer):
    """Says which transport a pair of tasks uses, and why: the engine's rule.

    The same function decides in the engine's handshake (the accepting end
    chooses) and predicts in its start-up log; see
    kernels/common/transport_choice.h. Two ends are on one host when both
    ``boot_id`` and ``netns`` are known for both and equal; when they are not
    known for both, when both hosts are loopback or addresses of this
    machine, or the host strings are equal.

    Args:
        chooser: The end that chooses (the accepting one; for a prediction,
            this task), a dict with the keys:
            ``task`` (str, for the reasons),
            ``allowed`` (``"auto"``, ``"shm,tcp"`` or a list of names:
            its TF_RDMA_TRANSPORT),
            ``verbs`` (True: it has a usable RDMA device, False: it has none
            or does not ask for one, None: not known),
            ``verbs_detail`` (the device, or why there is none),
            ``boot_id`` and ``netns`` (its host identity; None when not known),
            ``shm_id`` (its /dev/shm directory, ``"<device>:<inode>"``: with
            a host identity, shm needs it equal at both ends),
            ``host`` (its endpoint's host as the cluster names it) and
            ``host_kind`` (``"loopback"``, ``"local"``, ``"remote"``, or None
            to have ``host`` judged here against this machine's interfaces).
            Missing keys are not known.
        peer: The other end, the same keys; ``allowed`` None means the same
            as the chooser's.

    Returns:
        A dict: ``transport`` (``"verbs"``, ``"shm"``, ``"tcp"``, or None when
        the pair cannot connect), ``fallback`` (when ``transport`` is verbs
        but an end's verbs is not known: what the pair uses without it, or
        None), ``same_host`` (bool), ``shared_shm`` (whether the ends see
        one /dev/shm), ``host_reason`` (why the ends are, or are not, on one
        host) and ``reason`` (why this transport, or why none).

    Raises:
        ConfigError: ``allowed`` or ``host_kind`` is not valid, or a key is
            unknown.
        LibraryError: The native library is missing or does not load.
    """
    lib = _load()
    ends = (_pair_end(chooser, "chooser"), _pair_end(peer, "peer"))
    answer = _answer(lib, lib.tfrdma_choose_transport(ctypes.byref(ends[0]),
                                                      ctypes.byref(ends[1])))
    if "error" in answer:
        raise ConfigError(answer["error"])
    return answer


def remove_stale_segments(owner_pids=None):
    """Removes the shared memory that dead tf_rdma processes left behind.

    A process killed with SIGKILL cannot remove its segments from /dev/shm.
    A segment is removed only when no process holds its lock (its owner holds
    one while it lives: region.h), it is a regular file, and it is still
    linked; the same collection runs in every endpoint when it starts.

    Args:
        owner_pids: Only the segments of these pids (``tfrdma.<pid>.<n>``);
            None: of every owner. An empty list removes nothing.

    Returns:
        A dict: ``removed`` (the names removed from /dev/shm), ``bytes``
        (their total size) and ``errors`` (``"<name>: <why>"`` for segments
        that could not be looked at, e.g. without permission).

    Raises:
        LibraryError: The native library is missing or does not load.
    """
    if owner_pids is not None:
        owner_pids = [int(pid) for pid in owner_pids]
        if not owner_pids:
            return {"removed": [], "bytes": 0, "errors": []}
    lib = _load()
    pids = None if owner_pids is None else ",".join(map(str, owner_pids)).encode()
    return _answer(lib, lib.tfrdma_remove_stale_segments(pids))
