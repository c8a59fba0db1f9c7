"""TensorFlow optimizer: :class:`LossScaleOptimizer`, a Keras 3 optimizer that holds the loss-scale
state and applies a step only when it is finite (a skipped step leaves the variables and the
inner optimizer's state unchanged), with tf.keras 2's ``get_scaled_loss`` / ``get_unscaled_gradients``, :class:`LossScaleCheck`, the
``model.fit`` callback that acts on its ``max_consecutive_skips`` and ``floor_action``, and
:class:`UpdateOps`, the array namespace of :mod:`unimp.rounding` (how a half parameter takes
its update).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.saving import serialization_lib  # after the backend check (package __init__)
from keras.src.utils import tracking

from unimp.backends.tensorflow.overflow import _warn_resync, all_finite
from unimp.backends.tensorflow.scaling import (
    LossScaleOps,
    _count_skipped,
    _ensure_extra,
    _extra,
    _traced_fields,
    _unscale,
)
from unimp.keras.optimizer import (  # export / import_update_state: the backend's public names
    Float32View,
    HalfUpdates,
    UpdateRule,
    export_update_state,  # noqa: F401
    float32_update,
    import_update_state,  # noqa: F401
    )
from unimp.keras.optimizer import half_update as keras_half_update
from unimp.loss_scale import (
    EXTRA_FIELDS,
    DynamicLossScale,
    FitCheck,
    LossScaleConfig,
    LossScaleState,
    from_state_dict,
    unchanged_fields,
    update_arrays,
)
from unimp.loss_scale import state_dict as _portable_state_dict
from unimp.loss_scale.keras_args import (
    check_keras_arguments,
    keras_positional,
    resolve_keras_loss_scale,
)
from unimp.rounding import check_seed, check_update_mode


@keras.saving.register_keras_serializable(package="unimp")
class LossScaleOptimizer(HalfUpdates, keras.optimizers.LossScaleOptimizer):
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
        inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap; a ``loss_scale_factor``
            it has is cleared with a warning (Keras 3 clears it silently).
        loss_scale: a loss-scale config, ``"dynamic"``, a number (static; by keyword only, since
            Keras reads a positional number as ``initial_scale``), ``"none"``, or a
            ``to_dict()`` dict; ``None`` is unimp's ``DynamicLossScale()``.
        name: optimizer name.
        initial_scale: Keras's argument, for drop-in use: with ``dynamic_growth_steps`` it
            means ``DynamicLossScale.preset("keras", init_scale=..., growth_interval=...)``;
            not together with ``loss_scale``.
        dynamic_growth_steps: Keras's argument, for drop-in use (see ``initial_scale``).
        update: how half-precision variables take their updates (a policy's ``update``,
            :mod:`unimp.rounding`): ``"nearest"`` (default), ``"kahan"`` (a compensation
            variable per half variable, in its dtype, made at ``build`` and saved with the
            optimizer's variables) or ``"stochastic"`` (bfloat16 variables; the random bits
            of variable ``i`` at the inner optimizer's ``iterations`` ``t`` are
            ``random_bits(seed, t, i)``, as in torch and JAX). The inner optimizer computes in
            float32 either way; sparse (``IndexedSlices``) updates round to nearest.
        seed: the stochastic-rounding seed, an integer (its low 32 bits are used).
        **kwargs: what Keras's LossScaleOptimizer also takes: ``dynamic=True`` (Keras 3 and
            tf.keras; ``False`` is refused, as Keras does: use ``loss_scale=`` with a number),
            and the base-optimizer arguments older Keras configs hold (``weight_decay``,
            ``clipnorm``, ``use_ema``, ... ``loss_scale_factor``), at their defaults only.

    ``get_config()`` holds Keras's keys (``name``, ``inner_optimizer``, ``initial_scale``,
    ``dynamic_growth_steps``) and unimp's ``loss_scale`` (the whole rule; it wins on load), so
    :meth:`from_config` reads what unimp and Keras 3.0-3.15 wrote. An inner optimizer's
    ``loss_scale_factor`` is set to ``None``, with a ``UserWarning`` (Keras 3 clears it
    silently): kept, the gradients would be divided by both scales.

    Attributes:
        dynamic_scale: float32 ``keras.Variable``, the scale of the next step (as Keras).
        counter, consecutive_skips, total_skips: int32 ``keras.Variable``s (the unimp state).
        loss_scale_config: the loss-scale config.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras optimizer.
        ValueError: ``inner_optimizer`` is already loss-scaled, a bad loss-scale config, ``loss_scale`` together with Keras's arguments, an
            argument Keras's LossScaleOptimizer does not take either (named in Keras's words:
            "set `clipnorm` on the `inner_optimizer`", with the fix), or ``dynamic=False``.

    Example:
        >>> import keras, tensorflow as tf
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
        *args: Any,
        loss_scale: Any = None,
        name: str | None = None,
        initial_scale: float | None = None,
        dynamic_growth_steps: int | None = None,
        update: str = "nearest",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        loss_scale, name = keras_positional(args, loss_scale, name)
        check_keras_arguments(kwargs)
        update = check_update_mode(update)
        seed = check_seed(seed, "LossScaleOptimizer: seed")
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
        config = resolve_keras_loss_scale(loss_scale, initial_scale, dynamic_growth_steps)
        # Everything is validated: from here on nothing can fail on the user's input.
        factor = getattr(inner_optimizer, "loss_scale_factor", None)
        if factor is not None:  # Keras 3 clears it silently: the loss would be scaled twice
            warnings.warn(
                f"inner_optimizer has loss_scale_factor={factor!r}: LossScaleOptimizer clears it "
                "(as Keras 3's does), or the gradients would be unscaled twice. For a static "
                f"scale give LossScaleOptimizer(opt, loss_scale={factor!r}) instead.",
                UserWarning,
                stacklevel=2,
            )
            inner_optimizer.loss_scale_factor = None
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
        _ensure_extra(self, config)
        self._create_untracked_state()
        self._update_mode, self._update_seed = update, int(seed)
        inner_optimizer.apply = _GuardedApply(inner_optimizer.apply, self)

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
        # Set by scale_loss while a scale other than 1 may be in the gradients, cleared when
        # they are unscaled (apply, get_unscaled_gradients): the inner optimizer applied
        # directly meanwhile would step on gradients times the scale (_guard_inner)
        self._scaled_pending = False
        self._inner_ok = 0  # > 0 while this optimizer applies its inner one
        # Who traced the update (a TrainStep's id, or None for any other tf.function / fit):
        # the config is baked into those graphs as constants, so load_state_dict may no longer
        # swap the parts of it the update uses (see there).
        self._traced_by: set[int | None] = set()
        self._tracer: int | None = None
        # the update rule's compensation variables by the inner optimizer's variable index
        self._compensations: dict[int, Any] = {}

    # -- configuration ---------------------------------------------------------------------

    _seed_fixed_why = (
        "a tf.function (model.fit, or a train step) traced this optimizer's update: the traced "
        "graph keeps the old seed"
    )

    def _seed_fixed(self) -> bool:
        return bool(self._traced_by)

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
        # (Keras computes beta**t in the variable's dtype, where bfloat16's beta_2=0.999 is 1.0:
        # apply runs the inner update_step in float32 for half variables, _float32_update)
        self._check_half_variables(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        keras.optimizers.Optimizer.build(self, var_list)
        self._make_compensations(var_list)

    def _rule_class(self) -> type:
        return _UpdateRule

    def ensure_built(self, trainable_variables: list[Any] | None) -> None:
        """Builds the optimizer (and its inner optimizer) for ``trainable_variables`` unless it
        is built.

        Raises:
            ValueError: not built and no variables given.
        """
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
        if not self._loss_scale_config.unity:
            self._scaled_pending = True
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
        self._scaled_pending = False
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
        self.ensure_built(variables)
        known = variables if variables is not None else self._trainable_variables
        scale = tf.convert_to_tensor(self.dynamic_scale)
        already, self._gradients_unscaled = self._gradients_unscaled, False
        unscaled = [
            self._unscale_for(g, v, scale, already) for g, v in zip(grads, known, strict=True)
        ]
        grads_finite = all_finite([g for g in unscaled if g is not None])
        loss_finite = tf.equal(tf.convert_to_tensor(self._bad_losses), 0.0)
        self.apply_unscaled(unscaled, variables, grads_finite, loss_finite)

    def apply_unscaled(
        self, unscaled: list[Any], variables: list[Any] | None, grads_finite: Any, loss_finite: Any
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        """The guarded update and the loss-scale update, for gradients already unscaled and
        checked: what :meth:`apply` does after its unscale, and what unimp's train step calls
        (its public face: the step reads no private member of the optimizer). On one replica,
        or in a ``merge_call`` strategy's replica, where the finite flags are reduced over every
        replica first. Traces under ``tf.function``; no host read.

        Args:
            unscaled: one unscaled gradient (or None) per variable.
            variables: the variables, or None for the ones the optimizer was built with.
            grads_finite: boolean scalar tensor (this replica's).
            loss_finite: boolean scalar tensor (this replica's).

        Returns:
            ``(applied, consecutive_skips, total_skips, grads_finite, loss_finite)``, the flags
            reduced across replicas under a strategy.
        """
        self._scaled_pending = False
        self._inner_ok += 1
        try:
            return self._apply_unscaled_here(unscaled, variables, grads_finite, loss_finite)
        finally:
            self._inner_ok -= 1

    def _apply_unscaled_here(
        self, unscaled: list[Any], variables: list[Any] | None, grads_finite: Any, loss_finite: Any
    ) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor, tf.Tensor]:
        replica = tf.distribute.get_replica_context()
        if (
            tf.distribute.has_strategy()
            and replica is not None
            and not tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            return self._replica_apply(replica, unscaled, variables, grads_finite, loss_finite)
        grads_finite, loss_finite = self.agree_replicas(grads_finite, loss_finite)
        applied, consecutive, total = self._apply_unscaled(
            unscaled, variables, grads_finite, loss_finite
        )
        return applied, consecutive, total, grads_finite, loss_finite

    def agree_replicas(self, grads_finite: Any, loss_finite: Any) -> tuple[Any, Any]:
        """The hook of a data-parallel engine outside ``tf.distribute`` (Horovod): the finite
        flags every replica decides the step with, after it has made the loss-scale state the
        same on every replica. Called once per step, inside the traced update, after the
        gradients are unscaled and checked and before the skip and the loss-scale update read
        the flags and the state; it must not read the device on the host.

        Here, on one process, the flags as given (a ``tf.distribute`` strategy that needs
        ``merge_call`` agrees in its own path, over its replicas, and never calls this).
        :class:`unimp.distributed.horovod.tensorflow.LossScaleOptimizer` reduces them over the
        Horovod ranks.

        Args:
            grads_finite: boolean scalar tensor, this replica's gradients are all finite.
            loss_finite: boolean scalar tensor, this replica's losses given to
                :meth:`scale_loss` since the last step were finite.

        Returns:
            ``(grads_finite, loss_finite)``, boolean scalar tensors, the same on every replica.
        """
        return grads_finite, loss_finite

    def loss_scale_state_variables(self) -> list[Any]:
        """The variables that hold the loss-scale state, in :class:`unimp.LossScaleState` field
        order: ``dynamic_scale`` (float32), ``counter``, ``consecutive_skips``, ``total_skips``
        (int32), then ``loss_scale_extra`` (int32 vector of the ``EXTRA_FIELDS``) where the
        config's rule keeps it. What an engine compares and broadcasts to keep replicas equal
        (assigning them changes the state; :meth:`load_state_dict` is the checked way to set
        it from a saved one).

        Returns:
            A list of 4 or 5 ``keras.Variable``s.
        """
        extra = getattr(self, "loss_scale_extra", None)
        return [*self._state_variables(), *(() if extra is None else (extra,))]

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
        held = [tf.convert_to_tensor(v) for v in self._state_variables()] + list(_extra(self) or ())
        mine = tf.stack([tf.cast(v, tf.float64) for v in held])
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
            with _float32_update(self.inner_optimizer, self._update_rule()):
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
            with _float32_update(self.inner_optimizer, self._update_rule()):
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
        held = [tf.convert_to_tensor(v) for v in self._state_variables()]
        extra = _extra(self)
        scale, counter, consecutive, total, *extra = update_arrays(
            LossScaleOps, self._loss_scale_config, *held, grads_finite, loss_finite, extra=extra,
            applied=applied,
        )
        # A skipped step must not touch the inner optimizer at all (its iterations included).
        tf.cond(applied, apply_inner, lambda: _count_skipped(self))
        same = unchanged_fields(self._loss_scale_config)  # the core says what the rule leaves
        if "scale" not in same:
            self.dynamic_scale.assign(scale)
        if "counter" not in same:
            self.counter.assign(counter)
        if extra and not set(EXTRA_FIELDS) <= set(same):
            self.loss_scale_extra.assign(tf.stack(extra))
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
        extra = _extra(self)
        held = [*self._state_variables(), *(extra or ())]
        return LossScaleState(*(v.numpy() for v in held))

    def state(self) -> LossScaleState:
        """The loss-scale state read to the host (one read; not for inside a step), as
        :meth:`unimp.keras.LossScaleOptimizer.state`."""
        return self._state()

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state in unimp's portable format (the same in every backend).

        Returns:
            ``unimp.loss_scale.state_dict(config, state)``: JSON-able.
        """
        return _portable_state_dict(self._loss_scale_config, self._state())

    def load_state_dict(self, state_dict: Any, *, owner: int | None = None) -> bool:
        """Loads a portable loss-scale state: the saved config replaces this optimizer's, as in
        every unimp backend (and as torch.amp.GradScaler.load_state_dict takes the saved
        factors and interval). Validated before anything is assigned.

        TensorFlow bakes the config into a traced step as constants, so a different config is
        adopted only while no ``tf.function`` has traced this optimizer's update yet (the usual
        resume: build, load, train). :meth:`TrainStep.load_state_dict` adopts it at any time
        and retraces its step.

        Args:
            state_dict: a portable loss-scale state (:func:`unimp.loss_scale.state_dict`).
            owner: the id of a train step that retraces itself after the load (what
                :meth:`TrainStep.load_state_dict` passes): the update it traced
                (:meth:`tracing`) does not hold the old config back.

        Returns:
            True where the loaded config changes a field a traced update has built in: the
            ``owner`` must retrace.

        Raises:
            ValueError: a malformed or foreign state_dict, or one saved with a different
                loss-scale config after a ``tf.function`` (of anyone but ``owner``) traced this
                optimizer (the message shows both configs and the fix).
        """
        config, state = from_state_dict(state_dict, current=self._loss_scale_config)
        if owner is None:
            self._check_retrace(config, self._traced_by, "TrainStep.load_state_dict (which retraces)")
        else:  # the owner retraces; a tf.function of anyone else (model.fit) keeps the old rule
            others = self._traced_by - {owner}
            self._check_retrace(config, others, "a new optimizer (that function keeps the old config)")
        retrace = _traced_fields(config) != _traced_fields(self._loss_scale_config)
        self._adopt(config, state)
        if retrace and owner is not None:
            self._traced_by.discard(owner)
        return retrace

    @contextlib.contextmanager
    def tracing(self, owner: int) -> Iterator[None]:
        """Marks the loss-scale updates traced inside the block as ``owner``'s (a train step's
        id; nested blocks restore the outer owner), so that :meth:`load_state_dict` knows whose
        graphs hold the current config. Host-side bookkeeping while tracing: nothing runs on
        the device."""
        outer, self._tracer = self._tracer, owner
        try:
            yield
        finally:
            self._tracer = outer

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
        _ensure_extra(self, config)
        if _extra(self) is not None:
            self.loss_scale_extra.assign(np.array([getattr(state, n) for n in EXTRA_FIELDS], np.int32))

    # -- serialization ---------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Keras's keys (``initial_scale``, ``dynamic_growth_steps``: ``None`` for a rule Keras
        cannot express) and unimp's ``loss_scale`` (the whole rule)."""
        cfg = self._loss_scale_config
        dynamic = isinstance(cfg, DynamicLossScale)
        out = {
            "name": self.name,
            "inner_optimizer": serialization_lib.serialize_keras_object(self.inner_optimizer),
            "initial_scale": float(cfg.initial_scale()),
            "dynamic_growth_steps": cfg.growth_interval if dynamic else None,
            "loss_scale": cfg.to_dict(),
        }
        if self._update_mode != "nearest":  # unimp's: how half variables take their updates
            out.update(update=self._update_mode, seed=self._update_seed)
        return out

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        """Builds the optimizer from :meth:`get_config`'s dict, or from the config Keras's own
        LossScaleOptimizer wrote (3.0-3.11 also wrote the base optimizer's keys, at defaults).

        Raises:
            ValueError: a key neither Keras nor unimp writes, or a non-default base key.
        """
        config = dict(config)
        inner = serialization_lib.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        if "loss_scale" in config:  # unimp's own: the rule is in loss_scale, Keras's keys echo it
            config.pop("initial_scale", None)
            config.pop("dynamic_growth_steps", None)
        return cls(inner, **config)


_HALF = (tf.float16, tf.bfloat16)


class _GuardedApply:
    """The inner optimizer's ``apply`` while an unimp :class:`LossScaleOptimizer` wraps it:
    applied directly (``inner.apply_gradients(...)``, ``opt.inner_optimizer.apply(...)``) after
    ``scale_loss`` and before the gradients were unscaled, it would step on gradients times the
    loss scale (65536 by default in torch, 32768 in Keras): refused with the fix, before anything
    changes (the same rule as torch's GradScaler's check on ``optimizer.step()``)."""

    def __init__(self, apply: Callable[..., Any], owner: LossScaleOptimizer) -> None:
        self._apply = apply
        self._owner = weakref.ref(owner)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner()
        if owner is not None and owner._scaled_pending and owner._inner_ok == 0:
            raise RuntimeError(
                "the inner optimizer is applying gradients of a scaled loss (scale_loss) that were "
                "never unscaled, so the step would be the loss scale times too large: apply them "
                "through the LossScaleOptimizer (optimizer.apply_gradients(...), which unscales), "
                "or unscale first with optimizer.get_unscaled_gradients(grads)."
            )
        return self._apply(*args, **kwargs)


class _Float32View(Float32View):
    """:class:`unimp.keras.optimizer.Float32View` on TensorFlow: a ``tf.float32`` dtype, a
    replica's variable found through its distributed container (``tf.distribute``), and
    sparse (``IndexedSlices``) writes, an Embedding's, rounded to nearest by the optimizer
    itself (with a warning under a rule)."""

    __slots__ = ()
    dtype = tf.float32

    @staticmethod
    def widen(x: Any) -> Any:
        return tf.cast(x, tf.float32)

    def __getattr__(self, name: str) -> Any:
        if name == "_distributed_container" and not hasattr(self._var, name):
            # Keras finds a replica's variable in its slots through its distributed container,
            # read from the handle of a CompositeTensor; the view is none: hand it out directly
            handle = getattr(self._var, "handle", None)
            if handle is not None and hasattr(handle, name):
                return getattr(handle, name)
        return getattr(self._var, name)

    def _narrow(self, value: Any) -> Any:
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(tf.cast(value.values, self._var.dtype), value.indices, value.dense_shape)
        return tf.cast(value, self._var.dtype)

    # sparse updates (embedding rows) are rounded to nearest, with a warning under a rule
    def _sparse(self) -> None:
        self._flush()
        if self._rule is not None and not self._rule.warned_sparse:
            self._rule.warned_sparse = True
            warnings.warn(
                f"update={self._rule.mode!r}: a sparse (IndexedSlices) update, an Embedding's, is "
                "rounded to nearest by the optimizer itself, not by the rule.",
                UserWarning,
                stacklevel=3,
            )

    def scatter_update(self, value: Any) -> Any:
        self._sparse()
        return self._var.scatter_update(self._narrow(value))

    def scatter_add(self, value: Any) -> Any:
        self._sparse()
        return self._var.scatter_add(self._narrow(value))

    def scatter_sub(self, value: Any) -> Any:
        self._sparse()
        return self._var.scatter_sub(self._narrow(value))




class _UpdateRule(UpdateRule):
    """:class:`unimp.keras.optimizer.UpdateRule` on this backend's tensors (:class:`UpdateOps`,
    a replica's variable read by ``tf.convert_to_tensor``)."""

    tensor = staticmethod(tf.convert_to_tensor)

    @property
    def ops(self) -> Any:
        return UpdateOps




def _float32_update(optimizer: Any, rule: _UpdateRule | None = None) -> Any:
    """:func:`unimp.keras.optimizer.float32_update` with this backend's view (:class:`_Float32View`)."""
    return float32_update(optimizer, rule, view=_Float32View)


def half_update(optimizer: Any, update: str = "kahan", *, seed: int = 0) -> LossScaleOptimizer:
    """A Keras optimizer whose updates to half-precision variables are Kahan-compensated or
    stochastically rounded (:mod:`unimp.rounding`; pure bfloat16 training that learns): unimp's
    :class:`LossScaleOptimizer` around it with no loss scale and ``update=`` (see there), for
    ``model.compile`` and custom loops alike; give ``LossScaleOptimizer(opt, loss_scale=...,
    update=...)`` for both.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` or a name like ``"adam"``.
        update: ``"kahan"``, ``"stochastic"`` (bfloat16 variables) or ``"nearest"``.
        seed: the stochastic-rounding seed, an integer (its low 32 bits are used).

    Returns:
        A :class:`LossScaleOptimizer` (``loss_scale="none"``).

    Raises:
        TypeError: not a Keras optimizer, or one already loss-scaled (give it ``update=``), or a
            seed that is not an integer.
        ValueError: an unknown ``update``.
    """
    return keras_half_update(optimizer, update, seed=seed, optimizer_class=LossScaleOptimizer)


class LossScaleCheck(FitCheck, keras.callbacks.Callback):
    """A Keras callback that acts on the loss-scale config's ``max_consecutive_skips`` and
    ``floor_action`` during ``model.fit``, where no step result is read (a custom loop checks
    them when it reads a :class:`unimp.StepResult`).

    After every ``every``-th training batch it reads the model's
    :class:`LossScaleOptimizer` state (one device read: a sync on an accelerator, which is why
    it is a callback the user adds) and runs :class:`unimp.loss_scale.FloorWatch`'s check: a
    :class:`unimp.LossScaleError` stops ``fit`` as DeepSpeed and fairseq stop at the floor; a
    floor hit under ``floor_action="warn"`` warns once per new hit.

    Args:
        every: check after every ``every``-th batch (an int >= 1, as the loss-scale configs'
            integer fields; default 1). Floor hits are counted on the device, so a later check
            still sees them; a run of skips longer than ``max_consecutive_skips`` is seen if it
            lasts until a check. A config with neither check reads nothing.

    Raises:
        ValueError: ``every`` is not an int >= 1.
        TypeError: (in ``fit``) the model's optimizer is not unimp's LossScaleOptimizer.

    Example:
        ``model.fit(x, y, callbacks=[unimp.backends.tensorflow.LossScaleCheck()])``
    """

    fix = "the model compiled with unimp's LossScaleOptimizer (mp.prepare(model, optimizer) does it)"

    optimizer_class = LossScaleOptimizer

    def read_state(self, optimizer: LossScaleOptimizer) -> LossScaleState:
        return optimizer._state()


class UpdateOps(LossScaleOps):
    """:mod:`unimp.rounding`'s array namespace over TF tensors (eager and in ``tf.function``):
    the loss-scale rule's namespace (``where``, ``isfinite``, ``f32``, ``i32``) plus bit
    patterns by ``tf.bitcast`` and int32 arithmetic wrapping as NumPy's."""

    @staticmethod
    def to_dtype(x: Any, dtype: str) -> tf.Tensor:
        return tf.cast(x, tf.as_dtype(dtype))

    @staticmethod
    def bits(x: Any) -> tf.Tensor:
        return tf.bitcast(tf.cast(x, tf.float32), tf.int32)

    @staticmethod
    def from_bits(b: Any) -> tf.Tensor:
        return tf.bitcast(b, tf.float32)

    @staticmethod
    def iota(shape: tuple[int, ...]) -> tf.Tensor:
        return tf.reshape(tf.range(int(np.prod(shape, dtype=np.int64)), dtype=tf.int32), shape)

    xor = staticmethod(tf.bitwise.bitwise_xor)
    and_ = staticmethod(tf.bitwise.bitwise_and)

    @staticmethod
    def shr(x: Any, k: int) -> tf.Tensor:
        """Logical right shift (TF's ``right_shift`` on int32 is arithmetic: masked)."""
        return tf.bitwise.bitwise_and(tf.bitwise.right_shift(x, k), (1 << (32 - k)) - 1)

    @staticmethod
    def add(a: Any, b: Any) -> tf.Tensor:
        return a + b

    @staticmethod
    def mul(a: Any, b: Any) -> tf.Tensor:
        return a * b  # int32 wraps modulo 2**32
