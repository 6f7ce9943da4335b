"""Static gradient buckets for data-parallel training.

A :class:`BucketPlan` takes the gradients of one training step (names,
dtypes and shapes, all known when the step is traced) and decides, once,
which gradients are all-reduced together and where each one lives:

* **Which together.** Gradients are taken in the order backpropagation
  produces them and packed greedily into *buckets* of at most
  ``bucket_bytes`` (a gradient larger than that gets a bucket of its own).
  The strategy emits one collective per bucket, so a bucket's all-reduce can
  start as soon as its last gradient exists, while backpropagation is still
  computing the gradients of the earlier layers.
* **Where.** Every bucket is laid out at fixed, 64-byte aligned offsets, and
  the buckets at fixed aligned offsets in one buffer of
  :attr:`BucketPlan.buffer_bytes`, so memory can be allocated (and
  registered) once; nothing is negotiated per step.

Like :mod:`tf_rdma.graph_passes.plan`, this module is pure Python (standard
library only) and never imports TensorFlow: the strategy hands it plain
descriptions of the gradients. Both the plan's JSON form and its hash depend
only on the gradients given (in the order given) and the settings, so every
worker that traces the same model computes the same plan and the same hash.
"""

# The order
# ---------
#
# Backpropagation computes the gradient of a variable after the gradients of
# everything that was computed from it, so the last layers' gradients exist
# first. The plan does not see the backward graph; it takes the *reverse of
# the order in which the gradients are given* as the order in which they are
# produced (order="reverse", the default). The strategy gives them in the
# order of the model's trainable variables, which is the order in which the
# layers were built and, for sequential and most functional models, the
# forward order. This is the same proxy PyTorch DDP and Horovod use; it is
# exact for a chain of layers and a good guess otherwise. order="given" takes
# the gradients as given (for callers that already know the backward order).
#
# The packing
# -----------
#
# Walking the gradients in that order, each one goes into the open bucket of
# its dtype (one collective reduces one dtype). Within a bucket a gradient
# starts at the next multiple of `alignment` (64 bytes, a cache line: the
# collective op concatenates a bucket's tensors at exactly these offsets). If
# the gradient does not fit behind the ones already in the bucket (the
# bucket's size would exceed `bucket_bytes`), the bucket is closed and a new
# one is opened for the gradient. A gradient larger than `bucket_bytes` thus
# always ends up alone. When the walk ends, the buckets still open are closed.
#
# Buckets are numbered in the order in which they become ready during
# backpropagation, i.e. by the position of their last gradient in the walk:
# bucket 0 holds the last layers. The buffer holds bucket 0 first; every bucket starts at an aligned
# offset.

import dataclasses
import hashlib
import json
import math
import operator
import re

from tf_rdma.errors import PlanError
from tf_rdma.graph_passes.plan import DTYPE_SIZES, align_up, normalize_dtype

__all__ = [
    "BUCKET_FORMAT_VERSION",
    "DEFAULT_BUCKET_BYTES",
    "BUCKET_ALIGNMENT",
    "ORDERS",
    "Gradient",
    "GradientLayout",
    "Bucket",
    "BucketPlan",
]

#: Version of the bucket plan format; part of the hash and of the JSON form.
BUCKET_FORMAT_VERSION = 1
#: Default largest bucket, in bytes (4 MiB).
DEFAULT_BUCKET_BYTES = 4 << 20
#: Default alignment of every gradient and bucket in the buffer (a cache line).
BUCKET_ALIGNMENT = 64
#: The orders a plan can take the gradients in (see the module comment).
ORDERS = ("reverse", "given")

_MAX_ALIGNMENT = 4096
_INT64_MAX = 2**63 - 1
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")


def _check_name(name, what):
    if not isinstance(name, str) or not name:
        raise PlanError(f"{what} must be a non-empty str, got {name!r}")
    if any(c.isspace() or not c.isprintable() for c in name):
        raise PlanError(
            f"{what} {name!r} must not contain whitespace or control "
            f"characters")
    return name


def _static_shape(shape, key):
    """Returns ``shape`` as a tuple of ints >= 0, or raises PlanError."""
    if shape is None or getattr(shape, "rank", 0) is None:
        raise PlanError(
            f"gradient {key!r}: shape {shape!r} has unknown rank; bucketing "
            f"needs every gradient's shape at trace time (an IndexedSlices "
            f"gradient must be converted to a dense tensor first)")
    if isinstance(shape, (str, bytes)):
        raise PlanError(
            f"gradient {key!r}: shape must be a sequence of ints, got "
            f"{shape!r}")
    try:
        dims = list(shape)
    except (TypeError, ValueError) as e:
        raise PlanError(
            f"gradient {key!r}: shape must be a sequence of ints, got "
            f"{shape!r}") from e
    out = []
    for i, d in enumerate(dims):
        if d is not None and not isinstance(d, bool):
            try:
                d = operator.index(d)
            except TypeError:
                pass
        if d is None or (isinstance(d, int) and not isinstance(d, bool)
                         and d < 0):
            raise PlanError(
                f"gradient {key!r}: dimension {i} of shape {shape!r} is "
                f"unknown ({d!r}); bucketing needs every gradient's shape at "
                f"trace time")
        if not isinstance(d, int) or isinstance(d, bool):
            raise PlanError(
                f"gradient {key!r}: dimension {i} of shape {shape!r} must be "
                f"an int, got {d!r}")
        out.append(d)
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class Gradient:
    """One gradient of a training step, as the bucket plan sees it.

    Fields are normalised on construction: ``dtype`` to its name and
    ``shape`` to a tuple of python ints.

    Attributes:
      key: The gradient's name (usually its variable's), unique within a
        plan; non-empty, no whitespace or control characters.
      dtype: The dtype name, a key of :data:`~tf_rdma.graph_passes.plan.DTYPE_SIZES`.
      shape: The static shape, every dim an int ``>= 0``.
    """

    key: str
    dtype: str
    shape: tuple

    def __post_init__(self):
        _check_name(self.key, "gradient key")
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        object.__setattr__(self, "shape", _static_shape(self.shape, self.key))

    @property
    def nbytes(self):
        """Bytes of the gradient."""
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)

    def to_dict(self):
        """Returns the gradient as a JSON-ready dict (shape as a list)."""
        return {"key": self.key, "dtype": self.dtype, "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class GradientLayout:
    """Where one gradient lives.

    Attributes:
      key, dtype, shape, nbytes: As in :class:`Gradient`.
      index: Position of the gradient in the list given to the plan.
      bucket: Number of the bucket that holds it.
      position: Position of the gradient within its bucket's list.
      offset: Byte offset of the gradient within its bucket (aligned).
      buffer_offset: Byte offset of the gradient within the whole buffer.
    """

    key: str
    dtype: str
    shape: tuple
    nbytes: int
    index: int
    bucket: int
    position: int
    offset: int
    buffer_offset: int


@dataclasses.dataclass(frozen=True)
class Bucket:
    """One bucket: the gradients reduced by one collective.

    Attributes:
      index: The bucket's number (the order in which buckets become ready).
      dtype: The dtype of all its gradients.
      keys: Keys of its gradients, in layout order.
      indices: Positions of its gradients in the list given to the plan, in
        layout order (what a caller needs to pick the tensors).
      nbytes: Bytes of the bucket: the end of its last gradient, rounded up
        to the alignment.
      payload_bytes: Bytes of the gradients alone (without padding).
      offset: Byte offset of the bucket within the whole buffer (aligned).
    """

    index: int
    dtype: str
    keys: tuple
    indices: tuple
    nbytes: int
    payload_bytes: int
    offset: int


def _check_int(value, what, lo, hi):
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(f"{what} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise PlanError(f"{what} must be in [{lo}, {hi}], got {value!r}")
    return value


def _as_gradient(g, index):
    if isinstance(g, Gradient):
        return g
    if isinstance(g, dict):
        fields = ("key", "dtype", "shape")
        if set(g) != set(fields):
            raise PlanError(
                f"gradient {g!r} must have exactly the fields {list(fields)!r}")
        return Gradient(**g)
    if isinstance(g, (tuple, list)) and len(g) == 3:
        return Gradient(*g)
    raise PlanError(
        f"gradient {index} must be a Gradient, a dict with key/dtype/shape or "
        f"a (key, dtype, shape) tuple, got {g!r}")


class BucketPlan:
    """The static bucket plan of a training step's gradients.

    Args:
      gradients: An iterable of :class:`Gradient` (or of dicts with the
        fields ``key, dtype, shape``, or of ``(key, dtype, shape)`` tuples),
        in the order of the model's variables (forward order); may be empty.
      bucket_bytes: Largest bucket in bytes, an int ``>= 1``. A gradient
        larger than this gets a bucket of its own.
      alignment: Alignment of every gradient within a bucket and of every
        bucket within the buffer: a power of two in ``[64, 4096]``.
      order: ``"reverse"`` (default): the gradients are produced in the
        reverse of the order given (backpropagation of a forward-ordered
        list); ``"given"``: in the order given.
      name: The plan's name, made of ``[A-Za-z0-9_.-]``; it names the
        collectives (see :meth:`collective_name`).

    Raises:
      PlanError: If an argument is invalid, a gradient is malformed, or two
        gradients share a key.
    """

    def __init__(self, gradients, bucket_bytes=DEFAULT_BUCKET_BYTES,
                 alignment=BUCKET_ALIGNMENT, order="reverse", name="grads"):
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise PlanError(
                f"bucket plan name must be a non-empty str of [A-Za-z0-9_.-], "
                f"got {name!r}")
        _check_int(bucket_bytes, "bucket_bytes", 1, _INT64_MAX)
        _check_int(alignment, "bucket alignment", BUCKET_ALIGNMENT,
                   _MAX_ALIGNMENT)
        if alignment & (alignment - 1):
            raise PlanError(
                f"bucket alignment must be a power of two in "
                f"[{BUCKET_ALIGNMENT}, {_MAX_ALIGNMENT}], got {alignment!r}")
        if order not in ORDERS:
            raise PlanError(
                f"bucket order must be one of {ORDERS!r}, got {order!r}")
        if isinstance(gradients, (str, bytes, dict, Gradient)):
            raise PlanError(
                f"gradients must be an iterable of Gradient, got {gradients!r}")
        try:
            items = list(gradients)
        except TypeError as e:
            raise PlanError(
                f"gradients must be an iterable of Gradient, got "
                f"{gradients!r}") from e
        grads = []
        seen = {}
        for i, g in enumerate(items):
            g = _as_gradient(g, i)
            if g.key in seen:
                raise PlanError(
                    f"duplicate gradient key {g.key!r} (gradients {seen[g.key]} "
                    f"and {i})")
            seen[g.key] = i
            grads.append(g)
        self._name = name
        self._bucket_bytes = bucket_bytes
        self._alignment = alignment
        self._order = order
        self._gradients = tuple(grads)
        self._layout()
        self._hash = hashlib.sha256(
            _canonical_json(self.to_dict()).encode("utf-8")).hexdigest()

    def _layout(self):
        n = len(self._gradients)
        walk = range(n - 1, -1, -1) if self._order == "reverse" else range(n)
        closed = []        # [(dtype, [index, ...], [offset, ...], end)]
        open_by_dtype = {}  # dtype -> (indices, offsets, end)
        for i in walk:
            g = self._gradients[i]
            cur = open_by_dtype.get(g.dtype)
            if cur is not None:
                indices, offsets, end = cur
                start = align_up(end, self._alignment)
                if start + g.nbytes > self._bucket_bytes:
                    closed.append((g.dtype, indices, offsets, end))
                    cur = None
            if cur is None:
                indices, offsets, start = [], [], 0
            indices.append(i)
            offsets.append(start)
            open_by_dtype[g.dtype] = (indices, offsets, start + g.nbytes)
        for dtype, (indices, offsets, end) in open_by_dtype.items():
            closed.append((dtype, indices, offsets, end))
        # A bucket is ready when its last gradient exists: number them in
        # that order (the walk position of their last gradient).
        rank = {i: step for step, i in enumerate(walk)}
        closed.sort(key=lambda c: rank[c[1][-1]])

        buckets = []
        layouts = [None] * n
        buffer_offset = 0
        for b, (dtype, indices, offsets, end) in enumerate(closed):
            nbytes = align_up(end, self._alignment)
            for pos, (i, off) in enumerate(zip(indices, offsets)):
                g = self._gradients[i]
                layouts[i] = GradientLayout(
                    key=g.key, dtype=g.dtype, shape=g.shape, nbytes=g.nbytes,
                    index=i, bucket=b, position=pos, offset=off,
                    buffer_offset=buffer_offset + off)
            buckets.append(Bucket(
                index=b, dtype=dtype,
                keys=tuple(self._gradients[i].key for i in indices),
                indices=tuple(indices), nbytes=nbytes,
                payload_bytes=sum(self._gradients[i].nbytes for i in indices),
                offset=buffer_offset))
            buffer_offset += nbytes
        if buffer_offset > _INT64_MAX:
            raise PlanError(
                f"bucket plan {self._name!r} would need a buffer of "
                f"{buffer_offset} bytes, more than fits in int64")
        self._buckets = tuple(buckets)
        self._layouts = tuple(layouts)
        self._by_key = {l.key: l for l in layouts}
        self._buffer_bytes = buffer_offset

    # Accessors.

    @property
    def name(self):
        """The plan's name."""
        return self._name

    @property
    def bucket_bytes(self):
        """Largest bucket, in bytes (a larger gradient is alone in its own)."""
        return self._bucket_bytes

    @property
    def alignment(self):
        """Alignment of every gradient and bucket, in bytes."""
        return self._alignment

    @property
    def order(self):
        """``"reverse"`` or ``"given"``: how the gradients are walked."""
        return self._order

    @property
    def gradients(self):
        """Tuple of :class:`Gradient`, in the order given."""
        return self._gradients

    @property
    def buckets(self):
        """Tuple of :class:`Bucket`, in the order they become ready."""
        return self._buckets

    @property
    def layouts(self):
        """Tuple of :class:`GradientLayout`, in the order of :attr:`gradients`."""
        return self._layouts

    @property
    def buffer_bytes(self):
        """Bytes of the buffer that holds every bucket."""
        return self._buffer_bytes

    @property
    def payload_bytes(self):
        """Bytes of all the gradients (without padding)."""
        return sum(g.nbytes for g in self._gradients)

    @property
    def hash(self):
        """Hex sha256 of the canonical JSON of the plan (see :meth:`to_json`)."""
        return self._hash

    @property
    def short_hash(self):
        """The first 12 hex digits of :attr:`hash`."""
        return self._hash[:12]

    def layout(self, key):
        """Returns the :class:`GradientLayout` of gradient ``key``.

        Raises:
          PlanError: If the plan has no gradient ``key``.
        """
        try:
            return self._by_key[key]
        except (KeyError, TypeError):
            pass
        known = sorted(self._by_key)
        shown = known[:5]
        more = "" if len(known) <= 5 else f" ({len(known)} in all)"
        raise PlanError(
            f"bucket plan {self._name!r} has no gradient {key!r}; its "
            f"gradients include {shown!r}{more}")

    def collective_name(self, bucket):
        """Returns the collective instance name of bucket ``bucket``.

        ``"<name>.<short hash>.bucket<i>"``: the same on every worker that
        computed the same plan, different for every bucket (so buckets can
        run concurrently), and different for a different plan (so two
        workers that disagree about the buckets never pair up their
        collectives by mistake).

        Raises:
          PlanError: If ``bucket`` is not a bucket number of the plan.
        """
        if (not isinstance(bucket, int) or isinstance(bucket, bool)
                or not 0 <= bucket < len(self._buckets)):
            raise PlanError(
                f"bucket must be an int in [0, {len(self._buckets)}), got "
                f"{bucket!r}")
        return f"{self._name}.{self._hash[:8]}.bucket{bucket}"

    def split(self, values):
        """Groups per-gradient values into buckets.

        Args:
          values: A sequence with one value per gradient, in the order of
            :attr:`gradients` (the gradient tensors themselves, say).

        Returns:
          A list with one list per bucket (in bucket order) of the values of
          its gradients, in layout order.

        Raises:
          PlanError: If ``values`` does not have one value per gradient.
        """
        values = list(values)
        if len(values) != len(self._gradients):
            raise PlanError(
                f"bucket plan {self._name!r} has {len(self._gradients)} "
                f"gradients, got {len(values)} values")
        return [[values[i] for i in b.indices] for b in self._buckets]

    def merge(self, bucket_values):
        """The inverse of :meth:`split`: per-bucket lists back to one list.

        Args:
          bucket_values: One sequence per bucket, each with one value per
            gradient of the bucket, in layout order.

        Returns:
          A list of the values in the order of :attr:`gradients`.

        Raises:
          PlanError: If the number of buckets or of values in a bucket does
            not match the plan.
        """
        bucket_values = list(bucket_values)
        if len(bucket_values) != len(self._buckets):
            raise PlanError(
                f"bucket plan {self._name!r} has {len(self._buckets)} buckets, "
                f"got {len(bucket_values)}")
        out = [None] * len(self._gradients)
        for b, vals in zip(self._buckets, bucket_values):
            vals = list(vals)
            if len(vals) != len(b.indices):
                raise PlanError(
                    f"bucket {b.index} of plan {self._name!r} has "
                    f"{len(b.indices)} gradients, got {len(vals)} values")
            for i, v in zip(b.indices, vals):
                out[i] = v
        return out

    # Serialisation.

    def to_dict(self):
        """Returns the plan as a JSON-ready dict (everything the hash covers)."""
        return {
            "format": BUCKET_FORMAT_VERSION,
            "name": self._name,
            "bucket_bytes": self._bucket_bytes,
            "alignment": self._alignment,
            "order": self._order,
            "gradients": [g.to_dict() for g in self._gradients],
        }

    @classmethod
    def from_dict(cls, d):
        """Builds a plan from the output of :meth:`to_dict`.

        Raises:
          PlanError: If ``d`` is not such a dict, has missing or unknown
            fields, or a format version other than
            :data:`BUCKET_FORMAT_VERSION`.
        """
        if not isinstance(d, dict):
            raise PlanError(f"a bucket plan must be a JSON object, got {d!r}")
        fields = ("format", "name", "bucket_bytes", "alignment", "order",
                  "gradients")
        missing = [f for f in fields if f not in d]
        unknown = sorted(str(k) for k in d if k not in fields)
        if missing or unknown:
            raise PlanError(
                f"bucket plan {d!r} has missing fields {missing!r} and "
                f"unknown fields {unknown!r}; expected exactly {list(fields)!r}")
        version = d["format"]
        if type(version) is not int or version != BUCKET_FORMAT_VERSION:
            raise PlanError(
                f"unsupported bucket plan format version {version!r}; this "
                f"tf_rdma reads format {BUCKET_FORMAT_VERSION}")
        if not isinstance(d["gradients"], list):
            raise PlanError(
                f"bucket plan field 'gradients' must be a list, got "
                f"{d['gradients']!r}")
        return cls(d["gradients"], bucket_bytes=d["bucket_bytes"],
                   alignment=d["alignment"], order=d["order"], name=d["name"])

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
          PlanError: If ``text`` is not valid JSON or not a valid bucket plan.
        """
        if isinstance(text, (bytes, bytearray)):
            text = text.decode("utf-8")
        if not isinstance(text, str):
            raise PlanError(
                f"bucket plan JSON must be a str, got {type(text).__name__}")
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"malformed bucket plan JSON: {e}") from e
        return cls.from_dict(d)

    # Comparison and display.

    def __eq__(self, other):
        if not isinstance(other, BucketPlan):
            return NotImplemented
        return self._hash == other._hash

    def __hash__(self):
        return hash(self._hash)

    def __repr__(self):
        return (f"BucketPlan(name={self._name!r}, "
                f"gradients={len(self._gradients)}, "
                f"buckets={len(self._buckets)}, "
                f"bucket_bytes={self._bucket_bytes}, "
                f"buffer_bytes={self._buffer_bytes}, "
                f"hash={self.short_hash!r})")

    def summary(self):
        """Returns a readable multi-line description of the plan."""
        lines = [
            f"BucketPlan {self._name!r} (format {BUCKET_FORMAT_VERSION}, hash "
            f"{self.short_hash}): {len(self._gradients)} gradients in "
            f"{len(self._buckets)} buckets of <= {self._bucket_bytes} bytes, "
            f"order {self._order}, alignment {self._alignment}, buffer "
            f"{self._buffer_bytes} bytes",
        ]
        if not self._buckets:
            lines.append("(no gradients)")
            return "\n".join(lines)
        header = ("bucket", "gradient", "dtype", "shape", "bytes", "offset",
                  "buffer offset")
        rows = []
        for b in self._buckets:
            for i in b.indices:
                l = self._layouts[i]
                rows.append((str(b.index), l.key, l.dtype,
                             "[" + ", ".join(map(str, l.shape)) + "]",
                             str(l.nbytes), str(l.offset),
                             str(l.buffer_offset)))
        widths = [max(len(r[i]) for r in (header, *rows))
                  for i in range(len(header))]
        right = (0, 4, 5, 6)

        def fmt(row):
            return "  ".join(
                c.rjust(w) if i in right else c.ljust(w)
                for i, (c, w) in enumerate(zip(row, widths))).rstrip()

        lines.append(fmt(header))
        lines.append(fmt(tuple("-" * w for w in widths)))
        lines.extend(fmt(r) for r in rows)
        return "\n".join(lines)


def _canonical_json(d):
    return json.dumps(d, sort_keys=True, separators=(",", ":"))
