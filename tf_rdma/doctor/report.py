"""The doctor's report: every check gathered (:func:`build_report`) and
rendered as text (:func:`format_text`; ``--json`` prints the dict itself).

The JSON shape is ``tf_rdma/doctor_schema.json`` (:data:`SCHEMA_PATH`,
version :data:`SCHEMA_VERSION`), described field by field in
docs/doctor.md.
"""

import os
import platform
import socket
import sys

from tf_rdma.doctor.rdma import (PROC_MODULES, SYS_MODULE, dev_infiniband,
                                 find_pyverbs, kernel_support, rdma_devices,
                                 usable_ports)
from tf_rdma.doctor.self_test import SELF_TEST_BYTES, self_test
from tf_rdma.doctor.system import dev_shm, memlock, op_library
from tf_rdma.doctor.transports import host_identity, transport_choice

__all__ = ["SCHEMA_VERSION", "SCHEMA_PATH", "build_report", "format_text"]

#: Version of the JSON report's shape; bumped when a field changes meaning.
SCHEMA_VERSION = 5

#: The JSON Schema of the ``--json`` report, checked into the repository.
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "doctor_schema.json")


def build_report(cluster_json=None, task=None, plan_bytes=0, run_self_test=False, env=None,
                 allow_dist_packages=True, reach=False):
    """Gathers the whole doctor report.

    Args:
        cluster_json: ClusterSpec JSON for the transport choice (default TF_CONFIG).
        task: This task, for the transport choice.
        plan_bytes: Bytes the plans in use register (0: memlock and /dev/shm
            not checked).
        run_self_test: Run the loopback RDMA write self-test.
        env: The environment (default ``os.environ``).
        allow_dist_packages: Look for the distribution's pyverbs when
            ``import pyverbs`` fails.
        reach: Connect to every other task's gRPC and endpoint ports.

    Returns:
        The report dict; its shape is ``tf_rdma/doctor_schema.json``.

    Raises:
        ConfigError: An argument or setting has a value the doctor cannot use.
    """
    env = os.environ if env is None else env
    library = op_library()
    mem = memlock(plan_bytes)
    shm = dev_shm(plan_bytes)
    module, pv_info = find_pyverbs(allow_dist_packages)
    kernel = kernel_support()
    dev = dev_infiniband()
    devices, dev_error = rdma_devices(module)
    usable = usable_ports(devices)
    if usable:
        reason = None
    else:
        parts = []
        if kernel["reason"]:
            parts.append(kernel["reason"])
        if not module:
            parts.append("pyverbs is not importable")
        elif dev_error:
            parts.append(dev_error)
        elif devices:
            parts.append("no port is ACTIVE")
        if not dev["present"]:
            parts.append(f"{dev['path']} is absent")
        reason = "; ".join(parts) or "no usable RDMA device"
    transports = transport_choice(cluster_json, task, env, reach=reach)
    test = self_test(module, devices) if run_self_test else {
        "ran": False, "ok": None, "device": None, "port": None, "bytes": SELF_TEST_BYTES,
        "seconds": None, "reason": "not requested; pass --self-test"}
    return {
        "schema_version": SCHEMA_VERSION,
        "host": {"hostname": socket.gethostname(), "kernel": platform.release(),
                 "python": sys.executable, "python_version": platform.python_version(),
                 **host_identity()},
        "rdma": {"usable": bool(usable), "reason": reason,
                 "device_count": len(devices), "active_ports": len(usable)},
        "op_library": library,
        "pyverbs": pv_info,
        "kernel": kernel,
        "dev_infiniband": dev,
        "devices": devices,
        "device_error": dev_error,
        "memlock": mem,
        "dev_shm": shm,
        "transports": transports,
        "self_test": test,
    }


def _plan_verdict(check):
    """The end of a memlock or /dev/shm line: whether the plan's bytes fit."""
    if check["sufficient"] is None:
        return "; plan size not checked (--plan-bytes)"
    if check["sufficient"]:
        return f"; enough for {check['plan_bytes']} bytes"
    return f"; NOT enough: {check['advice']}"


def _mib(n):
    return f"{n / (1 << 20):.1f} MiB"


def format_text(report):
    """Renders the report as readable text.

    Args:
        report: A dict from :func:`build_report`.

    Returns:
        The text, ending with a newline.
    """
    out = []
    rdma = report["rdma"]
    verbs = report["transports"]["verbs"]
    if rdma["usable"]:
        out.append(f"RDMA: {rdma['active_ports']} active port(s) on {rdma['device_count']} device(s)")
    elif verbs["available"]:
        out.append(f"RDMA: tf_rdma can use {verbs['device']}; the inventory below is "
                   f"incomplete: {rdma['reason']}")
    else:
        out.append(f"RDMA: no RDMA devices usable here: {rdma['reason']}")
    lib = report["op_library"]
    if lib["loads"]:
        out.append(f"op library: loads into TensorFlow {lib['tensorflow']} ({lib['path']})")
    else:
        out.append(f"op library: DOES NOT LOAD: {lib['error']}")
    pv = report["pyverbs"]
    if pv["importable"]:
        out.append(f"pyverbs: imports from {pv['path']} ({pv['source']}"
                   + (f", version {pv['version']}" if pv["version"] else "") + ")")
    else:
        out.append("pyverbs: not importable (install: apt-get install python3-pyverbs, or "
                   "pip install pyverbs where the system rdma-core is at least the wheel's "
                   "version; see docs/doctor.md)")
    for t in pv["tried"]:
        out.append(f"  tried {t['where']}: {t['error']}")
    k = report["kernel"]
    sc = k["sys_class_infiniband"]
    out.append(f"kernel: {sc['path']} " + (f"lists {', '.join(sc['devices']) or 'no devices'}"
                                          if sc["present"] else "is absent"))
    mods = k["modules"]
    if mods["readable"]:
        out.append(f"  RDMA modules ({mods['source']}): {', '.join(mods['loaded']) or 'none loaded'}")
    else:
        out.append(f"  RDMA modules: not readable ({PROC_MODULES} and {SYS_MODULE} unavailable)")
    d = report["dev_infiniband"]
    if d["present"]:
        out.append(f"{d['path']}:")
        for e in d["entries"]:
            access = ("rw" if e["readable"] and e["writable"] else "r" if e["readable"]
                      else "w" if e["writable"] else "no access")
            out.append(f"  {e['name']} {e['mode']} uid={e['owner_uid']} gid={e['group_gid']} ({access})")
    else:
        out.append(f"{d['path']}: absent")
    if report["devices"]:
        out.append("devices:")
        for dev in report["devices"]:
            out.append(f"  {dev['name']}: max MR size {dev['max_mr_size']}, fw {dev['fw_version']}"
                       + (" (EMULATED: softnic, a stand-in for tests; numbers over it say "
                          "nothing about RDMA hardware)" if dev["emulated"] else "")
                       + (f", error {dev['error']}" if dev["error"] else ""))
            for p in dev["ports"]:
                out.append(f"    port {p['port']}: {p['state']}, {p['link_layer']}, "
                           f"active MTU {p['active_mtu']}, lid {p['lid']}")
                for g in p["gids"]:
                    out.append(f"      gid[{g['index']}] {g['gid']} {g['type']}"
                               + (f" {g['netdev']}" if g["netdev"] else "")
                               + (f" ip {g['ip']}" if g["ip"] else ""))
    else:
        out.append(f"devices: none ({report['device_error'] or 'none found'})")
    m = report["memlock"]
    line = f"memlock (ulimit -l): soft {m['soft_text']}, hard {m['hard_text']}"
    out.append(line + _plan_verdict(m))
    d = report["dev_shm"]
    if not d["present"]:
        line = f"{d['path']}: absent (tf_rdma cannot make regions)"
    else:
        line = (f"{d['path']}: {_mib(d['free'])} free of {_mib(d['total'])}; tf_rdma segments: "
                f"{d['tf_rdma_segments']} ({_mib(d['tf_rdma_bytes'])})")
    out.append(line + _plan_verdict(d))
    tr = report["transports"]
    out.append(f"transports (TF_RDMA_TRANSPORT={tr['setting']}):")
    if tr["verbs"]["available"]:
        out.append(f"  verbs: usable ({tr['verbs']['device']})")
    else:
        out.append(f"  verbs: not usable ({tr['verbs']['reason']})")
    if tr["cluster_source"] is None:
        out.append("  no cluster given (--cluster or TF_CONFIG): no pairs to report")
    else:
        out.append(f"  cluster from {tr['cluster_source']}"
                   + (f", this task {tr['task']}" if tr["task"] else ", all pairs"))
        for p in tr["pairs"]:
            out.append(f"  {p['a']} <-> {p['b']}: {p['transport'] or 'none'} ({p['reason']})")
    h = report["host"]
    out.append(f"  this host: boot id {h['boot_id'] or '?'}, network namespace "
               f"{h['netns'] or '?'}, /dev/shm {h['dev_shm_id'] or '?'}: tasks whose three "
               f"are the same use shm; the same boot id and namespace with another "
               f"/dev/shm (a container of its own) use tcp")
    if tr["reach"] is not None:
        out.append("reachability (a TCP connection to each task's ports):")
        for r in tr["reach"]:
            parts = []
            for name, probe in (("gRPC", r["grpc"]), ("tf_rdma", r["endpoint"])):
                state = "reachable" if probe["reachable"] else f"NOT reachable ({probe['error']})"
                parts.append(f"{name} {probe['address']} {state}")
            out.append(f"  {r['task']}: " + "; ".join(parts))
    st = report["self_test"]
    if not st["ran"]:
        out.append(f"self-test: not run ({st['reason']})")
    elif st["ok"]:
        out.append(f"self-test: ok, RDMA write of {st['bytes']} bytes on {st['device']} port "
                   f"{st['port']} verified in {st['seconds']} s")
    else:
        out.append(f"self-test: FAILED on {st['device']} port {st['port']}: {st['reason']}")
    return "\n".join(out) + "\n"
