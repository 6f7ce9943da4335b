"""Loading the op library: version checks and the errors a user sees."""

import ctypes
import hashlib
import hmac
import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

import tensorflow as tf  # noqa: E402
import tf_rdma  # noqa: E402
from tf_rdma import _loader  # noqa: E402
from tf_rdma.errors import LibraryError  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def copy_package(tmp_path, with_library=True, built_for=None):
    dst = tmp_path / "tf_rdma"
    shutil.copytree(os.path.join(REPO, "tf_rdma"), dst, symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))
    if not with_library:
        os.remove(dst / _loader.LIBRARY_FILE)
    if built_for is not None:
        with open(dst / "_build_info.json", "w") as f:
            json.dump({"tensorflow_version": built_for}, f)
    return tmp_path


def import_in_subprocess(path):
    env = dict(os.environ, PYTHONPATH=str(path), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", "import tf_rdma"], env=env,
                          capture_output=True, text=True, timeout=60,
                          cwd=str(path))


def test_import_registers_ops_and_records_version():
    ops = tf_rdma.ops.raw_ops()
    assert hasattr(ops, "tf_rdma_send") and hasattr(ops, "tf_rdma_recv")
    c = _loader.load().c
    assert c.tfrdma_built_tf_version().decode() == tf.__version__


def test_library_built_for_another_tensorflow(tmp_path):
    proc = import_in_subprocess(copy_package(tmp_path, built_for="2.99.0"))
    assert proc.returncode != 0
    assert "LibraryError" in proc.stderr
    assert "built against TensorFlow 2.99.0" in proc.stderr
    assert tf.__version__ in proc.stderr
    assert "pip install --no-build-isolation" in proc.stderr


def test_missing_library(tmp_path):
    proc = import_in_subprocess(copy_package(tmp_path, with_library=False))
    assert proc.returncode != 0
    assert "op library is missing" in proc.stderr
    assert "pip install --no-build-isolation" in proc.stderr


@pytest.mark.parametrize("version", ["2.15.1", "1.15.0", "2.9.0rc1"])
def test_too_old_tensorflow_is_named(version):
    with pytest.raises(LibraryError, match=version.replace(".", r"\.")):
        _loader.check_tensorflow_version(version)


@pytest.mark.parametrize("version", ["2.16.0", "2.21.0", "2.22.0rc0", "3.0.0"])
def test_supported_tensorflow_versions(version):
    _loader.check_tensorflow_version(version)


def test_handshake_hmac_matches_python():
    """The C++ HMAC-SHA256 behind the bootstrap proof equals Python's."""
    c = _loader.load().c
    rng = random.Random(7)
    for _ in range(300):
        key = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 150)))
        msg = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300)))
        out = ctypes.create_string_buffer(32)
        c.tfrdma_hmac_sha256(key, len(key), msg, len(msg), out)
        assert out.raw == hmac.new(key, msg, hashlib.sha256).digest()
