"""Static memory plans for cross-task tensor transfers.

A :class:`Plan` lists every tensor that crosses from one task to another in a
step (a :class:`Transfer`) and fixes where each one lives in registered
memory (a :class:`SlotLayout` inside a :class:`RegionLayout`). Both ends of a
transfer compute the layout from their own copy of the plan, so the layout
rules below are a contract: the C++ send/recv ops get their offsets, strides
and sizes from here, and the plan hash tells the two ends whether they agree.

This module is pure Python (standard library only; numpy is used if present,
for dtype names). It must not import TensorFlow.
"""

# How the layout works
# --------------------
#
# Every directed pair of tasks (src -> dst) gets one *data region*. It lives in
# the memory of dst, which registers it with the NIC; src writes into it with
# one-sided RDMA writes, and dst reads the tensors out of it. Traffic the other
# way (dst -> src) is a different pair with its own region.
#
# Inside a region each transfer owns a *slot*. A slot is a 64-byte *header*
# (SLOT_HEADER_BYTES: at byte 0 the sequence word the writer publishes last,
# so the receiver can tell that a complete, current tensor has landed; at 8
# the id of the call that wrote it; at 16 the receiver's count of threads
# asleep on the sequence word, kernels/common/wait.h; the rest reserved)
# followed by the raw tensor bytes. The header is exactly one cache line, so the payload
# starts 64-byte aligned. The slot's *stride* is header + payload rounded up
# to the plan's alignment.
#
# Each slot exists in `depth` consecutive *copies*: copy c starts at
# offset + c * stride. Step s uses copy s % depth. With one copy, the sender
# would have to wait for the receiver to finish reading step s before it
# could write step s + 1; with depth >= 2 it writes step s + 1 into the next
# copy while step s is still being read, so the two sides overlap. The first
# slot of a pair starts at offset 0 and each next slot starts where the
# copies of the previous one end (offset + depth * stride, aligned already).
# The region is the total rounded up to whole pages (PAGE_BYTES), at least
# one page, because memory is registered by the page.
#
# The *credit region* lives on the sender (src), one per pair. It has one
# 64-byte line per slot copy: copy c of the slot with credit_index i has its
# credit word at (i * depth + c) * 64. When the receiver has finished reading
# a copy it writes that word, which tells the sender the copy may be
# overwritten. One line per copy keeps two credits from ever sharing a cache
# line. It too is rounded up to whole pages, at least one.
#
# Why everything is sorted: the two ends of a transfer build their plans
# independently (from different graphs, dicts, or traversal orders). Pairs
# are taken in sorted (src, dst) order and transfers within a pair in key
# order, so the layout and the hash depend only on the *set* of transfers and
# the plan settings, never on the order in which they were given.

import dataclasses
import difflib
import hashlib
import json
import math
import operator
import re

from tf_rdma.errors import PlanError

__all__ = [
    "SLOT_HEADER_BYTES",
    "PAGE_BYTES",
    "CREDIT_LINE_BYTES",
    "FORMAT_VERSION",
    "MAX_DEPTH",
    "DTYPE_SIZES",
    "align_up",
    "canonical_task",
    "normalize_dtype",
    "Transfer",
    "SlotLayout",
    "RegionLayout",
    "Plan",
]

#: Bytes of the header in front of every slot copy (one cache line).
SLOT_HEADER_BYTES = 64
#: Payload of a dynamic slot: the tensor's shape, byte count and payload-area
#: generation (kernels/engine/engine.h, DynamicMeta).
DYNAMIC_META_BYTES = 256
#: Highest rank the dynamic path carries.
MAX_DYNAMIC_RANK = 29
#: Regions and credit regions are whole multiples of this many bytes.
PAGE_BYTES = 4096
#: Bytes of one credit line in the sender's credit region (one per slot copy).
CREDIT_LINE_BYTES = 64
#: Where a slot header and a credit line keep, after their word, the count of
#: the owner's threads asleep on it (kernels/common/wait.h); no peer writes it.
SLEEPERS_OFFSET = 16
#: Version of the plan format; part of the hash and of the JSON form.
FORMAT_VERSION = 1
#: Largest allowed ``depth`` (number of copies of each slot).
MAX_DEPTH = 64

_MIN_ALIGNMENT = 64
_MAX_ALIGNMENT = PAGE_BYTES
_INT64_MAX = 2**63 - 1

#: Dtypes a transfer may have (fixed-size, memcpy-able), name -> itemsize.
DTYPE_SIZES = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
_JOB = r"(?P<job>[A-Za-z][A-Za-z0-9_]*)"
_LONG_TASK_RE = re.compile(
    r"/?job:" + _JOB
    + r"(?:/replica:(?P<replica>[0-9]+))?"
    + r"/task:(?P<task>[0-9]+)"
    + r"(?:/device:[A-Za-z_][A-Za-z0-9_]*:[0-9]+)?"
)
_SHORT_TASK_RE = re.compile(_JOB + r":(?P<task>[0-9]+)")
_TASK_FORMS = (
    "'/job:<job>/task:<i>', '/job:<job>/replica:0/task:<i>', "
    "'/job:<job>/replica:0/task:<i>/device:<type>:<n>', "
    "'job:<job>/task:<i>' or '<job>:<i>'"
)


def align_up(n, a):
    """Rounds ``n`` up to the next multiple of ``a``.

    Args:
      n: A non-negative int.
      a: A positive int (need not be a power of two).

    Returns:
      The smallest multiple of ``a`` that is ``>= n``.

    Raises:
      PlanError: If ``n`` is negative or ``a`` is not positive.
    """
    n = operator.index(n)
    a = operator.index(a)
    if a <= 0:
        raise PlanError(f"align_up: alignment must be positive, got {a!r}")
    if n < 0:
        raise PlanError(f"align_up: size must be >= 0, got {n!r}")
    return (n + a - 1) // a * a


def canonical_task(name):
    """Returns the canonical ``/job:<job>/task:<i>`` form of a task name.

    Accepted forms (the device part, if any, is dropped: a plan is per task)::

      /job:worker/task:1
      /job:worker/replica:0/task:1
      /job:worker/replica:0/task:1/device:CPU:0
      job:worker/task:1
      worker:1

    Args:
      name: The task name, a str.

    Returns:
      The task as ``"/job:worker/task:1"``.

    Raises:
      PlanError: If ``name`` is not a str in one of the forms above, or names
        a replica other than 0.
    """
    if not isinstance(name, str):
        raise PlanError(
            f"task name must be a str, got {name!r} ({type(name).__name__}); "
            f"expected {_TASK_FORMS}")
    m = _LONG_TASK_RE.fullmatch(name) or _SHORT_TASK_RE.fullmatch(name)
    if m is None:
        raise PlanError(f"invalid task name {name!r}; expected {_TASK_FORMS}")
    replica = m.groupdict().get("replica")
    if replica is not None and int(replica) != 0:
        raise PlanError(
            f"invalid task name {name!r}: replica must be 0 in TensorFlow 2, "
            f"got replica:{replica}")
    return f"/job:{m.group('job')}/task:{int(m.group('task'))}"


def _supported_dtypes():
    return ", ".join(sorted(DTYPE_SIZES))


def normalize_dtype(x):
    """Returns the name of a supported dtype.

    Args:
      x: A dtype name (``"float32"``), an object with a ``.name`` str
        attribute (``tf.float32``, ``numpy.dtype("float32")``), or a numpy
        scalar type (``numpy.float32``).

    Returns:
      The dtype name, a key of :data:`DTYPE_SIZES`.

    Raises:
      PlanError: If ``x`` cannot be read as a dtype, or the dtype is not
        fixed-size and memcpy-able (``string``, ``resource``, ``variant``,
        quantized types, non-native byte order ...).
    """
    if isinstance(x, str):
        name = x
    elif isinstance(getattr(x, "name", None), str):
        if getattr(x, "isnative", True) is False:
            raise PlanError(
                f"unsupported dtype {x!r}: non-native byte order cannot be "
                f"copied as is; use the native byte order")
        name = x.name
    else:
        name = None
        if isinstance(x, type):
            try:
                import numpy  # pylint: disable=import-outside-toplevel
            except ImportError:  # pragma: no cover - numpy is optional
                numpy = None
            if numpy is not None and issubclass(x, numpy.generic):
                name = numpy.dtype(x).name
        if name is None:
            raise PlanError(
                f"cannot interpret {x!r} as a dtype; expected a dtype name, "
                f"a tf.DType, a numpy dtype or a numpy scalar type, one of: "
                f"{_supported_dtypes()}")
    if name not in DTYPE_SIZES:
        raise PlanError(
            f"unsupported dtype {name!r}: a transfer needs a fixed-size, "
            f"memcpy-able dtype, one of: {_supported_dtypes()}")
    return name


def _normalize_shape(shape, key, dynamic=False):
    """Returns ``shape`` as a tuple of python ints, or raises PlanError.

    A dynamic transfer's shape may be None (unknown rank) and its dims None
    or -1 (unknown); they are normalised to None.
    """
    if dynamic:
        if shape is None or getattr(shape, "rank", 0) is None:
            return None
        try:
            dims = [None if d is None or (isinstance(d, int) and d == -1)
                    else d for d in list(shape)]
        except (TypeError, ValueError) as e:
            raise PlanError(
                f"transfer {key!r}: shape must be a sequence of ints or None, "
                f"got {shape!r}") from e
        if len(dims) > MAX_DYNAMIC_RANK:
            raise PlanError(
                f"transfer {key!r}: rank {len(dims)} exceeds "
                f"{MAX_DYNAMIC_RANK}, the most the dynamic path carries")
        known = _normalize_shape([d for d in dims if d is not None], key)
        it = iter(known)
        return tuple(None if d is None else next(it) for d in dims)
    if shape is None:
        raise PlanError(
            f"transfer {key!r}: shape None means an unknown rank; a static "
            f"transfer needs a fully known shape (use dynamic=True)")
    if isinstance(shape, (str, bytes)):
        raise PlanError(
            f"transfer {key!r}: shape must be a sequence of ints, got {shape!r}")
    if getattr(shape, "rank", 0) is None:  # tf.TensorShape(None)
        raise PlanError(
            f"transfer {key!r}: shape {shape!r} has unknown rank; a static "
            f"transfer needs a fully known shape (use dynamic=True)")
    try:
        dims = list(shape)
    except (TypeError, ValueError) as e:
        raise PlanError(
            f"transfer {key!r}: shape must be a sequence of ints, got "
            f"{shape!r}") from e
    out = []
    for i, d in enumerate(dims):
        if d is not None and not isinstance(d, bool):
            try:
                d = operator.index(d)
            except TypeError:
                pass
        if d is None or (isinstance(d, int) and d < 0):
            raise PlanError(
                f"transfer {key!r}: dimension {i} of shape {shape!r} is "
                f"unknown ({d!r}); a static transfer needs a fully known shape "
                f"(use dynamic=True)")
        if not isinstance(d, int) or isinstance(d, bool):
            raise PlanError(
                f"transfer {key!r}: dimension {i} of shape {shape!r} must be "
                f"an int, got {d!r}")
        out.append(d)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One tensor sent from task ``src`` to task ``dst`` every step.

    Fields are normalised on construction: tasks to ``/job:<job>/task:<i>``,
    ``dtype`` to its name, ``shape`` to a tuple of python ints.

    Attributes:
      key: The transfer's name, unique within a plan; non-empty, no
        whitespace or control characters.
      src: The sending task.
      dst: The receiving task (different from ``src``).
      dtype: The dtype name, a key of :data:`DTYPE_SIZES`.
      shape: The static shape; every dim an int ``>= 0``. For a dynamic
        transfer, dims may be None (known at run time only), or the shape
        None (unknown rank).
      dynamic: True for the dynamic path: the slot holds the shape and the
        bytes go to a payload area that grows on demand.
    """

    key: str
    src: str
    dst: str
    dtype: str
    shape: tuple
    dynamic: bool = False

    def __post_init__(self):
        key = self.key
        if not isinstance(key, str) or not key:
            raise PlanError(f"transfer key must be a non-empty str, got {key!r}")
        if any(c.isspace() or not c.isprintable() for c in key):
            raise PlanError(
                f"transfer key {key!r} must not contain whitespace or "
                f"control characters")
        src = canonical_task(self.src)
        dst = canonical_task(self.dst)
        if src == dst:
            raise PlanError(
                f"transfer {key!r}: src and dst are the same task {src!r}; "
                f"a transfer must cross between two tasks")
        object.__setattr__(self, "src", src)
        object.__setattr__(self, "dst", dst)
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        if not isinstance(self.dynamic, bool):
            raise PlanError(
                f"transfer {key!r}: dynamic must be a bool, got {self.dynamic!r}")
        object.__setattr__(self, "shape",
                           _normalize_shape(self.shape, key, self.dynamic))

    @property
    def itemsize(self):
        """Bytes per element of ``dtype``."""
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self):
        """Bytes of the tensor (itemsize times elements); None if dynamic."""
        if self.dynamic:
            return None
        return self.itemsize * math.prod(self.shape)

    @property
    def slot_bytes(self):
        """Payload bytes of the slot: the tensor, or a dynamic slot's meta."""
        return DYNAMIC_META_BYTES if self.dynamic else self.nbytes

    def to_dict(self):
        """Returns the transfer as a JSON-ready dict (shape as a list).

        ``"dynamic"`` appears only for dynamic transfers, so static plans keep
        the same JSON (and hash) as before the dynamic path existed.
        """
        d = {"key": self.key, "src": self.src, "dst": self.dst,
             "dtype": self.dtype,
             "shape": None if self.shape is None else list(self.shape)}
        if self.dynamic:
            d["dynamic"] = True
        return d


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where one transfer lives: a slot of ``depth`` copies in a region.

    Attributes:
      key, src, dst, dtype, shape, dynamic: As in :class:`Transfer`.
      nbytes: Payload bytes of one copy: the tensor's bytes, or
        :data:`DYNAMIC_META_BYTES` for a dynamic slot.
      region: Name of the data region (on ``dst``) that holds the slot.
      region_bytes: Size of that region.
      offset: Byte offset of copy 0 of the slot within the region.
      stride: Bytes from one copy to the next (header + payload, aligned).
      depth: Number of copies.
      credit_index: Position of the transfer within its (src, dst) pair.
      credit_bytes: Size of the pair's credit region (on ``src``).
    """

    key: str
    src: str
    dst: str
    dtype: str
    shape: tuple
    nbytes: int
    region: str
    region_bytes: int
    offset: int
    stride: int
    depth: int
    credit_index: int
    credit_bytes: int
    dynamic: bool = False

    def _check_copy(self, copy):
        copy = operator.index(copy)
        if not 0 <= copy < self.depth:
            raise PlanError(
                f"slot {self.key!r}: copy must be in [0, {self.depth}), "
                f"got {copy!r}")
        return copy

    def copy_offset(self, copy):
        """Byte offset of the header of copy ``copy`` within the region."""
        return self.offset + self._check_copy(copy) * self.stride

    def payload_offset(self, copy):
        """Byte offset of the tensor bytes of copy ``copy`` within the region."""
        return self.copy_offset(copy) + SLOT_HEADER_BYTES

    def credit_offset(self, copy):
        """Byte offset of copy ``copy``'s credit word in the credit region."""
        copy = self._check_copy(copy)
        return (self.credit_index * self.depth + copy) * CREDIT_LINE_BYTES


@dataclasses.dataclass(frozen=True)
class RegionLayout:
    """The data region of one (src, dst) pair and its credit region.

    Attributes:
      name: ``"<plan name>/<src>-><dst>"``.
      src: The sending task (holds the credit region).
      dst: The receiving task (holds the data region).
      nbytes: Size of the data region, whole pages.
      credit_bytes: Size of the credit region, whole pages.
      keys: Keys of the transfers in the region, in layout order.
    """

    name: str
    src: str
    dst: str
    nbytes: int
    credit_bytes: int
    keys: tuple


def _check_int(value, what, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"{what} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise PlanError(f"{what} must be in [{lo}, {hi}], got {value!r}")
    return value


class Plan:
    """The static memory plan for a set of cross-task transfers.

    Args:
      transfers: An iterable of :class:`Transfer` (or of dicts with the
        fields ``key, src, dst, dtype, shape``); may be empty.
      name: The plan's name, non-empty, made of ``[A-Za-z0-9_.-]``.
      depth: Copies of each slot, an int in ``[1, 64]``.
      alignment: Alignment of every slot copy, a power of two in
        ``[64, 4096]``.

    Raises:
      PlanError: If any argument is invalid, or two transfers share a key.
    """

    def __init__(self, transfers, name="default", depth=2, alignment=64):
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise PlanError(
                f"plan name must be a non-empty str of [A-Za-z0-9_.-], "
                f"got {name!r}")
        _check_int(depth, "plan depth", 1, MAX_DEPTH)
        _check_int(alignment, "plan alignment", _MIN_ALIGNMENT, _MAX_ALIGNMENT)
        if alignment & (alignment - 1):
            raise PlanError(
                f"plan alignment must be a power of two in "
                f"[{_MIN_ALIGNMENT}, {_MAX_ALIGNMENT}], got {alignment!r}")
        if isinstance(transfers, (str, bytes, dict, Transfer)):
            raise PlanError(
                f"transfers must be an iterable of Transfer, got {transfers!r}")
        try:
            items = list(transfers)
        except TypeError as e:
            raise PlanError(
                f"transfers must be an iterable of Transfer, got "
                f"{transfers!r}") from e
        by_key = {}
        for t in items:
            if isinstance(t, dict):
                t = _transfer_from_dict(t)
            elif not isinstance(t, Transfer):
                raise PlanError(
                    f"each transfer must be a Transfer or a dict, got {t!r}")
            if t.key in by_key:
                raise PlanError(
                    f"duplicate transfer key {t.key!r}: {by_key[t.key]!r} "
                    f"and {t!r}")
            by_key[t.key] = t

        self._name = name
        self._depth = depth
        self._alignment = alignment
        self._transfers = tuple(
            sorted(by_key.values(), key=lambda t: (t.src, t.dst, t.key)))
        self._layout()
        self._hash = hashlib.sha256(
            _canonical_json(self.to_dict()).encode("utf-8")).hexdigest()

    def _layout(self):
        pairs = {}
        for t in self._transfers:  # Already sorted by (src, dst, key).
            pairs.setdefault((t.src, t.dst), []).append(t)
        slots = []
        regions = []
        for (src, dst), group in sorted(pairs.items()):
            region_name = f"{self._name}/{src}->{dst}"
            placed = []
            offset = 0
            for t in group:
                stride = align_up(SLOT_HEADER_BYTES + t.slot_bytes,
                                  self._alignment)
                placed.append((t, offset, stride))
                offset += self._depth * stride
            region_bytes = max(PAGE_BYTES, align_up(offset, PAGE_BYTES))
            if region_bytes > _INT64_MAX:
                raise PlanError(
                    f"region {region_name!r} would need {region_bytes} bytes, "
                    f"more than fits in int64; the transfers are too large")
            credit_bytes = max(
                PAGE_BYTES,
                align_up(len(group) * self._depth * CREDIT_LINE_BYTES,
                         PAGE_BYTES))
            for index, (t, off, stride) in enumerate(placed):
                slots.append(SlotLayout(
                    key=t.key, src=t.src, dst=t.dst, dtype=t.dtype,
                    shape=t.shape, nbytes=t.slot_bytes, region=region_name,
                    region_bytes=region_bytes, offset=off, stride=stride,
                    depth=self._depth, credit_index=index,
                    credit_bytes=credit_bytes, dynamic=t.dynamic))
            regions.append(RegionLayout(
                name=region_name, src=src, dst=dst, nbytes=region_bytes,
                credit_bytes=credit_bytes,
                keys=tuple(t.key for t in group)))
        self._slots = tuple(slots)
        self._slot_by_key = {s.key: s for s in slots}
        self._regions = tuple(regions)

    # Plain accessors.

    @property
    def name(self):
        """The plan's name."""
        return self._name

    @property
    def depth(self):
        """Copies of each slot."""
        return self._depth

    @property
    def alignment(self):
        """Alignment of every slot copy, in bytes."""
        return self._alignment

    @property
    def transfers(self):
        """Tuple of :class:`Transfer`, sorted by (src, dst, key)."""
        return self._transfers

    @property
    def slots(self):
        """Tuple of :class:`SlotLayout`, in the order of :attr:`transfers`."""
        return self._slots

    @property
    def regions(self):
        """Tuple of :class:`RegionLayout`, sorted by (src, dst)."""
        return self._regions

    @property
    def tasks(self):
        """Sorted tuple of every task that sends or receives."""
        return tuple(sorted({t.src for t in self._transfers}
                            | {t.dst for t in self._transfers}))

    @property
    def bytes_per_step(self):
        """Tensor bytes moved per step by the static transfers (dynamic ones
        are known only at run time)."""
        return sum(t.nbytes for t in self._transfers if not t.dynamic)

    @property
    def hash(self):
        """Hex sha256 of the canonical JSON of the plan (see :meth:`to_json`)."""
        return self._hash

    @property
    def short_hash(self):
        """The first 12 hex digits of :attr:`hash`."""
        return self._hash[:12]

    def slot(self, key):
        """Returns the :class:`SlotLayout` of transfer ``key``.

        Raises:
          PlanError: If the plan has no transfer ``key``.
        """
        try:
            return self._slot_by_key[key]
        except (KeyError, TypeError):
            pass
        known = sorted(self._slot_by_key)
        close = difflib.get_close_matches(str(key), known, n=3)
        shown = close or known[:5]
        more = "" if len(known) <= len(shown) else f" ({len(known)} in all)"
        hint = f"; known keys include {shown!r}{more}" if known else (
            "; the plan has no transfers")
        raise PlanError(f"plan {self._name!r} has no transfer {key!r}{hint}")

    def op_attrs(self, key, side, timeout_ms=-1, match_calls=False):
        """Returns the attrs of the op that sends or receives ``key``.

        This is the contract between a plan and the TfRdmaSend / TfRdmaRecv
        ops (kernels/ops/send_recv_ops.cc): both the Python wrappers and the
        graph rewrite build their ops from it. The dtype attr (``T`` of send,
        ``dtype`` of recv) is not included.

        Args:
          key: The transfer's key.
          side: ``"send"`` (the op on ``src``; its peer is ``dst``) or
            ``"recv"`` (the op on ``dst``; its peer is ``src``).
          timeout_ms: Milliseconds an op may wait, or -1 for TF_RDMA_TIMEOUT.
          match_calls: True where calls of the function may overlap (the
            rewrite): each write carries TensorFlow's step id of its call and
            the recv takes only its own call's tensor. False pairs the n-th
            send with the n-th recv, for programs where each task calls its
            own function (each side's step ids differ). Both sides must agree.

        Raises:
          PlanError: If the plan has no transfer ``key`` or ``side`` is neither.
        """
        if side not in ("send", "recv"):
            raise PlanError(f"side must be 'send' or 'recv', got {side!r}")
        slot = self.slot(key)
        return dict(
            tensor_name=key,
            peer=slot.dst if side == "send" else slot.src,
            region=slot.region,
            plan_hash=self._hash,
            region_bytes=slot.region_bytes,
            credit_bytes=slot.credit_bytes,
            offset=slot.offset,
            stride=slot.stride,
            depth=slot.depth,
            credit_index=slot.credit_index,
            shape=None if slot.shape is None else list(slot.shape),
            dynamic=slot.dynamic,
            timeout_ms=timeout_ms,
            match_calls=bool(match_calls),
        )

    def _known_task(self, task):
        task = canonical_task(task)
        if task not in self.tasks:
            raise PlanError(
                f"task {task!r} is not in plan {self._name!r}; its tasks are "
                f"{list(self.tasks)!r}")
        return task

    def region_bytes(self, task):
        """Bytes of data regions ``task`` must register (it is their dst).

        Args:
          task: A task name in any form :func:`canonical_task` accepts.

        Returns:
          An int: the sum of ``nbytes`` of the regions whose ``dst`` is
          ``task`` (0 for a task that only sends). Credit regions are not
          included; see :meth:`credit_bytes`.

        Raises:
          PlanError: If ``task`` is malformed or not in the plan.
        """
        task = self._known_task(task)
        return sum(r.nbytes for r in self._regions if r.dst == task)

    def credit_bytes(self, task):
        """Bytes of credit regions ``task`` must register (it is their src).

        Args:
          task: A task name in any form :func:`canonical_task` accepts.

        Returns:
          An int: the sum of ``credit_bytes`` of the regions whose ``src`` is
          ``task`` (0 for a task that only receives).

        Raises:
          PlanError: If ``task`` is malformed or not in the plan.
        """
        task = self._known_task(task)
        return sum(r.credit_bytes for r in self._regions if r.src == task)

    # Serialisation.

    def to_dict(self):
        """Returns the plan as a JSON-ready dict (everything the hash covers)."""
        return {
            "format": FORMAT_VERSION,
            "name": self._name,
            "depth": self._depth,
            "alignment": self._alignment,
            "transfers": [t.to_dict() for t in self._transfers],
        }

    @classmethod
    def from_dict(cls, d):
        """Builds a plan from the output of :meth:`to_dict`.

        Raises:
          PlanError: If ``d`` is not such a dict, has missing or unknown
            fields, or a format version other than :data:`FORMAT_VERSION`.
        """
        if not isinstance(d, dict):
            raise PlanError(f"a plan must be a JSON object, got {d!r}")
        _check_fields(d, ("format", "name", "depth", "alignment", "transfers"),
                      "plan")
        version = d["format"]
        if type(version) is not int or version != FORMAT_VERSION:
            raise PlanError(
                f"unsupported plan format version {version!r}; this tf_rdma "
                f"reads format {FORMAT_VERSION}")
        if not isinstance(d["transfers"], list):
            raise PlanError(
                f"plan field 'transfers' must be a list, got {d['transfers']!r}")
        return cls([_transfer_from_dict(t) for t in d["transfers"]],
                   name=d["name"], depth=d["depth"], alignment=d["alignment"])

    def to_json(self, indent=None):
        """Returns the plan as JSON.

        Args:
          indent: None for the canonical compact form (whose sha256 is
            :attr:`hash`), or an indent for a readable form.
        """
        if indent is None:
            return _canonical_json(self.to_dict())
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    @classmethod
    def from_json(cls, text):
        """Builds a plan from :meth:`to_json` output.

        Raises:
          PlanError: If ``text`` is not valid JSON or not a valid plan.
        """
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")
        if not isinstance(text, str):
            raise PlanError(f"plan JSON must be a str, got {type(text).__name__}")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"malformed plan JSON: {e}") from e
        return cls.from_dict(d)

    # Comparison and display.

    def __eq__(self, other):
        if not isinstance(other, Plan):
            return NotImplemented
        return self._hash == other._hash

    def __hash__(self):
        return hash(self._hash)

    def __repr__(self):
        return (f"Plan(name={self._name!r}, transfers={len(self._transfers)}, "
                f"tasks={len(self.tasks)}, depth={self._depth}, "
                f"alignment={self._alignment}, "
                f"bytes_per_step={self.bytes_per_step}, "
                f"hash={self.short_hash!r})")

    def summary(self):
        """Returns a readable multi-line description of the plan."""
        lines = [
            f"Plan {self._name!r} (format {FORMAT_VERSION}, hash "
            f"{self.short_hash}): {len(self._transfers)} transfers, "
            f"{len(self.tasks)} tasks, depth {self._depth}, "
            f"alignment {self._alignment}",
        ]
        if not self._transfers:
            lines.append("(no transfers)")
        else:
            header = ("key", "src -> dst", "dtype", "shape", "bytes", "region",
                      "offset", "stride")
            rows = [(s.key, f"{s.src} -> {s.dst}", s.dtype,
                     _shape_text(s.shape),
                     "dynamic" if s.dynamic else str(s.nbytes),
                     s.region, str(s.offset), str(s.stride))
                    for s in self._slots]
            lines.extend(_table(header, rows, right=(4, 6, 7)))
            lines.append("")
            header = ("region", "slots", "bytes", "credit bytes")
            rows = [(r.name, str(len(r.keys)), str(r.nbytes),
                     str(r.credit_bytes)) for r in self._regions]
            lines.extend(_table(header, rows, right=(1, 2, 3)))
        lines.append("")
        lines.append(f"bytes per step: {self.bytes_per_step} "
                     f"({_human(self.bytes_per_step)})")
        return "\n".join(lines)


def _canonical_json(d):
    return json.dumps(d, sort_keys=True, separators=(",", ":"))


def _check_fields(d, fields, what):
    missing = [f for f in fields if f not in d]
    unknown = sorted(str(k) for k in d if k not in fields)
    problems = []
    if missing:
        problems.append(f"missing fields {missing!r}")
    if unknown:
        problems.append(f"unknown fields {unknown!r}")
    if problems:
        raise PlanError(
            f"{what} {d!r} has {' and '.join(problems)}; expected exactly the "
            f"fields {list(fields)!r}")


def _transfer_from_dict(d):
    if not isinstance(d, dict):
        raise PlanError(f"a transfer must be a JSON object, got {d!r}")
    fields = ("key", "src", "dst", "dtype", "shape")
    _check_fields(d, fields + (("dynamic",) if "dynamic" in d else ()),
                  "transfer")
    return Transfer(**d)


def _table(header, rows, right=()):
    widths = [max(len(r[i]) for r in (header, *rows))
              for i in range(len(header))]

    def fmt(row):
        cells = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    return [fmt(header), fmt(tuple("-" * w for w in widths))] + [
        fmt(r) for r in rows]


def _shape_text(shape):
    if shape is None:
        return "<unknown rank>"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


def _human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover
