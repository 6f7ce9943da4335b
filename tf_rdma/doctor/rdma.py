"""RDMA on this machine: pyverbs, the kernel's support, /dev/infiniband, devices.

* **pyverbs** (:func:`find_pyverbs`): whether it imports and from where.
  When ``import pyverbs`` fails in this environment, the doctor looks for
  the distribution's package (Debian/Ubuntu ``python3-pyverbs``) in the
  system ``dist-packages`` directories and loads *only* the ``pyverbs``
  package from there, without adding those directories to ``sys.path``.
* **kernel** (:func:`kernel_support`): ``/sys/class/infiniband`` and the RDMA
  kernel modules (from ``/proc/modules`` where readable, else
  ``/sys/module``).
* **/dev/infiniband** (:func:`dev_infiniband`): the character devices and
  whether this user may open them.
* **devices** (:func:`rdma_devices`): every RDMA device with its ports, port
  state, link layer, active MTU, GID table (type RoCE v1, RoCE v2 or IB, and
  the IP address a RoCE GID stands for) and the device's maximum MR size.

Standard library only, plus pyverbs where it imports.
"""

import importlib
import importlib.machinery
import importlib.util
import ipaddress
import os
import platform
import stat
import sys
import sysconfig

from tf_rdma.doctor.system import read_text

__all__ = [
    "SYS_CLASS_INFINIBAND", "DEV_INFINIBAND", "PROC_MODULES", "SYS_MODULE",
    "DIST_PACKAGES_DIRS", "RDMA_MODULES", "find_pyverbs", "kernel_support",
    "dev_infiniband", "rdma_devices", "usable_ports",
]

SYS_CLASS_INFINIBAND = "/sys/class/infiniband"
DEV_INFINIBAND = "/dev/infiniband"
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
    """Names a GID type from sysfs text or pyverbs' ``query_gid_type``.

    sysfs says ``IB/RoCE v1`` or ``RoCE v2``; pyverbs returns libibverbs'
    ``enum ibv_gid_type_sysfs`` as an int, where 0 is IB/RoCE v1 and 1 is
    RoCE v2 (not ``enum ibv_gid_type``, where 1 would be RoCE v1).
    """
    ib_or_v1 = "IB" if link_layer == "InfiniBand" else "RoCE v1"
    if raw is None:
        return "IB" if link_layer == "InfiniBand" else "unknown"
    if isinstance(raw, int):
        return {0: ib_or_v1, 1: "RoCE v2"}.get(raw, "unknown")
    text = str(raw).strip().lower()
    if "v2" in text:
        return "RoCE v2"
    if "roce" in text or text == "ib":
        return ib_or_v1
    return "unknown"


def _gid_table(ctx, dev_name, port_num, length, link_layer, sys_class):
    """Returns the non-zero GIDs of a port with their types, netdevs and IPs."""
    table = []
    base = os.path.join(sys_class, dev_name, "ports", str(port_num))
    for index in range(length):
        gid = read_text(os.path.join(base, "gids", str(index)))
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
        raw_type = read_text(os.path.join(base, "gid_attrs", "types", str(index)))
        if raw_type is None and ctx is not None:
            try:
                raw_type = ctx.query_gid_type(port_num, index)
            except Exception:  # noqa: BLE001
                raw_type = None
        gid_type = _gid_type_name(raw_type, link_layer)
        table.append({
            "index": index, "gid": gid, "type": gid_type,
            "netdev": read_text(os.path.join(base, "gid_attrs", "ndevs", str(index))),
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
                 "emulated": False, "ports": [], "error": None}
        try:
            with pv_device.Context(name=name) as ctx:
                attr = ctx.query_device()
                entry["node_guid"] = str(attr.node_guid)
                entry["fw_version"] = str(attr.fw_version)
                # softnic (tests/softnic/, docs/verbs.md) says so in its
                # firmware version: "softnic (emulated)".
                entry["emulated"] = "(emulated)" in entry["fw_version"]
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


def usable_ports(devices):
    """``(device, port)`` pairs of the devices' ports in state ACTIVE."""
    return [(d, p) for d in devices if not d.get("error") for p in d["ports"]
            if p["state"] in ("ACTIVE", "ACTIVE_DEFER")]
