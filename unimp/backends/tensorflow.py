"""TensorFlow / Keras 3 backend: Keras dtype policies, a LossScaleOptimizer on unimp's rule, a train step.

Targets Keras 3 on the TensorFlow backend (TensorFlow >= 2.16). The loss-scale rule is not written
here: :class:`LossScaleOptimizer` runs :func:`unimp.loss_scale.update_arrays` on TensorFlow tensors
(``tf.where`` and friends), so it traces under ``tf.function``, compiles under ``jit_compile`` and
matches the NumPy reference bit for bit.

Importing this module imports TensorFlow and Keras and checks that Keras runs on TensorFlow.
unimp itself sets no environment variable and writes no file (importing TensorFlow sets a few of
its own, e.g. ``TF2_BEHAVIOR``; Keras may create ``~/.keras/keras.json``).

Example:
    >>> import unimp
    >>> mp = unimp.mixed_precision("mixed_float16", backend="tensorflow")
    >>> with mp.autocast():
    ...     layer = keras.layers.Dense(4)
    >>> layer.compute_dtype, layer.variable_dtype
    ('float16', 'float32')
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import tensorflow as tf

try:
    import keras
except ImportError as e:  # pragma: no cover - keras ships with TensorFlow >= 2.16
    raise ImportError(
        'unimp\'s tensorflow backend needs Keras 3: pip install "unimp[tensorflow]"'
    ) from e

from unimp.backends._base import MixedPrecisionBase
from unimp.dtypes import canonical_dtype, device_support, parse_device
from unimp.loss_scale import (
    DynamicLossScale,
    LossScaleConfig,
    LossScaleState,
    ReplicaDesyncWarning,
    from_state_dict,
    loss_scale_from_dict,
    update_arrays,
)
from unimp.loss_scale import state_dict as _portable_state_dict
from unimp.step import StepResult, check_step_options, warn_half_optimizer_state

__all__ = [
    "LossScaleOptimizer",
    "MixedPrecision",
    "ReplicaDesyncWarning",
    "StepResult",
    "TrainStep",
    "all_finite",
    "cast_tree",
    "device_info",
    "framework_version",
    "keras_policy_name",
    "to_dtype",
]


def _check_keras() -> None:
    major = int(str(keras.__version__).split(".")[0])
    if major < 3:
        raise ImportError(
            f"unimp's tensorflow backend needs Keras 3, found keras {keras.__version__}. "
            'Install it with: pip install "unimp[tensorflow]" (TensorFlow >= 2.16 ships Keras 3).'
        )
    current = keras.backend.backend()
    if current != "tensorflow":
        other = (
            f" or use unimp's {current!r} backend for Keras on {current},"
            if current in ("jax", "torch")
            else ""
        )
        raise ImportError(
            f"unimp's tensorflow backend needs Keras on the TensorFlow backend, but Keras runs on "
            f"{current!r}. Set the environment variable KERAS_BACKEND=tensorflow before Keras is "
            "first imported (e.g. `KERAS_BACKEND=tensorflow python train.py`, or "
            f'"backend": "tensorflow" in ~/.keras/keras.json){other} and restart Python.'
        )


_check_keras()

from keras.src.saving import serialization_lib  # noqa: E402  (after the backend check)
from keras.src.utils import tracking  # noqa: E402

_TF_DTYPES = {
    "float64": tf.float64,
    "float32": tf.float32,
    "float16": tf.float16,
    "bfloat16": tf.bfloat16,
}


# --------------------------------------------------------------------------------------------
# Neutral helpers (COMMON_API)
# --------------------------------------------------------------------------------------------


def to_dtype(name: Any) -> tf.DType:
    """The ``tf.DType`` for a canonical dtype name.

    Args:
        name: anything :func:`unimp.dtypes.canonical_dtype` accepts (``"float16"``, ``"bf16"``,
            ``tf.float16``, ...).

    Returns:
        ``tf.float64``, ``tf.float32``, ``tf.float16`` or ``tf.bfloat16``.

    Raises:
        ValueError: not a supported floating dtype; the message lists the accepted names.

    Example:
        >>> to_dtype("bf16")
        tf.bfloat16
    """
    return _TF_DTYPES[canonical_dtype(name)]


def framework_version() -> str:
    """The installed TensorFlow version string (Keras's is in :func:`device_info`)."""
    return str(tf.__version__)


def _is_floating_array(x: Any) -> bool:
    if isinstance(x, (tf.Tensor, tf.Variable, keras.Variable)):
        return bool(tf.as_dtype(x.dtype).is_floating)
    if isinstance(x, tf.IndexedSlices):
        return bool(x.values.dtype.is_floating)
    if isinstance(x, (np.ndarray, np.generic)):
        return bool(np.issubdtype(x.dtype, np.floating)) or x.dtype.name == "bfloat16"
    return False


def _cast_leaf(x: Any, dtype: tf.DType) -> Any:
    if not _is_floating_array(x):
        return x
    if isinstance(x, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(x.values, dtype), x.indices, x.dense_shape)
    if isinstance(x, keras.Variable):
        x = x.value
    return tf.cast(x, dtype)


def cast_tree(tree: Any, dtype: Any) -> Any:
    """Casts the floating array leaves of a nested structure to ``dtype``.

    Floating ``tf.Tensor``, ``tf.Variable``, ``keras.Variable``, ``tf.IndexedSlices`` and NumPy
    floating arrays are cast (the result is a ``tf.Tensor``); integers, booleans, Python
    scalars, strings and other objects pass through unchanged (as Keras's ``_should_cast`` and
    jmp's ``_cast_floating_to``).

    Args:
        tree: a nest of lists, tuples, dicts and leaves (``tf.nest`` structure rules).
        dtype: the target floating dtype (any form :func:`to_dtype` accepts).

    Returns:
        A structure of the same shape.

    Raises:
        ValueError: ``dtype`` is not a supported floating dtype.

    Example:
        >>> out = cast_tree({"x": tf.ones(2), "ids": tf.constant([1, 2])}, "float16")
        >>> out["x"].dtype, out["ids"].dtype
        (tf.float16, tf.int32)
    """
    target = to_dtype(dtype)
    return tf.nest.map_structure(lambda x: _cast_leaf(x, target), tree)


def _finite_leaf(x: Any) -> tf.Tensor:
    if isinstance(x, tf.IndexedSlices):
        x = x.values
    return tf.reduce_all(tf.math.is_finite(x))


def all_finite(tree: Any) -> tf.Tensor:
    """A device bool scalar: every element of every floating leaf is finite.

    Non-floating leaves and ``None`` are ignored; an empty tree gives ``True``. Nothing is
    copied to the host.

    Args:
        tree: a nest of tensors, variables or arrays.

    Returns:
        ``tf.bool`` scalar tensor.

    Example:
        >>> bool(all_finite([tf.constant([1.0, float("inf")]), tf.constant([3])]))
        False
    """
    flags = [_finite_leaf(x) for x in tf.nest.flatten(tree) if _is_floating_array(x)]
    if not flags:
        return tf.constant(True)
    if len(flags) == 1:
        return flags[0]
    return tf.reduce_all(tf.stack(flags))


def device_info() -> list[dict[str, Any]]:
    """For ``unimp info``: each visible TensorFlow device with its kind, the half dtypes it
    runs and the recommended recipe, by the core rule :func:`unimp.dtypes.device_support`.

    Returns:
        ``[{"device", "kind", "float16", "bfloat16", "recommended"}, ...]`` (GPUs add
        ``name``).
    """
    out = []
    for dev in tf.config.list_physical_devices():
        kind = {"GPU": "gpu", "TPU": "tpu"}.get(dev.device_type.upper(), "cpu")
        details = tf.config.experimental.get_device_details(dev) or {} if kind == "gpu" else {}
        cc = details.get("compute_capability")
        entry: dict[str, Any] = {
            "device": dev.name,
            **device_support(kind, tuple(cc) if cc else None),
        }
        if details.get("device_name"):
            entry["name"] = details["device_name"]
        out.append(entry)
    return out


def keras_policy_name(param_dtype: Any, compute_dtype: Any) -> str | None:
    """The Keras ``DTypePolicy`` name for variables in ``param_dtype`` computing in ``compute_dtype``.

    Returns:
        ``"mixed_float16"`` / ``"mixed_bfloat16"`` (float32 variables, half compute), a dtype
        name when both are equal, or ``None`` when Keras has no such policy.
    """
    p, c = canonical_dtype(param_dtype), canonical_dtype(compute_dtype)
    if p == c:
        return p
    if p == "float32" and c in ("float16", "bfloat16"):
        return f"mixed_{c}"
    return None


# --------------------------------------------------------------------------------------------
# Loss-scale state on TF tensors
# --------------------------------------------------------------------------------------------


class _TFOps:
    """unimp.loss_scale.update_arrays's array namespace over TensorFlow tensors."""

    where = staticmethod(tf.where)
    minimum = staticmethod(tf.minimum)
    maximum = staticmethod(tf.maximum)
    isfinite = staticmethod(tf.math.is_finite)

    @staticmethod
    def f32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.float32)

    @staticmethod
    def i32(x: Any) -> tf.Tensor:
        return tf.cast(x, tf.int32)


def _divide(x: tf.Tensor, scale: tf.Tensor) -> tf.Tensor:
    """x / scale computed in float32 (float64 for float64 x), returned in x's dtype."""
    if x.dtype == tf.float32:
        return x / scale
    if x.dtype == tf.float64:
        return x / tf.cast(scale, tf.float64)
    return tf.cast(tf.cast(x, tf.float32) / scale, x.dtype)


def _unscale(g: Any, scale: tf.Tensor) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(_divide(g.values, scale), g.indices, g.dense_shape)
    return _divide(tf.convert_to_tensor(g), scale)


def _warn_resync() -> None:
    warnings.warn(
        "the replicas' loss-scale states differ (a checkpoint restored on one worker only?); "
        "re-synchronized every replica from replica 0. Restore loss-scale state on every worker "
        "(or under strategy.scope()) to avoid this.",
        ReplicaDesyncWarning,
        stacklevel=2,
    )


def _resolve_loss_scale(value: Any) -> LossScaleConfig:
    if value is None:
        return DynamicLossScale()
    return loss_scale_from_dict(value)


@keras.saving.register_keras_serializable(package="unimp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """A Keras optimizer that scales the loss and follows unimp's loss-scale rule.

    It subclasses ``keras.optimizers.LossScaleOptimizer`` (so ``model.compile`` does not wrap
    it a second time under a ``mixed_float16`` policy) but replaces its rule with unimp's
    reference algorithm, computed by :func:`unimp.loss_scale.update_arrays` on TF tensors:
    any growth and backoff factor, min and max scale, growth never to inf, skip counters, and
    the forward-overflow rule (a non-finite loss passed through :meth:`scale_loss` skips the
    step without lowering the scale). With ``DynamicLossScale.preset("keras")`` it gives the
    same scales and weights as Keras's own optimizer.

    The contract: :meth:`apply` / :meth:`apply_gradients` take gradients of the *scaled* loss
    and divide them by the scale exactly once (float32 division, as Keras). After
    :meth:`get_unscaled_gradients` (tf.keras 2's custom-loop API) the next apply takes its
    gradients as already unscaled, as tf.keras 2 did, so a tf.keras 2 loop runs unchanged.

    A skipped step (non-finite gradient or loss) leaves the variables and the whole inner
    optimizer state, ``iterations`` (hence any learning-rate schedule) included, unchanged.
    Works eagerly, in ``model.fit``, in custom ``tf.GradientTape`` loops, inside
    ``tf.function`` and under ``jit_compile``. Under a ``tf.distribute`` strategy that needs
    ``merge_call`` (MirroredStrategy, MultiWorkerMirroredStrategy) the finite flags are
    summed over every replica before the decision, so an overflow on any replica skips the
    step on all (Keras's own optimizer reads the flag of the first replica only), and
    replicas whose loss-scale state differs are re-synchronized from replica 0 with a
    :class:`ReplicaDesyncWarning`.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap; its ``loss_scale_factor``
            must be ``None``.
        loss_scale: a loss-scale config, ``"dynamic"``, a number (static), ``"none"``, or a
            ``to_dict()`` dict; ``None`` is unimp's ``DynamicLossScale()``.
        name: optimizer name.
        initial_scale, dynamic_growth_steps: Keras's arguments, for drop-in use: they mean
            ``DynamicLossScale.preset("keras", init_scale=..., growth_interval=...)``; not
            together with ``loss_scale``.

    Attributes:
        dynamic_scale: float32 ``keras.Variable``, the scale of the next step (as Keras).
        counter, consecutive_skips, total_skips: int32 ``keras.Variable``s (the unimp state).
        loss_scale_config: the loss-scale config.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras optimizer, or an unknown argument.
        ValueError: ``inner_optimizer`` is already loss-scaled or has ``loss_scale_factor``
            set, a bad loss-scale config, or ``loss_scale`` together with Keras's arguments.

    Example:
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=1024.0)
        >>> w = keras.Variable(1.0)
        >>> with tf.GradientTape() as tape:
        ...     loss = opt.scale_loss(0.5 * w * w)
        >>> _ = opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))
        >>> float(w.numpy())
        0.8999999761581421
    """

    def __init__(
        self,
        inner_optimizer: Any,
        loss_scale: Any = None,
        name: str | None = None,
        *,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(
                f"LossScaleOptimizer got unexpected argument(s) {sorted(kwargs)}; set options such as "
                "learning_rate or clipnorm on the inner optimizer."
            )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "LossScaleOptimizer needs a keras.optimizers.Optimizer instance, got "
                f"{type(inner_optimizer).__name__}; e.g. LossScaleOptimizer(keras.optimizers.Adam())."
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "inner_optimizer is already a LossScaleOptimizer (the loss would be scaled twice); "
                "pass its .inner_optimizer instead."
            )
        if getattr(inner_optimizer, "loss_scale_factor", None) is not None:
            raise ValueError(
                f"inner_optimizer has loss_scale_factor={inner_optimizer.loss_scale_factor!r}: the "
                "gradients would be unscaled twice. Create it with loss_scale_factor=None and give "
                "the scale to LossScaleOptimizer(loss_scale=...)."
            )
        if initial_scale is not None or dynamic_growth_steps is not None:
            if loss_scale is not None:
                raise ValueError(
                    "give either loss_scale= or Keras's initial_scale=/dynamic_growth_steps=, not both."
                )
            overrides = {}
            if initial_scale is not None:
                overrides["init_scale"] = initial_scale
            if dynamic_growth_steps is not None:
                overrides["growth_interval"] = dynamic_growth_steps
            config = DynamicLossScale.preset("keras", **overrides)
        else:
            config = _resolve_loss_scale(loss_scale)
        # Everything is validated: from here on nothing can fail on the user's input.
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self._loss_scale_config = config
        self.dynamic_scale = self.add_variable(
            shape=(),
            dtype="float32",
            initializer=keras.initializers.Constant(config.initial_scale()),
            name="dynamic_scale",
        )
        self.counter = self.add_variable(shape=(), dtype="int32", name="counter")
        self.consecutive_skips = self.add_variable(
            shape=(), dtype="int32", name="consecutive_skips"
        )
        self.total_skips = self.add_variable(shape=(), dtype="int32", name="total_skips")
        self._create_untracked_state()

    @tracking.no_automatic_dependency_tracking
    def _create_untracked_state(self) -> None:
        # Non-finite losses seen by scale_loss since the last apply (not checkpointed). A
        # float32 count summed over replicas, so under a tf.distribute strategy a forward
        # overflow on any replica is seen by all.
        with keras.name_scope(self.name, caller=self):
            self._bad_losses = tf.Variable(
                0.0,
                trainable=False,
                name="pending_bad_losses",
                synchronization=tf.VariableSynchronization.ON_WRITE,
                aggregation=tf.VariableAggregation.SUM,
            )
        # Set by get_unscaled_gradients (Python state, so it is read when a tf.function is
        # traced): the next apply takes its gradients as already unscaled (tf.keras 2's contract).
        self._gradients_unscaled = False
        # Who traced the update (a TrainStep's id, or None for any other tf.function / fit):
        # the config is baked into those graphs as constants, so load_state_dict may no longer
        # swap the parts of it the update uses (see there).
        self._traced_by: set[int | None] = set()
        self._tracer: int | None = None

    # -- configuration ---------------------------------------------------------------------

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The unimp loss-scale config (static)."""
        return self._loss_scale_config

    @property
    def loss_scale(self) -> tf.Tensor:
        """The current scale, a float32 scalar tensor (tf.keras 2's ``loss_scale``)."""
        return tf.convert_to_tensor(self.dynamic_scale)

    @property
    def dynamic(self) -> bool:
        """True for a dynamic loss scale (tf.keras 2's ``dynamic``)."""
        return bool(self._loss_scale_config.dynamic)

    @property
    def initial_scale(self) -> float:
        """The scale before the first step."""
        return float(self._loss_scale_config.initial_scale())

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Keras's name for ``growth_interval`` (``None`` for static or disabled scales)."""
        return getattr(self._loss_scale_config, "growth_interval", None)

    # -- building --------------------------------------------------------------------------

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list: list[Any]) -> None:
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        # Keras makes the slots in each variable's dtype: float16 moments for float16 weights
        eps = getattr(self.inner_optimizer, "epsilon", None)
        if eps is not None and any(
            keras.backend.standardize_dtype(v.dtype) == "float16" and v.trainable for v in var_list
        ):
            try:  # a float or a NumPy scalar; anything else is not Adam-like
                eps = float(eps)
            except (TypeError, ValueError):
                eps = None
            if eps is not None:
                warn_half_optimizer_state(type(self.inner_optimizer).__name__, eps)
        keras.optimizers.Optimizer.build(self, var_list)

    def _ensure_built(self, trainable_variables: list[Any] | None) -> None:
        if self.built:
            return
        if trainable_variables is None:
            raise ValueError(
                "the optimizer is not built: pass trainable_variables to apply(), use "
                "apply_gradients(zip(grads, variables)), or call optimizer.build(variables) first."
            )
        with keras.name_scope(self.name, caller=self):
            self.build(trainable_variables)
        self.built = True

    # -- scaling ---------------------------------------------------------------------------

    def scale_loss(self, loss: Any) -> Any:
        """Multiplies the loss by the current scale, and records whether the loss is finite.

        The product is computed in float32 (float64 for a float64 loss), so a float16 loss
        does not overflow when scaled. A non-finite loss marks the next :meth:`apply` as a
        forward overflow: that step is skipped without lowering the scale.

        Args:
            loss: a floating scalar (or tensor) loss, or a zero-argument callable returning
                one (tf.keras 2 accepted callables; a callable is returned then).

        Returns:
            The scaled loss, float32 (float64 for a float64 loss).

        Raises:
            TypeError: ``loss`` is not floating.
        """
        if callable(loss) and not tf.is_tensor(loss):
            return lambda: self.scale_loss(loss())
        loss = tf.convert_to_tensor(loss)
        if not loss.dtype.is_floating:
            raise TypeError(f"scale_loss needs a floating loss, got {loss.dtype.name}.")
        wide = tf.float64 if loss.dtype == tf.float64 else tf.float32
        loss = tf.cast(loss, wide)
        self._bad_losses.assign_add(
            tf.cast(tf.logical_not(tf.reduce_all(tf.math.is_finite(loss))), tf.float32)
        )
        return loss * tf.cast(self.dynamic_scale, wide)

    def get_scaled_loss(self, loss: Any) -> Any:
        """tf.keras 2's name for :meth:`scale_loss`."""
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads: Any) -> list[Any]:
        """Divides gradients of the scaled loss by the current scale (tf.keras 2's API).

        As in tf.keras 2, the next :meth:`apply` / :meth:`apply_gradients` then takes its
        gradients as unscaled and does not divide them again, also when they were transformed
        in between (clipped, for example). Call both in the same step (inside one
        ``tf.function`` when compiled).

        Args:
            grads: a list of gradients (tensors, ``tf.IndexedSlices`` or ``None``).

        Returns:
            A list of the same length; ``None`` entries stay ``None``.
        """
        scale = tf.convert_to_tensor(self.dynamic_scale)
        out = []
        for g in grads:
            if g is None:
                out.append(None)
                continue
            out.append(_unscale(g, scale))
        self._gradients_unscaled = True
        return out

    def _unscale_for(self, g: Any, v: Any, scale: tf.Tensor, already: bool) -> Any:
        if g is None or already or self._overwrite_variable_with_gradient(v):
            return g
        return _unscale(g, scale)

    # -- the step --------------------------------------------------------------------------

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Unscales the gradients once, applies them unless non-finite, updates the scale.

        Args:
            grads: gradients of the scaled loss (or of :meth:`get_unscaled_gradients`), one per
                variable.
            trainable_variables: the variables; needed on the first call unless built.

        Raises:
            ValueError: the number of gradients and variables differ, or the optimizer is not
                built and no variables are given.
        """
        grads = list(grads)
        if len(grads) == 0:
            return
        variables = None if trainable_variables is None else list(trainable_variables)
        known = (
            variables
            if variables is not None
            else (self._trainable_variables if self.built else None)
        )
        if known is not None and len(known) != len(grads):
            raise ValueError(
                f"got {len(grads)} gradients for {len(known)} variables; pass one gradient per variable."
            )
        self._ensure_built(variables)
        known = variables if variables is not None else self._trainable_variables
        scale = tf.convert_to_tensor(self.dynamic_scale)
        already, self._gradients_unscaled = self._gradients_unscaled, False
        unscaled = [
            self._unscale_for(g, v, scale, already) for g, v in zip(grads, known, strict=True)
        ]
        grads_finite = all_finite([g for g in unscaled if g is not None])
        loss_finite = tf.equal(tf.convert_to_tensor(self._bad_losses), 0.0)
        self._apply_step(unscaled, variables, grads_finite, loss_finite)

    def _apply_step(
        self, unscaled: list[Any], variables: list[Any] | None, grads_finite: Any, loss_finite: Any
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """The step after unscaling, on one replica or in a ``merge_call`` strategy's replica.

        Returns:
            ``(applied, consecutive_skips, total_skips, grads_finite, loss_finite)``, the flags
            reduced across replicas under a strategy.
        """
        replica = tf.distribute.get_replica_context()
        if (
            tf.distribute.has_strategy()
            and replica is not None
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            return self._replica_apply(replica, unscaled, variables, grads_finite, loss_finite)
        applied, consecutive, total = self._apply_unscaled(
            unscaled, variables, grads_finite, loss_finite
        )
        return applied, consecutive, total, grads_finite, loss_finite

    def _replica_apply(
        self,
        replica: Any,
        unscaled: list[Any],
        variables: list[Any] | None,
        grads_finite: Any,
        loss_finite: Any,
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        # MirroredStrategy & co: the inner optimizer's apply calls merge_call, which may not run
        # inside a tf.cond in replica context. Agree on one decision, then branch in
        # cross-replica context (as keras.optimizers.LossScaleOptimizer does), but reduce the
        # finite flags over every replica first: Keras reads them from the first replica only,
        # so an overflow on another replica would be applied there as inf / NaN.
        bad = tf.stack(
            [
                tf.cast(tf.logical_not(grads_finite), tf.float32),
                tf.cast(tf.logical_not(loss_finite), tf.float32),
            ]
        )
        bad = replica.all_reduce("sum", bad)
        grads_finite, loss_finite = tf.equal(bad[0], 0.0), tf.equal(bad[1], 0.0)
        # Replicas whose loss-scale state differs (a checkpoint restored on one worker only)
        # are re-synchronized from replica 0, with a warning: the update below reads the
        # primary (replica 0) copy in cross-replica context and assigns it to every replica.
        mine = tf.stack(
            [tf.cast(tf.convert_to_tensor(v), tf.float64) for v in self._state_variables()]
        )
        everyone = replica.all_gather(mine[None], axis=0)
        differ = tf.reduce_any(tf.not_equal(everyone, everyone[:1]))
        applied, consecutive, total = replica.merge_call(
            self._cross_replica_apply,
            args=(unscaled, variables, grads_finite, loss_finite, differ),
        )
        return applied, consecutive, total, grads_finite, loss_finite

    def _state_variables(self) -> tuple[Any, Any, Any, Any]:
        return self.dynamic_scale, self.counter, self.consecutive_skips, self.total_skips

    def _cross_replica_apply(
        self,
        distribution: Any,
        unscaled: Any,
        variables: Any,
        grads_finite: Any,
        loss_finite: Any,
        differ: Any,
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        first = distribution.experimental_local_results

        def warn() -> None:
            tf.py_function(_warn_resync, [], [])

        tf.cond(first(differ)[0], warn, lambda: None)

        def apply_inner() -> None:
            distribution.extended.call_for_each_replica(
                self.inner_optimizer.apply,
                args=(unscaled,),
                kwargs={"trainable_variables": variables},
            )

        return self._update_state(first(grads_finite)[0], first(loss_finite)[0], apply_inner)

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """``apply(grads, variables)`` from ``(gradient, variable)`` pairs (tf.keras 2 / Keras API).

        Returns:
            The inner optimizer's ``iterations`` (as tf.keras 2 did).
        """
        pairs = list(grads_and_vars)
        if pairs:
            grads, variables = zip(*pairs, strict=True)
            self.apply(list(grads), list(variables))
        return self.iterations

    def _apply_unscaled(
        self, unscaled: list[Any], variables: list[Any] | None, grads_finite: Any, loss_finite: Any
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        """Runs unimp's rule on the device, applies the inner optimizer when the step is clean.

        Returns:
            ``(applied, consecutive_skips, total_skips)`` after the step (device tensors).
        """

        def apply_inner() -> None:
            self.inner_optimizer.apply(unscaled, trainable_variables=variables)

        return self._update_state(grads_finite, loss_finite, apply_inner)

    def _update_state(
        self, grads_finite: Any, loss_finite: Any, apply_inner: Callable[[], None]
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
        grads_finite = tf.convert_to_tensor(grads_finite, tf.bool)
        loss_finite = tf.convert_to_tensor(loss_finite, tf.bool)
        applied = tf.logical_and(grads_finite, loss_finite)
        if tf.inside_function():
            self._traced_by.add(self._tracer)
        scale, counter, consecutive, total = update_arrays(
            _TFOps,
            self._loss_scale_config,
            tf.convert_to_tensor(self.dynamic_scale),
            tf.convert_to_tensor(self.counter),
            tf.convert_to_tensor(self.consecutive_skips),
            tf.convert_to_tensor(self.total_skips),
            grads_finite,
            loss_finite,
        )
        # A skipped step must not touch the inner optimizer at all (its iterations included).
        tf.cond(applied, apply_inner, lambda: None)
        self.dynamic_scale.assign(scale)
        self.counter.assign(counter)
        self.consecutive_skips.assign(consecutive)
        self.total_skips.assign(total)
        self._bad_losses.assign(0.0)
        return applied, consecutive, total

    def stateless_apply(
        self, optimizer_variables: Any, grads: Any, trainable_variables: Any
    ) -> Any:
        raise NotImplementedError(
            "unimp's LossScaleOptimizer is stateful on the TensorFlow backend; use apply() or "
            "apply_gradients()."
        )

    # -- state -----------------------------------------------------------------------------

    def _state(self) -> LossScaleState:
        return LossScaleState(
            np.float32(self.dynamic_scale.numpy()),
            int(self.counter.numpy()),
            int(self.consecutive_skips.numpy()),
            int(self.total_skips.numpy()),
        )

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state in unimp's portable format (the same in every backend).

        Returns:
            ``unimp.loss_scale.state_dict(config, state)``: JSON-able.
        """
        return _portable_state_dict(self._loss_scale_config, self._state())

    def load_state_dict(self, state_dict: Any) -> None:
        """Loads a portable loss-scale state: the saved config replaces this optimizer's, as in
        every unimp backend (and as torch.amp.GradScaler.load_state_dict takes the saved
        factors and interval). Validated before anything is assigned.

        TensorFlow bakes the config into a traced step as constants, so a different config is
        adopted only while no ``tf.function`` has traced this optimizer's update yet (the usual
        resume: build, load, train). :meth:`TrainStep.load_state_dict` adopts it at any time
        and retraces its step.

        Raises:
            ValueError: a malformed or foreign state_dict, or one saved with a different
                loss-scale config after a ``tf.function`` traced this optimizer (the message
                shows both configs and the fix).
        """
        config, state = from_state_dict(state_dict)
        self._check_retrace(config, self._traced_by, "TrainStep.load_state_dict (which retraces)")
        self._adopt(config, state)

    def _check_retrace(self, config: LossScaleConfig, traced_by: set, fix: str) -> None:
        """Raises when ``config`` differs from the current one in a field the traced update
        uses and a tf.function in ``traced_by`` has the current one built in; changes nothing."""
        if traced_by and _traced_fields(config) != _traced_fields(self._loss_scale_config):
            raise ValueError(
                f"the state_dict was saved with loss scale {config.to_dict()}, this optimizer uses "
                f"{self._loss_scale_config.to_dict()} and a traced tf.function (model.fit, or "
                f"your own) has that config built in: load the state before the first step, "
                f"load it through {fix}, or create the optimizer with loss_scale=<the saved "
                "config>."
            )

    def _adopt(self, config: LossScaleConfig, state: LossScaleState) -> None:
        self._loss_scale_config = config
        self.dynamic_scale.assign(np.float32(state.scale))
        self.counter.assign(np.int32(state.counter))
        self.consecutive_skips.assign(np.int32(state.consecutive_skips))
        self.total_skips.assign(np.int32(state.total_skips))

    # -- serialization ---------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
            "loss_scale": self._loss_scale_config.to_dict(),
        }

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


def _as_device(device: Any) -> str:
    """``"cpu"``, ``"cuda:1"``, ``"gpu"``, ``"/GPU:0"``, a full device name, a
    ``tf.config.LogicalDevice`` or ``tf.DeviceSpec``, as ``"/CPU:N"`` / ``"/GPU:N"``.

    Checked against the physical devices only: listing logical ones would start TensorFlow's
    runtime, after which virtual devices and memory growth can no longer be configured. The
    logical device is checked when the step first runs (:func:`_check_placed`)."""
    if isinstance(device, tf.DeviceSpec):
        device = device.to_string()
    kind, index = parse_device(getattr(device, "name", device))  # the core's reading
    if kind == "tpu":
        raise ValueError(f"device={device!r}: unimp's TensorFlow backend runs on 'cpu' or 'gpu'.")
    kinds = {"cpu": "CPU", "gpu": "GPU"}
    name = f"/{kinds[kind]}:{index or 0}"
    if kind == "gpu" and (index or 0) >= len(tf.config.list_physical_devices("GPU")):
        physical = [d.device_type for d in tf.config.list_physical_devices()]
        have = ", ".join(f"/{t}:{i}" for t in dict.fromkeys(physical) for i in range(physical.count(t)))
        raise ValueError(f"device={device!r}: TensorFlow has no {name} here (it has {have}).")
    return name


_PLACED_OK: set[str] = set()


def _check_placed(name: str) -> None:
    """Once per name, when work is first placed: the logical device exists (TensorFlow would
    otherwise fall back to another device silently, with soft placement)."""
    if name in _PLACED_OK:
        return
    have = [d.name for d in tf.config.list_logical_devices()]
    if "/device:" + name[1:] not in have:
        listed = ", ".join(h.replace("/device:", "/") for h in have)
        raise ValueError(f"device {name}: TensorFlow has no such device here (it has {listed}).")
    _PLACED_OK.add(name)


def _traced_fields(config: LossScaleConfig) -> dict[str, Any]:
    """The parts of a config that a traced update has built in: the kind and the dynamic
    rule's factors, interval and bounds. Not ``init_scale`` (only the start state) nor
    ``max_consecutive_skips`` (checked on the host), nor a static scale's value (the update
    reads the scale variable)."""
    d = config.to_dict()
    for key in ("init_scale", "max_consecutive_skips", "scale"):
        d.pop(key, None)
    return d


def _wrap_optimizer(optimizer: Any, config: LossScaleConfig) -> LossScaleOptimizer:
    """unimp's LossScaleOptimizer around ``optimizer`` (unwrapping a Keras one)."""
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, LossScaleOptimizer):
        if optimizer.loss_scale_config != config:
            raise ValueError(
                f"the optimizer's loss scale {optimizer.loss_scale_config.to_dict()} differs from the "
                f"recipe's {config.to_dict()}; pass its .inner_optimizer to let the recipe wrap it."
            )
        return optimizer
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        optimizer = optimizer.inner_optimizer
    return LossScaleOptimizer(optimizer, config)


# --------------------------------------------------------------------------------------------
# The train step
# --------------------------------------------------------------------------------------------


def _to_host(x: Any) -> Any:
    return x.numpy() if hasattr(x, "numpy") else x


def _batch_to_tensors(batch: Any) -> Any:
    """NumPy leaves as tensors (one trace per shape/dtype, not per value)."""
    if tf.is_tensor(batch) or (
        type(batch) in (tuple, list) and all(tf.is_tensor(x) for x in batch)
    ):
        return batch  # the usual batch: nothing to convert (tf.nest costs ~20 us per step)

    def conv(x: Any) -> Any:
        if isinstance(x, (np.ndarray, np.generic)):
            return tf.convert_to_tensor(x)
        return x

    return tf.nest.map_structure(conv, batch)


def _times(g: Any, factor: tf.Tensor) -> Any:
    """g * factor in g's dtype (``None`` and ``tf.IndexedSlices`` handled)."""
    if g is None:
        return None
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(
            g.values * tf.cast(factor, g.values.dtype), g.indices, g.dense_shape
        )
    return g * tf.cast(factor, g.dtype)


def _strategy_of(variables: list[Any]) -> Any:
    """The tf.distribute strategy holding ``variables``, or None (plain variables)."""
    value = getattr(variables[0], "value", variables[0])
    if isinstance(value, tf.distribute.DistributedValues):
        return value.distribute_strategy
    return None


def _global_norm(grads: list[Any]) -> tf.Tensor:
    squares = [
        tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(g), tf.float32)))
        for g in grads
        if g is not None
    ]
    if not squares:
        return tf.constant(0.0, tf.float32)
    return tf.sqrt(tf.add_n(squares))


class TrainStep:
    """A compiled training step: ``step(batch) -> StepResult``. Built by
    :meth:`MixedPrecision.train_step`; see there.

    Attributes:
        optimizer: the :class:`LossScaleOptimizer` holding the loss-scale state.
        function: the ``tf.function`` (traced once per batch signature).
    """

    def __init__(
        self,
        model: Any,
        optimizer: LossScaleOptimizer,
        loss_fn: Callable[[Any, Any], Any],
        grad_accum_steps: int,
        max_grad_norm: float | None,
        jit_compile: bool,
        device: str | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        variables = list(model.trainable_variables)
        optimizer._ensure_built(variables)
        self._variables = variables
        self.strategy = _strategy_of(variables)
        if self.strategy is not None and device is not None:
            raise ValueError(
                f"device={device!r} and a tf.distribute strategy both place the step: bind the "
                "recipe without a device (the strategy says where the replicas run)."
            )
        if self.strategy is not None and jit_compile:
            raise ValueError(
                "jit_compile=True is not supported under a tf.distribute strategy (its "
                "merge_call cannot be compiled by XLA); use jit_compile=False."
            )
        self._jit_compile = jit_compile
        self.function = self._make_function()

    def _make_function(self) -> Any:
        if self.strategy is None:
            return tf.function(self._step, jit_compile=self._jit_compile)
        return tf.function(self._distributed_step)

    def tracing_count(self) -> int:
        """How many times the step has been traced (1 after any number of same-signature calls)."""
        return int(self.function.experimental_get_tracing_count())

    def __call__(self, batch: Any) -> StepResult:
        if self.grad_accum_steps > 1:
            k = self.grad_accum_steps
            if not isinstance(batch, (list, tuple)) or len(batch) != k:
                got = (
                    f"{type(batch).__name__} of length {len(batch)}"
                    if isinstance(batch, (list, tuple))
                    else type(batch).__name__
                )
                raise ValueError(
                    f"with grad_accum_steps={k}, step(batch) takes a list of {k} micro-batches, got {got}."
                )
            batch = list(batch)
        batch = _batch_to_tensors(batch)
        if self.strategy is not None and not isinstance(batch, tf.distribute.DistributedValues):
            batch = self._split(batch)
        if self.device is None:
            raw = self.function(batch)
        else:
            _check_placed(self.device)
            with tf.device(self.device):
                raw = self.function(batch)
        return StepResult(raw, to_host=_to_host, config=self.optimizer.loss_scale_config)

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state in unimp's portable format."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Any) -> None:
        """Loads a portable loss-scale state; the saved config replaces the recipe's (as in
        every unimp backend). A different config retraces the step, which has the config
        built in; other tf.functions that traced the same optimizer keep the old one.

        Raises:
            ValueError: a bad or foreign state dict; nothing is changed.
        """
        opt = self.optimizer
        config, state = from_state_dict(state_dict)
        # this step retraces; a tf.function of anyone else (model.fit) would keep the old rule
        others = opt._traced_by - {id(self)}
        opt._check_retrace(config, others, "a new optimizer (that function keeps the old config)")
        retrace = _traced_fields(config) != _traced_fields(opt.loss_scale_config)
        opt._adopt(config, state)
        if retrace:
            opt._traced_by.discard(id(self))
            self.function = self._make_function()

    def _split(self, batch: Any) -> Any:
        """A global batch as per-replica slices along axis 0 (equal sizes)."""
        n = self.strategy.num_replicas_in_sync
        for x in tf.nest.flatten(batch):
            if tf.is_tensor(x) and (x.shape.rank == 0 or x.shape[0] % n):
                raise ValueError(
                    f"under {type(self.strategy).__name__} with {n} replicas, every tensor of "
                    f"the global batch is split along axis 0 into {n} equal parts; got shape "
                    f"{x.shape}. Use a global batch size divisible by {n}, or pass a batch from "
                    "strategy.experimental_distribute_dataset(...)."
                )

        def piece(ctx: Any) -> Any:
            i = ctx.replica_id_in_sync_group
            return tf.nest.map_structure(
                lambda x: tf.split(x, n)[i] if tf.is_tensor(x) else x, batch
            )

        return self.strategy.experimental_distribute_values_from_function(piece)

    # -- traced code -----------------------------------------------------------------------

    def _distributed_step(self, batch: Any) -> dict:
        opt = self.optimizer
        outer, opt._tracer = opt._tracer, id(self)  # the update runs in merge_call, out of _step
        try:
            per_replica = self.strategy.run(self._step, args=(batch,))
        finally:
            opt._tracer = outer
        first = self.strategy.experimental_local_results
        out = {k: None if v is None else first(v)[0] for k, v in per_replica.items()}
        # every field but the loss is the same on every replica; the loss is the mean
        out["loss"] = self.strategy.reduce("mean", per_replica["loss"], axis=None)
        return out

    def _finish(
        self, unscaled: list[Any], loss: tf.Tensor, loss_finite: tf.Tensor, scale: tf.Tensor
    ) -> dict:
        grads_finite = all_finite([g for g in unscaled if g is not None])
        replica = tf.distribute.get_replica_context() if self.strategy is not None else None
        if replica is not None and replica.num_replicas_in_sync > 1:
            # Keras's optimizer sums the gradients over replicas: give it local / n, so the
            # update is the mean gradient, as one device on the whole global batch.
            inv = tf.constant(1.0 / replica.num_replicas_in_sync, tf.float32)
            unscaled = [_times(g, inv) for g in unscaled]
        grad_norm = None
        if self.max_grad_norm is not None:
            # clipping acts on the unscaled gradients; the norm is reported before clipping.
            # Under a strategy it is the norm of the all-reduced gradient, the same on every
            # replica (clipping each replica by its own norm would not be clip(mean)).
            grad_norm = _global_norm(
                unscaled
                if replica is None or replica.num_replicas_in_sync == 1
                else replica.all_reduce("sum", [g for g in unscaled if g is not None])
            )
            limit = tf.constant(self.max_grad_norm, tf.float32)
            factor = limit / tf.maximum(grad_norm, limit)
            unscaled = [_times(g, factor) for g in unscaled]
        applied, consecutive, total, grads_finite, loss_finite = self.optimizer._apply_step(
            unscaled, self._variables, grads_finite, loss_finite
        )
        return {
            "loss": loss,
            "scale": scale,
            "applied": applied,
            "loss_finite": loss_finite,
            "grads_finite": grads_finite,
            "grad_norm": grad_norm,
            "consecutive_skips": consecutive,
            "total_skips": total,
        }

    def _scaled_grads(self, batch: Any, scale: tf.Tensor) -> tuple[list[Any], tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = tf.convert_to_tensor(self.loss_fn(self.model, batch))
            if not loss.dtype.is_floating:
                raise TypeError(f"loss_fn must return a floating loss, got {loss.dtype.name}.")
            if loss.shape.rank not in (None, 0):
                raise ValueError(
                    f"loss_fn must return a scalar loss, got shape {loss.shape}; reduce it (e.g. "
                    "tf.reduce_mean)."
                )
            loss32 = tf.cast(loss, tf.float32)
            scaled = loss32 * scale
        return tape.gradient(scaled, self._variables), loss32

    def _step(self, batch: Any) -> dict:
        opt = self.optimizer
        outer, opt._tracer = opt._tracer, id(self)  # runs while tracing: marks whose graph it is
        try:
            return self._step_body(batch)
        finally:
            opt._tracer = outer

    def _step_body(self, batch: Any) -> dict:
        scale = tf.identity(tf.convert_to_tensor(self.optimizer.dynamic_scale))
        if self.grad_accum_steps == 1:
            grads, loss32 = self._scaled_grads(batch, scale)
            unscaled = [None if g is None else _unscale(g, scale) for g in grads]
            return self._finish(unscaled, loss32, tf.math.is_finite(loss32), scale)
        # a window of k micro-batches: sum the scaled gradients in float32 from exact zeros,
        # take the mean, unscale once; the window is skipped when any micro-batch is non-finite
        k = self.grad_accum_steps
        total: list[Any] = [None] * len(self._variables)
        losses = []
        for micro in batch:
            grads, loss32 = self._scaled_grads(micro, scale)
            losses.append(loss32)
            for i, g in enumerate(grads):
                if g is not None:
                    g = tf.cast(tf.convert_to_tensor(g), tf.float32)
                    total[i] = g if total[i] is None else total[i] + g
        kf = tf.constant(float(k), tf.float32)
        unscaled = [
            None if t is None else tf.cast((t / kf) / scale, v.dtype)
            for t, v in zip(total, self._variables, strict=True)
        ]
        stacked = tf.stack(losses)
        return self._finish(
            unscaled, tf.reduce_mean(stacked), tf.reduce_all(tf.math.is_finite(stacked)), scale
        )


# --------------------------------------------------------------------------------------------
# MixedPrecision
# --------------------------------------------------------------------------------------------


def _output_layers(model: Any) -> list[Any]:
    """The layers producing a model's outputs (nested models searched), [] when unknown."""
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
        if not layers:
            return []
        last = layers[-1]
        return _output_layers(last) if isinstance(last, keras.Model) else [last]
    outputs = getattr(model, "_outputs", None) if isinstance(model, keras.Model) else None
    if not outputs:
        return [] if isinstance(model, keras.Model) else [model]
    found = []
    for t in tf.nest.flatten(outputs):
        history = getattr(t, "_keras_history", None)
        op = getattr(history, "operation", None) if history is not None else None
        if isinstance(op, keras.Model) and op is not model:
            found.extend(_output_layers(op))
        elif isinstance(op, keras.layers.Layer) and not isinstance(op, keras.layers.InputLayer):
            found.append(op)
    return list({id(x): x for x in found}.values())


class MixedPrecision(MixedPrecisionBase):
    """A recipe bound to Keras 3 on TensorFlow.

    Keras has no per-op autocast: every cast mode uses Keras's per-layer dtype policies
    (layers cast their float inputs and variables to the compute dtype, integer inputs are
    never cast, normalization layers compute their statistics in float32).

    Args:
        recipe: a :class:`~unimp.Recipe` or anything :func:`~unimp.get_recipe` accepts.
        device: where the model lives and the step runs: ``"cpu"``, ``"gpu"`` / ``"cuda"``
            with an optional ``":N"``, or a TensorFlow device name (``"/GPU:0"``); the same
            option as torch's. :meth:`autocast` also enters ``tf.device`` (layers built inside
            put their variables there) and :meth:`train_step` runs under it. ``None``
            (default): TensorFlow's own placement.

    Attributes:
        compute_dtype, param_dtype, output_dtype: ``tf.DType``.
        dtype_policy: the ``keras.DTypePolicy`` for the recipe (e.g. ``mixed_float16``).
        output_dtype_policy: the ``keras.DTypePolicy`` :meth:`prepare` gives output layers.

    Raises:
        ValueError: the policy has no Keras ``DTypePolicy`` (Keras stores variables either in
            the compute dtype or in float32 with half compute), naming the policies it has; or
            a device TensorFlow does not have (the message lists the ones it has).

    Example:
        >>> mp = MixedPrecision("mixed_bfloat16")
        >>> mp.dtype_policy.name, mp.compute_dtype
        ('mixed_bfloat16', tf.bfloat16)
    """

    _cast_tree = staticmethod(cast_tree)

    backend = "tensorflow"

    def __init__(self, recipe: Any = "mixed_float16", device: Any = None) -> None:
        resolved = None if device is None else _as_device(device)  # before anything is kept
        super().__init__(recipe)
        self._device = resolved
        p = self.policy
        name = keras_policy_name(p.param_dtype, p.compute_dtype)
        if name is None:
            raise ValueError(
                f"Keras has no dtype policy for {p}: it keeps variables in the compute dtype or in "
                "float32 with float16/bfloat16 compute. Use e.g. 'mixed_float16', 'mixed_bfloat16', "
                "'float32', 'bfloat16' or 'params=float32,compute=float16,output=float32'."
            )
        self._keras_name = name
        self._output_name = keras_policy_name(p.param_dtype, p.output_dtype)

    @property
    def device(self) -> str | None:
        """The bound TensorFlow device name (``"/CPU:0"``, ``"/GPU:1"``), or None."""
        return self._device

    def _placed(self) -> contextlib.AbstractContextManager:
        if self._device is None:
            return contextlib.nullcontext()
        _check_placed(self._device)
        return tf.device(self._device)

    @property
    def compute_dtype(self) -> tf.DType:
        """The compute dtype as a ``tf.DType``."""
        return to_dtype(self.policy.compute_dtype)

    @property
    def param_dtype(self) -> tf.DType:
        """The parameter (variable) dtype as a ``tf.DType``."""
        return to_dtype(self.policy.param_dtype)

    @property
    def output_dtype(self) -> tf.DType:
        """The output dtype as a ``tf.DType``."""
        return to_dtype(self.policy.output_dtype)

    @property
    def dtype_policy(self) -> Any:
        """The ``keras.DTypePolicy`` layers built in :meth:`autocast` get."""
        return keras.DTypePolicy(self._keras_name)

    @property
    def output_dtype_policy(self) -> Any:
        """The ``keras.DTypePolicy`` of output layers: variables in param dtype, compute in output dtype.

        Raises:
            ValueError: Keras cannot express it (e.g. bfloat16 variables with float32 output).
        """
        if self._output_name is None:
            raise ValueError(
                f"Keras has no dtype policy with variables in {self.policy.param_dtype} computing "
                f"in {self.policy.output_dtype}; pick an output_dtype equal to the param dtype or "
                "the compute dtype."
            )
        return keras.DTypePolicy(self._output_name)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[Any]:
        """Sets Keras's global dtype policy to :attr:`dtype_policy` inside the block (and
        enters ``tf.device`` of the bound device, if any).

        Layers constructed inside use the recipe's compute and variable dtypes. The previous
        global policy is restored on exit, also when an exception escapes.

        Yields:
            The ``keras.DTypePolicy`` in force.
        """
        previous = keras.config.dtype_policy()
        policy = self.dtype_policy
        keras.config.set_dtype_policy(policy)
        try:
            with self._placed():
                yield policy
        finally:
            keras.config.set_dtype_policy(previous)

    def loss_scale_optimizer(self, optimizer: Any) -> LossScaleOptimizer:
        """Wraps ``optimizer`` in unimp's :class:`LossScaleOptimizer` with the recipe's loss scale.

        A Keras ``LossScaleOptimizer`` is unwrapped first; an unimp one with the recipe's loss
        scale is returned as is.

        Raises:
            TypeError: not a Keras optimizer or optimizer name.
            ValueError: an unimp optimizer with a different loss scale.
        """
        if not isinstance(optimizer, (str, keras.optimizers.Optimizer)):
            raise TypeError(
                f"optimizer must be a keras.optimizers.Optimizer or a name like 'adam', got "
                f"{type(optimizer).__name__}."
            )
        return _wrap_optimizer(optimizer, self.loss_scale)

    def prepare(self, model: Any, optimizer: Any = None, **compile_kwargs: Any) -> tuple[Any, Any]:
        """Applies the recipe to a Keras model and optimizer.

        * The layers producing the model's outputs get :attr:`output_dtype_policy`, so the
          outputs come out in the output dtype and a final softmax runs in float32 under
          ``mixed_float16`` (a float16 softmax is a known source of NaN and poor accuracy).
          Hidden layers keep the policy they were built with: build the model inside
          :meth:`autocast` (a warning says so when the model's policy differs).
        * The optimizer is wrapped in unimp's :class:`LossScaleOptimizer` (not Keras's) with
          the recipe's loss scale; with ``compile_kwargs`` (``loss=``, ``metrics=``, ...) the
          model is compiled with it, so ``fit`` follows unimp's rule. A model already
          compiled with another optimizer is left alone, with a warning that says so.

        Args:
            model: a ``keras.Model`` (or layer) built inside :meth:`autocast`.
            optimizer: a Keras optimizer or name (``"adam"``), or ``None``.
            **compile_kwargs: passed to ``model.compile`` together with the wrapped optimizer.

        Returns:
            ``(model, optimizer)``: the same model, the wrapped optimizer (``None`` if none given).

        Raises:
            TypeError: ``model`` is not a Keras layer or model, or a bad optimizer.
            ValueError: compile arguments without an optimizer, or an output policy Keras
                cannot express. Nothing is changed when an error is raised.
        """
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"prepare needs a keras.Model, got {type(model).__name__}.")
        if optimizer is not None and not isinstance(optimizer, (str, keras.optimizers.Optimizer)):
            raise TypeError(
                f"optimizer must be a keras.optimizers.Optimizer, a name like 'adam', or None, got "
                f"{type(optimizer).__name__}."
            )
        if "optimizer" in compile_kwargs:
            raise TypeError(
                "pass the optimizer as prepare(model, optimizer, ...), not in compile arguments."
            )
        if compile_kwargs and optimizer is None:
            raise ValueError(
                "compile arguments need an optimizer: prepare(model, 'adam', loss=...)."
            )
        out_policy = self.output_dtype_policy
        wrapped = None if optimizer is None else self.loss_scale_optimizer(optimizer)
        if model.dtype_policy.name != self._keras_name and not self.policy.is_float32:
            warnings.warn(
                f"the model's dtype policy is {model.dtype_policy.name!r}, the recipe's is "
                f"{self._keras_name!r}: its layers were built outside mp.autocast() and keep their "
                "dtypes. Build the model inside `with mp.autocast():`.",
                stacklevel=2,
            )
        current = getattr(model, "optimizer", None)
        if (
            optimizer is None
            and current is not None
            and not isinstance(current, LossScaleOptimizer)
        ):
            warnings.warn(
                f"the model is compiled with {type(current).__name__}, so fit does not follow the "
                "recipe's loss scale. Compile through prepare instead: "
                "mp.prepare(model, optimizer, loss=..., metrics=...).",
                stacklevel=2,
            )
        layers = _output_layers(model)
        if not layers:
            warnings.warn(
                "cannot find the layers producing this model's outputs (a subclassed model?): its "
                "outputs are not cast. Give the output layer dtype=mp.output_dtype_policy.",
                stacklevel=2,
            )
        if compile_kwargs:  # first: a bad compile argument leaves the layers untouched
            model.compile(optimizer=wrapped, **compile_kwargs)
        for layer in layers:
            if layer.dtype_policy.name != out_policy.name:
                layer.dtype_policy = out_policy
        return model, wrapped

    def train_step(
        self,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        jit_compile: bool = False,
    ) -> TrainStep:
        """A ``tf.function`` training step with the recipe's loss scaling: ``step(batch) -> StepResult``.

        Each call computes ``loss_fn(model, batch)`` (a floating scalar, unscaled), the
        gradients of the loss times the scale, unscales them once, and applies them through
        the optimizer unless a gradient or the loss is non-finite. Rules shared by every
        backend: clipping (``max_grad_norm``, as ``tf.clip_by_global_norm``) acts on the
        unscaled gradients and ``grad_norm`` is reported before clipping; a non-finite loss
        skips the step without lowering the scale; a skipped step leaves the variables and the
        whole optimizer state (``iterations`` included) unchanged.

        With ``grad_accum_steps = k > 1`` each call takes a list of k micro-batches (the same
        call shape in every backend: one call is one optimizer step and one StepResult): their
        scaled gradients are summed in float32 from exact zeros, the mean is unscaled once and
        applied, and the whole window is skipped when any micro-batch is non-finite. ``loss``
        is the mean micro-batch loss.

        The step is traced once per batch signature (NumPy arrays are converted to tensors;
        Python numbers in the batch would retrace per value).

        Under a ``tf.distribute`` strategy (a model built in ``strategy.scope()``) each call
        runs ``strategy.run``: a global batch is split along axis 0 into equal per-replica
        parts (or pass a batch from ``strategy.experimental_distribute_dataset``);
        ``loss_fn`` returns the local mean loss and the update is the mean gradient, as one
        device on the global batch. The finite flags are reduced over the replicas (a
        non-finite gradient on any replica skips the step on all), clipping uses the norm of
        the all-reduced gradient, ``loss`` is the mean over replicas, and replicas whose
        loss-scale state differs are re-synchronized from replica 0 with a
        :class:`ReplicaDesyncWarning`. ``jit_compile`` is not supported there.

        Args:
            model: a built Keras model (``model.trainable_variables`` non-empty).
            optimizer: a Keras optimizer (wrapped in :class:`LossScaleOptimizer` with the
                recipe's loss scale) or an unimp :class:`LossScaleOptimizer` (used as is).
            loss_fn: ``loss_fn(model, batch) -> scalar loss``.
            grad_accum_steps: micro-batches per optimizer step, >= 1.
            max_grad_norm: ``None`` or a finite number > 0.
            jit_compile: compile the step with XLA.

        Returns:
            A :class:`TrainStep`; ``step.state_dict()`` / ``load_state_dict()`` hold the
            loss-scale state in the portable format.

        Raises:
            TypeError: ``loss_fn`` not callable, bad optimizer or model.
            ValueError: bad ``grad_accum_steps`` or ``max_grad_norm``, or an unbuilt model.
        """
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"train_step needs a keras.Model, got {type(model).__name__}.")
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}."
            )
        grad_accum_steps, max_grad_norm = check_step_options(grad_accum_steps, max_grad_norm)
        if not model.built or not model.trainable_variables:
            raise ValueError(
                "the model has no trainable variables yet: build it first (keras.Input in the "
                "model, model.build(input_shape), or call it on one batch)."
            )
        if isinstance(optimizer, LossScaleOptimizer):
            lso = optimizer
        else:
            lso = self.loss_scale_optimizer(optimizer)
        return TrainStep(
            model, lso, loss_fn, int(grad_accum_steps), max_grad_norm, bool(jit_compile),
            device=self._device,
        )
