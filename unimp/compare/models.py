"""The models ``unimp compare`` trains, defined once as shapes and NumPy initial weights.

Every framework's runner builds the same network from these weights:

* ``mlp`` (the seeds' model): flatten -> Dense(512) -> ReLU -> Dropout(0.2) -> Dense(classes).
* ``cnn``: Conv 3x3 (16 filters, same padding) -> ReLU -> flatten (H, W, C order) ->
  Dropout(0.2) -> Dense(classes).

Dropout masks come with each batch (drawn in NumPy), so the frameworks stay in step. The model
returns logits; the loss is the mean softmax cross-entropy computed in the output dtype.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MODELS", "hidden_size", "init_weights"]

MODELS = ("mlp", "cnn")
_HIDDEN = 512
_FILTERS = 16


def hidden_size(model: str, image_shape: tuple[int, int, int]) -> int:
    """Width of the layer dropout acts on."""
    if model == "mlp":
        return _HIDDEN
    if model == "cnn":
        h, w, _ = image_shape
        return h * w * _FILTERS
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
    return {
        "k": _glorot(rng, 9 * c, 9 * _FILTERS, (3, 3, c, _FILTERS)),
        "bk": np.zeros(_FILTERS, np.float32),
        "w2": _glorot(rng, hidden, num_classes, (hidden, num_classes)),
        "b2": np.zeros(num_classes, np.float32),
    }
