"""TensorFlow :class:`MixedPrecision`: a recipe bound to Keras 3 (dtype policies under
``autocast()``, ``prepare`` for ``model.fit``, ``train_step``).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from unimp.attached import attach, check_attachable, peek
from unimp.backends._base import MixedPrecisionBase
from unimp.backends.tensorflow.casting import cast_tree, keras_policy_name, to_dtype
from unimp.backends.tensorflow.devices import _as_device, _check_placed
from unimp.backends.tensorflow.fp8 import fp8_select, fp8_swap
from unimp.backends.tensorflow.optimizer import LossScaleOptimizer, _wrap_optimizer
from unimp.backends.tensorflow.overrides import _resolve, apply_overrides
from unimp.backends.tensorflow.precision import matmul_precision
from unimp.backends.tensorflow.scaling import _to_host
from unimp.backends.tensorflow.step import TrainStep
from unimp.rounding import step_seed
from unimp.step import check_scaled_half_params
from unimp.steprecorder import with_log
from unimp.trainstep import StepOptions


def _cast_call(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The call of a prepared model: the original call, floating outputs in the output dtype."""
    return cast_tree(model._unimp.call(*args, **kwargs), model._unimp.output_dtype)


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
        output_dtype_policy: a ``keras.DTypePolicy`` computing in the output dtype, for a layer
            the user wants out of the compute dtype (the Keras guide's float32 output layer:
            ``Dense(10, dtype=mp.output_dtype_policy)``); :meth:`prepare` gives it to none.

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
        """A ``keras.DTypePolicy`` with variables in the param dtype computing in the output dtype.

        :meth:`prepare` does not give it to any layer (the output dtype is a cast of the
        model's outputs in every backend); give it to a layer yourself to compute that layer
        in the output dtype, as the Keras mixed-precision guide does for a final softmax.

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

        Layers constructed inside use the recipe's compute and variable dtypes; the policy's
        ``matmul_precision`` (TensorFlow's global TF32 switch) is set for the block. The previous
        global policy and TF32 switch are restored on exit, also when an exception escapes.

        Yields:
            The ``keras.DTypePolicy`` in force.
        """
        previous = keras.config.dtype_policy()
        policy = self.dtype_policy
        keras.config.set_dtype_policy(policy)
        try:
            with self._placed(), matmul_precision(self.policy.matmul_precision):
                yield policy
        finally:
            keras.config.set_dtype_policy(previous)

    def loss_scale_optimizer(self, optimizer: Any, *, seed: int = 0) -> LossScaleOptimizer:
        """Wraps ``optimizer`` in unimp's :class:`LossScaleOptimizer` with the recipe's loss scale
        and the policy's ``update`` rule (``seed``: its stochastic-rounding seed).

        A Keras ``LossScaleOptimizer`` is unwrapped first; an unimp one with the recipe's loss
        scale and update rule is returned as is.

        Raises:
            TypeError: not a Keras optimizer or optimizer name.
            ValueError: an unimp optimizer with a different loss scale.
        """
        if not isinstance(optimizer, (str, keras.optimizers.Optimizer)):
            raise TypeError(
                f"optimizer must be a keras.optimizers.Optimizer or a name like 'adam', got "
                f"{type(optimizer).__name__}."
            )
        return _wrap_optimizer(optimizer, self.loss_scale, self.policy.update, seed)

    def prepare(self, model: Any, optimizer: Any = None, **compile_kwargs: Any) -> Any:
        """Applies the recipe to a Keras model and optimizer.

        * The model's floating outputs are cast to the output dtype (its ``call`` is wrapped, as
          torch's ``forward`` and JAX's :meth:`apply`): every layer, the last one included,
          computes in the policy it was built with, so one recipe is one computation in every
          framework (:class:`unimp.Policy`). Build the model inside :meth:`autocast` (a
          warning says so when the model's policy differs). For the Keras guide's float32
          output layer (a float16 softmax can overflow), give that layer
          ``dtype=mp.output_dtype_policy``. The wrapper is not saved with the model, and
          ``copy.deepcopy`` (which Keras does through the config) drops it too: a loaded or
          copied model returns its last layer's dtype until prepared again. Preparing the
          same model again is a ``ValueError``, as in torch (prepare applies the recipe once).
        * An FP8 recipe: the Dense layers it selects (:meth:`fp8_layers`; the first and last
          out by default) get unimp's emulated float8 matmul in their ``call`` and float32
          scaling states (non-trainable variables), in place; the model must be built.
        * The optimizer is wrapped in unimp's :class:`LossScaleOptimizer` (not Keras's) with
          the recipe's loss scale; with ``compile_kwargs`` (``loss=``, ``metrics=``, ...) the
          model is compiled with it, so ``fit`` follows unimp's rule. A model already
          compiled with another optimizer is left alone, with a warning that says so.
        * Each layer the policy's ``overrides`` cover gets its override's Keras dtype policy
          (:mod:`unimp.backends.tensorflow.overrides`; e.g. ``"mixed_float16;l2:float32"``
          gives layer ``l2`` the ``float32`` policy, the guide's float32 output layer).

        Args:
            model: a ``keras.Model`` (or layer) built inside :meth:`autocast`.
            optimizer: a Keras optimizer or name (``"adam"``), or ``None``.
            **compile_kwargs: passed to ``model.compile`` together with the wrapped optimizer.

        Returns:
            The same model alone when no optimizer is given, else ``(model, optimizer)`` with
            the wrapped optimizer: the shape of every backend's ``prepare`` (and of Apex's
            ``amp.initialize``).

        Raises:
            TypeError: ``model`` is not a Keras layer or model, or has an attribute ``_unimp`` of
                its own (:mod:`unimp.attached`); a bad optimizer.
            ValueError: the model was already prepared, compile arguments without an
                optimizer, an override conflict or an override Keras cannot express. Nothing is changed when an error is raised.
        """
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"prepare needs a keras.Model, got {type(model).__name__}.")
        check_attachable(model)  # where unimp keeps its facts: refused before anything changes
        if peek(model, "prepared", False):  # as torch's prepare
            raise ValueError("this model was already prepared; prepare() applies the recipe once.")
        if optimizer is not None and not isinstance(optimizer, (str, keras.optimizers.Optimizer)):
            raise TypeError(
                f"optimizer must be a keras.optimizers.Optimizer, a name like 'adam', or None, got "
                f"{type(optimizer).__name__}."
            )
        if "optimizer" in compile_kwargs:
            raise TypeError(
                "pass the optimizer as prepare(model, optimizer, ...), not in compile arguments."
            )
        _check_half_variables(model, self.loss_scale)
        if compile_kwargs and optimizer is None:
            raise ValueError(
                "compile arguments need an optimizer: prepare(model, 'adam', loss=...)."
            )
        wrapped = None if optimizer is None else self.loss_scale_optimizer(optimizer)
        overridden = _resolve(self, model)  # warns / raises before anything changes
        # built outside autocast: none of the layers holding weights has the recipe's policy
        # (the model's own policy is not the test: a loaded or deep-copied model is rebuilt
        # under the global policy while its layers keep the policies they were saved with)
        weighted = [x for x in model._flatten_layers(include_self=False) if x.weights] or [model]
        if not self.policy.is_float32 and all(
            x.dtype_policy.name != self._keras_name for x in weighted
        ):
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
        if self._recipe.fp8 is not None:
            fp8_swap(model, self._recipe.fp8)
        if compile_kwargs:  # first: a bad compile argument leaves the model untouched
            model.compile(optimizer=wrapped, **compile_kwargs)
        apply_overrides(self, model, overridden)
        self._cast_outputs(model)
        attach(model).prepared = True  # a deep copy (through the config) drops it, as the cast
        return model if optimizer is None else (model, wrapped)

    def fp8_layers(self, model: Any) -> tuple[str, ...]:
        """The dotted paths (layer names joined, ``"mlp.fc1"``) of the Dense layers that run
        float8 matmuls under the recipe, in model order; ``()`` without an FP8 recipe. The
        same rule and names in every backend (:meth:`unimp.fp8.recipe.FP8Recipe.select`; first
        and last Dense out by default). ``EinsumDense`` (``MultiHeadAttention``'s projections)
        is not a Dense here.

        Raises:
            TypeError: ``model`` is not a Keras layer or model.
            ValueError: a selected layer called at several places (named).
        """
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"mp.fp8_layers(model) takes a keras.Model (or layer), got {type(model).__name__}.")
        if self._recipe.fp8 is None:
            return ()
        return fp8_select(model, self._recipe.fp8)

    def _cast_outputs(self, model: Any) -> None:
        """Wraps ``model.call`` so its floating outputs come out in the output dtype.

        A method bound to the model, not a closure over it, so ``copy.deepcopy`` rebinds it to
        the copy. Preparing again with the same output dtype changes nothing.

        Raises:
            ValueError: the model was prepared for another output dtype.
        """
        done = peek(model, "output_dtype", None)
        if done is not None:
            if done != self.policy.output_dtype:
                raise ValueError(
                    f"this model was prepared with output dtype {done}; prepare applies one recipe "
                    f"per model (here output {self.policy.output_dtype}): build the model again "
                    "under this recipe's autocast()."
                )
            return
        attach(model).call = model.call
        attach(model).output_dtype = self.policy.output_dtype
        model.call = types.MethodType(_cast_call, model)

    def train_step(
        self,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        jit_compile: bool = False,
        stats_every: int | None = None,
        log: Any = None,
        log_every: int = 100,
        rounding_seed: int = 0,
        schedule_counts: str = "applied",
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
        :class:`ReplicaDesyncWarning`. ``jit_compile`` is refused there (measured: the
        replica step compiled by XLA reads the mirrored variables' copies on other devices).

        ``grad_accum_steps``, ``max_grad_norm``, ``stats_every``, ``schedule_counts``, ``log``,
        ``log_every`` and ``rounding_seed`` are the options every backend takes, validated and
        documented once by :class:`unimp.trainstep.StepOptions`; below, what some of them mean
        in Keras.

        Args:
            model: a built Keras model (``model.trainable_variables`` non-empty); the policy's
                ``overrides`` are applied to it here if :meth:`prepare` did not.
            optimizer: a Keras optimizer (wrapped in :class:`LossScaleOptimizer` with the
                recipe's loss scale) or an unimp :class:`LossScaleOptimizer` (used as is).
            loss_fn: ``loss_fn(model, batch) -> scalar loss``.
            jit_compile: compile the step with XLA.
            schedule_counts: ``"applied"`` (default: a skipped step leaves ``iterations``, hence
                any learning-rate schedule, unchanged) or ``"attempted"`` (``iterations`` grows
                on a skipped step too); see :data:`unimp.step.SCHEDULE_COUNTS`.
            stats_every: ``None`` (default) or ``k >= 1``: on calls 0, k, 2k, ... (counted by
                the step; a call that raises is not counted) the result's ``stats`` holds
                :class:`unimp.stats.StepStats`: each trainable variable's gradient (named by
                ``variable.path`` from the model down, without the model's own name:
                ``"dense/kernel"``), unscaled and before clipping, at the step's loss scale; and
                the floating outputs of every leaf layer (named as its weights are:
                ``"dense"``; ``name.0`` / ``name.key`` for tuple and dict outputs) at scale 1, every call of a layer (every micro-batch) taken together. Those steps run a second ``tf.function``
                (:attr:`TrainStep.stats_function`, traced on its first call), which while
                tracing wraps each leaf layer's ``call`` to record its output (a layer in a
                quantized mode is not seen); the others call the plain one, whose graph is
                the same as without the option. Reading ``result.stats`` is the only sync.
                Not supported under a ``tf.distribute`` strategy (a ``ValueError``).

        Returns:
            A :class:`TrainStep`; ``step.state_dict()`` / ``load_state_dict()`` hold the
            loss-scale state in the portable format.

        Raises:
            TypeError: ``loss_fn`` not callable, bad optimizer or model.
            ValueError: bad ``grad_accum_steps``, ``max_grad_norm`` or ``stats_every`` (before
                anything is built), an unbuilt model, or ``stats_every`` under a strategy.
        """
        options = StepOptions(
            grad_accum_steps, max_grad_norm, stats_every, schedule_counts, log, log_every, rounding_seed
        )
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"train_step needs a keras.Model, got {type(model).__name__}.")
        if not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be callable as loss_fn(model, batch), got {type(loss_fn).__name__}."
            )
        if not model.built or not model.trainable_variables:
            raise ValueError(
                "the model has no trainable variables yet: build it first (keras.Input in the "
                "model, model.build(input_shape), or call it on one batch)."
            )
        if isinstance(optimizer, LossScaleOptimizer):
            lso = optimizer
            _check_update_rule(lso, self.policy.update, options.rounding_seed)
        else:
            lso = self.loss_scale_optimizer(optimizer, seed=options.rounding_seed)
        _check_half_variables(model, lso.loss_scale_config)
        if self.policy.overrides and not peek(model, "overrides", False):
            apply_overrides(self, model)  # a model not prepared still runs its overrides
        step = TrainStep(
            model, lso, loss_fn, options, bool(jit_compile), device=self._device, policy=self.policy
        )
        return with_log(step, self, log, options.log_every, step.optimizer.loss_scale_config, _to_host)


def _check_update_rule(lso: LossScaleOptimizer, mode: str, seed: int) -> None:
    """An unimp optimizer given to ``train_step`` applies the policy's ``update``; one that
    ``prepare`` made (seed 0) takes the step's seed until it is built."""
    lso.update_seed = step_seed(
        lso.update_mode, lso.update_seed, lso.built, mode, seed, "its .inner_optimizer"
    )


def _check_half_variables(model: Any, loss_scale: Any) -> None:
    """float16 trainable variables under a loss scale: refused (the rule of every backend)."""
    check_scaled_half_params(
        [v.path for v in model.trainable_variables if str(v.dtype) == "float16"],
        loss_scale,
        "build those layers under a float32 or mixed dtype policy",
    )
