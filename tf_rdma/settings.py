"""Environment variables that configure tf_rdma, read and checked in one place.

Each setting is read when a tf_rdma endpoint starts; a bad value is a
ConfigError that names the variable, the value and what is allowed.

:data:`SETTINGS` lists every variable with its default and meaning; the
README's settings table is generated from it (:func:`markdown_table`), and a
test fails when the two disagree (``TF_RDMA_REGENERATE_DOCS=1 pytest
tests/test_settings.py`` rewrites the README's table).
"""

import collections
import os

from tf_rdma.errors import ConfigError

#: The transports, in the order "auto" tries them (the project's design).
TRANSPORTS = ("verbs", "shm", "tcp")
DEFAULT_TIMEOUT_S = 60.0
#: The longest wait bound tf_rdma takes (a week), for the setting and the ops.
MAX_TIMEOUT_S = 7 * 24 * 3600
DEFAULT_POLL_US = 50
#: The engine's kMaxSpinUs: the largest TF_RDMA_COLLECTIVE_SPIN_US.
MAX_SPIN_US = 100000
#: The engine's kMaxHostCpus: the largest TF_RDMA_HOST_CPUS.
MAX_HOST_CPUS = 65536
#: Seconds a wait lasts before the stall inspector logs it (0: off).
DEFAULT_STALL_WARNING_S = 10.0
# tf_rdma.cluster's DEFAULT_PORT_OFFSET (not imported: cluster imports the
# graph passes; tests/test_settings.py checks the two agree).
DEFAULT_PORT_OFFSET = 1000

#: One environment variable: its name, its default as shown to users ("" for
#: none) and what it does.
Setting = collections.namedtuple("Setting", ["name", "default", "meaning"])

#: One verbs setting: the variable, its default as shown, its meaning, the
#: engine config key, and a check that returns the value or raises.
VerbsSetting = collections.namedtuple(
    "VerbsSetting", ["name", "default", "meaning", "key", "parse"])


def _int_in(lo, hi):
    def parse(name, raw):
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise ConfigError(f"{name}={raw!r} is not an integer in "
                              f"[{lo}, {hi}]")
        return value
    return parse


def _choice(values):
    """A word the user writes, mapped to what the engine reads."""
    def parse(name, raw):
        if raw not in values:
            raise ConfigError(f"{name}={raw!r} is not one of "
                              f"{', '.join(values)}")
        return values[raw]
    return parse


def _one_of(*allowed):
    return _choice({word: word for word in allowed})


def _device_name(name, raw):
    if not raw or any(ch.isspace() for ch in raw):
        raise ConfigError(f"{name}={raw!r} is not an RDMA device name "
                          f"(e.g. mlx5_0; `tf-rdma doctor` lists them)")
    return raw


#: The verbs transport's settings (docs/verbs.md), in the order the docs
#: list them. Unset: the default (in the engine).
VERBS_SETTINGS = (
    VerbsSetting("TF_RDMA_VERBS_DEVICE", "",
                 "RDMA device to use, e.g. `mlx5_0`; default: the one whose "
                 "active port carries this task's cluster address (RoCE), else "
                 "the first with an active port", "verbs_device", _device_name),
    VerbsSetting("TF_RDMA_VERBS_PORT", "", "port of that device, in [1, 255]; "
                 "default: chosen the same way", "verbs_port", _int_in(1, 255)),
    VerbsSetting("TF_RDMA_VERBS_GID_INDEX", "",
                 "GID index, in [0, 255]; default: InfiniBand routes by LID, "
                 "RoCE takes the RoCE v2 GID of the interface that carries this "
                 "task's cluster address", "verbs_gid_index", _int_in(0, 255)),
    VerbsSetting("TF_RDMA_VERBS_MTU", "",
                 "path MTU in bytes, one of 256, 512, 1024, 2048, 4096; "
                 "default: the port's active MTU (the smaller end wins)",
                 "verbs_mtu", _one_of("256", "512", "1024", "2048", "4096")),
    VerbsSetting("TF_RDMA_VERBS_SL", "0", "service level, in [0, 15] (RoCE: "
                 "the 802.1p priority, e.g. a lossless PFC class)",
                 "verbs_sl", _int_in(0, 15)),
    VerbsSetting("TF_RDMA_VERBS_TRAFFIC_CLASS", "0",
                 "traffic class (RoCE: DSCP × 4 + ECN), in [0, 255]",
                 "verbs_traffic_class", _int_in(0, 255)),
    VerbsSetting("TF_RDMA_VERBS_TIMEOUT", "14",
                 "ack timeout exponent: a try waits 4.096 µs × 2^value, in "
                 "[1, 31] (14: 67 ms)", "verbs_timeout", _int_in(1, 31)),
    VerbsSetting("TF_RDMA_VERBS_RETRY_COUNT", "7",
                 "retries of an unacknowledged transfer before the pair "
                 "fails, in [0, 7]", "verbs_retry_count", _int_in(0, 7)),
    VerbsSetting("TF_RDMA_VERBS_QUEUE_DEPTH", "128",
                 "size of each pair's send queue, in [4, 32768]: it bounds the "
                 "work requests in flight on a pair (each write posts a notice "
                 "plus one request per GiB, or per MiB when staged)",
                 "verbs_queue_depth", _int_in(4, 32768)),
    VerbsSetting("TF_RDMA_VERBS_INLINE", "64",
                 "payloads up to this many bytes are posted inline (no DMA "
                 "read of the source), in [0, 1024]; capped at what the "
                 "device allows", "verbs_inline", _int_in(0, 1024)),
    VerbsSetting("TF_RDMA_VERBS_ODP", "auto",
                 "`auto`: where the device has implicit on-demand paging, "
                 "writes read tensors where they lie (zero-copy); `off`: "
                 "tensors TensorFlow allocated are copied into a registered "
                 "staging area first", "verbs_odp", _choice({"auto": 1, "off": 0})),
)

#: Every environment variable tf_rdma reads, in the order the docs list them.
SETTINGS = (
    Setting("TF_RDMA_SECRET", "",
            "job secret every task and the client must share (required); "
            "`tf-rdma launch` generates one"),
    Setting("TF_RDMA_TRANSPORT", "auto",
            "`auto` (per pair: verbs when both ends can use it, else shm "
            "when both are on one host, else tcp; verbs that is not usable "
            "is logged once and skipped) or a comma-separated list of `verbs`, "
            "`shm`, `tcp` in order of preference, e.g. `shm,verbs,tcp`; a "
            "list that names verbs but not tcp (`verbs`, `shm,verbs`) makes "
            "unusable verbs a start-up error"),
    Setting("TF_RDMA_TIMEOUT", f"{DEFAULT_TIMEOUT_S:g}",
            "seconds any op (transfer or collective) waits for a peer before "
            "it fails, in (0, 604800]"),
    Setting("TF_RDMA_STALL_WARNING", f"{DEFAULT_STALL_WARNING_S:g}",
            "seconds a wait (data, credit, collective block) lasts before "
            "the stall inspector logs one line naming the tensor or "
            "collective, the step, the peer and the peer's own position "
            "(repeated at 2x, 4x, ...); `0` turns it off; in [0, 604800] "
            "(docs/observability.md)"),
    Setting("TF_RDMA_POLL_US", str(DEFAULT_POLL_US),
            "µs a recv polls for its data on TensorFlow's thread before "
            "handing the wait to the engine, in [0, 10000]; a send that just "
            "wrote polls waiting recvs for 4x this, unless the cluster's "
            "tasks on this host outnumber its CPUs"),
    Setting("TF_RDMA_COLLECTIVE_SPIN_US", "auto",
            "µs a collective of at most 1 MiB spins for each of its peers' "
            "blocks before it sleeps, in [0, 100000]; `auto`: 500 where this "
            "host runs no more of the cluster's tasks than the process has "
            "CPUs (TF_RDMA_HOST_CPUS where set), else 0 (tasks that share "
            "cores would spin on the cores "
            "their peers need); every wait spins a few µs anyway "
            "(docs/collectives.md)"),
    Setting("TF_RDMA_HOST_CPUS", "",
            "the CPUs this host's tasks of the cluster share when each is "
            "bound to its own part of them (`tf-rdma launch` sets it when it "
            "binds, unless it is set already); `auto` spin compares the tasks "
            "on the host with this instead of the process's own CPUs; a "
            "positive integer, at most 65536"),
    Setting("TF_RDMA_REGION_BUDGET", "auto",
            "bytes of /dev/shm the regions that other tasks write into may "
            "take in this task, all writers together (one writer at most "
            "half): a number with an optional K, M, G or T (powers of 1024), "
            "or `auto`, three quarters of /dev/shm's size when the endpoint "
            "starts (docs/reliability.md)"),
    Setting("TF_RDMA_BIND", "*",
            "where a task's endpoint listens: `*`, every interface (IPv4 and "
            "IPv6), as TensorFlow's gRPC server does; or one host name or "
            "address to listen on only there. Peers dial the address the "
            "cluster names for the task (TF_CONFIG, TF_RDMA_ENDPOINTS) "
            "either way (docs/deploy.md)"),
    Setting("TF_RDMA_PORT_OFFSET", str(DEFAULT_PORT_OFFSET),
            "a task's tf_rdma endpoint listens on its gRPC port + this "
            "(tf_rdma.cluster)"),
    Setting("TF_RDMA_ENDPOINTS", "",
            'JSON `{"worker:0": "host:port", ...}` to place endpoints '
            "explicitly (tf_rdma.cluster)"),
) + tuple(
    Setting(v.name, v.default, v.meaning) for v in VERBS_SETTINGS) + (
    Setting("TF_RDMA_VERBS_LIBRARY", "",
            "path of the verbs plugin to load instead of the "
            "`_tf_rdma_verbs.so` next to the op library"),
    Setting("TF_RDMA_TIMELINE", "",
            "a directory: every process writes all its tf_rdma trace events "
            "(sends, recvs, collectives and their phases) and its peers' "
            "clock offsets to `<job>-<index>.<pid>.json` there, a Chrome "
            "trace (Perfetto, chrome://tracing); `tf-rdma timeline merge` "
            "puts the tasks' files on one clock, `tf-rdma timeline plot` "
            "draws a Gantt chart (docs/observability.md); created if missing"),
    Setting("TF_RDMA_TIMELINE_EVENTS", "all",
            "what TF_RDMA_TIMELINE records: `all` (the ops and their phases) "
            "or `ops` (only the sends', recvs' and collectives' own events: "
            "about one event's cost per op instead of up to six, so an op's "
            "time on the timeline stays close to its untraced time; "
            "`explain(measured=True)` then shows no phases)"),
)


def markdown_table():
    """The settings as the README's Markdown table (one line per variable)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default else "—"
        lines.append(f"| `{s.name}` | {default} | {s.meaning} |")
    return "\n".join(lines) + "\n"


# The engine's kMinSecretBytes (kernels/engine/engine.h); a test checks that
# they agree.
MIN_SECRET_LENGTH = 16


def secret(value=None, env=None):
    """Returns the job secret: `value`, else TF_RDMA_SECRET."""
    env = os.environ if env is None else env
    s = value if value is not None else env.get("TF_RDMA_SECRET", "")
    if not s:
        raise ConfigError(
            "no job secret: set TF_RDMA_SECRET to the same value on every task "
            "and the client (tf-rdma launch generates one), or pass secret=")
    if any(ch.isspace() for ch in s):
        raise ConfigError("TF_RDMA_SECRET must not contain whitespace")
    if len(s) < MIN_SECRET_LENGTH:
        raise ConfigError(
            f"TF_RDMA_SECRET has {len(s)} characters; it needs at least "
            f"{MIN_SECRET_LENGTH}: anyone who records one handshake can try "
            "short secrets offline (tf-rdma launch generates a 64-character one)")
    return s


def transport(value=None, env=None):
    """Returns the transport setting: `value`, else TF_RDMA_TRANSPORT, else auto.

    The result is "auto" or a comma-separated list of transports without
    repeats, in order of preference (e.g. "verbs", "shm,tcp").
    """
    env = os.environ if env is None else env
    raw = value if value is not None else env.get("TF_RDMA_TRANSPORT", "auto")
    t = raw.strip().lower()
    if t == "auto":
        return t
    names = [n.strip() for n in t.split(",")]
    if not all(n in TRANSPORTS for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"TF_RDMA_TRANSPORT={raw!r} is not auto or a "
                          f"comma-separated list of {', '.join(TRANSPORTS)} "
                          f"without repeats")
    return ",".join(names)


def allowed_transports(setting):
    """The transports a :func:`transport` setting allows, in order."""
    return list(TRANSPORTS) if setting == "auto" else setting.split(",")


def verbs_config(env=None):
    """Returns the engine config lines of the verbs settings that are set.

    Raises:
        ConfigError: A TF_RDMA_VERBS_* value is out of range; the message
            names the variable, the value and what is allowed.
    """
    env = os.environ if env is None else env
    lines = []
    for v in VERBS_SETTINGS:
        raw = env.get(v.name, "").strip()
        if raw:
            lines.append(f"{v.key}={v.parse(v.name, raw)}")
    return lines


def timeline_dir(value=None, env=None):
    """Returns the timeline directory: `value`, else TF_RDMA_TIMELINE, else None.

    The directory is created if missing and returned as an absolute path.

    Raises:
        ConfigError: The directory cannot be created or written to, or the
            path holds a character the engine's config cannot carry.
    """
    env = os.environ if env is None else env
    raw = value if value is not None else env.get("TF_RDMA_TIMELINE", "")
    if not raw:
        return None
    if "\n" in raw or "\0" in raw:
        raise ConfigError(f"TF_RDMA_TIMELINE={raw!r} holds a newline or NUL")
    path = os.path.abspath(os.path.expanduser(raw))
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"TF_RDMA_TIMELINE={raw!r}: cannot create the "
                          f"directory {path} ({e.strerror})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"TF_RDMA_TIMELINE={raw!r}: the directory {path} "
                          f"is not writable by this process")
    return path


TIMELINE_EVENTS = ("all", "ops")


def timeline_events(value=None, env=None):
    """Returns what the timeline records: `value`, else TF_RDMA_TIMELINE_EVENTS.

    Returns:
        ``"all"`` (the default: ops and their phases) or ``"ops"``.

    Raises:
        ConfigError: The value is neither.
    """
    env = os.environ if env is None else env
    raw = value if value is not None else env.get("TF_RDMA_TIMELINE_EVENTS",
                                                  "")
    events = raw.strip().lower() or "all"
    if events not in TIMELINE_EVENTS:
        raise ConfigError(f"TF_RDMA_TIMELINE_EVENTS={raw!r} is not one of "
                          f"{', '.join(TIMELINE_EVENTS)}")
    return events


def _number(variable, value, env, default, parse, valid, expected):
    """Reads a numeric setting: `value`, else the variable, else `default`."""
    env = os.environ if env is None else env
    raw = value if value is not None else env.get(variable)
    if raw is None or raw == "":
        return default
    try:
        number = parse(raw)
    except (TypeError, ValueError):
        number = None
    if number is None or not valid(number):
        raise ConfigError(f"{variable}={raw!r} is not {expected}")
    return number


def timeout_seconds(value=None, env=None):
    """Returns the wait bound in seconds: `value`, else TF_RDMA_TIMEOUT, else 60."""
    return _number("TF_RDMA_TIMEOUT", value, env, DEFAULT_TIMEOUT_S, float,
                   lambda s: 0 < s <= MAX_TIMEOUT_S,
                   "a number of seconds in (0, 604800]")


def stall_warning_seconds(value=None, env=None):
    """Returns the stall warning in seconds: `value`, else TF_RDMA_STALL_WARNING, else 10.

    0 turns the stall inspector off; fractions of a second are allowed (the
    engine takes whole milliseconds, at least 1 for a positive value).
    """
    return _number("TF_RDMA_STALL_WARNING", value, env,
                   DEFAULT_STALL_WARNING_S, float,
                   lambda s: 0 <= s <= MAX_TIMEOUT_S,
                   "a number of seconds in [0, 604800] (0: off)")


def poll_microseconds(value=None, env=None):
    """Returns the recv poll budget: `value`, else TF_RDMA_POLL_US, else 50."""
    return _number("TF_RDMA_POLL_US", value, env, DEFAULT_POLL_US, int,
                   lambda us: 0 <= us <= 10000,
                   "an integer number of microseconds in [0, 10000]")


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _bytes(raw):
    """``"512M"`` -> 536870912; ValueError for anything else."""
    text = str(raw).strip().upper().removesuffix("B").removesuffix("I")
    unit = text[-1:] if text[-1:] in _SIZE_UNITS and text[-1:] else ""
    number = text[:len(text) - len(unit)].strip()
    if not number.isdigit():
        raise ValueError(raw)
    return int(number) * _SIZE_UNITS[unit]


def region_budget(value=None, env=None):
    """Returns the region budget in bytes: `value`, else TF_RDMA_REGION_BUDGET; 0 for `auto`.

    0 lets the engine take three quarters of /dev/shm's size when it starts.
    """
    env = os.environ if env is None else env
    raw = value if value is not None else env.get("TF_RDMA_REGION_BUDGET", "")
    if str(raw).strip().lower() in ("", "auto"):
        return 0
    return _number("TF_RDMA_REGION_BUDGET", raw, env, 0, _bytes,
                   lambda n: n >= 1 << 20,
                   "`auto` or a number of bytes of at least 1M, with an "
                   "optional K, M, G or T (e.g. 8G)")


def bind(value=None, env=None):
    """Returns where the endpoint listens: `value`, else TF_RDMA_BIND, else ``*`` (everywhere)."""
    env = os.environ if env is None else env
    raw = value if value is not None else env.get("TF_RDMA_BIND", "")
    host = str(raw).strip()
    if not host:
        return "*"
    if any(c.isspace() for c in host) or host.count("*") and host != "*":
        raise ConfigError(f"TF_RDMA_BIND={raw!r} is not `*` or a host name "
                          f"or address")
    return host.strip("[]")


def host_cpus(value=None, env=None):
    """Returns the CPUs this host's tasks share: `value`, else TF_RDMA_HOST_CPUS, else 0 (unknown).

    Set by `tf-rdma launch` when it binds each local task to its own CPUs:
    each process then sees only its own, and the engine's `auto` spin needs
    the whole host's count to tell that the tasks do not share cores.
    """
    return _number("TF_RDMA_HOST_CPUS", value, env, 0, int,
                   lambda n: 1 <= n <= MAX_HOST_CPUS,
                   f"a positive integer number of CPUs, at most "
                   f"{MAX_HOST_CPUS}")


def collective_spin_microseconds(value=None, env=None):
    """Returns a small collective's spin budget: `value`, else TF_RDMA_COLLECTIVE_SPIN_US, else "auto".

    "auto" is resolved by the engine when it starts (500 µs with a CPU per
    task of the cluster on this host, else 0); a number is microseconds.
    """
    env = os.environ if env is None else env
    raw = value if value is not None else env.get("TF_RDMA_COLLECTIVE_SPIN_US")
    if raw is None or str(raw).strip().lower() in ("", "auto"):
        return "auto"
    return _number("TF_RDMA_COLLECTIVE_SPIN_US", raw, env, "auto", int,
                   lambda us: 0 <= us <= MAX_SPIN_US,
                   f"auto or an integer number of microseconds in "
                   f"[0, {MAX_SPIN_US}]")
