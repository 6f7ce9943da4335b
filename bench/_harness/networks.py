"""The real networks: what bench/models.py measures and the parity tests train.

Convolutional networks from ``keras.applications`` (no weights downloaded:
``weights=None``), a recurrent language model and a Transformer encoder,
each with an embedding, all classifying into 10 classes, on synthetic data.
They carry what the synthetic models of the other benches do not: hundreds
of variables from a few bytes to tens of MiB, batch normalization (moving
statistics updated in ``call``), dropout, recurrent state, attention.

``keras`` is passed in, not imported: the parameter-server programs build
these with Keras 2 (``tf_keras``: ParameterServerStrategy has no Keras 3
``fit``), the data-parallel ones with Keras 3; both have these layers and
applications under the same names.

Two sizes of each network:

``"test"``
    For the parity tests: small inputs (32x32 images, 20 tokens) and a
    2-layer Transformer of width 64, so that a few steps of every network
    fit in ``make test``'s budget.
``"bench"``
    For the benchmark, as the models are used: the same convolutional
    networks (ImageNet-sized ones at 32x32 would be the same weights with
    less compute per byte: the communication-heavy case; Inception-v3's
    smallest input is 75x75), an LSTM language model over 64 tokens of a
    10,000-word vocabulary, and a 4-layer Transformer encoder of width
    256 over 64 tokens.

Nothing here imports TensorFlow: an orchestrator may import this module.
"""

NAMES = ("vgg16", "resnet50", "inception_v3", "mobilenet_v2", "lstm",
         "transformer")
SIZES = ("test", "bench")
CLASSES = 10
#: Examples per worker and step, per size.
BATCH = {"test": 8, "bench": 16}

#: Per size: image side (per network where it must differ), tokens,
#: vocabulary, and the recurrent and attention models' widths.
_SHAPES = {
    "test": {"image": 32, "inception_image": 75, "tokens": 20,
             "vocab": 1000, "embed": 64, "lstm": 128, "layers": 2,
             "width": 64, "heads": 4, "ffn": 128},
    "bench": {"image": 32, "inception_image": 75, "tokens": 64,
              "vocab": 10000, "embed": 256, "lstm": 512, "layers": 4,
              "width": 256, "heads": 4, "ffn": 1024},
}


def _shapes(size):
    if size not in _SHAPES:
        raise ValueError(f"size {size!r} is not one of {', '.join(SIZES)}")
    return _SHAPES[size]


def _check(name):
    if name not in NAMES:
        raise ValueError(f"network {name!r} is not one of {', '.join(NAMES)}")


def vocabulary(size):
    """The token networks' vocabulary at ``size``."""
    return _shapes(size)["vocab"]


def takes_tokens(name):
    """True for the networks whose input is token ids, not images."""
    _check(name)
    return name in ("lstm", "transformer")


def input_shape(name, size="test"):
    """One example's shape: ``(side, side, 3)`` or ``(tokens,)``."""
    _check(name)
    s = _shapes(size)
    if takes_tokens(name):
        return (s["tokens"],)
    side = s["inception_image"] if name == "inception_v3" else s["image"]
    return (side, side, 3)


def build(name, keras, size="test", dropout=0.1):
    """A new, randomly initialised ``name`` (seed Keras first to repeat it).

    Args:
      name: One of NAMES.
      keras: The Keras module to build with (``keras`` or ``tf_keras``).
      size: ``"test"`` or ``"bench"``.
      dropout: The Transformer's attention and residual dropout rate.

    Returns:
      An uncompiled model whose output is 10 logits.
    """
    _check(name)
    s = _shapes(size)
    apps, layers = keras.applications, keras.layers
    shape = input_shape(name, size)
    if name == "vgg16":
        return apps.VGG16(input_shape=shape, weights=None, classes=CLASSES)
    if name == "resnet50":
        return apps.ResNet50(input_shape=shape, weights=None, classes=CLASSES)
    if name == "inception_v3":
        return apps.InceptionV3(input_shape=shape, weights=None,
                                classes=CLASSES)
    if name == "mobilenet_v2":
        return apps.MobileNetV2(input_shape=shape, weights=None,
                                classes=CLASSES,
                                alpha=0.35 if size == "test" else 1.0)
    tokens = keras.Input(shape, dtype="int32")
    h = layers.Embedding(s["vocab"], s["embed"])(tokens)
    if name == "lstm":
        h = layers.LSTM(s["lstm"])(h)
        return keras.Model(tokens, layers.Dense(CLASSES)(h))
    if s["embed"] != s["width"]:
        h = layers.Dense(s["width"])(h)
    for _ in range(s["layers"]):
        attended = layers.MultiHeadAttention(
            s["heads"], s["width"] // s["heads"], dropout=dropout)(h, h)
        h = layers.LayerNormalization()(h + layers.Dropout(dropout)(attended))
        inner = layers.Dense(s["ffn"], activation="relu")(h)
        h = layers.LayerNormalization()(h + layers.Dense(s["width"])(inner))
    pooled = layers.GlobalAveragePooling1D()(h)
    return keras.Model(tokens, layers.Dense(CLASSES)(pooled))


def data(np, name, rows, size="test", seed=0):
    """``rows`` synthetic examples and labels (numpy) for ``name``."""
    rng = np.random.RandomState(seed)
    shape = input_shape(name, size)
    if takes_tokens(name):
        x = rng.randint(0, vocabulary(size), size=(rows,) + shape)
        x = x.astype(np.int32)
    else:
        x = rng.normal(size=(rows,) + shape).astype(np.float32)
    return x, rng.randint(0, CLASSES, size=rows).astype(np.int32)
