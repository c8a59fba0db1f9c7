"""TensorFlow 2.1-2.3's experimental mixed-precision API, on Keras 3 through unimp.

TensorFlow 2.4 moved the API out of ``experimental`` and Keras 3 removed it, so code of that
era (seed 004's ``tf.keras.mixed_precision.experimental.Policy('mixed_float16')``) fails with
``AttributeError: module 'keras.mixed_precision' has no attribute 'experimental'``. Change
only the import line::

    import tensorflow as tf                                   # before
    from unimp.compat.tf_experimental import tf               # after

    from tensorflow.keras.mixed_precision import experimental as mixed_precision   # before
    from unimp.compat import tf_experimental as mixed_precision                   # after

``tf`` is TensorFlow itself with ``tf.keras.mixed_precision.experimental``,
``tf.mixed_precision.experimental`` and ``tf.train.experimental.
enable_mixed_precision_graph_rewrite`` put back; every other name is TensorFlow's own. The
calls map onto unimp:

* :class:`Policy` ``(name, loss_scale="auto")`` is a Keras ``DTypePolicy`` of that name that
  also carries the old ``loss_scale`` (``"auto"``: dynamic for ``"mixed_float16"``, else
  none; ``"dynamic"``; a number; a :class:`DynamicLossScale` / :class:`FixedLossScale`; or
  ``None``), read as a unimp loss-scale config by :attr:`Policy.loss_scale`.
* :func:`set_policy` / :func:`global_policy` set and read Keras's global dtype policy.
* :func:`LossScaleOptimizer` ``(optimizer, loss_scale)`` is unimp's
  :class:`unimp.backends.tensorflow.LossScaleOptimizer` with that loss scale: ``"dynamic"`` is
  TensorFlow 2.x's dynamic scale (``DynamicLossScale.preset("tf_keras")``: 2**15, x2 after
  2000 finite steps, /2 on overflow, never below 1), with ``get_scaled_loss`` /
  ``get_unscaled_gradients`` for custom loops.
* :class:`DynamicLossScale` ``(initial_loss_scale=2**15, increment_period=2000,
  multiplier=2.0)`` and :class:`FixedLossScale` ``(loss_scale_value)`` are the same rules.

* ``tf.keras.Sequential`` and ``tf.keras.models.Sequential`` (:class:`Sequential`) compile as
  TensorFlow 2.1-2.3 did: under a
  :class:`Policy` with a loss scale, ``model.compile(optimizer="adam", ...)`` wraps the
  optimizer in unimp's LossScaleOptimizer with the policy's loss scale (seed 004's code). A
  functional or subclassed ``tf.keras.Model`` is Keras 3's own: its ``compile`` wraps only
  ``"mixed_float16"``, in Keras's LossScaleOptimizer (the same rule without the floor of 1),
  and reads no policy's loss scale; pass it ``LossScaleOptimizer(opt, policy.loss_scale)``.

Nothing is printed where the old call means what unimp does. Where it meant something else,
one ``DeprecationWarning`` names the modern call: ``enable_mixed_precision_graph_rewrite``
(TensorFlow's graph rewrite is gone: here it sets the ``mixed_float16`` policy for the layers
built after it and wraps the optimizer).
"""

from __future__ import annotations

import math
import sys
import types
import warnings
from typing import Any

import keras
import tensorflow as _tf

from unimp.backends.tensorflow.optimizer import LossScaleOptimizer as _UnimpLossScaleOptimizer
from unimp.loss_scale import DynamicLossScale as _Dynamic
from unimp.loss_scale import StaticLossScale as _Static
from unimp.loss_scale.config import LossScaleConfig

__all__ = [
    "DynamicLossScale",
    "FixedLossScale",
    "LossScaleOptimizer",
    "Policy",
    "enable_mixed_precision_graph_rewrite",
    "global_policy",
    "set_policy",
    "tf",
]


class DynamicLossScale:
    """``tf.mixed_precision.experimental.DynamicLossScale``: TensorFlow 2.x's dynamic rule.

    Args:
        initial_loss_scale: the first scale (2**15).
        increment_period: finite steps before the scale grows (2000).
        multiplier: growth factor; an overflow divides by it (2.0). The scale never goes
            below 1, as TensorFlow's.

    Raises:
        ValueError: a value the rule cannot take (from :class:`unimp.DynamicLossScale`).
    """

    def __init__(self, initial_loss_scale: float = 2.0**15, increment_period: int = 2000, multiplier: float = 2.0) -> None:
        self.config = _Dynamic.preset(
            "tf_keras",
            init_scale=float(initial_loss_scale),
            growth_interval=increment_period,
            growth_factor=float(multiplier),
            backoff_factor=1.0 / float(multiplier),
        )
        self.initial_loss_scale, self.increment_period, self.multiplier = (
            float(initial_loss_scale), int(increment_period), float(multiplier),
        )  # fmt: skip


class FixedLossScale:
    """``tf.mixed_precision.experimental.FixedLossScale``: a static loss scale.

    Raises:
        ValueError: not a finite number > 0.
    """

    def __init__(self, loss_scale_value: float) -> None:
        self.config = _Static(loss_scale_value)


def _config(loss_scale: Any, what: str) -> LossScaleConfig | None:
    """The unimp config an old ``loss_scale`` argument names (None: no loss scaling)."""
    if loss_scale is None:
        return None
    if isinstance(loss_scale, (DynamicLossScale, FixedLossScale)):
        return loss_scale.config
    if isinstance(loss_scale, LossScaleConfig):
        return loss_scale
    if loss_scale == "dynamic":
        return _Dynamic.preset("tf_keras")
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not math.isfinite(loss_scale) or loss_scale <= 0:
            raise ValueError(f"{what}: a loss scale must be a finite number > 0, got {loss_scale!r}.")
        return _Static(float(loss_scale))
    raise ValueError(
        f"{what}: loss_scale must be 'dynamic', a number, a DynamicLossScale / FixedLossScale or "
        f"None, got {loss_scale!r}."
    )


@keras.saving.register_keras_serializable(package="unimp.compat")
class Policy(keras.DTypePolicy):
    """``tf.keras.mixed_precision.experimental.Policy``: a Keras dtype policy with the old
    ``loss_scale`` argument (see the module docstring).

    Args:
        name: a Keras policy name (``"mixed_float16"``, ``"mixed_bfloat16"``, ``"float32"``,
            ...).
        loss_scale: ``"auto"`` (default), ``"dynamic"``, a number, a :class:`DynamicLossScale`
            / :class:`FixedLossScale`, or ``None``.

    Raises:
        ValueError: an unknown policy name (Keras's message) or a bad ``loss_scale``.
    """

    def __init__(self, name: str, loss_scale: Any = "auto") -> None:
        super().__init__(name)
        self._default = isinstance(loss_scale, str) and loss_scale == "auto"
        if self._default:
            loss_scale = "dynamic" if name == "mixed_float16" else None
        self._loss_scale = _config(loss_scale, f"Policy({name!r})")

    @property
    def loss_scale(self) -> LossScaleConfig | None:
        """The policy's loss scale as a unimp config, or None (no loss scaling)."""
        return self._loss_scale

    def get_config(self) -> dict[str, Any]:
        ls = self._loss_scale
        return {"name": self.name, "loss_scale": "auto" if self._default else (None if ls is None else ls.to_dict())}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Policy:
        from unimp.loss_scale import loss_scale_from_dict

        ls = config.get("loss_scale", "auto")
        return cls(config["name"], ls if ls in ("auto", None) else loss_scale_from_dict(ls))


def set_policy(policy: Any) -> None:
    """``tf.keras.mixed_precision.experimental.set_policy``: sets Keras's global dtype policy
    (a :class:`Policy`, a Keras ``DTypePolicy`` or a policy name); layers built after it take
    it, and ``tf.keras.Sequential(...).compile`` its loss scale (:class:`Sequential`)."""
    if isinstance(policy, str):
        policy = Policy(policy)
    if not isinstance(policy, keras.DTypePolicy):
        raise TypeError(f"set_policy takes a Policy or a policy name, got {type(policy).__name__}.")
    keras.config.set_dtype_policy(policy)


def global_policy() -> Any:
    """``tf.keras.mixed_precision.experimental.global_policy``: Keras's global dtype policy."""
    return keras.config.dtype_policy()


def LossScaleOptimizer(optimizer: Any, loss_scale: Any) -> _UnimpLossScaleOptimizer:  # noqa: N802 (TF's name)
    """``tf.keras.mixed_precision.experimental.LossScaleOptimizer(optimizer, loss_scale)``:
    unimp's LossScaleOptimizer with that loss scale (``"dynamic"``: TensorFlow 2.x's rule).

    Raises:
        TypeError: not a Keras optimizer (a ``tf.compat.v1.train`` optimizer is named).
        ValueError: a bad ``loss_scale``.
    """
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"LossScaleOptimizer wraps a Keras optimizer (tf.keras.optimizers.Adam(...)), got "
            f"{type(optimizer).__name__}; TensorFlow 1's tf.train optimizers have no Keras 3 "
            "equivalent here: use tf.keras.optimizers.Adam(learning_rate=...)."
        )
    config = _config(loss_scale, "LossScaleOptimizer")
    return _UnimpLossScaleOptimizer(optimizer, loss_scale="none" if config is None else config)


def enable_mixed_precision_graph_rewrite(opt: Any, loss_scale: Any = "dynamic") -> _UnimpLossScaleOptimizer:
    """``tf.train.experimental.enable_mixed_precision_graph_rewrite``: the ``mixed_float16``
    policy for the layers built after the call, and ``opt`` wrapped in unimp's
    LossScaleOptimizer with ``loss_scale``; warns (``DeprecationWarning``) that TensorFlow's
    graph rewrite is gone and names the modern calls.

    Returns:
        The wrapped optimizer (compile the model with it, as the old code does).
    """
    wrapped = LossScaleOptimizer(opt, loss_scale)
    warnings.warn(
        "enable_mixed_precision_graph_rewrite was removed from TensorFlow (2.11): here it sets the "
        "mixed_float16 dtype policy, which applies to layers built after this call, and wraps the "
        "optimizer in unimp's LossScaleOptimizer. Write: mp = unimp.mixed_precision('mixed_float16', "
        "backend='tensorflow'); with mp.autocast(): model = ...; model, opt = mp.prepare(model, opt, "
        "loss=...).",
        DeprecationWarning,
        stacklevel=2,
    )
    keras.config.set_dtype_policy(Policy("mixed_float16"))
    return wrapped


@keras.saving.register_keras_serializable(package="unimp.compat")
class Sequential(keras.Sequential):
    """``tf.keras.Sequential`` whose ``compile`` follows the model's :class:`Policy`, as
    TensorFlow 2.1-2.3's did: the optimizer is wrapped in unimp's LossScaleOptimizer with the
    policy's ``loss_scale`` (TensorFlow 2.x's dynamic rule for ``"mixed_float16"``); without
    one, or with another policy, ``compile`` is Keras's own."""

    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        policy = self.dtype_policy
        config = getattr(policy, "loss_scale", None) if isinstance(policy, Policy) else None
        if config is not None and not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            optimizer = LossScaleOptimizer(optimizer, config)
        super().compile(optimizer, *args, **kwargs)

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compiles a loaded model as it was saved (Keras skips a custom ``compile``)."""
        from keras.src.saving import serialization_lib

        self.compile(**serialization_lib.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)


class _Namespace(types.ModuleType):
    """A module that reads as ``real`` with some names replaced."""

    def __init__(self, name: str, real: Any, **names: Any) -> None:
        super().__init__(name)
        self._real = real
        self.__dict__.update(names)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self._real)) | {k for k in self.__dict__ if not k.startswith("_")})


#: this module, as ``tf.keras.mixed_precision.experimental``
experimental = sys.modules[__name__]
#: TensorFlow with the experimental API put back (see the module docstring)
tf = _Namespace(
    "tensorflow",
    _tf,
    keras=_Namespace(
        "tensorflow.keras", _tf.keras, Sequential=Sequential,
        models=_Namespace("tensorflow.keras.models", _tf.keras.models, Sequential=Sequential),
        mixed_precision=_Namespace(
            "tensorflow.keras.mixed_precision", _tf.keras.mixed_precision, experimental=experimental,
        ),
    ),
    mixed_precision=_Namespace("tensorflow.mixed_precision", types.SimpleNamespace(), experimental=experimental),
    train=_Namespace("tensorflow.train", _tf.train, experimental=_Namespace(
        "tensorflow.train.experimental", _tf.train.experimental,
        enable_mixed_precision_graph_rewrite=enable_mixed_precision_graph_rewrite,
    )),
)  # fmt: skip
