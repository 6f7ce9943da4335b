"""Builds and installs tf_rdma.

The op library (kernels/ops, kernels/engine, kernels/transport/{shm,tcp},
kernels/common) is compiled into one shared object, tf_rdma/_tf_rdma_ops.so,
with the compile and link flags of the TensorFlow that is installed where this
package is being installed (tf.sysconfig). The TensorFlow version it was built against is
recorded in tf_rdma/_build_info.json, so that `import tf_rdma` can tell a
mismatch apart from a missing library.

The verbs transport (kernels/transport/verbs) is a separate plugin,
tf_rdma/_tf_rdma_verbs.so, linked to libibverbs only. It is built when the
compiler finds <infiniband/verbs.h> (Debian/Ubuntu: libibverbs-dev) and
skipped with a message otherwise; the core never links libibverbs and loads
the plugin with dlopen only when the verbs transport is allowed.

kernels/common is also built alone, without TensorFlow's headers, flags or
libraries, into tf_rdma/_tf_rdma_native.so: the rules that `tf-rdma doctor`,
the launcher and explain() share with the engine (which transport a pair
uses, the collection of stale shared-memory segments), loaded with ctypes by
tf_rdma/_native.py in processes that never load TensorFlow.

pip builds in an isolated environment by default, where the installed
TensorFlow is not importable. The flags are therefore read by running this
same interpreter with the isolation variables removed, which sees the target
environment's site-packages. `pip install --no-build-isolation .` avoids the
question altogether and is what the Makefile uses.

Object files are cached in build/obj and rebuilt only when a source or header
under kernels/ changed, so repeated installs take seconds.
"""

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))
LIBRARY = "tf_rdma._tf_rdma_ops"
LIBRARY_FILE = "_tf_rdma_ops.so"
CORE_SOURCE_DIRS = ["kernels/common", "kernels/engine", "kernels/ops",
                    "kernels/transport", "kernels/transport/shm",
                    "kernels/transport/tcp"]
# The verbs backend is a separate plugin, linked to libibverbs and dlopened by
# the core only when verbs is allowed; built only where the headers exist.
# Its factory.cc is the core's side of it (it dlopens the plugin): compiled
# into the core library, always, and not into the plugin.
VERBS_FILE = "_tf_rdma_verbs.so"
VERBS_SOURCE_DIR = "kernels/transport/verbs"
VERBS_CORE_SOURCE = "kernels/transport/verbs/factory.cc"
# kernels/common without TensorFlow, for the tools that run without it.
NATIVE_FILE = "_tf_rdma_native.so"
NATIVE_SOURCE_DIR = "kernels/common"
NATIVE_CFLAGS = ["-std=c++17", "-O2", "-fPIC", "-Wall", "-Wno-sign-compare",
                 "-DNDEBUG"]
VERBS_HEADER = "infiniband/verbs.h"

_QUERY = """
import json, tensorflow as tf
print(json.dumps({"version": tf.__version__,
                  "cflags": tf.sysconfig.get_compile_flags(),
                  "lflags": tf.sysconfig.get_link_flags()}))
"""


def tensorflow_build_flags():
    """Returns {version, cflags, lflags} of the TensorFlow being built against."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONNOUSERBASE")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    proc = subprocess.run([sys.executable, "-c", _QUERY], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(
            "tf_rdma: building the op library needs TensorFlow >= 2.16 "
            "installed in this environment (pip install tensorflow-cpu), then "
            "`pip install --no-build-isolation .`.\n" + proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def core_sources():
    return ([src for d in CORE_SOURCE_DIRS for src in sources_in(d)]
            + [VERBS_CORE_SOURCE])


def verbs_plugin_sources():
    return [src for src in sources_in(VERBS_SOURCE_DIR)
            if src != VERBS_CORE_SOURCE]


def sources_in(directory):
    return [os.path.join(directory, name)
            for name in sorted(os.listdir(os.path.join(ROOT, directory)))
            if name.endswith(".cc")]


def verbs_headers_present(cxx):
    """True when the compiler finds <infiniband/verbs.h> (libibverbs-dev)."""
    proc = subprocess.run([cxx, "-E", "-x", "c++", "-"],
                          input="#include <%s>\n" % VERBS_HEADER,
                          capture_output=True, text=True)
    return proc.returncode == 0


def newest_header_mtime():
    newest = 0.0
    for dirpath, _, files in os.walk(os.path.join(ROOT, "kernels")):
        for name in files:
            if name.endswith(".h"):
                newest = max(newest, os.path.getmtime(os.path.join(dirpath, name)))
    return newest


class BuildOpLibrary(build_ext):
    """Compiles the op library with TensorFlow's flags, in parallel."""

    def build_extension(self, ext):
        tf_info = tensorflow_build_flags()
        major_minor = tuple(int(x) for x in tf_info["version"].split(".")[:2])
        if major_minor < (2, 16):
            raise SystemExit("tf_rdma needs TensorFlow >= 2.16, found %s"
                             % tf_info["version"])
        cxx = os.environ.get("CXX", "g++")
        cflags = ['-DTF_RDMA_BUILT_TF_VERSION="%s"' % tf_info["version"], "-O2", "-fPIC", "-Wall", "-Wno-sign-compare", "-Wno-deprecated-declarations", "-I" + ROOT,
                  "-DNDEBUG"] + tf_info["cflags"]
        obj_dir = os.path.join(ROOT, "build", "obj",
                               "tf-" + tf_info["version"])
        native_obj_dir = os.path.join(ROOT, "build", "obj", "native")
        os.makedirs(obj_dir, exist_ok=True)
        os.makedirs(native_obj_dir, exist_ok=True)
        native_cflags = NATIVE_CFLAGS + ["-I" + ROOT]
        headers_mtime = newest_header_mtime()

        def compile_one(src, flags=cflags, objects=obj_dir):
            obj = os.path.join(objects, src.replace("/", "_") + ".o")
            src_path = os.path.join(ROOT, src)
            if (os.path.exists(obj) and os.path.getmtime(obj) >= max(
                    os.path.getmtime(src_path), headers_mtime)):
                return obj
            cmd = [cxx] + flags + ["-c", src_path, "-o", obj + ".tmp"]
            print("tf_rdma: compiling", src, flush=True)
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError("compiling %s failed:\n%s"
                                   % (src, proc.stderr))
            if proc.stderr.strip():
                print(proc.stderr, file=sys.stderr)
            os.replace(obj + ".tmp", obj)
            return obj

        verbs_sources = []
        if verbs_headers_present(cxx):
            verbs_sources = verbs_plugin_sources()
        else:
            print("tf_rdma: %s not found (install libibverbs-dev): building "
                  "without the verbs transport" % VERBS_HEADER, flush=True)
        jobs = int(os.environ.get("TF_RDMA_BUILD_JOBS", os.cpu_count() or 2))
        with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
            core = [pool.submit(compile_one, src) for src in ext.sources]
            verbs = [pool.submit(compile_one, src) for src in verbs_sources]
            native = [pool.submit(compile_one, src, native_cflags,
                                  native_obj_dir)
                      for src in sources_in(NATIVE_SOURCE_DIR)]
            try:
                core_objects = [f.result() for f in core]
                native_objects = [f.result() for f in native]
            except RuntimeError as e:
                raise SystemExit("tf_rdma: " + str(e))
            try:
                verbs_objects = [f.result() for f in verbs]
            except RuntimeError as e:
                # The core works without the plugin (verbs is then reported
                # unusable, with the reason, at run time).
                print("tf_rdma: building without the verbs transport:", e,
                      file=sys.stderr)
                verbs_objects = []

        out = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(out), exist_ok=True)

        def link(path, objs, flags):
            # Link to a temporary name and rename: processes that have the
            # old library mapped keep their (unlinked) copy instead of
            # crashing.
            print("tf_rdma: linking", os.path.relpath(path, ROOT), flush=True)
            subprocess.run([cxx, "-shared", "-o", path + ".tmp"] + objs + flags,
                           check=True)
            os.replace(path + ".tmp", path)

        link(out, core_objects, tf_info["lflags"] + ["-lrt", "-lpthread", "-ldl"])
        # No TensorFlow, and nothing left undefined: it loads anywhere.
        link(os.path.join(os.path.dirname(out), NATIVE_FILE), native_objects,
             ["-lrt", "-lpthread", "-Wl,--no-undefined"])
        verbs_out = os.path.join(os.path.dirname(out), VERBS_FILE)
        if verbs_objects:
            # Only libibverbs: the plugin uses nothing of TensorFlow's, and
            # every undefined symbol must resolve when it is dlopened.
            try:
                link(verbs_out, verbs_objects,
                     ["-libverbs", "-lpthread", "-Wl,--no-undefined"])
            except subprocess.CalledProcessError:
                print("tf_rdma: linking the verbs plugin failed (is "
                      "libibverbs.so installed?): building without the "
                      "verbs transport", file=sys.stderr)
                verbs_objects = []
        if not verbs_objects and os.path.exists(verbs_out):
            os.remove(verbs_out)
        with open(os.path.join(os.path.dirname(out), "_build_info.json"),
                  "w") as f:
            json.dump({"tensorflow_version": tf_info["version"],
                       "compiler": cxx}, f)
            f.write("\n")

    def copy_extensions_to_source(self):
        # In-place and editable builds put the library into the source tree,
        # with its build record. Copy-then-rename, never overwrite in place.
        for name in (LIBRARY_FILE, VERBS_FILE, NATIVE_FILE,
                     "_build_info.json"):
            src = os.path.join(self.build_lib, "tf_rdma", name)
            dst = os.path.join(ROOT, "tf_rdma", name)
            if name == VERBS_FILE and not os.path.exists(src):
                if os.path.exists(dst):
                    os.remove(dst)
                continue
            shutil.copyfile(src, dst + ".tmp")
            shutil.copymode(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)

    def get_ext_filename(self, fullname):
        return os.path.join(*fullname.split(".")) + ".so"


setup(
    name="tf-rdma",
    version="0.1.0",
    description=("Zero-copy, preallocated cross-task tensor transfers for "
                 "TensorFlow 2 over shared memory, TCP and RDMA"),
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    # graph_passes/ sits at the top of the source tree (design.md: the passes
    # import nothing from the engine or TensorFlow) and installs as
    # tf_rdma.graph_passes.
    packages=find_packages(include=["tf_rdma", "tf_rdma.*"]) + ["tf_rdma.graph_passes"],
    package_dir={"tf_rdma.graph_passes": "graph_passes"},
    package_data={"tf_rdma": ["_tf_rdma_ops.so", "_tf_rdma_verbs.so",
                              "_tf_rdma_native.so", "_build_info.json",
                              "doctor_schema.json"]},
    ext_modules=[Extension(LIBRARY, sources=core_sources())],
    cmdclass={"build_ext": BuildOpLibrary},
    install_requires=["numpy"],
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"],
                    # where the system's rdma-core is >= the wheel's (docs/doctor.md)
                    "verbs": ["pyverbs"]},
    entry_points={"console_scripts": ["tf-rdma = tf_rdma.cli:main"]},
    zip_safe=False,
)
