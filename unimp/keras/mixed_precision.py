"""``MixedPrecision`` for Keras 3 on any of its backends: the recipe as Keras dtype policies,
unimp's :class:`~unimp.keras.LossScaleOptimizer`, per-layer overrides, ``prepare`` for
``model.fit`` and a custom-loop ``train_step``.

The TensorFlow backend's ``MixedPrecision`` is this class with what only TensorFlow has
(``tf.device`` placement, the TF32 switch, float8 layers, ``tf.distribute``, a traced step).
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras

from unimp.attached import attach, check_attachable, peek
from unimp.backends._base import MixedPrecisionBase
from unimp.keras.blockscale import block_swap
from unimp.keras.casting import cast_tree, keras_policy_name, to_dtype
from unimp.keras.fp8 import fp8_select, fp8_swap
from unimp.keras.optimizer import LossScaleOptimizer
from unimp.keras.overrides import apply_overrides, resolve
from unimp.keras.precision import matmul_precision
from unimp.keras.step import TrainStep, host_value
from unimp.rounding import step_seed
from unimp.step import check_scaled_half_params
from unimp.steprecorder import with_log
from unimp.trainstep import StepOptions

__all__ = ["MixedPrecision", "check_half_variables"]


def _cast_call(model: Any, *args: Any, **kwargs: Any) -> Any:
    """The call of a prepared model: the original call, floating outputs in the output dtype."""
    return cast_tree(model._unimp.call(*args, **kwargs), model._unimp.output_dtype)


class MixedPrecision(MixedPrecisionBase):
    """A recipe bound to Keras 3, on whichever backend ``KERAS_BACKEND`` selects.

    Keras has no per-op autocast: every cast mode uses Keras's per-layer dtype policies
    (layers cast their float inputs and variables to the compute dtype, integer inputs are
    never cast, normalization layers compute their statistics in float32).

    On Keras's JAX and torch backends (``unimp.mixed_precision(..., backend="keras-jax")``)
    this class is the whole integration; on TensorFlow, ``backend="tensorflow"`` binds its
    subclass, which adds placement, the TF32 switch, float8 layers and ``tf.distribute``.
    The policy's ``update`` (compensated or stochastic updates of half variables) runs in
    :class:`~unimp.keras.LossScaleOptimizer` on every engine. An FP8 recipe runs emulated
    float8 Dense layers on Keras-JAX / Keras-torch (:mod:`unimp.keras.fp8`), a block-scaled
    recipe emulated block-scaled ones (:mod:`unimp.keras.blockscale`). The policy's
    ``matmul_precision`` is the engine's own setting (:mod:`unimp.keras.precision`), in force
    in :meth:`autocast` and in every train step.

    Args:
        recipe: a :class:`~unimp.Recipe` or anything :func:`~unimp.get_recipe` accepts.

    Attributes:
        compute_dtype, param_dtype, output_dtype: Keras dtype names (``"float16"``).
        dtype_policy: the ``keras.DTypePolicy`` for the recipe (e.g. ``mixed_float16``).
        output_dtype_policy: a ``keras.DTypePolicy`` computing in the output dtype, for a layer
            the user wants out of the compute dtype (the Keras guide's float32 output layer:
            ``Dense(10, dtype=mp.output_dtype_policy)``); :meth:`prepare` gives it to none.

    Raises:
        ValueError: the policy has no Keras ``DTypePolicy`` (Keras stores variables either in
            the compute dtype or in float32 with half compute), naming the policies it has.

    Example:
        >>> mp = MixedPrecision("mixed_bfloat16")
        >>> mp.dtype_policy.name, mp.compute_dtype
        ('mixed_bfloat16', 'bfloat16')
    """

    _cast_tree = staticmethod(cast_tree)
    _to_dtype = staticmethod(to_dtype)
    #: the loss-scale optimizer class this Keras integration wraps optimizers in
    optimizer_class: type = LossScaleOptimizer
    #: the float8 Dense classes of the backend, counted as ``"Dense"`` layers by fp8_layers
    _fp8_dense: tuple[type, ...] = ()
    #: the block-scaled Dense classes of the backend, counted as ``"Dense"`` layers likewise
    _block_dense: tuple[type, ...] = ()
    #: whether the float8 states take their new values as gradients (unimp.keras.fp8), which
    #: Keras's own gradient accumulation would merge by their maximum
    _fp8_states_are_gradients = True

    backend = "keras"

    def __init__(self, recipe: Any = "mixed_float16") -> None:
        super().__init__(recipe)
        p = self.policy
        name = keras_policy_name(p.param_dtype, p.compute_dtype)
        if name is None:
            raise ValueError(
                f"Keras has no dtype policy for {p}: it keeps variables in the compute dtype or in "
                "float32 with float16/bfloat16 compute. Use e.g. 'mixed_float16', 'mixed_bfloat16', "
                "'float32', 'bfloat16' or 'params=float32,compute=float16,output=float32'."
            )
        if self.backend == "keras":  # the engine, named in step logs and the doctor's report
            self.backend = f"keras-{keras.backend.backend()}"
        self._keras_name = name
        self._output_name = keras_policy_name(p.param_dtype, p.output_dtype)

    @property
    def compute_dtype(self) -> Any:
        """The compute dtype (a Keras dtype name; a ``tf.DType`` on the TensorFlow backend)."""
        return self._to_dtype(self.policy.compute_dtype)

    @property
    def param_dtype(self) -> Any:
        """The parameter (variable) dtype, as :attr:`compute_dtype`."""
        return self._to_dtype(self.policy.param_dtype)

    @property
    def output_dtype(self) -> Any:
        """The output dtype, as :attr:`compute_dtype`."""
        return self._to_dtype(self.policy.output_dtype)

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

    def _block(self) -> contextlib.AbstractContextManager:
        """What :meth:`autocast` enters besides the dtype policy: the policy's
        ``matmul_precision`` on the engine."""
        return matmul_precision(self.policy.matmul_precision)

    @contextlib.contextmanager
    def autocast(self) -> Iterator[Any]:
        """Sets Keras's global dtype policy to :attr:`dtype_policy` inside the block.

        Layers constructed inside use the recipe's compute and variable dtypes; the policy's
        ``matmul_precision`` is set for the block. The previous global policy and precision
        are restored on exit, also when an exception escapes.

        Yields:
            The ``keras.DTypePolicy`` in force.
        """
        previous = keras.config.dtype_policy()
        policy = self.dtype_policy
        keras.config.set_dtype_policy(policy)
        try:
            with self._block():
                yield policy
        finally:
            keras.config.set_dtype_policy(previous)

    def _wrap(self, optimizer: Any, seed: int) -> Any:
        """``optimizer`` (a Keras optimizer or name) in :attr:`optimizer_class`; one of that
        class is taken as is once :meth:`_check_given` accepts it, Keras's own is unwrapped."""
        if isinstance(optimizer, self.optimizer_class):
            self._check_given(optimizer, seed)
            return optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):  # Keras's own: unwrapped
            optimizer = optimizer.inner_optimizer
        return self._new_optimizer(keras.optimizers.get(optimizer), seed)

    def _check_given(self, optimizer: Any, seed: int) -> None:
        """Refuses an optimizer of :attr:`optimizer_class` the recipe would not have made: another
        loss scale, update rule or seed, naming the fix."""
        self._check_loss_scale(optimizer)
        update = self.policy.update
        if (optimizer.update_mode, optimizer.update_seed) != (update, seed):
            raise ValueError(
                f"the optimizer applies update={optimizer.update_mode!r} with seed "
                f"{optimizer.update_seed}, the recipe asks for update={update!r} with seed "
                f"{seed}: pass its inner_optimizer and unimp wraps it."
            )

    def _new_optimizer(self, inner: Any, seed: int) -> Any:
        """:attr:`optimizer_class` around ``inner`` with the recipe's loss scale and update rule."""
        return self.optimizer_class(inner, loss_scale=self.loss_scale, update=self.policy.update, seed=seed)

    def _check_loss_scale(self, optimizer: Any) -> None:
        """An unimp optimizer given as is must hold the recipe's loss scale (every engine).

        Raises:
            ValueError: another loss scale, naming the fix.
        """
        if optimizer.loss_scale_config != self.loss_scale:
            raise ValueError(
                f"the optimizer's loss scale is {optimizer.loss_scale_config}, the recipe's is "
                f"{self.loss_scale}: pass its inner_optimizer and unimp wraps it."
            )

    def loss_scale_optimizer(self, optimizer: Any, *, seed: int = 0) -> Any:
        """Wraps ``optimizer`` in unimp's loss-scale optimizer with the recipe's loss scale
        (``seed``: the stochastic-rounding seed of the policy's ``update`` rule, where the
        backend runs it).

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
        return self._wrap(optimizer, seed)

    def trace(self, step_or_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Which ops of one step ran in which dtype: :class:`unimp.trace.Trace`.

        On Keras-JAX the step is traced to a jaxpr and read by the JAX backend's trace
        (:mod:`unimp.backends.jax.trace`): nothing runs. On Keras-torch the step runs once under
        the torch backend's trace (:mod:`unimp.backends.torch.trace`: torch's dispatcher, and
        Keras's layers, which are torch modules, through module hooks), and everything it
        changed is put back: the model's and the optimizer's variables (the loss scale with
        them) and the step's counter; the traced call computes no statistics and writes no
        step log. Layers are named from the model down (``"l1"``, ``"mlp/fc1"``, as the
        TensorFlow backend's trace names them); the records say ``framework="keras-jax"`` or
        ``"keras-torch"``.

        Args:
            step_or_fn: a train step of this class (then ``args`` is ``(batch,)``), or any
                function of the backend's tensors.
            *args: what it is called with.
            **kwargs: its keyword arguments (``model=`` is ignored: the step's model, or
                Keras's name scopes, name the layers).

        Returns:
            The :class:`unimp.trace.Trace`.

        Raises:
            ValueError: a train step called with other than one batch.
        """
        from unimp import registry
        from unimp.trace import Trace

        engine = keras.backend.backend()
        kwargs.pop("model", None)
        if isinstance(step_or_fn, TrainStep) and len(args) != 1:
            raise ValueError(f"mp.trace(step, batch) takes one batch, got {len(args)} arguments.")
        registry.get_backend(engine)  # loads the engine's backend (or names its extra)
        if engine == "torch":
            found = self._trace_torch(step_or_fn, args, kwargs)
            return Trace([dataclasses.replace(r, framework=self.backend) for r in found], self.backend, found.recipe)
        prefix = ""
        if isinstance(step_or_fn, TrainStep):
            (batch,) = args
            prefix = f"{step_or_fn.model.name}/"
            step_or_fn, args = step_or_fn.traceable(batch)
        from unimp.backends.jax.trace import trace as jax_trace

        found = jax_trace(step_or_fn, *args, recipe=self._recipe.describe(), **kwargs)
        records = [
            dataclasses.replace(
                r, framework=self.backend,
                layer=r.layer[len(prefix):] if prefix and r.layer.startswith(prefix) else r.layer,
            )  # fmt: skip
            for r in found
        ]
        return Trace(records, self.backend, found.recipe)

    def _trace_torch(self, fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Keras-torch: one call of ``fn`` under the torch backend's trace; a train step is put
        back as it was afterwards (:meth:`trace`)."""
        from keras import ops

        from unimp.backends.torch.trace import trace as torch_trace
        from unimp.keras.fp8 import fp8_model_layers

        recipe = self._recipe.describe()
        if not isinstance(fn, TrainStep):
            return torch_trace(fn, *args, recipe=recipe, **kwargs)
        step = fn
        layers = {id(layer): path.replace(".", "/") for path, _, layer in fp8_model_layers(step.model)}
        held = step._variables()
        saved = [ops.copy(v.value) for v in held]
        calls, options = step.calls, step.options
        recorder = vars(step).pop("_recorder", None)  # a traced step is no step of the log
        step.options = dataclasses.replace(options, stats_every=None)  # nor a statistics step
        try:
            return torch_trace(step, *args, recipe=recipe, layers=layers, **kwargs)
        finally:
            for v, old in zip(held, saved, strict=True):
                v.assign(old)
            step.calls, step.options = calls, options
            if recorder is not None:
                step._recorder = recorder

    def _fp8_swap(self, model: Any) -> None:
        """Gives the Dense layers an FP8 recipe selects unimp's float8 matmul
        (:func:`unimp.keras.fp8.fp8_swap`)."""
        if self._recipe.fp8 is not None:
            fp8_swap(model, self._recipe.fp8)

    def _block_engine_refusal(self) -> str | None:
        """Why this Keras engine cannot run the recipe's block-scaled layers, or None: Keras's
        JAX and torch engines run them here (:mod:`unimp.keras.blockscale`), its TensorFlow
        engine in the TensorFlow backend's subclass."""
        engine = keras.backend.backend()
        if self._recipe.block is None or engine in ("jax", "torch"):
            return None
        return (f"block-scaled recipe {self._recipe.block.rule.name!r}: on Keras's {engine!r} engine the "
                "block-scaled Dense layers are the TensorFlow backend's; bind the recipe with "
                "backend='tensorflow' (or backend='keras').")

    def _block_swap(self, model: Any) -> None:
        """Gives the Dense layers a block-scaled recipe selects the block-scaled matmul
        (:func:`unimp.keras.blockscale.block_swap`)."""
        if self._recipe.block is not None:
            block_swap(model, self._recipe.block)

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
        * An FP8 recipe: the Dense layers it selects (``fp8_layers``; the first and last out
          by default) get unimp's emulated float8 matmul in their ``call`` and float32
          scaling states, in place; the model must be built. On Keras's JAX and torch
          backends the states are trainable variables with ``overwrite_with_gradient``, as
          Keras's own float8 ``Dense`` keeps them (:mod:`unimp.keras.fp8`); on TensorFlow,
          non-trainable variables written in the step (:mod:`unimp.backends.tensorflow.fp8`).
        * A block-scaled recipe (``mxfp8``, ``fp8-block``, ``nvfp4``, ``mxfp4``): the Dense
          layers it selects (the same first/last rule) get the block-scaled matmul in their
          ``call`` and a ``block_step`` counter, in place; the model must be built. On Keras's
          JAX and torch backends the rule runs over that framework backend's namespaces
          (:mod:`unimp.keras.blockscale`); on TensorFlow, the TensorFlow backend's
          (:func:`unimp.backends.tensorflow.blockscale.block_swap`).
        * The optimizer is wrapped in unimp's loss-scale optimizer (not Keras's) with the
          recipe's loss scale; with ``compile_kwargs`` (``loss=``, ``metrics=``, ...) the
          model is compiled with it, so ``fit`` follows unimp's rule. A model already
          compiled with another optimizer is left alone, with a warning that says so.
        * Each layer the policy's ``overrides`` cover gets its override's Keras dtype policy
          (:mod:`unimp.keras.overrides`; e.g. ``"mixed_float16;l2:float32"`` gives layer
          ``l2`` the ``float32`` policy, the guide's float32 output layer).

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
                optimizer, an override conflict or an override Keras cannot express. Nothing
                is changed when an error is raised.
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
        check_half_variables(model, self.loss_scale)
        why = self._block_engine_refusal()
        if why is not None:
            raise ValueError(why)
        if compile_kwargs and optimizer is None:
            raise ValueError(
                "compile arguments need an optimizer: prepare(model, 'adam', loss=...)."
            )
        wrapped = None if optimizer is None else self.loss_scale_optimizer(optimizer)
        if (
            wrapped is not None and self._recipe.fp8 is not None and self._fp8_states_are_gradients
            and getattr(wrapped.inner_optimizer, "gradient_accumulation_steps", None)
        ):  # the optimizer's build refuses it too (a model swapped otherwise); here first
            raise ValueError(
                "the optimizer's gradient_accumulation_steps with an FP8 recipe: Keras would merge "
                "the float8 states by their maximum, not by unimp's window rule. Accumulate in "
                "unimp's step instead: mp.train_step(model, optimizer, loss_fn, grad_accum_steps=k)."
            )
        overridden = resolve(self, model)  # warns / raises before anything changes
        self._warn_built_outside(model)
        current = getattr(model, "optimizer", None)
        if (
            optimizer is None
            and current is not None
            and not isinstance(current, self.optimizer_class)
        ):
            warnings.warn(
                f"the model is compiled with {type(current).__name__}, so fit does not follow the "
                "recipe's loss scale. Compile through prepare instead: "
                "mp.prepare(model, optimizer, loss=..., metrics=...).",
                stacklevel=2,
            )
        self._fp8_swap(model)
        self._block_swap(model)
        if compile_kwargs:  # first: a bad compile argument leaves the model untouched
            model.compile(optimizer=wrapped, **compile_kwargs)
        apply_overrides(self, model, overridden)
        self._cast_outputs(model)
        attach(model).prepared = True  # a deep copy (through the config) drops it, as the cast
        return model if optimizer is None else (model, wrapped)

    def _warn_built_outside(self, model: Any) -> None:
        """Warns when the model was built outside :meth:`autocast`: none of the layers holding
        weights has the recipe's policy (the model's own policy is not the test: a loaded or
        deep-copied model is rebuilt under the global policy while its layers keep the
        policies they were saved with)."""
        weighted = [x for x in model._flatten_layers(include_self=False) if x.weights] or [model]
        if not self.policy.is_float32 and all(
            x.dtype_policy.name != self._keras_name for x in weighted
        ):
            warnings.warn(
                f"the model's dtype policy is {model.dtype_policy.name!r}, the recipe's is "
                f"{self._keras_name!r}: its layers were built outside mp.autocast() and keep their "
                "dtypes. Build the model inside `with mp.autocast():`.",
                stacklevel=3,
            )

    def fp8_layers(self, model: Any) -> tuple[str, ...]:
        """The dotted paths of the Dense layers that run float8 matmuls under the recipe (a
        block-scaled recipe's layers under one), the same rule and names in every backend
        (:meth:`unimp.fp8.recipe.FP8Recipe.select`; first and last out by default); ``()``
        without an FP8 or block-scaled recipe. ``EinsumDense``
        (``MultiHeadAttention``'s projections) is not a Dense here.

        Raises:
            TypeError: ``model`` is not a Keras layer or model.
            ValueError: a selected layer is called at several places.
        """
        if not isinstance(model, keras.layers.Layer):
            raise TypeError(f"mp.fp8_layers(model) takes a keras.Model (or layer), got {type(model).__name__}.")
        if self._recipe.fp8 is not None:
            return fp8_select(model, self._recipe.fp8, self._fp8_dense)
        if self._recipe.block is not None:
            return fp8_select(model, self._recipe.block, self._block_dense)
        return ()

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
        stats_every: int | None = None,
        log: Any = None,
        log_every: int = 100,
        rounding_seed: int = 0,
        schedule_counts: str = "applied",
        stats_formats: Any = (),
    ) -> TrainStep:
        """A custom-loop training step with the recipe's loss scaling: ``step(batch) -> StepResult``.

        Each call computes ``loss_fn(model, batch)`` (a floating scalar, unscaled), the
        gradients of the loss times the scale, unscales them once, and applies them through
        the optimizer unless a gradient or the loss is non-finite. A non-finite loss skips
        the step without lowering the scale; a skipped step leaves the variables, the whole
        optimizer state (``iterations`` included) and the forward state (the non-trainable
        variables: normalization statistics) unchanged. The loss-scale state follows the core
        rule bit for bit, as the torch, JAX and TensorFlow backends' steps
        (:mod:`unimp.keras.step`: Keras's own custom-loop recipe per Keras backend; on JAX one
        compilation, on torch no host read per step).

        The options are :class:`unimp.trainstep.StepOptions`', the same rules as every
        backend's step (the step's algorithm is the core's :func:`unimp.trainstep.run_step`):
        ``grad_accum_steps`` (a list of micro-batches per call), ``max_grad_norm``,
        ``stats_every`` (on calls 0, k, 2k, ... ``result.stats`` holds
        :class:`unimp.stats.StepStats`: each trainable variable's unscaled gradient, named by
        its path from the model down, and every leaf layer's outputs, recorded by wrapping
        its ``call`` for that step; on JAX a second compiled step; ``stats_formats``: with the
        block formats' quantization error), ``schedule_counts``, ``log`` / ``log_every``.

        Args:
            model: a built Keras model; the policy's ``overrides`` are applied to it here if
                :meth:`prepare` did not.
            optimizer: a Keras optimizer or name (wrapped in :class:`LossScaleOptimizer` with
                the recipe's loss scale) or an unimp :class:`LossScaleOptimizer` (used as is).
            loss_fn: ``loss_fn(model, batch) -> scalar loss``; on JAX it runs traced (no
                Python branch on a tensor, as in any jitted JAX code).

        Returns:
            A :class:`unimp.keras.step.TrainStep`.

        Raises:
            TypeError: ``loss_fn`` not callable, bad optimizer or model.
            ValueError: a bad or unsupported option (before anything is built), an unbuilt
                model.
        """
        options = StepOptions(
            grad_accum_steps, max_grad_norm, stats_every, schedule_counts, log, log_every,
            rounding_seed, stats_formats=stats_formats,
        )  # fmt: skip
        lso = self._step_inputs(model, optimizer, loss_fn, options)
        step = TrainStep(model, lso, loss_fn, options, self.policy)
        return with_log(step, self, log, options.log_every, lso.loss_scale_config, host_value)

    def _step_optimizer(self, optimizer: Any, options: StepOptions) -> Any:
        """The loss-scale optimizer a train step applies (``optimizer`` wrapped, or as is). An
        unimp optimizer given as is applies the recipe's loss scale and ``update``; one that
        ``prepare`` made (seed 0) takes the step's ``rounding_seed`` until it is built."""
        if isinstance(optimizer, self.optimizer_class):
            self._check_loss_scale(optimizer)
            optimizer.update_seed = step_seed(
                optimizer.update_mode, optimizer.update_seed, optimizer.built, self.policy.update,
                options.rounding_seed, "its .inner_optimizer",
            )
            return optimizer
        return self.loss_scale_optimizer(optimizer, seed=options.rounding_seed)

    def _step_inputs(self, model: Any, optimizer: Any, loss_fn: Any, options: StepOptions) -> Any:
        """``train_step``'s checks of what it is given, the same on every Keras backend, and
        its optimizer; the policy's overrides applied to a model ``prepare`` did not see.

        Raises:
            TypeError: not a Keras model, ``loss_fn`` not callable, a bad optimizer.
            ValueError: an unbuilt model, float16 variables under a loss scale.
        """
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
        applied = peek(model, "overrides", None)
        if applied is not None and applied != self.policy.overrides:
            raise ValueError(
                f"this model was prepared with the overrides {dict(applied) or 'none'}, the "
                f"recipe's are {dict(self.policy.overrides) or 'none'}: a model takes one recipe; "
                "build it again under this recipe's autocast()."
            )
        lso = self._step_optimizer(optimizer, options)
        check_half_variables(model, lso.loss_scale_config)
        self._warn_built_outside(model)  # also for a model another recipe prepared
        if self.policy.overrides and applied is None:
            apply_overrides(self, model)  # a model not prepared still runs its overrides
        return lso

def check_half_variables(model: Any, loss_scale: Any) -> None:
    """float16 trainable variables under a loss scale: refused (the rule of every backend)."""
    check_scaled_half_params(
        [v.path for v in model.trainable_variables if str(v.dtype) == "float16"],
        loss_scale,
        "build those layers under a float32 or mixed dtype policy",
    )
