"""A Keras 3 :class:`LossScaleOptimizer` on unimp's loss-scale rule, written against
``keras.ops`` only: the same class on Keras's TensorFlow, JAX and torch backends.

The rule is not written here: :func:`unimp.loss_scale.update_arrays` runs on the backend's
tensors through :class:`KerasOps`. A step decides with selects, never with a Python branch on a
tensor (Keras's ``ops.cond`` is a Python ``if`` on torch, one host read per step): the inner
optimizer's update is computed, then kept or dropped per variable by ``ops.where``. On JAX that
is one traced step (Keras's JAX trainer calls :meth:`LossScaleOptimizer.stateless_apply` inside
its jitted step); on torch it is no host read; on TensorFlow it traces under ``tf.function``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
from keras import ops
from keras.src.utils import tracking

from unimp.keras.fp8 import is_state, keep_unrun, state_groups
from unimp.keras.overflow import all_finite
from unimp.loss_scale import (
    EXTRA_FIELDS,
    FitCheck,
    LossScaleConfig,
    LossScaleState,
    from_state_dict,
    tracks_extra,
    update_arrays,
)
from unimp.loss_scale import state_dict as _portable_state_dict
from unimp.loss_scale.keras_args import (
    check_keras_arguments,
    keras_positional,
    resolve_keras_loss_scale,
)
from unimp.rounding import check_seed, check_update_mode, check_update_state, update_half
from unimp.step import warn_half_optimizer_state

__all__ = [
    "Float32View",
    "HalfUpdates",
    "KerasOps",
    "LossScaleCheck",
    "LossScaleOptimizer",
    "UpdateOps",
    "UpdateRule",
    "export_update_state",
    "float32_update",
    "half_update",
    "import_update_state",
    "is_half_variable",
]


class KerasOps:
    """:func:`unimp.loss_scale.update_arrays`'s array namespace over ``keras.ops`` (any backend)."""

    where = staticmethod(ops.where)
    minimum = staticmethod(ops.minimum)
    maximum = staticmethod(ops.maximum)
    isfinite = staticmethod(ops.isfinite)

    @staticmethod
    def f32(x: Any) -> Any:
        return ops.cast(x, "float32")

    @staticmethod
    def i32(x: Any) -> Any:
        return ops.cast(x, "int32")


class UpdateOps(KerasOps):
    """:mod:`unimp.rounding`'s array namespace over ``keras.ops`` (any Keras engine, eager or
    compiled): the loss-scale rule's namespace plus bit patterns by ``ops.view`` (a bitcast:
    exact) and int32 arithmetic wrapping as NumPy's."""

    @staticmethod
    def to_dtype(x: Any, dtype: str) -> Any:
        return ops.cast(x, dtype)

    @staticmethod
    def bits(x: Any) -> Any:
        return ops.view(ops.cast(x, "float32"), "int32")

    @staticmethod
    def from_bits(b: Any) -> Any:
        return ops.view(b, "float32")

    @staticmethod
    def iota(shape: tuple[int, ...]) -> Any:
        return ops.reshape(ops.arange(math.prod(shape), dtype="int32"), shape)

    xor = staticmethod(ops.bitwise_xor)
    and_ = staticmethod(ops.bitwise_and)

    @staticmethod
    def shr(x: Any, k: int) -> Any:
        """Logical right shift of int32 (``right_shift`` is arithmetic there: masked)."""
        return ops.bitwise_and(ops.right_shift(x, k), (1 << (32 - k)) - 1)

    add = staticmethod(ops.add)
    mul = staticmethod(ops.multiply)  # int32 wraps modulo 2**32 on every engine


class UpdateRule:
    """A policy's ``update`` rule as unimp's Keras optimizers apply it to half variables
    (:func:`unimp.rounding.update_half`): the compensation buffer of each (``"kahan"``, an
    optimizer variable in its dtype), the random bits' ``(seed, step, index)``
    (``"stochastic"``: ``step`` is the inner optimizer's ``iterations`` before the update,
    ``index`` the variable's position in its list). ``ops``: the array namespace
    (:class:`UpdateOps`; the TensorFlow backend gives its own)."""

    ops: Any = UpdateOps

    def __init__(self, mode: str, seed: int, inner: Any, compensations: dict[int, Any]) -> None:
        self.mode, self.seed, self.inner, self.compensations = mode, seed, inner, compensations
        self.warned_sparse = False

    @staticmethod
    def tensor(x: Any) -> Any:
        """A variable's value as a tensor."""
        return ops.convert_to_tensor(x)

    def write(self, var: Any, target: Any) -> Any:
        """Writes ``var``'s update from the inner optimizer's float32 result ``target``."""
        index = self.inner._get_variable_index(var)
        comp = self.compensations.get(index)
        new, new_comp = update_half(
            self.ops, self.mode, self.tensor(var), target, None if comp is None else self.tensor(comp),
            seed=self.seed, step=ops.cast(self.inner.iterations, "int32"), index=index,
        )
        if comp is not None and new_comp is not None:
            self.inner.assign(comp, new_comp)
        return var.assign(new)


def _can_record(loss: Any) -> bool:
    """Whether :meth:`LossScaleOptimizer.scale_loss` may write its forward-overflow flag: not
    a JAX tracer outside Keras's ``StatelessScope`` (a custom ``jax.jit`` / ``jax.grad`` loop,
    as Keras's JAX guide writes it), where the write would leak the tracer into the variable;
    there the flag is not recorded (a non-finite loss counts as an overflow of the
    gradients, as Keras's own optimizer counts it)."""
    if keras.backend.backend() != "jax":
        return True
    import jax
    from keras.src.backend.common.stateless_scope import in_stateless_scope

    return in_stateless_scope() or not isinstance(loss, jax.core.Tracer)


def unscale(g: Any, scale: Any) -> Any:
    """``g / scale`` computed in float32 (float64 for float64 ``g``), returned in ``g``'s
    dtype: the unscale of this optimizer and of :class:`unimp.keras.step.TrainStep`."""
    dtype = keras.backend.standardize_dtype(g.dtype)
    if dtype == "float32":
        return ops.divide(g, scale)
    if dtype == "float64":
        return ops.divide(g, ops.cast(scale, "float64"))
    return ops.cast(ops.divide(ops.cast(g, "float32"), scale), dtype)


def is_half_variable(variable: Any) -> bool:
    """Whether ``variable`` (a Keras or backend variable) is float16 or bfloat16."""
    dtype = getattr(variable, "dtype", None)
    return dtype is not None and keras.backend.standardize_dtype(dtype) in ("float16", "bfloat16")


class Float32View:
    """A half-precision variable as an inner optimizer's ``update_step`` sees it: float32.

    Keras's optimizers compute in ``variable.dtype`` (``ops.cast(self.beta_2,
    variable.dtype)``): with bfloat16 variables Adam's ``beta_2 = 0.999`` is 1.0, the bias
    correction ``1 - beta_2**t`` is 0 and nothing is learned. Seen through this view, the
    hyperparameters, the step count and the bias corrections are float32 and the update is
    computed in float32 and rounded once into the variable (torch keeps its scalars in float32
    too, but rounds after each op in the variable's dtype); the optimizer's own state (moments)
    stays in the dtype it keeps it. Everything else (the variable's key in the optimizer, its
    shape) is the variable's. The same on Keras's TensorFlow, JAX and torch engines; the
    TensorFlow backend's subclass adds ``tf.distribute`` and sparse (``IndexedSlices``) writes.

    With a ``rule`` (an object whose ``write(variable, float32_target)`` applies a policy's
    ``update``, :func:`unimp.rounding.update_half`), a write's float32 result is applied by it
    instead of rounded to nearest; ``start`` is the float32 value the update starts from (the
    weight-decayed weight).
    """

    __slots__ = ("_var", "_rule", "_start")
    dtype: Any = "float32"

    def __init__(self, var: Any, rule: Any = None, start: Any = None) -> None:
        self._var = var
        self._rule = rule
        self._start = start

    @staticmethod
    def widen(x: Any) -> Any:
        """``x`` (a tensor or variable) in float32."""
        return ops.cast(x, "float32")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._var, name)

    def __jax_array__(self) -> Any:  # an update that reads the variable (JAX arrays only)
        return self._wide()

    def _wide(self) -> Any:
        return self.widen(self._var) if self._start is None else self._start

    def _narrow(self, value: Any) -> Any:
        return ops.cast(value, self._var.dtype)

    def _write(self, target: Any) -> Any:
        self._start = None  # written: later reads see the variable
        if self._rule is None:
            return self._var.assign(self._narrow(target))
        return self._rule.write(self._var, self.widen(target))

    def _flush(self) -> None:
        """The weight decay of an update step that never wrote the variable."""
        if self._start is not None:
            self._write(self._start)

    def assign(self, value: Any) -> Any:
        return self._write(value)

    def assign_add(self, delta: Any) -> Any:  # computed in float32, rounded once
        return self._write(self._wide() + delta)

    def assign_sub(self, delta: Any) -> Any:
        return self._write(self._wide() - delta)


if keras.backend.backend() == "tensorflow":  # a view read by an op (LAMB's and Adafactor's norms)
    import tensorflow as tf

    tf.register_tensor_conversion_function(
        Float32View, lambda view, dtype=None, name=None, as_ref=False: view._wide()
    )


@contextlib.contextmanager
def float32_update(optimizer: Any, rule: Any = None, view: type[Float32View] = Float32View) -> Iterator[None]:
    """While applying: ``optimizer.update_step`` sees half-precision variables as float32
    (:class:`Float32View`, or the ``view`` subclass given) and their gradients cast to float32
    (exact); float32 variables are updated as the optimizer does. The decoupled weight decay of
    half variables (AdamW, ``weight_decay=``) is computed in float32 too, as part of the same
    update (Keras casts the learning rate and the decay to the variable's dtype and rounds the
    decayed weight before the update). On torch, Keras's parallel (``torch._foreach``) step
    takes the float32 variables and each half variable goes through ``update_step``. With
    ``rule``, the update is applied by it (a policy's ``update``). Decided per variable while
    tracing: no cost in a compiled step, none at all without half variables. The instance
    attributes that route the update are removed on exit."""
    if "update_step" in vars(optimizer):  # already routed (a nested apply)
        yield
        return
    plain = optimizer.update_step
    plain_decay = optimizer._apply_weight_decay
    plain_key = optimizer._var_key
    plain_step = optimizer._backend_update_step

    def decays(variable: Any) -> bool:
        return optimizer.weight_decay is not None and optimizer._use_weight_decay(variable)

    def update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        if gradient is None or not is_half_variable(variable):
            return plain(gradient, variable, learning_rate)
        start = None
        if decays(variable):  # Keras's `variable - variable * wd * lr`, in float32
            w = view.widen(variable)
            start = w - w * view.widen(optimizer.weight_decay) * view.widen(learning_rate)
        seen = view(variable, rule, start)
        out = plain(view.widen(gradient), seen, learning_rate)
        seen._flush()
        return out

    def apply_weight_decay(variables: Any) -> Any:
        rest = [v for v in variables if not is_half_variable(v)]
        if rest:  # Keras-torch's torch._foreach decay refuses an empty list
            return plain_decay(rest)
        return None

    def var_key(variable: Any) -> Any:
        return plain_key(variable._var if isinstance(variable, Float32View) else variable)

    def backend_update_step(grads: Any, variables: Any, learning_rate: Any) -> Any:
        """Keras-torch's parallel step for the float32 variables, ``update_step`` for the half
        ones (under ``torch.no_grad``, as Keras's own torch step)."""
        import torch

        half = [is_half_variable(v) for v in variables]
        rest = [(g, v) for g, v, h in zip(grads, variables, half, strict=True) if not h]
        if rest:
            plain_step([g for g, _ in rest], [v for _, v in rest], learning_rate)
        with torch.no_grad():
            for g, v, h in zip(grads, variables, half, strict=True):
                if h:
                    update_step(g, v, learning_rate)

    optimizer.update_step = update_step
    optimizer._apply_weight_decay = apply_weight_decay
    optimizer._var_key = var_key
    routed = ["update_step", "_apply_weight_decay", "_var_key"]
    if keras.backend.backend() == "torch":
        optimizer._backend_update_step = backend_update_step
        routed.append("_backend_update_step")
    try:
        yield
    finally:
        for name in routed:
            delattr(optimizer, name)


_STATE = ("dynamic_scale", "counter", "consecutive_skips", "total_skips")


class HalfUpdates:
    """The policy's ``update`` rule as an unimp Keras optimizer holds it (this module's
    :class:`LossScaleOptimizer` and the TensorFlow backend's): :attr:`update_mode` and
    :attr:`update_seed`, whose seed is fixed once :meth:`_seed_fixed` says a compiled update
    baked it in (``_seed_fixed_why`` says when, in the error)."""

    _update_mode: str = "nearest"
    _update_seed: int = 0
    _rule_used = False  # set by the first _update_rule (a step that may be compiled took the seed)
    _seed_fixed_why = "this optimizer applied an update: a compiled step keeps the old seed"

    def _seed_fixed(self) -> bool:
        return self._rule_used

    def _rule_class(self) -> type:
        """The :class:`UpdateRule` class on this optimizer's tensors."""
        return UpdateRule

    def _update_rule(self) -> UpdateRule | None:
        """The policy's update rule for the inner step (None for ``"nearest"``)."""
        if self._update_mode == "nearest":
            return None
        self._rule_used = True
        return self._rule_class()(self._update_mode, self._update_seed, self.inner_optimizer, self._compensations)

    def _check_half_variables(self, var_list: list[Any]) -> None:
        """What ``build`` checks before anything is made: ``update="stochastic"`` takes bfloat16
        variables only, and an Adam-like inner optimizer over float16 variables keeps float16
        moments, where its epsilon rounds away (:func:`unimp.step.warn_half_optimizer_state`).

        Raises:
            ValueError: ``"stochastic"`` with a trainable float16 variable, naming the fix.
        """
        half = [v for v in var_list if v.trainable and is_half_variable(v)]
        if self._update_mode == "stochastic":
            for v in half:
                check_update_mode("stochastic", keras.backend.standardize_dtype(v.dtype))
        eps = getattr(self.inner_optimizer, "epsilon", None)
        if eps is not None and any(keras.backend.standardize_dtype(v.dtype) == "float16" for v in half):
            try:  # a float or a NumPy scalar; anything else is not Adam-like
                eps = float(eps)
            except (TypeError, ValueError):
                eps = None
            if eps is not None:
                warn_half_optimizer_state(type(self.inner_optimizer).__name__, eps)

    def _make_compensations(self, var_list: list[Any]) -> None:
        """``update="kahan"``: one compensation buffer per trainable half variable, an optimizer
        variable in its dtype, by the inner optimizer's index of the variable."""
        if self._update_mode != "kahan":
            return
        for v in var_list:
            if v.trainable and is_half_variable(v):
                self._compensations[self.inner_optimizer._get_variable_index(v)] = (
                    self.add_variable_from_reference(v, "compensation")
                )

    @property
    def update_mode(self) -> str:
        """How half-precision variables take their updates: ``"nearest"``, ``"kahan"`` or
        ``"stochastic"`` (the ``update=`` argument)."""
        return self._update_mode

    @property
    def update_seed(self) -> int:
        """The stochastic-rounding seed (the ``seed=`` argument; ``train_step`` sets the step's
        ``rounding_seed`` here until the optimizer is built)."""
        return self._update_seed

    @update_seed.setter
    def update_seed(self, seed: int) -> None:
        seed = check_seed(seed, "LossScaleOptimizer.update_seed")
        if seed != self._update_seed and self._seed_fixed():
            raise ValueError(
                f"update_seed cannot change after {self._seed_fixed_why}. Set it before the first "
                "step, or pass seed= to the LossScaleOptimizer."
            )
        self._update_seed = seed


@keras.saving.register_keras_serializable(package="unimp.keras")
class LossScaleOptimizer(HalfUpdates, keras.optimizers.LossScaleOptimizer):
    """A Keras optimizer that scales the loss by unimp's rule, on any Keras backend.

    It subclasses ``keras.optimizers.LossScaleOptimizer`` (so ``model.compile`` does not wrap it
    a second time under a ``mixed_float16`` policy, and Keras's trainers call its
    ``scale_loss``), and replaces its rule with unimp's reference algorithm on device tensors:
    any growth and backoff factor, min and max scale, growth never to inf, the skip counters and
    the large-scale trainers' rules (hysteresis, overflow tolerance, floor hits). With
    ``DynamicLossScale.preset("keras")`` (or Keras's ``initial_scale`` / ``dynamic_growth_steps``)
    it gives the scales and weights Keras's own optimizer gives.

    A skipped step (a non-finite gradient, or a non-finite loss passed to :meth:`scale_loss`)
    leaves the variables and the whole inner optimizer state unchanged, ``iterations`` (and so
    any learning-rate schedule) included: the inner update is computed and dropped by a select.
    A non-finite loss skips the step without lowering the scale (unimp's forward-overflow rule)
    where the loss reaches :meth:`scale_loss` statefully: custom loops, and ``fit`` on
    TensorFlow and torch. Keras's JAX trainer calls ``scale_loss`` in a scope whose writes it
    drops, so there a non-finite loss counts as an overflow of the gradients (as Keras's own
    optimizer counts it).

    Variables marked ``overwrite_with_gradient`` (float8 scales and histories) take their
    gradient as is, not unscaled (as Keras). Gradients are unscaled in float32.

    Args:
        inner_optimizer: the ``keras.optimizers.Optimizer`` to wrap; its ``loss_scale_factor``
            is cleared (as Keras does).
        loss_scale: a loss-scale config, ``"dynamic"``, a number (a static scale; by keyword,
            since Keras reads a second positional number as ``initial_scale``), ``"none"``, or
            a ``to_dict()`` dict; ``None`` is unimp's ``DynamicLossScale()``.
        name: optimizer name.
        initial_scale, dynamic_growth_steps: Keras's arguments, for drop-in use
            (``DynamicLossScale.preset("keras", init_scale=..., growth_interval=...)``); not
            together with ``loss_scale``.
        update: how half-precision (float16 / bfloat16) variables take their updates, the
            policy's ``update`` (:mod:`unimp.rounding`): ``"nearest"`` (the inner optimizer's
            float32 result rounded once), ``"kahan"`` (a compensation buffer per half variable,
            an optimizer variable in its dtype) or ``"stochastic"`` (bfloat16 variables only).
            Every engine runs the same rule on :class:`UpdateOps`, bit for bit.
        seed: the stochastic-rounding seed, an integer (its low 32 bits are used).
        **kwargs: ``dynamic=True`` and the base-optimizer arguments Keras's configs hold, at
            their defaults only (read by :mod:`unimp.loss_scale.keras_args`, as Keras does).

    Attributes:
        dynamic_scale: float32 ``keras.Variable``, the scale of the next step.
        counter, consecutive_skips, total_skips: int32 ``keras.Variable``s.
        loss_scale_config: the loss-scale config.

    Raises:
        TypeError: ``inner_optimizer`` is not a Keras optimizer.
        ValueError: a loss-scaled ``inner_optimizer``, a bad config, an unknown ``update``
            (and, when built, ``"stochastic"`` with float16 variables), or an argument Keras's
            LossScaleOptimizer refuses too (with the fix).

    Example:
        >>> import keras
        >>> opt = LossScaleOptimizer(keras.optimizers.SGD(0.1), loss_scale=1024.0)
        >>> w = keras.Variable([1.0])
        >>> opt.apply([opt.scale_loss(1.0) * keras.ops.ones((1,))], [w])
        >>> float(keras.ops.convert_to_numpy(w.value)[0])
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
                f"inner_optimizer must be a keras.optimizers.Optimizer, got "
                f"{type(inner_optimizer).__name__}; e.g. LossScaleOptimizer(keras.optimizers.Adam())."
            )
        if isinstance(inner_optimizer, keras.optimizers.LossScaleOptimizer):
            raise ValueError(
                "inner_optimizer is already a LossScaleOptimizer: wrap the plain optimizer once "
                "(its inner_optimizer)."
            )
        config = resolve_keras_loss_scale(loss_scale, initial_scale, dynamic_growth_steps)
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)
        self.inner_optimizer = inner_optimizer
        self.inner_optimizer.loss_scale_factor = None
        self._config: LossScaleConfig = config
        self._update_mode, self._update_seed = update, int(seed)
        self._create_untracked_state()

    @tracking.no_automatic_dependency_tracking
    def _create_untracked_state(self) -> None:
        # the update rule's compensation variables by the inner optimizer's variable index
        self._compensations: dict[int, Any] = {}

    # -- Keras's attributes ----------------------------------------------------------------

    @property
    def loss_scale_config(self) -> LossScaleConfig:
        """The loss-scale config."""
        return self._config


    @property
    def initial_scale(self) -> float:
        """The scale of the first step (Keras's name)."""
        return self._config.initial_scale()

    @initial_scale.setter
    def initial_scale(self, value: Any) -> None:  # Keras's __init__ / from_config write it
        pass

    @property
    def dynamic_growth_steps(self) -> int | None:
        """Keras's name for ``growth_interval`` (``None`` for static or disabled scales)."""
        return getattr(self._config, "growth_interval", None)

    @dynamic_growth_steps.setter
    def dynamic_growth_steps(self, value: Any) -> None:
        pass

    @property
    def loss_scale(self) -> Any:
        """The current scale, a float32 scalar tensor."""
        return self.dynamic_scale.value

    # -- building --------------------------------------------------------------------------

    def build(self, var_list: list[Any]) -> None:
        if self.inner_optimizer.gradient_accumulation_steps and state_groups(list(var_list)):
            # Keras accumulates overwrite_with_gradient variables by their maximum, which for
            # unimp's float8 states would keep the largest scale of the window (the smallest
            # amax), not the window's one scaling step (unimp.fp8.window_merge)
            raise ValueError(
                "the inner optimizer's gradient_accumulation_steps with unimp's float8 layers: "
                "Keras would merge the float8 states by their maximum, not by unimp's window "
                "rule. Accumulate in unimp's step instead: mp.train_step(model, optimizer, "
                "loss_fn, grad_accum_steps=k)."
            )
        self._check_half_variables(var_list)
        if not self.inner_optimizer.built:
            self.inner_optimizer.build(var_list)
        with keras.name_scope(self.name, caller=self):
            self.dynamic_scale = self.add_variable(
                shape=(), dtype="float32", initializer=keras.initializers.Constant(self.initial_scale),
                aggregation="none", name="dynamic_scale",
            )
            for n in _STATE[1:]:
                setattr(self, n, self.add_variable(
                    shape=(), dtype="int32", initializer="zeros", aggregation="none", name=n
                ))
            self.loss_scale_extra = (
                self.add_variable(
                    shape=(len(EXTRA_FIELDS),), dtype="int32", initializer="zeros",
                    aggregation="none", name="loss_scale_extra",
                )
                if tracks_extra(self._config)
                else None
            )
            # non-finite losses seen by scale_loss since the last step (forward overflow)
            self.bad_losses = self.add_variable(
                shape=(), dtype="float32", initializer="zeros", aggregation="none", name="bad_losses"
            )
            self._make_compensations(var_list)
        keras.optimizers.Optimizer.build(self, var_list)

    @property
    def variables(self) -> list[Any]:
        return self._variables + self.inner_optimizer.variables

    def _own(self) -> list[keras.Variable]:
        own = [getattr(self, n) for n in _STATE]
        if self.loss_scale_extra is not None:
            own.append(self.loss_scale_extra)
        return [*own, self.bad_losses]

    # -- scaling ---------------------------------------------------------------------------

    def scale_loss(self, loss: Any) -> Any:
        """The loss times the current scale, in float32 (float64 for a float64 loss); a
        non-finite loss marks the next step as a forward overflow (skipped, scale kept).

        Args:
            loss: a floating scalar or tensor.

        Returns:
            The scaled loss.

        Raises:
            TypeError: ``loss`` is not floating.
        """
        loss = ops.convert_to_tensor(loss)
        dtype = keras.backend.standardize_dtype(loss.dtype)
        if "float" not in dtype:
            raise TypeError(f"scale_loss needs a floating loss, got {dtype}.")
        wide = "float64" if dtype == "float64" else "float32"
        loss = ops.cast(loss, wide)
        if not self.built:
            return ops.multiply(loss, ops.cast(self.initial_scale, wide))
        if _can_record(loss):
            self.bad_losses.assign_add(
                ops.cast(ops.logical_not(ops.all(ops.isfinite(loss))), "float32")
            )
        return ops.multiply(loss, ops.cast(self.dynamic_scale, wide))

    # -- the step, as a function of values -------------------------------------------------

    def _decide(
        self, own: list[Any], grads: list[Any], variables: list[Any], values: list[Any]
    ) -> tuple[list[Any], Any, list[Any]]:
        """The step's decision on values: ``(unscaled gradients, applied, own values after)``,
        the rule run by :func:`unimp.loss_scale.update_arrays` (no branch on a tensor).
        Variables that take their gradient as their value (float8 states,
        :func:`unimp.keras.fp8.is_state`) are neither unscaled nor checked, and one whose
        layer did not run keeps ``values`` (:func:`unimp.keras.fp8.keep_unrun`)."""
        scale, bad = own[0], own[-1]
        unscaled = [
            g if g is None or is_state(v) else unscale(g, scale)
            for g, v in zip(grads, variables, strict=True)
        ]
        unscaled = keep_unrun(unscaled, variables, values)
        grads_finite = all_finite([g for g, v in zip(unscaled, variables, strict=True) if not is_state(v)])
        applied, new_own = self._rule(own, grads_finite, ops.equal(bad, 0.0))
        return unscaled, applied, new_own

    def _rule(self, own: list[Any], grads_finite: Any, loss_finite: Any) -> tuple[Any, list[Any]]:
        """``(applied, own values after)`` from the finite flags: the core rule on values."""
        scale, counter, consecutive, total, *rest = own
        extra = None
        if self.loss_scale_extra is not None:
            extra = tuple(ops.unstack(rest[0], num=len(EXTRA_FIELDS)))
        applied = ops.logical_and(grads_finite, loss_finite)
        new = update_arrays(
            KerasOps, self._config, scale, counter, consecutive, total, grads_finite,
            loss_finite, extra=extra, applied=applied,
        )
        new_own = list(new[:4])
        if extra is not None:
            new_own.append(ops.stack(list(new[4:])))
        new_own.append(ops.zeros_like(rest[-1]))
        return applied, new_own

    def stateless_apply(
        self, optimizer_variables: list[Any], grads: list[Any], trainable_variables: list[Any]
    ) -> tuple[list[Any], list[Any]]:
        """Keras's stateless step (what Keras's JAX trainer calls inside its jitted step).

        Args:
            optimizer_variables: values of :attr:`variables` (this optimizer's, then the inner
                optimizer's).
            grads: gradients of the scaled loss, one per trainable variable.
            trainable_variables: values of the trainable variables.

        Returns:
            ``(new_trainable_values, new_optimizer_values)``, as Keras's.

        Raises:
            ValueError: not built, lists of the wrong length, or Keras on TensorFlow (whose
                optimizers have no stateless step; use :meth:`apply`).
        """
        if not self.built:
            raise ValueError(
                "To call `stateless_apply`, LossScaleOptimizer must be built (i.e. its variables "
                "must have been created). You can build it via `optimizer.build(trainable_variables)`."
            )
        if keras.backend.backend() == "tensorflow":
            raise ValueError(
                "stateless_apply is not supported with the TensorFlow backend (Keras's optimizers "
                "have no stateless step there); use apply() or apply_gradients(), as Keras's "
                "TensorFlow trainer does."
            )
        optimizer_variables = list(optimizer_variables)
        if len(optimizer_variables) != len(self.variables):
            raise ValueError(
                f"got {len(optimizer_variables)} optimizer variable values for "
                f"{len(self.variables)} variables; pass one per optimizer.variables entry."
            )
        grads, train = list(grads), list(trainable_variables)
        if len(train) != len(self._trainable_variables):
            raise ValueError(
                f"got {len(train)} trainable variable values for the {len(self._trainable_variables)} "
                "variables the optimizer was built with; pass one value per variable, in order."
            )
        if not grads:
            return train, optimizer_variables  # nothing to apply (as apply() with no gradients)
        if len(grads) != len(train):
            raise ValueError(
                f"got {len(grads)} gradients for {len(train)} trainable variables; pass one "
                "gradient (or None) per variable."
            )
        n = len(self._variables)
        mine, inner = optimizer_variables[:n], optimizer_variables[n:]
        at = {id(v): i for i, v in enumerate(self._variables)}
        where = [at[id(v)] for v in self._own()]
        unscaled, applied, new_own = self._decide(
            [mine[i] for i in where], grads, self._trainable_variables, train
        )
        # The inner step as Keras's stateless_apply runs it (apply in a StatelessScope), with the
        # update rule's compensation buffers (this optimizer's variables) in the same scope.
        # Copies in: Keras's torch optimizers update their inputs in place even when stateless
        # (under jit, XLA drops the copies).
        opt = self.inner_optimizer
        comps = list(self._compensations.values())
        held = [*self._trainable_variables, *opt.variables, *comps]
        before = [*train, *inner, *(mine[at[id(c)]] for c in comps)]
        with keras.StatelessScope(state_mapping=[(v, ops.copy(x)) for v, x in zip(held, before, strict=True)]) as scope:
            with float32_update(opt, self._update_rule()):
                opt.apply(unscaled)
        after = [ops.where(applied, scope.get_current_value(v), x) for v, x in zip(held, before, strict=True)]
        new_train, new_inner = after[: len(train)], after[len(train) : len(train) + len(inner)]
        for c, value in zip(comps, after[len(train) + len(inner) :], strict=True):
            mine[at[id(c)]] = value
        for i, value in zip(where, new_own, strict=True):
            mine[i] = value
        return new_train, mine + new_inner

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """Unscales the gradients once, applies them unless non-finite, updates the scale.

        Args:
            grads: gradients of the scaled loss, one per variable.
            trainable_variables: the variables; needed on the first call unless built.

        Raises:
            ValueError: gradients and variables differ in number, or the optimizer is not
                built and no variables are given.
        """
        grads = list(grads)
        if not grads:
            return
        variables = None if trainable_variables is None else list(trainable_variables)
        if not self.built:
            if variables is None:
                raise ValueError(
                    "the optimizer is not built: pass trainable_variables to apply(), or call "
                    "optimizer.build(variables) first."
                )
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        variables = self._trainable_variables if variables is None else variables
        if len(variables) != len(grads):
            raise ValueError(
                f"got {len(grads)} gradients for {len(variables)} variables; pass one gradient "
                "per variable."
            )
        known = {id(v) for v in self._trainable_variables}
        unknown = [getattr(v, "path", repr(v)) for v in variables if id(v) not in known]
        if unknown:  # a subset, in any order, is what Keras's optimizers take too
            raise ValueError(
                f"apply() got variables the optimizer was not built with ({', '.join(unknown[:3])}); "
                "build it with every variable it will update: optimizer.build(model.trainable_variables)."
            )
        own = self._own()
        unscaled, applied, new_own = self._decide(
            [v.value for v in own], grads, variables, [v.value for v in variables]
        )
        self._guarded_apply(unscaled, variables, applied)
        for v, value in zip(own, new_own, strict=True):
            v.assign(value)

    def _guarded_apply(
        self, unscaled: list[Any], variables: list[Any], applied: Any, attempted: bool = False
    ) -> None:
        """The inner step runs statefully (on TensorFlow the inner optimizer has no stateless
        step), then every value it may write is put back unless the step is applied: one
        select per variable instead of a branch (no host read on torch). ``attempted``: a
        skipped step still counts in ``iterations`` (``schedule_counts="attempted"``)."""
        held = [*self.inner_optimizer.variables, *variables, *self._compensations.values()]
        before = [ops.copy(v.value) for v in held]
        try:
            with float32_update(self.inner_optimizer, self._update_rule()):
                self.inner_optimizer.apply(unscaled, trainable_variables=variables)
        except Exception:  # nothing half-changed: what the inner step wrote is put back
            for v, old in zip(held, before, strict=True):
                v.assign(old)
            raise
        for v, old in zip(held, before, strict=True):
            v.assign(ops.where(applied, v.value, old))
        if attempted:
            it = self.inner_optimizer.iterations
            it.assign(ops.where(applied, it.value, ops.add(it.value, 1)))

    def apply_unscaled(
        self,
        unscaled: list[Any],
        variables: list[Any],
        grads_finite: Any,
        loss_finite: Any,
        schedule_counts: str = "applied",
    ) -> tuple[Any, Any, Any]:
        """The guarded update and the loss-scale update, for gradients a train step has already
        unscaled and checked: what :meth:`apply` does after its unscale (the public face
        :class:`unimp.keras.step.TrainStep` calls). No host read.

        Args:
            unscaled: one unscaled gradient (or None) per variable.
            variables: the variables (the optimizer is built with them).
            grads_finite, loss_finite: bool scalar tensors.
            schedule_counts: ``"applied"`` or ``"attempted"`` (:data:`unimp.step.SCHEDULE_COUNTS`:
                whether a skipped step counts in ``iterations``).

        Returns:
            ``(applied, consecutive_skips, total_skips)``, scalar tensors after the step.
        """
        own = self._own()
        applied, new_own = self._rule([v.value for v in own], grads_finite, loss_finite)
        self._guarded_apply(unscaled, variables, applied, schedule_counts == "attempted")
        for v, value in zip(own, new_own, strict=True):
            v.assign(value)
        return applied, self.consecutive_skips.value, self.total_skips.value

    def apply_gradients(self, grads_and_vars: Any) -> Any:
        """``apply(grads, variables)`` from ``(gradient, variable)`` pairs.

        Returns:
            The inner optimizer's ``iterations``.
        """
        pairs = list(grads_and_vars)
        if pairs:
            grads, variables = zip(*pairs, strict=True)
            self.apply(list(grads), list(variables))
        return self.iterations

    # -- state -----------------------------------------------------------------------------

    def state(self) -> LossScaleState:
        """The loss-scale state read to the host (one read; not for inside a step).

        Returns:
            A :class:`unimp.loss_scale.LossScaleState` of NumPy scalars.
        """
        held = [getattr(self, n) for n in _STATE]
        fields = [ops.convert_to_numpy(v.value) for v in held]
        if self.loss_scale_extra is not None:
            fields += list(ops.convert_to_numpy(self.loss_scale_extra.value))
        return LossScaleState(*fields)

    def state_dict(self) -> dict[str, Any]:
        """The loss-scale state in unimp's portable format (the same in every backend)."""
        return _portable_state_dict(self._config, self.state())

    def load_state_dict(self, state_dict: Any) -> None:
        """Sets the loss-scale state from :meth:`state_dict`'s format (checked whole before
        anything changes). The saved config must be this optimizer's: a step compiled by Keras
        (``tf.function``, ``jax.jit``) has the rule's factors and interval built in, so another
        config would be reported but not followed.

        Raises:
            ValueError: not built, a bad state dict, or a state saved under another config.
        """
        if not self.built:
            raise ValueError("build the optimizer (optimizer.build(variables)) before loading its state.")
        config, state = from_state_dict(state_dict)
        if config.to_dict() != self._config.to_dict():
            raise ValueError(
                f"the state was saved under another loss-scale config ({config.to_dict()}, this "
                f"optimizer's: {self._config.to_dict()}); make the optimizer with "
                "LossScaleOptimizer(opt, loss_scale=<the saved config>) and load the state into it."
            )
        values = [state.scale, state.counter, state.consecutive_skips, state.total_skips]
        for n, v in zip(_STATE, values, strict=True):
            getattr(self, n).assign(v)
        if self.loss_scale_extra is not None:
            self.loss_scale_extra.assign([getattr(state, f) for f in EXTRA_FIELDS])

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config["loss_scale"] = self._config.to_dict()
        if self._update_mode != "nearest":  # unimp's: how half variables take their updates
            config.update(update=self._update_mode, seed=self._update_seed)
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> LossScaleOptimizer:
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        loss_scale = config.pop("loss_scale", None)
        if loss_scale is not None:
            config.pop("initial_scale", None)
            config.pop("dynamic_growth_steps", None)
        return cls(inner, loss_scale=loss_scale, **config)


def _host_int(variable: Any) -> int:
    return int(np.asarray(ops.convert_to_numpy(ops.convert_to_tensor(variable))))


def _built_rule(optimizer: Any) -> Any:
    if getattr(optimizer, "update_mode", "nearest") == "nearest" or not hasattr(optimizer, "_compensations"):
        raise ValueError(
            "this optimizer applies no update rule: use half_update(opt, 'kahan') or "
            "LossScaleOptimizer(opt, update=...) (mp.prepare does for a policy with update=)."
        )
    if not optimizer.built:
        raise ValueError(
            "the optimizer is not built: call optimizer.build(model.trainable_variables) first "
            "(its compensation variables are made there)."
        )
    return optimizer


def export_update_state(optimizer: Any) -> dict[str, Any]:
    """The optimizer's update-rule state in the portable format of
    :func:`unimp.rounding.check_update_state` (the inner optimizer's variable order), for
    :func:`import_update_state` in any backend. Keras's rule counts the inner optimizer's
    ``iterations``: every half variable's ``step`` is it.

    Raises:
        ValueError: not an unimp optimizer with ``update=``, or not built.
    """
    opt = _built_rule(optimizer)
    inner = opt.inner_optimizer
    out = []
    for i, v in enumerate(inner._trainable_variables):
        if not is_half_variable(v):
            out.append(None)
            continue
        comp = opt._compensations.get(i)
        out.append({
            "step": _host_int(inner.iterations) if opt.update_mode == "stochastic" else 0,
            "compensation": None if comp is None else np.asarray(ops.convert_to_numpy(ops.cast(comp, "float32"))),
        })
    return {"update": opt.update_mode, "seed": opt.update_seed, "params": out}


def import_update_state(optimizer: Any, state: dict[str, Any]) -> None:
    """Sets the optimizer's update-rule state (compensation variables, the seed) from
    :func:`export_update_state`'s dict of any backend. Stochastic rounding's counter is the
    inner optimizer's ``iterations``: every half variable's ``step`` must equal it (assign the
    iterations first, ``optimizer.inner_optimizer.iterations.assign(step)``, when the moments
    are ported too). All is checked before anything changes.

    Raises:
        ValueError: no rule or not built, another mode or number of variables, a buffer whose
            shape is not its variable's, or a step other than ``iterations``.
    """
    opt = _built_rule(optimizer)
    inner = opt.inner_optimizer
    variables = list(inner._trainable_variables)
    checked = check_update_state(state, opt.update_mode, len(variables))
    iterations = _host_int(inner.iterations)
    for i, (v, e) in enumerate(zip(variables, checked["params"], strict=True)):
        if e is None:
            continue
        comp = e["compensation"]
        if comp is not None and not is_half_variable(v):
            raise ValueError(
                f"params[{i}]: a compensation buffer for a {keras.backend.standardize_dtype(v.dtype)} "
                "variable: the rule keeps buffers for half variables only; export and import the "
                "same model."
            )
        if comp is not None and tuple(comp.shape) != tuple(v.shape):
            raise ValueError(
                f"params[{i}]: a compensation buffer of shape {tuple(comp.shape)} for a variable of "
                f"shape {tuple(v.shape)}: export and import the same model (Keras's Dense kernel "
                "is torch's Linear weight transposed: transpose the buffer too)."
            )
        if opt.update_mode == "stochastic" and e["step"] != iterations:
            raise ValueError(
                f"params[{i}] has taken {e['step']} updates, the inner optimizer's iterations is "
                f"{iterations} (Keras's rule counts them): assign "
                f"optimizer.inner_optimizer.iterations.assign({e['step']}) first."
            )
    for i, e in enumerate(checked["params"]):
        comp = opt._compensations.get(i)
        if comp is not None:
            value = np.zeros(comp.shape, np.float32) if e is None or e["compensation"] is None else e["compensation"]
            comp.assign(ops.cast(value, comp.dtype))
    opt._update_seed = checked["seed"]


def half_update(
    optimizer: Any, update: str = "kahan", *, seed: int = 0, optimizer_class: type | None = None
) -> LossScaleOptimizer:
    """A Keras optimizer whose updates to half-precision variables are Kahan-compensated or
    stochastically rounded (:mod:`unimp.rounding`; pure bfloat16 training that learns), on any
    Keras engine: :class:`LossScaleOptimizer` around it with no loss scale and ``update=`` (see
    there), for ``model.compile`` and custom loops alike; give ``LossScaleOptimizer(opt,
    loss_scale=..., update=...)`` for both.

    Args:
        optimizer: a ``keras.optimizers.Optimizer`` or a name like ``"adam"``.
        update: ``"kahan"``, ``"stochastic"`` (bfloat16 variables) or ``"nearest"``.
        seed: the stochastic-rounding seed, an integer (its low 32 bits are used).
        optimizer_class: the loss-scale optimizer class to build (default
            :class:`LossScaleOptimizer`; the TensorFlow backend's ``half_update`` gives its own).

    Returns:
        A :class:`LossScaleOptimizer` (``loss_scale="none"``).

    Raises:
        TypeError: not a Keras optimizer, or one already loss-scaled (give it ``update=``), or a
            seed that is not an integer.
        ValueError: an unknown ``update``.
    """
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise TypeError(
            "half_update takes the plain Keras optimizer; for a loss-scaled one build "
            "LossScaleOptimizer(inner, loss_scale=..., update=...) in one go."
        )
    return (optimizer_class or LossScaleOptimizer)(optimizer, loss_scale="none", update=update, seed=seed)


class LossScaleCheck(FitCheck, keras.callbacks.Callback):
    """A ``model.fit`` callback acting on the loss-scale config's ``max_consecutive_skips`` and
    ``floor_action``, on any Keras backend (the checks a train step makes when it reads its
    result; ``fit`` reads nothing by itself).

    After every ``every``-th training batch it reads the model's :class:`LossScaleOptimizer`
    state (one device read; on JAX, Keras's trainer first writes its state back to the
    variables, ``model.jax_state_sync()``) and runs :class:`unimp.loss_scale.FloorWatch`'s
    check: a :class:`unimp.LossScaleError` stops ``fit`` as DeepSpeed and fairseq stop at the
    floor; a floor hit under ``floor_action="warn"`` warns once per new hit. A config with
    neither check reads nothing. Matches :class:`unimp.backends.tensorflow.LossScaleCheck`.

    Args:
        every: check after every ``every``-th batch (an int >= 1; default 1).

    Raises:
        ValueError: ``every`` is not an int >= 1.
        TypeError: (in ``fit``) the model's optimizer is not unimp's (this package's
            :class:`LossScaleOptimizer`, or the TensorFlow backend's).

    Example:
        ``model.fit(x, y, callbacks=[unimp.keras.LossScaleCheck()])``
    """

    fix = (
        "the model compiled with unimp.keras.LossScaleOptimizer: "
        "model.compile(optimizer=LossScaleOptimizer(opt), ...)"
    )

    optimizer_class = LossScaleOptimizer

    def accepts(self, optimizer: Any) -> bool:
        """unimp's loss-scale optimizers on every Keras backend: this package's, and the
        TensorFlow backend's (what ``backend="keras"`` prepares on TensorFlow), each a Keras
        ``LossScaleOptimizer`` holding a loss-scale config and a ``state()``."""
        return (
            isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
            and hasattr(optimizer, "loss_scale_config")
            and callable(getattr(optimizer, "state", None))
        )

    def read_state(self, optimizer: LossScaleOptimizer) -> LossScaleState:
        if keras.backend.backend() == "jax":  # Keras's JAX trainer holds the state until asked
            self.model.jax_state_sync()
        return optimizer.state()
