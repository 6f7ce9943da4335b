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

TRANSPORTS = ("auto", "shm", "tcp")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_POLL_US = 50
# tf_rdma.cluster's DEFAULT_PORT_OFFSET (not imported: cluster imports the
# graph passes; tests/test_settings.py checks the two agree).
DEFAULT_PORT_OFFSET = 1000

#: One environment variable: its name, its default as shown to users ("" for
#: none) and what it does.
Setting = collections.namedtuple("Setting", ["name", "default", "meaning"])

#: Every environment variable tf_rdma reads, in the order the docs list them.
SETTINGS = (
    Setting("TF_RDMA_SECRET", "",
            "job secret every task and the client must share (required); "
            "`tf-rdma launch` generates one"),
    Setting("TF_RDMA_TRANSPORT", "auto",
            "`auto` (shm when both ends are on one host, else tcp), `shm` "
            "or `tcp`: the transports a task accepts"),
    Setting("TF_RDMA_TIMEOUT", f"{DEFAULT_TIMEOUT_S:g}",
            "seconds any op (transfer or collective) waits for a peer before "
            "it fails, in (0, 604800]"),
    Setting("TF_RDMA_POLL_US", str(DEFAULT_POLL_US),
            "µs a recv polls for its data on TensorFlow's thread before "
            "handing the wait to the engine, in [0, 10000]; a send that just "
            "wrote polls waiting recvs for 4x this"),
    Setting("TF_RDMA_PORT_OFFSET", str(DEFAULT_PORT_OFFSET),
            "a task's tf_rdma endpoint listens on its gRPC port + this "
            "(tf_rdma.cluster)"),
    Setting("TF_RDMA_ENDPOINTS", "",
            'JSON `{"worker:0": "host:port", ...}` to place endpoints '
            "explicitly (tf_rdma.cluster)"),
)


def markdown_table():
    """The settings as the README's Markdown table (one line per variable)."""
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for s in SETTINGS:
        default = f"`{s.default}`" if s.default else "—"
        lines.append(f"| `{s.name}` | {default} | {s.meaning} |")
    return "\n".join(lines) + "\n"


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
    return s


def transport(value=None, env=None):
    """Returns the transport setting: `value`, else TF_RDMA_TRANSPORT, else auto."""
    env = os.environ if env is None else env
    t = value if value is not None else env.get("TF_RDMA_TRANSPORT", "auto")
    t = t.strip().lower()
    if t not in TRANSPORTS:
        raise ConfigError(f"TF_RDMA_TRANSPORT={t!r} is not one of "
                          f"{', '.join(TRANSPORTS)}")
    return t


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
                   lambda s: 0 < s <= 7 * 24 * 3600,
                   "a number of seconds in (0, 604800]")


def poll_microseconds(value=None, env=None):
    """Returns the recv poll budget: `value`, else TF_RDMA_POLL_US, else 50."""
    return _number("TF_RDMA_POLL_US", value, env, DEFAULT_POLL_US, int,
                   lambda us: 0 <= us <= 10000,
                   "an integer number of microseconds in [0, 10000]")
