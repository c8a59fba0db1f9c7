"""The models ``unimp compare`` trains, defined once as shapes and NumPy initial weights.

Every framework's runner builds the same network from these weights:

* ``mlp`` (the seeds' model): flatten -> Dense(512) -> ReLU -> Dropout(0.2) -> Dense(classes).
* ``cnn``: Conv 3x3 (16 filters, same padding) -> ReLU -> flatten (H, W, C order) ->
  Dropout(0.2) -> Dense(classes).
* ``vit``: a one-block pre-norm vision transformer whose tokens are the image rows (H tokens of
  W*C features): Dense(W*C -> 32) ``emb`` + learned position embedding ``pos`` (H, 32) ->
  ``x + attn(ln1(x))`` (2 heads of 16, q/k/v/o projections with biases, softmax over the keys,
  no mask) -> ``x + mlp(ln2(x))`` (Dense(64) ``fc1`` -> ReLU -> Dense(32) ``fc2``) -> LayerNorm
  ``lnf`` -> mean over tokens -> Dropout(0.2) -> Dense(classes) ``l2``. LayerNorms have scale and
  bias and epsilon :data:`LAYER_NORM_EPS` in every framework (Keras's default is 1e-3). ReLU,
  not GELU: the frameworks' GELU approximations differ. Softmax and LayerNorm are where torch
  autocast, Keras dtype policies and jmp-style JAX compute in different dtypes.

Layer names (torch attributes, Keras layer names, JAX ``named_scope``) are the same everywhere:
``emb``, ``pos``, ``ln1``, ``attn`` (``q``, ``k``, ``v``, ``o``), ``ln2``, ``mlp`` (``fc1``,
``fc2``), ``lnf``, ``l2``.

Dropout masks come with each batch (drawn in NumPy), so the frameworks stay in step. The model
returns logits; the loss is the mean softmax cross-entropy computed in the output dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "FP8_PATHS",
    "weight_layer",
    "LAYER_NORM_EPS",
    "MODELS",
    "VIT_DIM",
    "VIT_HEADS",
    "VIT_MLP",
    "hidden_size",
    "init_weights",
]

MODELS = ("mlp", "cnn", "vit")
_HIDDEN = 512
_FILTERS = 16
#: ``vit``: token width D, attention heads (head dim D / heads = 16), MLP width.
VIT_DIM, VIT_HEADS, VIT_MLP = 32, 2, 64
#: epsilon of every LayerNorm, set explicitly in each framework.
LAYER_NORM_EPS = 1e-5


def hidden_size(model: str, image_shape: tuple[int, int, int]) -> int:
    """Width of the layer dropout acts on."""
    if model == "mlp":
        return _HIDDEN
    if model == "cnn":
        h, w, _ = image_shape
        return h * w * _FILTERS
    if model == "vit":
        return VIT_DIM
    raise ValueError(f"unknown --model {model!r}; choose one of {', '.join(MODELS)}.")


def _glorot(
    rng: np.random.Generator, fan_in: int, fan_out: int, shape: tuple[int, ...]
) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def init_weights(
    model: str, image_shape: tuple[int, int, int], num_classes: int, seed: int
) -> dict[str, np.ndarray]:
    """One NumPy draw of the initial weights (float32), loaded into every framework.

    Returns:
        ``mlp``: ``w1`` (features, 512), ``b1`` (512,), ``w2`` (512, classes), ``b2`` (classes,).
        ``cnn``: ``k`` (3, 3, C, 16) HWIO, ``bk`` (16,), ``w2`` (H*W*16, classes), ``b2``.
        ``vit`` (D = 32, dense kernels (in, out), biases zero, LayerNorm ``*_g`` ones and
        ``*_b`` zeros): ``emb_w`` (W*C, D), ``emb_b`` (D,), ``pos`` (H, D) normal * 0.02,
        ``ln1_g``/``ln1_b`` (D,), ``attn_{q,k,v,o}_w`` (D, D) and ``attn_{q,k,v,o}_b`` (D,)
        (head ``j`` is columns ``16*j .. 16*j+15`` of q/k/v, rows of o), ``ln2_g``/``ln2_b``,
        ``mlp_fc1_w`` (D, 64), ``mlp_fc1_b`` (64,), ``mlp_fc2_w`` (64, D), ``mlp_fc2_b`` (D,),
        ``lnf_g``/``lnf_b``, ``w2`` (D, classes), ``b2`` (classes,).
    """
    rng = np.random.default_rng(seed)
    h, w, c = image_shape
    hidden = hidden_size(model, image_shape)
    if model == "mlp":
        features = h * w * c
        return {
            "w1": _glorot(rng, features, _HIDDEN, (features, _HIDDEN)),
            "b1": np.zeros(_HIDDEN, np.float32),
            "w2": _glorot(rng, _HIDDEN, num_classes, (_HIDDEN, num_classes)),
            "b2": np.zeros(num_classes, np.float32),
        }
    if model == "vit":
        return _vit_weights(rng, image_shape, num_classes)
    return {
        "k": _glorot(rng, 9 * c, 9 * _FILTERS, (3, 3, c, _FILTERS)),
        "bk": np.zeros(_FILTERS, np.float32),
        "w2": _glorot(rng, hidden, num_classes, (hidden, num_classes)),
        "b2": np.zeros(num_classes, np.float32),
    }


def _vit_weights(
    rng: np.random.Generator, image_shape: tuple[int, int, int], num_classes: int
) -> dict[str, np.ndarray]:
    h, w, c = image_shape
    d = VIT_DIM

    def dense(name: str, fan_in: int, fan_out: int) -> dict[str, np.ndarray]:
        return {
            f"{name}_w": _glorot(rng, fan_in, fan_out, (fan_in, fan_out)),
            f"{name}_b": np.zeros(fan_out, np.float32),
        }

    def norm(name: str) -> dict[str, np.ndarray]:
        return {f"{name}_g": np.ones(d, np.float32), f"{name}_b": np.zeros(d, np.float32)}

    return {
        **dense("emb", w * c, d),
        "pos": (rng.standard_normal((h, d)) * 0.02).astype(np.float32),
        **norm("ln1"),
        **{k: v for n in "qkvo" for k, v in dense(f"attn_{n}", d, d).items()},
        **norm("ln2"),
        **dense("mlp_fc1", d, VIT_MLP),
        **dense("mlp_fc2", VIT_MLP, d),
        **norm("lnf"),
        "w2": _glorot(rng, d, num_classes, (d, num_classes)),
        "b2": np.zeros(num_classes, np.float32),
    }


#: The Dense/Linear layers of each model in model order, by the dotted paths every runner uses
#: (an FP8 recipe selects among them; the first and the last stay out by default).
FP8_PATHS = {
    "mlp": ("l1", "l2"),
    "cnn": ("l2",),  # the convolution is float8-capable in the recipe, but not built
    "vit": ("emb", "attn.q", "attn.k", "attn.v", "attn.o", "mlp.fc1", "mlp.fc2", "l2"),
}

_LAYER_PREFIXES = ("emb", "pos", "ln1", "attn", "ln2", "mlp", "lnf")


def weight_layer(name: str) -> str:
    """The top-level layer a weight of :func:`init_weights` belongs to, by the layer names every
    runner uses (``w1``/``b1`` -> ``l1``, ``k``/``bk`` -> ``conv``, ``w2``/``b2`` -> ``l2``,
    ``attn_q_w`` -> ``attn``, ``mlp_fc1_b`` -> ``mlp``)."""
    fixed = {"w1": "l1", "b1": "l1", "k": "conv", "bk": "conv", "w2": "l2", "b2": "l2"}
    if name in fixed:
        return fixed[name]
    for prefix in _LAYER_PREFIXES:
        if name == prefix or name.startswith(prefix + "_"):
            return prefix
    raise ValueError(f"no layer for weight {name!r}")
