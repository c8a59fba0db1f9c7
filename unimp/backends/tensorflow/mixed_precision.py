"""TensorFlow :class:`MixedPrecision`: a recipe bound to Keras 3 on TensorFlow: the Keras
integration (:class:`unimp.keras.MixedPrecision`: dtype policies under ``autocast()``,
``prepare`` for ``model.fit``, overrides) with what only TensorFlow has: ``tf.device``
placement, the TF32 switch, float8 layers, ``tf.distribute`` and a traced ``train_step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from unimp.backends._base import MixedPrecisionBase
from unimp.backends.tensorflow.blockscale import BlockScaledDense, block_swap
from unimp.backends.tensorflow.casting import cast_tree, to_dtype
from unimp.backends.tensorflow.devices import _as_device, _check_placed
from unimp.backends.tensorflow.fp8 import FP8Dense, fp8_swap
from unimp.backends.tensorflow.optimizer import LossScaleOptimizer
from unimp.backends.tensorflow.precision import matmul_precision
from unimp.backends.tensorflow.scaling import _to_host
from unimp.backends.tensorflow.step import TrainStep
from unimp.keras.mixed_precision import MixedPrecision as KerasMixedPrecision
from unimp.steprecorder import with_log
from unimp.trainstep import StepOptions


class MixedPrecision(KerasMixedPrecision):
    """A recipe bound to Keras 3 on TensorFlow.

    Keras has no per-op autocast: every cast mode uses Keras's per-layer dtype policies
    (layers cast their float inputs and variables to the compute dtype, integer inputs are
    never cast, normalization layers compute their statistics in float32). The Keras side
    (:meth:`autocast`, :meth:`prepare`, :meth:`loss_scale_optimizer`, overrides) is
    :class:`unimp.keras.MixedPrecision`'s; this class adds placement, the TF32 switch
    (``matmul_precision``), float8 layers (FP8 recipes), the policy's ``update`` rule, and a
    ``tf.function`` :meth:`train_step` that runs under ``tf.distribute``.

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
    _to_dtype = staticmethod(to_dtype)
    optimizer_class = LossScaleOptimizer
    _fp8_dense = (FP8Dense,)
    _block_dense = (BlockScaledDense,)
    _fp8_states_are_gradients = False  # non-trainable variables written in the step

    backend = "tensorflow"

    def __init__(self, recipe: Any = "mixed_float16", device: Any = None) -> None:
        resolved = None if device is None else _as_device(device)  # before anything is kept
        super().__init__(recipe)
        self._device = resolved

    trace = MixedPrecisionBase.trace  # this backend's dtype trace (unimp.keras has none yet)

    @property
    def device(self) -> str | None:
        """The bound TensorFlow device name (``"/CPU:0"``, ``"/GPU:1"``), or None."""
        return self._device

    def _placed(self) -> contextlib.AbstractContextManager:
        if self._device is None:
            return contextlib.nullcontext()
        _check_placed(self._device)
        return tf.device(self._device)

    @contextlib.contextmanager
    def _block(self) -> Any:
        """:meth:`autocast` also enters ``tf.device`` of the bound device, if any, and sets the
        policy's ``matmul_precision`` (TensorFlow's global TF32 switch), restored on exit."""
        with self._placed(), matmul_precision(self.policy.matmul_precision):
            yield

    def _block_engine_refusal(self) -> str | None:
        """Block-scaled recipes run here (:func:`unimp.backends.tensorflow.blockscale.block_swap`)."""
        return None

    def _block_swap(self, model: Any) -> None:
        """Gives the Dense layers a block-scaled recipe selects the block-scaled matmul
        (:func:`unimp.backends.tensorflow.blockscale.block_swap`)."""
        if self._recipe.block is not None:
            block_swap(model, self._recipe.block)

    def _fp8_swap(self, model: Any) -> None:
        """This backend's float8 layers (:func:`unimp.backends.tensorflow.fp8.fp8_swap`)."""
        if self._recipe.fp8 is not None:
            fp8_swap(model, self._recipe.fp8)

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
        stats_formats: Any = (),
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
        ``log_every``, ``rounding_seed`` and ``stats_formats`` (block-scaled formats whose
        quantization error the statistics take) are the options every backend takes,
        validated and documented once by :class:`unimp.trainstep.StepOptions`; below, what
        some of them mean in Keras.

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
            grad_accum_steps, max_grad_norm, stats_every, schedule_counts, log, log_every, rounding_seed,
            stats_formats=stats_formats,
        )
        lso = self._step_inputs(model, optimizer, loss_fn, options)
        step = TrainStep(
            model, lso, loss_fn, options, bool(jit_compile), device=self._device, policy=self.policy
        )
        return with_log(step, self, log, options.log_every, step.optimizer.loss_scale_config, _to_host)

