"""Environment variables that configure tf_rdma, read and checked in one place.

Each setting is read when a tf_rdma endpoint starts; a bad value is a
ConfigError that names the variable, the value and what is allowed.

| variable | default | meaning |
|---|---|---|
| TF_RDMA_SECRET | (none) | job secret every task must share; `tf-rdma launch` generates one |
| TF_RDMA_TRANSPORT | auto | auto, shm or tcp: which transports a task accepts (auto: shm when both ends are on one host, else tcp) |
| TF_RDMA_TIMEOUT | 60 | seconds any op waits for a peer before failing |
| TF_RDMA_POLL_US | 50 | microseconds a recv polls for its data on TensorFlow's thread before handing the wait to an engine thread (0 to 10000) |
| TF_RDMA_PORT_OFFSET | 1000 | endpoint port = gRPC port + offset (tf_rdma.cluster) |
| TF_RDMA_ENDPOINTS | (none) | JSON task → "host:port" overrides (tf_rdma.cluster) |
"""

import os

from tf_rdma.errors import ConfigError

TRANSPORTS = ("auto", "shm", "tcp")
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_POLL_US = 50


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
