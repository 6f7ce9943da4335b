"""Which RDMA NIC a verbs run used: hardware, or softnic, the emulated one.

A bench that measures the verbs transport on a host without a usable RDMA
device runs its tf_rdma processes over softnic (tests/softnic/,
docs/verbs.md), a libibverbs that emulates a NIC in user space and that a
process loads when ``build/softnic`` comes first on its
``LD_LIBRARY_PATH``. Numbers measured over it say nothing about RDMA
hardware, so they must never carry the hardware's label: their system is
``tf_rdma-verbs-emulated``, a real device's ``tf_rdma-verbs``.

Two sides:

- The orchestrator (no TensorFlow) picks the library its cluster starts
  with (``select``, from ``--nic auto|hardware|emulated``). In ``auto`` it
  asks the engine, in a child process with the bench's own environment,
  whether verbs is usable (``tf_rdma.server.verbs_status``, the check a
  starting endpoint makes) and falls back to softnic, loudly, when it is
  not.
- The label is not taken from that choice, nor from the environment: the
  client asks the running servers which libibverbs they loaded
  (``servers_nic``: each server's ``/proc/self/maps`` and the library file
  it maps, read by ops placed on that server) and whether that library is
  softnic (it exports the symbol ``softnic_emulated``, which rdma-core's
  libibverbs does not). A library path set by hand, a copy of softnic
  elsewhere, servers started by hand on other hosts: the servers' answer
  decides.
"""

import json
import os
import subprocess
import sys

from _harness.children import REPO

#: Where ``make softnic`` puts the emulated NIC's libibverbs.so.1.
SOFTNIC_DIR = os.path.join(REPO, "build", "softnic")
SOFTNIC_LIB = os.path.join(SOFTNIC_DIR, "libibverbs.so.1")

#: The name of the dynamic symbol that marks softnic's libibverbs
#: (tests/softnic/libibverbs.map, version SOFTNIC_1).
MARK = b"softnic_emulated"

#: ``--nic`` choices.
MODES = ("auto", "hardware", "emulated")

#: The line that goes with every emulated number a bench prints.
EMULATED_NOTE = ("EMULATED RDMA NIC: the verbs numbers were measured over "
                 "softnic, an RDMA NIC emulated in user space (tests/softnic,"
                 " docs/verbs.md); they say nothing about RDMA hardware")

_PROBE_PREFIX = "NIC_PROBE "

# The probe: the engine's verdict on verbs in a process with the bench's
# environment, and the libibverbs that the verbs plugin loaded for it.
_PROBE = r"""
import json, os, sys
sys.path.insert(0, os.environ["BENCH_HARNESS_DIR"])
from _harness import nic
from tf_rdma import server
out = dict(server.verbs_status())
libraries = nic.libibverbs_paths(open("/proc/self/maps").read())
out["libibverbs"] = libraries
out["emulated"] = any(nic.is_softnic(open(path, "rb").read())
                      for path in libraries if os.path.exists(path))
print(%r + json.dumps(out), flush=True)
""" % _PROBE_PREFIX


def system_name(transport, emulated):
    """The ``system`` of a tf_rdma transport's results: ``tf_rdma-verbs``
    on hardware, ``tf_rdma-verbs-emulated`` over softnic."""
    name = f"tf_rdma-{transport}"
    return name + "-emulated" if transport == "verbs" and emulated else name


def is_emulated_system(system):
    """True for a system name measured over the emulated NIC."""
    return system.endswith("-emulated")


def _library_path(env):
    return [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]


def softnic_env(env):
    """``env`` with ``build/softnic`` first on LD_LIBRARY_PATH."""
    env = dict(env)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        [SOFTNIC_DIR] + [p for p in _library_path(env)
                         if os.path.realpath(p) != os.path.realpath(
                             SOFTNIC_DIR)])
    return env


def without_softnic(env):
    """``env`` without ``build/softnic`` on LD_LIBRARY_PATH."""
    env = dict(env)
    kept = [p for p in _library_path(env)
            if os.path.realpath(p) != os.path.realpath(SOFTNIC_DIR)]
    if kept:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(kept)
    else:
        env.pop("LD_LIBRARY_PATH", None)
    return env


def libibverbs_paths(maps_text):
    """The libibverbs files mapped in a process, from its /proc/PID/maps."""
    out = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if os.path.basename(path).startswith("libibverbs.so") and \
                path not in out:
            out.append(path)
    return out


def is_softnic(library_bytes):
    """True when a libibverbs file is softnic: its dynamic string table
    names ``softnic_emulated`` (NUL-delimited, as ELF string tables are)."""
    return b"\0" + MARK + b"\0" in library_bytes


def probe(env, timeout=180):
    """Asks the engine, in a child with ``env``, whether verbs is usable.

    Returns:
      ``{"available", "device", "reason", "libibverbs": [paths],
      "emulated"}``; on a child that gave no answer, ``available`` False
      and ``reason`` its last output.
    """
    env = dict(env)
    env["BENCH_HARNESS_DIR"] = os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env,
                              capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"available": False, "device": None, "libibverbs": [],
                "emulated": False,
                "reason": f"the probe gave no answer in {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(_PROBE_PREFIX):
            return json.loads(line[len(_PROBE_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"available": False, "device": None, "libibverbs": [],
            "emulated": False,
            "reason": f"asking the engine failed (exit {proc.returncode}): "
                      f"{tail}"}


def select(mode, env, log, probe_fn=probe):
    """The environment a verbs cluster starts with, for ``--nic mode``.

    - ``hardware``: ``env`` without build/softnic on its library path; the
      engine then refuses to start where no device is usable
      (TF_RDMA_TRANSPORT=verbs), and the run fails.
    - ``emulated``: build/softnic first on the library path.
    - ``auto``: the engine is asked (``probe_fn``) with ``env`` as it is; if
      verbs is usable the cluster gets ``env`` unchanged, else softnic, and
      the log says why, loudly.

    Whatever is chosen here, the results' label comes from the servers
    (``servers_nic``).

    Args:
      mode: One of ``MODES``.
      env: The environment the cluster would start with.
      log: The bench's progress logger.
      probe_fn: ``probe`` (a test may pass another).

    Returns:
      ``(env, selection)``: the cluster's environment, and
      ``{"mode", "chosen": "hardware"|"emulated"|None, "why"}`` for the
      JSON; ``env`` is None when nothing can run (``why`` says why).
    """
    if mode not in MODES:
        raise ValueError(f"--nic must be one of {', '.join(MODES)}, "
                         f"not {mode!r}")
    have_softnic = os.path.exists(SOFTNIC_LIB)
    if mode == "hardware":
        log("verbs: --nic hardware: the host's libibverbs (build/softnic "
            "is taken off LD_LIBRARY_PATH)")
        return without_softnic(env), {
            "mode": mode, "chosen": "hardware",
            "why": "--nic hardware: the host's libibverbs, never softnic"}
    if mode == "emulated":
        if not have_softnic:
            return None, {"mode": mode, "chosen": None,
                          "why": f"--nic emulated, but softnic is not built "
                                 f"({SOFTNIC_LIB}; `make softnic`)"}
        log("verbs: --nic emulated: " + EMULATED_NOTE)
        return softnic_env(env), {"mode": mode, "chosen": "emulated",
                                  "why": "--nic emulated"}
    log("verbs: asking the engine whether an RDMA device is usable here")
    found = probe_fn(env)
    if found.get("available"):
        if found.get("emulated"):
            # softnic was on the library path already (set by hand).
            log(f"verbs: the engine can use {found.get('device')}, but the "
                f"libibverbs it loads is softnic "
                f"({', '.join(found.get('libibverbs', []))}): "
                + EMULATED_NOTE)
            return env, {"mode": mode, "chosen": "emulated",
                         "why": "softnic was on LD_LIBRARY_PATH already",
                         "device": found.get("device")}
        log(f"verbs: RDMA device usable: {found.get('device')}")
        return env, {"mode": mode, "chosen": "hardware",
                     "why": "the engine can use this host's device",
                     "device": found.get("device")}
    reason = found.get("reason")
    if not have_softnic:
        return None, {"mode": mode, "chosen": None,
                      "why": f"no usable RDMA device ({reason}) and softnic "
                             f"is not built ({SOFTNIC_LIB}; `make softnic`)"}
    log(f"verbs: NO usable RDMA device here ({reason}); running the verbs "
        f"cluster over softnic instead. " + EMULATED_NOTE)
    return softnic_env(env), {"mode": mode, "chosen": "emulated",
                              "why": f"no usable RDMA device: {reason}"}


# --- the client's side: ask the running servers ---


def servers_nic(tf, tasks):
    """Which libibverbs each running server loaded, and whether it is softnic.

    Reads each server's ``/proc/self/maps`` with a ``tf.io.read_file``
    placed on that server (so it is the server process's map, on the
    server's host), then each libibverbs file it maps, the same way, and
    looks for softnic's mark in it.

    Args:
      tf: The tensorflow module (the client imports it; this module does
        not).
      tasks: The server devices, e.g. ``"/job:worker/task:0"``.

    Returns:
      ``{"emulated": bool, "servers": [{"task", "libibverbs": [paths],
      "emulated": bool}]}``; ``emulated`` is True when any server's
      library is softnic.

    Raises:
      RuntimeError: A server has no libibverbs loaded (it does not use
        verbs), so nothing can be said about its NIC.
    """
    def read_on(task, path):
        with tf.device(task):
            return tf.io.read_file(path).numpy()

    servers = []
    for task in tasks:
        maps = read_on(task, "/proc/self/maps").decode(errors="replace")
        libraries = libibverbs_paths(maps)
        if not libraries:
            raise RuntimeError(
                f"the server {task} has no libibverbs loaded, so it does not "
                f"use the verbs transport (are its TF_RDMA_TRANSPORT=verbs "
                f"and verbs plugin in place?)")
        emulated = any(is_softnic(read_on(task, path)) for path in libraries)
        servers.append({"task": task, "libibverbs": libraries,
                        "emulated": emulated})
    return {"emulated": any(s["emulated"] for s in servers),
            "servers": servers}
