"""Finds, checks and loads the op library, once per process.

The library is compiled by setup.py against one TensorFlow; loading it into
another is undefined behaviour (at best an undefined-symbol error, at worst a
crash later). So before loading, the TensorFlow version recorded at build time
(_build_info.json) is compared with the running one, and every failure becomes
a LibraryError that says what to run.
"""

import ctypes
import json
import os
import threading

from tf_rdma.errors import LibraryError

MIN_TENSORFLOW = (2, 16)
LIBRARY_FILE = "_tf_rdma_ops.so"
_REBUILD = ("rebuild it against the installed TensorFlow: from the tf-rdma "
            "source tree run `pip install --no-build-isolation .` (or `make "
            "install`)")

_lock = threading.Lock()
_loaded = None


def library_path():
    """Returns the path where the op library must be."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), LIBRARY_FILE)


def _version_tuple(version):
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_tensorflow_version(version):
    """Raises LibraryError if `version` is older than tf_rdma supports."""
    if _version_tuple(version) < MIN_TENSORFLOW:
        raise LibraryError(
            f"tf_rdma needs TensorFlow >= {'.'.join(map(str, MIN_TENSORFLOW))}, "
            f"but TensorFlow {version} is installed; upgrade it "
            f"(pip install -U tensorflow-cpu) and {_REBUILD}")


def built_for(path):
    """The TensorFlow version the library at `path` was built for (None: unknown)."""
    info = os.path.join(os.path.dirname(path), "_build_info.json")
    try:
        with open(info) as f:
            return json.load(f).get("tensorflow_version")
    except (OSError, ValueError):
        return None


class _Library:
    """The loaded library: the op module and the engine's C interface."""

    def __init__(self, path, ops, cdll):
        self.path = path
        self.ops = ops
        self.c = cdll


def read_json(function):
    """Calls the op library's ``function(buf, size)`` and parses the JSON it
    writes (tfrdma_info, tfrdma_stats: they return the size they need).

    Raises:
        LibraryError: The library cannot be loaded.
    """
    fn = getattr(load().c, function)
    size = fn(None, 0)
    while True:
        buf = ctypes.create_string_buffer(size + 1024)
        size = fn(buf, len(buf))
        if size <= len(buf):  # else it grew meanwhile: ask again
            break
    return json.loads(buf.value.decode("utf-8", errors="replace"))


def load():
    """Loads the op library (once) and returns it.

    Raises:
        LibraryError: The library is missing, was built for another
            TensorFlow, or fails to load; the message says what to do.
    """
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        import tensorflow as tf  # pylint: disable=g-import-not-at-top

        check_tensorflow_version(tf.__version__)
        path = library_path()
        if not os.path.exists(path):
            raise LibraryError(
                f"tf_rdma's op library is missing (expected {path}); the "
                f"package was installed without building it. {_REBUILD[0].upper()}"
                f"{_REBUILD[1:]}. A C++17 compiler (g++) is needed.")
        built = built_for(path)
        if built is not None and built != tf.__version__:
            raise LibraryError(
                f"tf_rdma's op library was built against TensorFlow {built}, "
                f"but TensorFlow {tf.__version__} is installed; {_REBUILD}")
        try:
            ops = tf.load_op_library(path)
        except (tf.errors.NotFoundError, OSError) as e:
            raise LibraryError(
                f"tf_rdma's op library at {path} does not load into TensorFlow "
                f"{tf.__version__} ({e}); it was probably built against "
                f"another TensorFlow: {_REBUILD}") from e
        cdll = ctypes.CDLL(path)
        cdll.tfrdma_start.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                      ctypes.c_int]
        cdll.tfrdma_start.restype = ctypes.c_int
        cdll.tfrdma_stop.argtypes = []
        cdll.tfrdma_stop.restype = None
        cdll.tfrdma_started.restype = ctypes.c_int
        cdll.tfrdma_info.argtypes = [ctypes.c_char_p, ctypes.c_int]
        cdll.tfrdma_info.restype = ctypes.c_int
        cdll.tfrdma_stats.argtypes = [ctypes.c_char_p, ctypes.c_int]
        cdll.tfrdma_stats.restype = ctypes.c_int
        cdll.tfrdma_clock_offsets.argtypes = [ctypes.c_int, ctypes.c_int64,
                                              ctypes.c_char_p, ctypes.c_int]
        cdll.tfrdma_clock_offsets.restype = ctypes.c_int
        cdll.tfrdma_verbs_probe.argtypes = [ctypes.c_char_p, ctypes.c_char_p,
                                            ctypes.c_int]
        cdll.tfrdma_verbs_probe.restype = ctypes.c_int
        cdll.tfrdma_hmac_sha256.argtypes = [ctypes.c_char_p, ctypes.c_int,
                                            ctypes.c_char_p, ctypes.c_int,
                                            ctypes.c_char_p]
        cdll.tfrdma_hmac_sha256.restype = None
        cdll.tfrdma_built_tf_version.restype = ctypes.c_char_p
        cdll.tfrdma_trace_bench.argtypes = [ctypes.c_int64]
        cdll.tfrdma_trace_bench.restype = ctypes.c_int64
        cdll.tfrdma_allreduce_loop.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int64,
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ctypes.POINTER(ctypes.c_int64), ctypes.c_char_p, ctypes.c_int]
        cdll.tfrdma_allreduce_loop.restype = ctypes.c_int
        cdll.tfrdma_stall_bench.argtypes = [ctypes.c_int64]
        cdll.tfrdma_stall_bench.restype = ctypes.c_int64
        cdll.tfrdma_trace_events.argtypes = [ctypes.c_int]
        cdll.tfrdma_trace_events.restype = None
        compiled = cdll.tfrdma_built_tf_version().decode()
        if compiled not in ("unknown", tf.__version__):
            raise LibraryError(
                f"tf_rdma's op library was compiled against TensorFlow "
                f"{compiled}, but TensorFlow {tf.__version__} is installed; "
                f"{_REBUILD}")
        from tf_rdma import _auto_control_deps  # pylint: disable=g-import-not-at-top
        _auto_control_deps.register_order_insensitive_ops()
        _loaded = _Library(path, ops, cdll)
        return _loaded
