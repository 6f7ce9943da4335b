"""Byte and time units: the ``--sizes`` argument and the two formatters."""

import argparse
import re

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB

_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))


def parse_size(text):
    """Parses "4096", "4K", "4KiB", "64k", "1M", "256MiB", "1G" into bytes.

    The benches' tensors are float32, so a size must be a positive multiple
    of 4 bytes.

    Raises:
      argparse.ArgumentTypeError: ``text`` is not such a size (argparse
        reports it as a usage error naming the value).
    """
    m = re.fullmatch(r"\s*([0-9]+)\s*([kKmMgG]?)(?:i?[bB])?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (examples: 4096, 4K, 64KiB, 16M, 1G)")
    value = int(m.group(1)) * {"": 1, "k": KiB, "m": MiB, "g": GiB}[
        m.group(2).lower()]
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(
            f"size {text!r} must be a positive multiple of 4 bytes (the "
            f"tensor is float32)")
    return value


def human_size(n, exact=True):
    """``n`` bytes in the largest binary unit that fits: "64 MiB".

    Args:
      n: A byte count.
      exact: True (a size the user chose, shown as given): only a unit that
        divides ``n``, else bytes ("4100 B"). False (a size something
        computed, such as a pipelining block): three significant digits in
        the largest unit not above ``n`` ("4.13 MiB").
    """
    for unit, scale in _UNITS:
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
        if n >= scale and not exact:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def human_time(s):
    """Seconds in us, ms or s with 3 to 4 digits; "-" for None (not measured)."""
    if s is None:
        return "-"
    if s < 0:
        return "-" + human_time(-s)
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"
