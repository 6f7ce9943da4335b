"""``tf-rdma doctor``: what this machine offers tf_rdma, and why.

The report covers, in this order:

* **op library**: whether tf_rdma's op library is there and loads into the
  installed TensorFlow (``import tf_rdma`` does not load it, so the doctor
  runs, and says so, when it is missing or built for another TensorFlow).
* **pyverbs**: whether it imports and from where. When ``import pyverbs``
  fails in this environment, the doctor looks for the distribution's package
  (Debian/Ubuntu ``python3-pyverbs``) in the system ``dist-packages``
  directories and loads *only* the ``pyverbs`` package from there, without
  adding those directories to ``sys.path``.
* **kernel**: ``/sys/class/infiniband`` and the RDMA kernel modules (from
  ``/proc/modules`` where readable, else ``/sys/module``).
* **/dev/infiniband**: the character devices and whether this user may open
  them.
* **devices**: every RDMA device with its ports, port state, link layer,
  active MTU, GID table (type RoCE v1, RoCE v2 or IB, and the IP address a
  RoCE GID stands for) and the device's maximum MR size.
* **memlock**: ``RLIMIT_MEMLOCK`` (``ulimit -l``) against the bytes a plan
  needs to register (``--plan-bytes``).
* **/dev/shm**: its size and free space against the same bytes: every
  tf_rdma region is a ``/dev/shm`` segment, whatever the transport.
* **transports**: which transport tf_rdma picks for each pair of tasks of a
  ClusterSpec (``--cluster`` or ``TF_CONFIG``), and why.
* **self-test** (``--self-test``): on a machine with an active port, a
  loopback RC queue pair and an RDMA write of 1 MiB into a registered region,
  verified byte by byte.

Exit status: 0 when the doctor ran (with or without RDMA), 1 with
``--require-rdma`` when no usable RDMA device was found (or the self-test
failed), 2 for usage errors. The JSON shape (``--json``) is described by
``tf_rdma/doctor_schema.json`` and ``docs/doctor.md``.

The inventory uses only the standard library (plus pyverbs where it
imports) and ``tf_rdma.settings`` / ``tf_rdma.cluster``; whether verbs is
usable is asked of the engine (:func:`engine_verbs_status`, which loads the
op library and so TensorFlow).
"""

import fcntl
import importlib
import importlib.machinery
import importlib.util
import ipaddress
import json
import os
import platform
import re
import resource
import socket
import stat
import struct
import sys
import sysconfig
import time

from tf_rdma import cluster as cluster_lib
from tf_rdma import settings
from tf_rdma.errors import ConfigError, LibraryError
from tf_rdma.subcommand import Command

__all__ = [
    "SCHEMA_VERSION",
    "SCHEMA_PATH",
    "SELF_TEST_BYTES",
    "op_library",
    "find_pyverbs",
    "kernel_support",
    "dev_infiniband",
    "rdma_devices",
    "memlock",
    "dev_shm",
    "engine_verbs_status",
    "transport_choice",
    "plan_transports",
    "self_test",
    "build_report",
    "format_text",
    "validate",
    "add_arguments",
    "run",
    "COMMAND",
]

#: Version of the JSON report's shape; bumped when a field changes meaning.
SCHEMA_VERSION = 3

#: The JSON Schema of the ``--json`` report, checked into the repository.
SCHEMA_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "doctor_schema.json")

#: Bytes the self-test writes through the loopback queue pair.
SELF_TEST_BYTES = 1 << 20

SYS_CLASS_INFINIBAND = "/sys/class/infiniband"
DEV_INFINIBAND = "/dev/infiniband"
DEV_SHM = "/dev/shm"
PROC_MODULES = "/proc/modules"
SYS_MODULE = "/sys/module"

#: Directories where distributions install Python packages built for the system Python.
DIST_PACKAGES_DIRS = (
    "/usr/lib/python3/dist-packages",
    "/usr/lib/python3.{minor}/dist-packages",
    "/usr/lib64/python3.{minor}/site-packages",
    "/usr/lib/python3.{minor}/site-packages",
)

#: Kernel modules that matter for RDMA: the core, the user-space verbs
#: interface, the connection manager and common providers.
RDMA_MODULES = (
    "ib_core", "ib_uverbs", "rdma_cm", "rdma_ucm", "ib_cm", "iw_cm",
    "mlx5_ib", "mlx4_ib", "bnxt_re", "irdma", "efa", "hfi1", "qedr",
    "rdma_rxe", "siw", "vmw_pvrdma", "erdma", "mana_ib",
)

_PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
_LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
_MTUS = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}

_USAGE = "tf-rdma doctor [--json] [--self-test] [--require-rdma] [--cluster JSON] [--task TASK] [--plan-bytes N]"
_DESCRIPTION = """\
Report what this machine offers tf_rdma: pyverbs, the kernel's RDMA support,
/dev/infiniband, RDMA devices with their ports and GID tables, the memlock
limit, and which transport tf_rdma picks for each pair of tasks of a cluster.
"""
_EPILOG = """\
exit status: 0 the report was made (with or without RDMA); 1 with
--require-rdma when there is no usable RDMA device or the self-test failed;
2 usage errors.

examples:
  tf-rdma doctor
  tf-rdma doctor --json
  tf-rdma doctor --cluster '{"worker": ["localhost:2222", "localhost:2223"]}' --task worker:0
  tf-rdma doctor --self-test --require-rdma --plan-bytes 268435456
"""


# --------------------------------------------------------------------------- pyverbs


def _dist_packages_dirs():
    """Returns the distribution package directories that exist, in search order."""
    minor = sys.version_info.minor
    seen = []
    for pattern in DIST_PACKAGES_DIRS:
        path = pattern.format(minor=minor)
        if path not in seen and os.path.isdir(path):
            seen.append(path)
    return seen


def _package_version(name):
    """Returns the installed version of a distribution (pip or dpkg), or None."""
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:  # noqa: BLE001 - not installed through pip
        pass
    try:
        with open("/var/lib/dpkg/status", encoding="utf-8", errors="replace") as f:
            block = {}
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    if block.get("Package") == "python3-pyverbs":
                        return block.get("Version")
                    block = {}
                elif ":" in line and not line.startswith(" "):
                    key, _, value = line.partition(":")
                    block[key] = value.strip()
            if block.get("Package") == "python3-pyverbs":
                return block.get("Version")
    except OSError:
        pass
    return None


def _load_package_from(directory, name="pyverbs"):
    """Imports package ``name`` from ``directory`` only, without touching sys.path.

    Args:
        directory: A directory that contains the package directory ``name``.
        name: The top-level package name.

    Returns:
        The imported module.

    Raises:
        ImportError: The package is not there or fails to import; the message
            says which directory and why.
    """
    spec = importlib.machinery.PathFinder.find_spec(name, [directory])
    if spec is None or spec.loader is None:
        raise ImportError(f"no package {name!r} in {directory!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        # The compiled submodules are what fails on an ABI or symbol mismatch.
        importlib.import_module(f"{name}.device")
    except BaseException:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
        raise
    return module


def find_pyverbs(allow_dist_packages=True):
    """Imports pyverbs, from this environment or from the distribution's package.

    Args:
        allow_dist_packages: When ``import pyverbs`` fails, also try the
            system ``dist-packages`` directories (only the ``pyverbs``
            package is loaded from there).

    Returns:
        A ``(module_or_None, info)`` pair. ``info`` is a dict with
        ``importable`` (bool), ``source`` (``"environment"``,
        ``"distribution"`` or None), ``path`` (the package directory),
        ``version``, ``error`` (why it did not import, or None) and
        ``tried`` (a list of ``{"where", "error"}``).
    """
    info = {"importable": False, "source": None, "path": None, "version": None,
            "error": None, "tried": []}
    module = None
    try:
        module = importlib.import_module("pyverbs")
        importlib.import_module("pyverbs.device")
        info["source"] = "environment"
    except Exception as err:  # noqa: BLE001 - ImportError, or a symbol-version OSError
        module = None
        info["tried"].append({"where": "import pyverbs (sys.path of " + sys.executable + ")",
                              "error": f"{type(err).__name__}: {err}"})
    if module is None and allow_dist_packages:
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        for directory in _dist_packages_dirs():
            package_dir = os.path.join(directory, "pyverbs")
            if not os.path.isdir(package_dir):
                info["tried"].append({"where": package_dir, "error": "not present"})
                continue
            compiled = sorted(f for f in os.listdir(package_dir) if f.endswith(".so"))
            if compiled and not any(f.endswith(suffix) for f in compiled):
                info["tried"].append({
                    "where": package_dir,
                    "error": f"its compiled modules (e.g. {compiled[0]}) are not built for this "
                             f"Python {platform.python_version()} (extension suffix {suffix})"})
                continue
            try:
                module = _load_package_from(directory)
                info["source"] = "distribution"
                break
            except Exception as err:  # noqa: BLE001
                info["tried"].append({"where": package_dir, "error": f"{type(err).__name__}: {err}"})
    if module is not None:
        info["importable"] = True
        info["path"] = os.path.dirname(os.path.realpath(module.__file__))
        info["version"] = _package_version("pyverbs")
    else:
        info["error"] = "; ".join(f"{t['where']}: {t['error']}" for t in info["tried"]) or \
            "pyverbs is not installed"
    return module, info


# --------------------------------------------------------------------------- kernel, /dev


def kernel_support(sys_class=SYS_CLASS_INFINIBAND, proc_modules=PROC_MODULES, sys_module=SYS_MODULE):
    """Reports the kernel's RDMA support.

    Args:
        sys_class: The sysfs class directory of RDMA devices.
        proc_modules: The loaded-modules list.
        sys_module: The sysfs module directory (lists built-in modules too).

    Returns:
        A dict with ``sys_class_infiniband`` (``{"path", "present",
        "devices"}``), ``modules`` (``{"source", "readable", "loaded"}``,
        ``source`` being the file or directory read, ``loaded`` the RDMA
        modules found) and ``reason``: None when the kernel exposes RDMA
        devices, else one sentence saying what is missing.
    """
    present = os.path.isdir(sys_class)
    devices = sorted(os.listdir(sys_class)) if present else []
    modules = {"source": None, "readable": False, "loaded": []}
    try:
        with open(proc_modules, encoding="utf-8") as f:
            names = {line.split()[0] for line in f if line.strip()}
        modules.update(source=proc_modules, readable=True,
                       loaded=sorted(n for n in names if n in RDMA_MODULES))
    except OSError:
        if os.path.isdir(sys_module):
            names = set(os.listdir(sys_module))
            modules.update(source=sys_module, readable=True,
                           loaded=sorted(n for n in names if n in RDMA_MODULES))
    if devices:
        reason = None
    elif not present:
        reason = (f"the kernel has no InfiniBand/RDMA support loaded: {sys_class} is absent "
                  "(no ib_core module, or a container without /sys/class/infiniband)")
    else:
        reason = f"{sys_class} exists but lists no RDMA device (no NIC driver or rxe/siw device)"
    return {"sys_class_infiniband": {"path": sys_class, "present": present, "devices": devices},
            "modules": modules, "reason": reason}


def dev_infiniband(path=DEV_INFINIBAND):
    """Reports the character devices under ``/dev/infiniband`` and their permissions.

    Args:
        path: The device directory.

    Returns:
        A dict with ``path``, ``present`` and ``entries``, a list of
        ``{"name", "mode", "owner_uid", "group_gid", "readable", "writable"}``
        (``mode`` as ``ls -l`` writes it; readable/writable for this process).
    """
    result = {"path": path, "present": os.path.isdir(path), "entries": []}
    if not result["present"]:
        return result
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        try:
            st = os.stat(full)
        except OSError:
            continue
        result["entries"].append({
            "name": name, "mode": stat.filemode(st.st_mode), "owner_uid": st.st_uid,
            "group_gid": st.st_gid, "readable": os.access(full, os.R_OK),
            "writable": os.access(full, os.W_OK)})
    return result


# --------------------------------------------------------------------------- devices


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _gid_ip(gid_text):
    """Returns the IP address a RoCE GID stands for, or None (zero GID, not an IP)."""
    try:
        addr = ipaddress.IPv6Address(gid_text)
    except ValueError:
        return None
    if int(addr) == 0:
        return None
    if addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)


def _gid_type_name(raw, link_layer):
    """Names a GID type from sysfs text or a pyverbs enum value."""
    if raw is None:
        return "IB" if link_layer == "InfiniBand" else "unknown"
    text = str(raw).strip().lower()
    if "v2" in text or text == "2":
        return "RoCE v2"
    if "roce" in text or text == "1":
        return "IB" if link_layer == "InfiniBand" else "RoCE v1"
    if text in ("ib", "0"):
        return "IB" if link_layer == "InfiniBand" else "RoCE v1"
    return "unknown"


def _gid_table(ctx, dev_name, port_num, length, link_layer, sys_class):
    """Returns the non-zero GIDs of a port with their types, netdevs and IPs."""
    table = []
    base = os.path.join(sys_class, dev_name, "ports", str(port_num))
    for index in range(length):
        gid = _read(os.path.join(base, "gids", str(index)))
        if gid is None and ctx is not None:
            try:
                gid = str(ctx.query_gid(port_num, index))
            except Exception:  # noqa: BLE001 - an empty slot
                gid = None
        if gid is None:
            continue
        try:
            if int(ipaddress.IPv6Address(gid)) == 0:
                continue
        except ValueError:
            pass
        raw_type = _read(os.path.join(base, "gid_attrs", "types", str(index)))
        if raw_type is None and ctx is not None:
            try:
                raw_type = ctx.query_gid_type(port_num, index)
            except Exception:  # noqa: BLE001
                raw_type = None
        gid_type = _gid_type_name(raw_type, link_layer)
        table.append({
            "index": index, "gid": gid, "type": gid_type,
            "netdev": _read(os.path.join(base, "gid_attrs", "ndevs", str(index))),
            "ip": _gid_ip(gid) if link_layer == "Ethernet" else None})
    return table


def rdma_devices(pyverbs, sys_class=SYS_CLASS_INFINIBAND):
    """Lists the RDMA devices that libibverbs sees, with ports and GID tables.

    Args:
        pyverbs: The pyverbs module (from :func:`find_pyverbs`), or None.
        sys_class: The sysfs class directory, for GID types and netdevs.

    Returns:
        A ``(devices, error)`` pair: a list of device dicts (``name``,
        ``node_guid``, ``fw_version``, ``max_mr_size``, ``ports``) and the
        reason there are none (or a query error), else None.
    """
    if pyverbs is None:
        return [], "pyverbs is not importable, so libibverbs was not asked"
    import pyverbs.device as pv_device  # pylint: disable=import-outside-toplevel
    try:
        listed = pv_device.get_device_list()
    except Exception as err:  # noqa: BLE001 - PyverbsRDMAError without devices
        return [], f"libibverbs found no RDMA devices ({type(err).__name__}: {err})"
    if not listed:
        return [], "libibverbs found no RDMA devices (empty device list)"
    devices, errors = [], []
    for dev in listed:
        name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
        entry = {"name": name, "node_guid": None, "fw_version": None, "max_mr_size": None,
                 "ports": [], "error": None}
        try:
            with pv_device.Context(name=name) as ctx:
                attr = ctx.query_device()
                entry["node_guid"] = str(attr.node_guid)
                entry["fw_version"] = str(attr.fw_version)
                entry["max_mr_size"] = int(attr.max_mr_size)
                for port_num in range(1, attr.phys_port_cnt + 1):
                    pattr = ctx.query_port(port_num)
                    link = _LINK_LAYERS.get(int(pattr.link_layer), str(pattr.link_layer))
                    entry["ports"].append({
                        "port": port_num,
                        "state": _PORT_STATES.get(int(pattr.state), str(pattr.state)),
                        "link_layer": link,
                        "active_mtu": _MTUS.get(int(pattr.active_mtu)),
                        "lid": int(pattr.lid),
                        "gids": _gid_table(ctx, name, port_num, int(pattr.gid_tbl_len),
                                           link, sys_class)})
        except Exception as err:  # noqa: BLE001
            entry["error"] = f"{type(err).__name__}: {err}"
            errors.append(f"{name}: {entry['error']}")
        devices.append(entry)
    return devices, ("; ".join(errors) or None)


def _usable_ports(devices):
    return [(d, p) for d in devices if not d.get("error") for p in d["ports"]
            if p["state"] in ("ACTIVE", "ACTIVE_DEFER")]


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


# --------------------------------------------------------------------------- transports


def _interface_ipv4_addresses():
    """Returns the IPv4 addresses of this machine's interfaces (SIOCGIFADDR)."""
    result = set()
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return result
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name in names:
            try:
                packed = fcntl.ioctl(sock.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
                result.add(socket.inet_ntoa(packed[20:24]))
            except OSError:
                continue
    return result


def _interface_ipv6_addresses():
    result = set()
    text = _read("/proc/net/if_inet6") or ""
    for line in text.splitlines():
        hexaddr = line.split()[0] if line.split() else ""
        if len(hexaddr) == 32:
            result.add(str(ipaddress.IPv6Address(bytes.fromhex(hexaddr))))
    return result


def local_addresses():
    """Returns the names and addresses under which this machine is reachable.

    Returns:
        A set of lower-case host names and IP address strings: the host
        name, the fully qualified name, ``localhost``, and every interface
        address.
    """
    names = {"localhost", socket.gethostname().lower(), socket.getfqdn().lower()}
    names |= _interface_ipv4_addresses() | _interface_ipv6_addresses()
    return names


def _host_kind(host, local):
    """Classifies a task's host: ``"loopback"``, ``"local"`` or ``"remote"``."""
    h = host.strip("[]").lower()
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        ip = None
    if h == "localhost" or (ip is not None and ip.is_loopback):
        return "loopback"
    if h in local:
        return "local"
    if ip is None:
        # A host name that is not ours by name: resolve it and compare addresses.
        try:
            infos = socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)
        except OSError:
            return "remote"
        resolved = {info[4][0] for info in infos}
        if resolved and all(ipaddress.ip_address(a).is_loopback for a in resolved):
            return "loopback"
        if resolved & local:
            return "local"
    return "remote"


def _load_cluster(cluster_json, env):
    """Returns ``(cluster, source)`` from --cluster, else TF_CONFIG, else ``(None, None)``."""
    if cluster_json:
        try:
            data = json.loads(cluster_json)
        except ValueError as err:
            raise ConfigError(f"--cluster {cluster_json!r} is not valid JSON: {err}") from None
        if isinstance(data, dict) and "cluster" in data:
            data = data["cluster"]
        return cluster_lib._normalize_cluster(data, "--cluster"), "--cluster"
    if (env.get(cluster_lib.TF_CONFIG_ENV) or "").strip():
        return cluster_lib.cluster_from_tf_config(env), cluster_lib.TF_CONFIG_ENV
    return None, None


def engine_verbs_status(env=None, host=None):
    """Asks the engine whether verbs is usable here (:func:`tf_rdma.server.verbs_status`).

    Where the op library itself cannot load, verbs counts as unusable and
    the reason says why.

    Args:
        env: The environment (TF_RDMA_VERBS_*; default ``os.environ``).
        host: The task's host, whose address picks the device and GID.
    """
    from tf_rdma import server  # pylint: disable=import-outside-toplevel

    try:
        return server.verbs_status(env, host)
    except LibraryError as err:
        return {"available": False, "device": None,
                "reason": f"the op library does not load, so the engine was not asked: {err}"}


def transport_choice(cluster_json=None, task=None, env=None, verbs=None, local=None):
    """Says which transport tf_rdma picks for each pair of tasks, and why.

    The engine decides at the hello between two tasks: the first transport
    of ``TF_RDMA_TRANSPORT`` (``auto``: verbs, shm, tcp) that both ends
    allow and that fits the pair — verbs when both ends have a usable RDMA
    device, shm when both run on one host (same boot and network namespace),
    tcp always. The doctor predicts that from this host's verbs status and
    the addresses: two tasks are on one host when both are loopback
    addresses, both are addresses or names of this machine, or they have the
    same host string. It assumes the other hosts' RDMA devices are like this
    one's.

    Args:
        cluster_json: A ClusterSpec as JSON (``{"worker": [...]}`` or a whole
            TF_CONFIG); default: ``TF_CONFIG`` from ``env``.
        task: This task (``"worker:0"``, ``"/job:worker/task:0"``); default:
            TF_CONFIG's task; None: every pair of tasks is reported.
        env: The environment (default ``os.environ``).
        verbs: ``{"available", "device", "reason"}`` for this host; default:
            :func:`engine_verbs_status` (with this task's host, if known).
        local: Names/addresses of this machine (default :func:`local_addresses`).

    Returns:
        A dict with ``setting`` (``auto`` or a list such as ``shm,tcp``),
        ``cluster_source``, ``task``, ``tasks`` (``{"task", "address",
        "host_kind"}``), ``pairs`` (``{"a", "b", "transport", "reason"}``,
        ``transport`` None when the pair cannot connect) and ``verbs``.

    Raises:
        ConfigError: The cluster, task or a TF_RDMA_* setting is not valid;
            the message names the bad value.
    """
    env = os.environ if env is None else env
    setting = settings.transport(env=env)
    allowed = settings.allowed_transports(setting)
    result = {"setting": setting, "cluster_source": None, "task": None, "tasks": [], "pairs": [],
              "verbs": verbs}
    cluster, source = _load_cluster(cluster_json, env)
    if cluster is None:
        if task:
            raise ConfigError(f"--task {task!r} given without a cluster: pass --cluster or set TF_CONFIG")
        if verbs is None:
            result["verbs"] = engine_verbs_status(env)
        return result
    result["cluster_source"] = source
    local = local_addresses() if local is None else local
    tasks = []
    for job, index, address in cluster_lib.iter_tasks(cluster):
        host, _ = cluster_lib.split_address(address)
        tasks.append({"task": cluster_lib.canonical_task(job, index), "address": address,
                      "host": host, "host_kind": _host_kind(host, local)})
    names = [t["task"] for t in tasks]
    me = None
    if task:
        me = cluster_lib.canonical_task(task)
        if me not in names:
            raise ConfigError(f"--task {task!r}: the cluster has no task {me} "
                              f"(it has {', '.join(names)})")
    elif source == cluster_lib.TF_CONFIG_ENV and not cluster_json:
        mine = cluster_lib.task_from_tf_config(env)
        me = cluster_lib.canonical_task(*mine) if mine else None
    result["task"] = me
    result["tasks"] = [{k: t[k] for k in ("task", "address", "host_kind")} for t in tasks]
    if verbs is None:
        # This task's host picks the device and GID, as its endpoint would.
        host = next((t["host"] for t in tasks if t["task"] == me), None)
        verbs = result["verbs"] = engine_verbs_status(env, host)
    forced = "" if setting == "auto" else f" (TF_RDMA_TRANSPORT={setting})"
    start_fails = None
    if "verbs" in allowed and "tcp" not in allowed and not verbs["available"]:
        start_fails = (f"TF_RDMA_TRANSPORT={setting} asks for verbs, which is not usable "
                       f"here ({verbs['reason']}): the endpoint does not start")
    for i, a in enumerate(tasks):
        for b in tasks[i + 1:]:
            if me is not None and me not in (a["task"], b["task"]):
                continue
            same, why = _same_host(a, b)
            chosen, reason = None, None
            if start_fails:
                result["pairs"].append({"a": a["task"], "b": b["task"], "transport": None,
                                        "reason": start_fails})
                continue
            for t in allowed:
                if t == "verbs" and verbs["available"]:
                    chosen = "verbs"
                    reason = (f"RDMA device {verbs['device']} (when the other end has a usable "
                              f"device too; else the next allowed transport)")
                elif t == "shm" and same:
                    chosen, reason = "shm", why
                elif t == "tcp":
                    chosen, reason = "tcp", why
                if chosen:
                    break
            if chosen:
                reason += forced
            else:
                reason = (f"{why}, but TF_RDMA_TRANSPORT={setting} allows only "
                          f"{', '.join(allowed)}: the hello fails with 'no common transport'")
            result["pairs"].append({"a": a["task"], "b": b["task"], "transport": chosen,
                                    "reason": reason})
    return result


def plan_transports(pairs, cluster=None, env=None):
    """Says which transport carries each (src, dst) task pair of a plan.

    A pair that this process's endpoint has already connected reports the
    transport it uses; any other pair reports the transport the engine is
    expected to choose (:func:`transport_choice`) in ``cluster``. With an
    endpoint running, its own settings and verbs status are used; otherwise
    the environment's.

    Args:
        pairs: ``(src, dst)`` task names, e.g. from a Plan's transfers.
        cluster: The cluster (dict job → addresses, or a
            ``tf.train.ClusterSpec``); default: TF_CONFIG's, when set.
        env: The environment (default ``os.environ``).

    Returns:
        One ``{"src", "dst", "transport", "status", "reason"}`` per pair, in
        order; ``status`` is ``connected``, ``expected`` or ``unknown``,
        ``transport`` None unless known.

    Raises:
        ConfigError: A setting or the cluster is not valid.
    """
    from tf_rdma import server  # pylint: disable=import-outside-toplevel

    env = dict(os.environ if env is None else env)
    connected, verbs = {}, None
    if server.endpoint_running():
        info = server.endpoint_info()
        env["TF_RDMA_TRANSPORT"] = info["transport"]
        unusable = info["verbs"].startswith("unusable: ")
        verbs = {"available": not unusable,
                 "device": None if unusable else info["verbs"],
                 "reason": info["verbs"][len("unusable: "):] if unusable else None}
        for line in info["pair"]:
            a, _, rest = line.partition(" -> ")
            b, _, transport = rest.rpartition(" ")
            connected[(a, b)] = transport
    if cluster is None and (env.get(cluster_lib.TF_CONFIG_ENV) or "").strip():
        cluster = cluster_lib.cluster_from_tf_config(env)
    if hasattr(cluster, "as_dict"):
        cluster = cluster.as_dict()
    expected = {}
    if cluster is not None:
        choice = transport_choice(json.dumps(cluster), None, env, verbs=verbs)
        for p in choice["pairs"]:
            expected[(p["a"], p["b"])] = expected[(p["b"], p["a"])] = p
    out = []
    for src, dst in pairs:
        src, dst = cluster_lib.canonical_task(src), cluster_lib.canonical_task(dst)
        row = {"src": src, "dst": dst, "transport": None, "status": "unknown",
               "reason": ("not connected from this process, and no cluster to predict from "
                          "(set TF_CONFIG or pass the cluster)") if cluster is None else
                         "a task of this pair is not in the cluster"}
        if (src, dst) in connected:
            row.update(transport=connected[(src, dst)], status="connected",
                       reason="this process's endpoint uses it")
        elif (src, dst) in expected:
            p = expected[(src, dst)]
            row.update(transport=p["transport"], status="expected", reason=p["reason"])
        out.append(row)
    return out


def _same_host(a, b):
    """Returns ``(same_host, reason)`` for two task dicts."""
    ka, kb = a["host_kind"], b["host_kind"]
    if ka == "loopback" and kb == "loopback":
        return True, "both tasks are on loopback addresses of this host"
    if ka in ("loopback", "local") and kb in ("loopback", "local"):
        return True, "both tasks are on addresses of this host"
    if a["host"].lower() == b["host"].lower():
        return True, f"both tasks are on host {a['host']}"
    remote = [t for t in (a, b) if t["host_kind"] == "remote"]
    return False, ("different hosts: " + ", ".join(f"{t['task']} is on {t['host']}" for t in remote)
                   + (" (not this machine)" if len(remote) == 1 else ""))


# --------------------------------------------------------------------------- self-test


def self_test(pyverbs, devices, nbytes=SELF_TEST_BYTES, timeout_s=5.0):
    """Writes ``nbytes`` through a loopback RC queue pair and checks them.

    The first active port is used: one RC QP connected to itself, a source
    region with a pattern, a destination region registered for remote
    write, one signalled RDMA WRITE, and a byte-by-byte comparison.

    Args:
        pyverbs: The pyverbs module, or None.
        devices: The device list from :func:`rdma_devices`.
        nbytes: Bytes to write (default 1 MiB).
        timeout_s: How long to wait for the completion.

    Returns:
        A dict with ``ran`` (bool), ``ok`` (True, False, or None when it did
        not run), ``device``, ``port``, ``bytes``, ``seconds`` and ``reason``
        (why it did not run or failed; None on success).
    """
    result = {"ran": False, "ok": None, "device": None, "port": None, "bytes": nbytes,
              "seconds": None, "reason": None}
    if pyverbs is None:
        result["reason"] = "pyverbs is not importable"
        return result
    usable = _usable_ports(devices)
    if not usable:
        result["reason"] = "no RDMA port in state ACTIVE"
        return result
    dev, port = usable[0]
    result.update(ran=True, device=dev["name"], port=port["port"])
    from pyverbs import enums as e  # pylint: disable=import-outside-toplevel
    from pyverbs.addr import AHAttr, GlobalRoute
    from pyverbs.cq import CQ
    from pyverbs.device import Context
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, SendWR
    pattern = bytes((i * 7 + 13) & 0xFF for i in range(nbytes))
    start = time.monotonic()
    try:
        with Context(name=dev["name"]) as ctx:
            pd = PD(ctx)
            cq = CQ(ctx, 16)
            cap = QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=1, max_recv_sge=1)
            qp = QP(pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap, sq_sig_all=1))
            access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
            src = MR(pd, nbytes, e.IBV_ACCESS_LOCAL_WRITE)
            dst = MR(pd, nbytes, access)
            src.write(pattern, nbytes)
            dst.write(bytes(nbytes), nbytes)

            attr = QPAttr(qp_state=e.IBV_QPS_INIT)
            attr.port_num = port["port"]
            attr.pkey_index = 0
            attr.qp_access_flags = access
            qp.to_init(attr)

            if port["link_layer"] == "Ethernet":
                gids = [g for g in port["gids"] if g["type"] == "RoCE v2"] or port["gids"]
                if not gids:
                    raise RuntimeError(f"port {port['port']} of {dev['name']} has no GID")
                gid_index = gids[0]["index"]
                route = GlobalRoute(dgid=ctx.query_gid(port["port"], gid_index),
                                    sgid_index=gid_index, hop_limit=64)
                ah = AHAttr(gr=route, is_global=1, port_num=port["port"], dlid=0)
            else:
                ah = AHAttr(port_num=port["port"], dlid=port["lid"])
            attr.ah_attr = ah
            attr.path_mtu = int(ctx.query_port(port["port"]).active_mtu)
            attr.dest_qp_num = qp.qp_num
            attr.rq_psn = 0
            attr.max_dest_rd_atomic = 1
            attr.min_rnr_timer = 12
            qp.to_rtr(attr)
            attr.sq_psn = 0
            attr.timeout = 14
            attr.retry_cnt = 7
            attr.rnr_retry = 7
            attr.max_rd_atomic = 1
            qp.to_rts(attr)

            wr = SendWR(wr_id=1, opcode=e.IBV_WR_RDMA_WRITE, num_sge=1,
                        sg=[SGE(src.buf, nbytes, src.lkey)], send_flags=e.IBV_SEND_SIGNALED)
            wr.set_wr_rdma(dst.rkey, dst.buf)
            qp.post_send(wr)
            deadline = time.monotonic() + timeout_s
            while True:
                polled, wcs = cq.poll()
                if polled:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no completion within {timeout_s} s")
            if wcs[0].status != e.IBV_WC_SUCCESS:
                raise RuntimeError(f"work completion status {wcs[0].status}")
            got = dst.read(nbytes, 0)
            if got != pattern:
                first = next(i for i in range(nbytes) if got[i] != pattern[i])
                raise RuntimeError(f"data mismatch at byte {first}")
            for obj in (qp, src, dst, cq, pd):
                obj.close()
        result["ok"] = True
    except Exception as err:  # noqa: BLE001 - any verbs failure is the report
        result["ok"] = False
        result["reason"] = f"{type(err).__name__}: {err}"
    result["seconds"] = round(time.monotonic() - start, 6)
    return result


# --------------------------------------------------------------------------- report


def build_report(cluster_json=None, task=None, plan_bytes=0, run_self_test=False, env=None,
                 allow_dist_packages=True):
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
    usable = _usable_ports(devices)
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
    transports = transport_choice(cluster_json, task, env)
    test = self_test(module, devices) if run_self_test else {
        "ran": False, "ok": None, "device": None, "port": None, "bytes": SELF_TEST_BYTES,
        "seconds": None, "reason": "not requested; pass --self-test"}
    return {
        "schema_version": SCHEMA_VERSION,
        "host": {"hostname": socket.gethostname(), "kernel": platform.release(),
                 "python": sys.executable, "python_version": platform.python_version()},
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
    st = report["self_test"]
    if not st["ran"]:
        out.append(f"self-test: not run ({st['reason']})")
    elif st["ok"]:
        out.append(f"self-test: ok, RDMA write of {st['bytes']} bytes on {st['device']} port "
                   f"{st['port']} verified in {st['seconds']} s")
    else:
        out.append(f"self-test: FAILED on {st['device']} port {st['port']}: {st['reason']}")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- schema


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _type_ok(value, name):
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def validate(instance, schema, path="$"):
    """Checks a JSON value against the subset of JSON Schema the doctor's schema uses.

    Supported keywords: ``type`` (a name or a list), ``properties``,
    ``required``, ``additionalProperties`` (false or a schema), ``items``,
    ``enum``, ``const``, ``minimum``, ``$ref`` to ``#/definitions/NAME``.

    Args:
        instance: The value to check.
        schema: The schema (the root schema on the first call).
        path: Where ``instance`` is, for messages.

    Returns:
        A list of error messages, each naming the path and the bad value;
        empty when the value is valid.
    """
    return _validate(instance, schema, path, schema)


def _validate(value, schema, path, root):
    if "$ref" in schema:
        ref = schema["$ref"]
        if not ref.startswith("#/definitions/"):
            return [f"{path}: unsupported $ref {ref!r}"]
        return _validate(value, root["definitions"][ref.split("/")[-1]], path, root)
    errors = []
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_type_ok(value, n) for n in names):
            return [f"{path}: {value!r} is not of type {' or '.join(names)}"]
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{path}: {value!r} is not one of {schema['enum']!r}")
    if "pattern" in schema and isinstance(value, str) and not re.search(schema["pattern"], value):
        errors.append(f"{path}: {value!r} does not match {schema['pattern']!r}")
    if "const" in schema and value != schema["const"]:
        errors.append(f"{path}: {value!r} is not {schema['const']!r}")
    if "minimum" in schema and isinstance(value, (int, float)) and not isinstance(value, bool) \
            and value < schema["minimum"]:
        errors.append(f"{path}: {value!r} is below the minimum {schema['minimum']!r}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in value:
                errors.append(f"{path}: required property {key!r} is missing")
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                errors += _validate(item, props[key], f"{path}.{key}", root)
            elif extra is False:
                errors.append(f"{path}: property {key!r} is not allowed")
            elif isinstance(extra, dict):
                errors += _validate(item, extra, f"{path}.{key}", root)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            errors += _validate(item, schema["items"], f"{path}[{i}]", root)
    return errors


# --------------------------------------------------------------------------- command line


def add_arguments(parser):
    """Adds the ``doctor`` options to an argparse parser.

    Args:
        parser: The subcommand's ``argparse.ArgumentParser``.
    """
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--self-test", action="store_true",
                        help="on an active RDMA port: loopback RC QP, RDMA write of 1 MiB, verified")
    parser.add_argument("--require-rdma", action="store_true",
                        help="exit with status 1 when no usable RDMA device is found "
                             "(or the self-test fails)")
    parser.add_argument("--cluster", metavar="JSON",
                        help="ClusterSpec as JSON ({\"worker\": [\"host:port\", ...]}, or a whole "
                             "TF_CONFIG) for the transport choice; default: TF_CONFIG")
    parser.add_argument("--task", metavar="TASK",
                        help="this task (worker:0 or /job:worker/task:0); default: TF_CONFIG's task, "
                             "else every pair")
    parser.add_argument("--plan-bytes", metavar="N", default="0",
                        help="bytes the plans in use register, checked against ulimit -l "
                             "and the free space of /dev/shm (default 0: not checked)")
    parser.add_argument("--no-dist-packages", action="store_true",
                        help="do not look for the distribution's pyverbs when import pyverbs fails")


def run(args, parser=None):
    """Runs ``tf-rdma doctor``.

    Args:
        args: The parsed arguments (see :func:`add_arguments`).
        parser: The parser, for usage errors (exit status 2).

    Returns:
        The exit status: 0, or 1 with ``--require-rdma`` and no usable RDMA
        (or a failed self-test).
    """
    def usage(message):
        if parser is not None:
            parser.error(message)
        print(f"tf-rdma doctor: error: {message}", file=sys.stderr)
        raise SystemExit(2)

    text = str(args.plan_bytes).strip()
    if not text.isdigit():
        usage(f"--plan-bytes {args.plan_bytes!r} is not a non-negative integer number of bytes")
    try:
        report = build_report(cluster_json=args.cluster, task=args.task, plan_bytes=int(text),
                              run_self_test=args.self_test,
                              allow_dist_packages=not args.no_dist_packages)
    except ConfigError as err:
        usage(str(err))
    if args.json:
        json.dump(report, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_text(report))
    sys.stdout.flush()
    if args.require_rdma:
        # What tf_rdma needs is the engine's verdict; pyverbs only inspects.
        if not (report["rdma"]["usable"] or report["transports"]["verbs"]["available"]):
            return 1
        if report["self_test"]["ran"] and not report["self_test"]["ok"]:
            return 1
    return 0


def main(argv=None):
    """Runs the doctor on its own (``python -m tf_rdma.doctor``).

    Args:
        argv: The arguments, without the program name.

    Returns:
        The exit status.
    """
    return COMMAND.main(argv, prog="tf-rdma doctor")


#: ``tf-rdma doctor``, for the ``tf-rdma`` parser (tf_rdma.cli).
COMMAND = Command(
    name="doctor",
    help="report RDMA devices, pyverbs, memlock, kernel support and the transport choice",
    usage=_USAGE,
    description=_DESCRIPTION,
    epilog=_EPILOG,
    add_arguments=add_arguments,
    run=run,
)


if __name__ == "__main__":
    sys.exit(main())
