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

pytestmark = pytest.mark.timeout(300)


def copy_package(tmp_path, with_library=True, built_for=None):
    """Lays tf_rdma out in tmp_path as an install does (graph_passes inside)."""
    dst = tmp_path / "tf_rdma"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(os.path.join(REPO, "tf_rdma"), dst, ignore=ignore)
    shutil.copytree(os.path.join(REPO, "graph_passes"), dst / "graph_passes", ignore=ignore)
    if not with_library:
        os.remove(dst / _loader.LIBRARY_FILE)
    if built_for is not None:
        with open(dst / "_build_info.json", "w") as f:
            json.dump({"tensorflow_version": built_for}, f)
    return tmp_path


def run_in_subprocess(path, code="import tf_rdma.ops"):
    env = dict(os.environ, PYTHONPATH=str(path), TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, "-c", code], env=env,
                          capture_output=True, text=True, timeout=150,
                          cwd=str(path))


# What must start without TensorFlow: the package, the graph passes, the
# settings, the collectives package (its cost model and simulator), the
# command line with every subcommand's parser, and the engine's rules that
# the doctor and the launcher apply (tf_rdma._native).
LIGHT_IMPORTS = """
import sys
import tf_rdma, tf_rdma.errors, tf_rdma.cluster, tf_rdma.settings
import tf_rdma.graph_passes.plan, tf_rdma.launch, tf_rdma.doctor.command, tf_rdma.cli
import tf_rdma.collectives, tf_rdma.collectives.simulate, tf_rdma.collectives.cost
import tf_rdma.counters  # tf_rdma.stats(): loads the library only when called
tf_rdma.cli.build_parser()  # every subcommand's module (`tf-rdma launch`, ...)
plan = tf_rdma.Plan([tf_rdma.Transfer("x", "/job:w/task:0", "/job:w/task:1", "float32", [4])])
from tf_rdma import _native
_native.choose_transport({"allowed": "auto", "host": "127.0.0.1"}, {"host": "localhost"})
_native.remove_stale_segments(owner_pids=[99999999])
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras"))
print("LOADED", loaded)
"""


def test_import_tf_rdma_loads_neither_tensorflow_nor_the_library(tmp_path):
    # With the library removed, so that loading it would fail loudly.
    proc = run_in_subprocess(copy_package(tmp_path, with_library=False), LIGHT_IMPORTS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "LOADED []" in proc.stdout, proc.stdout


@pytest.mark.fast
def test_graph_passes_installs_as_tf_rdma_graph_passes(tmp_path):
    # graph_passes/ is a real directory at the top of the tree (no link inside
    # tf_rdma/), mapped to tf_rdma.graph_passes by setup.py: in a build, and in
    # the editable install the tests run against.
    assert not os.path.lexists(os.path.join(REPO, "tf_rdma", "graph_passes"))
    subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                   cwd=REPO, check=True, capture_output=True, timeout=120)
    built = sorted(os.listdir(tmp_path / "tf_rdma" / "graph_passes"))
    source = sorted(n for n in os.listdir(os.path.join(REPO, "graph_passes")) if n.endswith(".py"))
    assert built == source and "plan.py" in built
    import tf_rdma.graph_passes.plan as plan_module  # pylint: disable=import-outside-toplevel
    assert os.path.dirname(plan_module.__file__) == os.path.join(REPO, "graph_passes")


def test_doctor_reports_a_library_that_does_not_load(tmp_path):
    proc = run_in_subprocess(
        copy_package(tmp_path, built_for="2.99.0"),
        "import json; from tf_rdma.doctor import system; print(json.dumps(system.op_library()))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    entry = json.loads(proc.stdout.strip().splitlines()[-1])
    assert entry["present"] and not entry["loads"], entry
    assert entry["built_for"] == "2.99.0" and entry["tensorflow"] == tf.__version__
    assert "built against TensorFlow 2.99.0" in entry["error"], entry


def test_import_registers_ops_and_records_version():
    ops = tf_rdma.ops.raw_ops()
    assert hasattr(ops, "tf_rdma_send") and hasattr(ops, "tf_rdma_recv")
    c = _loader.load().c
    assert c.tfrdma_built_tf_version().decode() == tf.__version__


def test_library_built_for_another_tensorflow(tmp_path):
    proc = run_in_subprocess(copy_package(tmp_path, built_for="2.99.0"))
    assert proc.returncode != 0
    assert "LibraryError" in proc.stderr
    assert "built against TensorFlow 2.99.0" in proc.stderr
    assert tf.__version__ in proc.stderr
    assert "pip install --no-build-isolation" in proc.stderr


def test_missing_library(tmp_path):
    proc = run_in_subprocess(copy_package(tmp_path, with_library=False))
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
