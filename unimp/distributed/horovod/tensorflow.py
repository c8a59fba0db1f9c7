"""unimp with Horovod and TensorFlow: unimp's Keras LossScaleOptimizer reduced over the ranks,
Horovod's two TensorFlow 2 patterns, and float16 compression made safe.

Horovod's TensorFlow 2 patterns, with unimp::

    import horovod.tensorflow as hvd
    import unimp.distributed.horovod.tensorflow as uhvd

    hvd.init()
    optimizer = uhvd.DistributedOptimizer(keras.optimizers.Adam(0.001 * hvd.size()))
    optimizer.build(model.trainable_variables)
    uhvd.broadcast_variables(model.variables, root_rank=0)

    # (a) the optimizer all-reduces, the tape is plain (seed 004's snippet)
    with tf.GradientTape() as tape:
        loss = loss_fn(model(inputs), labels)
        scaled = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))

    # (b) the tape all-reduces (Horovod's DistributedGradientTape); the optimizer does not again
    tape = uhvd.DistributedGradientTape(tape, optimizer)

Either way every rank takes the same decision: the gradients are the ranks' mean, and the
finite flags (the gradients', and the loss flag of the forward-overflow rule) are all-reduced
with ``hvd.Max`` of "not finite" before the skip and the loss-scale update, inside the traced
update, so one rank's non-finite gradient skips the step on every rank and the scale backs off
on all of them. The same all-reduce compares the ranks' loss-scale states; a mismatch (a
checkpoint restored on one rank only) is re-synchronized from rank 0 with a
:class:`unimp.ReplicaDesyncWarning`, as in every engine, and that step is skipped (its
gradients were scaled by different scales). One all-reduce of
``2 + 2 * n_state`` float64 values a step, on the device; the host reads nothing unless the
states differ.

Why not Horovod's own ``hvd.DistributedOptimizer(keras_optimizer)``: it wraps tf.keras 2's
optimizer hooks, which Keras 3 does not have, and a Keras 3 optimizer passes through it
without an all-reduce (seen with Horovod 0.28.1, Keras 3.15: two ranks applying gradients 1 and 2
with SGD(1.0) to a weight 1.0 end with 0.0 and -1.0, not both -0.5).
:class:`LossScaleOptimizer` reduces in ``apply`` itself. And ``hvd.broadcast_variables`` assigns
inside a ``tf.function`` where a Keras 3 variable is a tensor ("AttributeError ... assign");
:func:`broadcast_variables` takes them.

Float16 compression: as in :mod:`unimp.distributed.horovod.torch`, ``hvd.Compression.fp16``
casts the loss-scaled gradients to float16 (65536 x a gradient of 1 is already inf) and is
refused; ``compression="fp16"`` (or a policy whose ``reduce_dtype`` is half) divides each
gradient by ``scale * world_size`` in float32 before the cast, sums, and multiplies the sum by
the scale in float32 (:class:`LossScaleCompression`).

Horovod is not installed in unimp's default test environment: this module is tested in the
``horovod`` tox env (``scripts/build_horovod.sh``; ``tests/test_horovod_tensorflow.py`` runs
``examples/distributed/horovod_tensorflow.py`` on two ranks). ``mp.train_step`` does not
all-reduce through Horovod: use one of the loops above.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf
from keras.src.utils import tracking

from unimp.backends.tensorflow import LossScaleOptimizer as _LossScaleOptimizer
from unimp.dtypes import canonical_dtype
from unimp.loss_scale import LossScaleState, warn_replica_desync
from unimp.policy import Policy

try:
    import horovod.tensorflow as hvd
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "unimp.distributed.horovod.tensorflow needs Horovod built for TensorFlow: run "
        "scripts/build_horovod.sh (Horovod 0.28.1 with a C++17 patch; Gloo, no MPI). "
        f"({e})"
    ) from e

__all__ = [
    "DistributedGradientTape",
    "DistributedOptimizer",
    "LossScaleCompression",
    "LossScaleOptimizer",
    "broadcast_state",
    "broadcast_variables",
]

#: the loss-scale state's fields, in the order of ``loss_scale_state_variables()`` (flattened)
_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(LossScaleState))


def _wire(compression: Any) -> str | None:
    """The wire dtype a ``compression`` argument asks for: None (no compression) or a half
    dtype name.

    Raises:
        ValueError: Horovod's own ``Compression.fp16``, or an unknown value.
    """
    if compression is hvd.Compression.fp16:
        raise ValueError(
            "hvd.Compression.fp16 casts the loss-scaled gradients to float16, which overflows at "
            "common scales (65536 * a gradient of 1 is already inf): pass compression='fp16', "
            "which unscales and divides by the world size in float32 before the cast."
        )
    if isinstance(compression, Policy):
        reduce = compression.reduce_dtype
        return None if reduce in (None, "float32", "float64") else reduce
    if compression is None or compression is hvd.Compression.none or compression == "none":
        return None
    if compression == "fp16":
        return "float16"
    raise ValueError(
        f"compression must be 'none', 'fp16' or a unimp.Policy (its reduce_dtype), got {compression!r}."
    )


class LossScaleCompression:
    """Horovod compression that keeps the loss scale off the half-precision wire.

    ``compress`` divides a floating gradient by ``scale * world_size`` in float32 and casts it
    to the wire dtype; the ranks must SUM (``op=hvd.Sum``, as :func:`DistributedOptimizer` and
    :func:`DistributedGradientTape` set); ``decompress`` casts back and multiplies by the scale
    in float32, giving the mean of the scaled gradients in their dtype, as ``op=hvd.Average``
    without compression would. The scale is the optimizer's ``dynamic_scale``, read on the
    device (no host read), or 1 for gradients that
    :meth:`~unimp.backends.tensorflow.LossScaleOptimizer.get_unscaled_gradients` already
    unscaled (:attr:`unscaled`). The wire then carries unscaled mean contributions: it
    overflows only where the mean of the unscaled gradients does not fit float16, and values
    below about ``world_size * 2**-25`` flush to 0 (as :func:`unimp.distributed.fp16_mean`'s
    ``mode="predivide"``).

    Args:
        optimizer: the :class:`LossScaleOptimizer` whose scale multiplies the gradients.
        world_size: the number of ranks summing (default ``hvd.size()``).
        dtype: the wire dtype, the policy's ``reduce_dtype``: ``"float16"`` (default) or
            ``"bfloat16"`` (float32's range: no overflow, 8 significand bits).

    Attributes:
        unscaled: True while the gradients to compress are already unscaled (set by
            :class:`LossScaleOptimizer` around its all-reduce; read when the all-reduce is
            traced).

    Raises:
        ValueError: ``dtype`` is not a half dtype (float32 needs no compression).

    Example:
        Rank 0's scaled gradient 65536 (inf in float16) goes on the wire as
        ``65536 / (65536 * 2) = 0.5``; rank 1's 131072 as 1.0; their sum comes back as
        ``1.5 * 65536``, the mean of the scaled gradients.
    """

    def __init__(self, optimizer: Any, world_size: int | None = None, dtype: str = "float16") -> None:
        wire = canonical_dtype(dtype)
        if wire not in ("float16", "bfloat16"):
            raise ValueError(
                f"LossScaleCompression dtype must be 'float16' or 'bfloat16', got {dtype!r}; a "
                "float32 reduce needs no compression (compression='none')."
            )
        self.optimizer = optimizer
        self.world_size = hvd.size() if world_size is None else int(world_size)
        self.dtype = tf.dtypes.as_dtype(wire)
        self.unscaled = False

    def compress(self, tensor: Any) -> tuple[Any, Any]:
        """``(wire tensor, context)``: a floating ``tensor`` divided by ``scale * world_size``
        in float32 and cast to the wire dtype; anything else as it is, with context None."""
        if not tensor.dtype.is_floating:
            return tensor, None
        if self.unscaled:
            scale = tf.constant(1.0, tf.float32)
        else:
            scale = tf.cast(tf.convert_to_tensor(self.optimizer.dynamic_scale), tf.float32)
        wire = tf.cast(tf.cast(tensor, tf.float32) / (scale * float(self.world_size)), self.dtype)
        return wire, (tensor.dtype, scale)

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """The summed wire tensor times the scale, in float32, cast back to the gradient's dtype."""
        if ctx is None:
            return tensor
        dtype, scale = ctx
        return tf.cast(tf.cast(tensor, tf.float32) * scale, dtype)


class LossScaleOptimizer(_LossScaleOptimizer):
    """:class:`unimp.backends.tensorflow.LossScaleOptimizer` that all-reduces its gradients over
    the Horovod ranks and agrees with every rank on each step.

    ``apply`` / ``apply_gradients`` take each rank's gradients of the scaled loss and replace
    them by the ranks' mean (``compression`` as :func:`DistributedOptimizer` says) before
    unscaling, unless :func:`DistributedGradientTape` with this optimizer reduced them already.
    :meth:`agree_replicas` reduces the finite flags and compares the loss-scale states in one
    all-reduce. The rest is the optimizer unimp's TensorFlow backend has: the same rule and
    state, custom loops, eagerly or inside ``tf.function``. Not under a ``tf.distribute``
    strategy (that strategy reduces over its own replicas).

    Args:
        inner_optimizer, loss_scale, **kwargs: as :class:`unimp.backends.tensorflow.LossScaleOptimizer`.
        compression: ``"none"`` (default), ``"fp16"`` or a :class:`unimp.Policy` (its
            ``reduce_dtype``), see :func:`DistributedOptimizer`.

    Raises:
        ValueError: as the base optimizer; ``hvd.Compression.fp16`` or an unknown compression.
    """

    def __init__(
        self, inner_optimizer: Any, loss_scale: Any = None, *, compression: Any = "none", **kwargs: Any
    ) -> None:
        wire = _wire(compression)  # before anything is built
        super().__init__(inner_optimizer, loss_scale=loss_scale, **kwargs)
        self._horovod_setup(wire)

    @tracking.no_automatic_dependency_tracking
    def _horovod_setup(self, wire: str | None) -> None:
        self._wire_compression = None if wire is None else LossScaleCompression(self, dtype=wire)
        self._reduced_by_tape = False  # set by DistributedGradientTape for the next apply

    def mark_reduced(self) -> None:
        """Says that the gradients of the next :meth:`apply` are the ranks' mean already
        (:func:`DistributedGradientTape` calls it), so it does not all-reduce them again.
        Python state, read when the step is traced."""
        self._reduced_by_tape = True

    def apply(self, grads: Any, trainable_variables: Any = None) -> None:
        """All-reduces the gradients (unless :func:`DistributedGradientTape` did), then
        unscales, checks, agrees over the ranks and applies, as the base optimizer.

        Raises:
            ValueError: as the base optimizer's ``apply``.
        """
        grads = list(grads)
        reduced, self._reduced_by_tape = self._reduced_by_tape, False
        if not reduced and hvd.size() > 1:
            grads = self._allreduce(grads)
        super().apply(grads, trainable_variables)

    def _allreduce(self, grads: list[Any]) -> list[Any]:
        comp = self._wire_compression
        if comp is None:
            return [None if g is None else hvd.allreduce(g, op=hvd.Average) for g in grads]
        # gradients of get_unscaled_gradients (tf.keras 2's loop) carry no scale: divide by 1
        comp.unscaled = self._gradients_unscaled
        try:
            # IndexedSlices are gathered, not summed, by Horovod, and never compressed: dense
            return [
                None if g is None else hvd.allreduce(tf.convert_to_tensor(g), op=hvd.Sum, compression=comp)
                for g in grads
            ]
        finally:
            comp.unscaled = False

    def agree_replicas(self, grads_finite: Any, loss_finite: Any) -> tuple[Any, Any]:
        """The finite flags reduced over the Horovod ranks, and the loss-scale state made the
        same on every rank, in one all-reduce (``hvd.Max`` of "not finite" and of each state
        field and its negation, float64). Where the states differ, every rank takes rank 0's
        (``hvd.broadcast``), a :class:`unimp.ReplicaDesyncWarning` names the fields with their
        min and max, and the step is skipped as a forward overflow (the ranks scaled their
        losses by different scales, so the mean of their gradients is none; the scale taken
        from rank 0 is kept). Inside the traced update; the host reads nothing unless the
        states differ. On one rank, the flags as given.

        Args:
            grads_finite, loss_finite: boolean scalar tensors, this rank's.

        Returns:
            ``(grads_finite, loss_finite)``, boolean scalar tensors, the same on every rank.
        """
        if hvd.size() == 1:
            return grads_finite, loss_finite
        held = self.loss_scale_state_variables()
        mine = tf.concat([tf.reshape(tf.cast(tf.convert_to_tensor(v), tf.float64), [-1]) for v in held], 0)
        bad = tf.cast(tf.stack([tf.logical_not(grads_finite), tf.logical_not(loss_finite)]), tf.float64)
        both = hvd.allreduce(tf.concat([bad, mine, -mine], 0), op=hvd.Max, name="unimp.step_agreement")
        n = int(mine.shape[0])
        hi, lo = both[2 : 2 + n], -both[2 + n :]
        names = _STATE_FIELDS[:n]

        def resync() -> tf.Tensor:
            tf.py_function(lambda a, b: _warn(names, a.numpy(), b.numpy()), [lo, hi], [])
            for v in held:
                v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank=0))
            return tf.constant(True)

        differ = tf.reduce_any(tf.not_equal(hi, lo))
        tf.cond(differ, resync, lambda: tf.constant(False))
        # the ranks scaled their losses by different scales: their mean is no gradient; skip the
        # step as a forward overflow (the re-synchronized scale is kept)
        return tf.equal(both[0], 0.0), tf.logical_and(tf.equal(both[1], 0.0), tf.logical_not(differ))


def _warn(names: tuple[str, ...], lo: np.ndarray, hi: np.ndarray) -> None:
    differ = [f"{n} in [{a:g}, {b:g}]" for n, a, b in zip(names, lo, hi, strict=True) if a != b]
    warn_replica_desync(
        "Load the same checkpoint on every rank, or call uhvd.broadcast_state(optimizer) after loading",
        differ,
    )


def DistributedOptimizer(  # noqa: N802 - mirrors hvd.DistributedOptimizer
    optimizer: Any, loss_scale: Any = None, compression: Any = "none", **kwargs: Any
) -> LossScaleOptimizer:
    """``hvd.DistributedOptimizer`` for Keras 3 with unimp's loss scaling: a
    :class:`LossScaleOptimizer` that all-reduces in ``apply``.

    Args:
        optimizer: a Keras optimizer (``keras.optimizers.Adam(...)``), or a not yet built
            :class:`unimp.backends.tensorflow.LossScaleOptimizer`, whose inner optimizer, loss
            scale and ``update`` rule are taken.
        loss_scale: the loss scale for a plain Keras optimizer (see the base optimizer;
            ``None``: unimp's ``DynamicLossScale()``); not with a LossScaleOptimizer, which
            has its own.
        compression: ``"none"`` (the mean in the gradients' dtype, ``hvd.Average``), ``"fp16"``
            (:class:`LossScaleCompression`, ``hvd.Sum``), or a :class:`unimp.Policy`: its
            ``reduce_dtype`` picks the wire (``None`` or float32: ``"none"``; float16 or
            bfloat16: :class:`LossScaleCompression` in that dtype).
        **kwargs: the base optimizer's (``name``, ``update``, ``seed``).

    Returns:
        A :class:`LossScaleOptimizer`.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: an optimizer that already all-reduces, a built LossScaleOptimizer (wrap it
            before the first step), ``loss_scale`` with a LossScaleOptimizer,
            ``hvd.Compression.fp16`` (the scaled gradients overflow float16: use
            ``compression="fp16"``), or an unknown ``compression``.
    """
    if isinstance(optimizer, LossScaleOptimizer):
        raise ValueError("this optimizer already all-reduces over the Horovod ranks; use it as it is.")
    if isinstance(optimizer, _LossScaleOptimizer):
        if loss_scale is not None:
            raise ValueError(
                "loss_scale= goes with a plain Keras optimizer; this LossScaleOptimizer has its "
                f"own ({optimizer.loss_scale_config.to_dict()})."
            )
        if optimizer.built:
            raise ValueError(
                "this LossScaleOptimizer has already stepped (it is built); wrap it with "
                "uhvd.DistributedOptimizer before the first step, so every rank starts from the "
                "same state."
            )
        kwargs.setdefault("update", optimizer.update_mode)
        kwargs.setdefault("seed", optimizer.update_seed)
        loss_scale, optimizer = optimizer.loss_scale_config, optimizer.inner_optimizer
    return LossScaleOptimizer(optimizer, loss_scale=loss_scale, compression=compression, **kwargs)


def DistributedGradientTape(  # noqa: N802 - mirrors hvd.DistributedGradientTape
    gradtape: tf.GradientTape, optimizer: LossScaleOptimizer, compression: Any = "none", **kwargs: Any
) -> tf.GradientTape:
    """``hvd.DistributedGradientTape`` set up for unimp's loss scaling: ``gradient`` returns the
    ranks' mean of the gradients, and ``optimizer``'s next ``apply`` does not all-reduce them
    again. Its sources may be Keras 3 variables (``model.trainable_variables``), on which
    Horovod's own tape fails.

    Args:
        gradtape: the ``tf.GradientTape`` that recorded the scaled loss.
        optimizer: the :class:`LossScaleOptimizer` (from :func:`DistributedOptimizer`) that
            applies the gradients: its scale is read by the compression, and it agrees with the
            other ranks on the finite flags (a plain LossScaleOptimizer would let one rank skip
            a non-finite loss while the others apply).
        compression: as :func:`DistributedOptimizer`; with a half wire, sparse gradients are
            made dense (``sparse_as_dense=True``), since Horovod gathers them uncompressed.
        **kwargs: Horovod's (``sparse_as_dense``, ``device_dense``, ...); ``op`` must stay
            ``hvd.Average`` (the default).

    Returns:
        Horovod's distributed tape.

    Raises:
        TypeError: ``optimizer`` is not this module's LossScaleOptimizer (the fix:
            ``uhvd.DistributedOptimizer(optimizer)``).
        ValueError: ``hvd.Compression.fp16``, an unknown compression, an ``op`` other than
            ``hvd.Average``, or ``sparse_as_dense=False`` with a half wire.
    """
    if not isinstance(optimizer, LossScaleOptimizer):
        raise TypeError(
            "DistributedGradientTape needs the optimizer that will apply the gradients, made by "
            "uhvd.DistributedOptimizer(optimizer) (it agrees with the other ranks on every "
            f"skip); got {type(optimizer).__name__}."
        )
    wire = _wire(compression)
    if kwargs.get("op", hvd.Average) != hvd.Average:
        raise ValueError("unimp's DistributedGradientTape averages over the ranks; leave op unset.")
    if wire is not None:
        if kwargs.get("sparse_as_dense", True) is False:
            raise ValueError(
                "a compressed wire needs dense gradients (Horovod gathers sparse ones "
                "uncompressed, and would sum them): leave sparse_as_dense unset."
            )
        kwargs.update(op=hvd.Sum, sparse_as_dense=True, compression=LossScaleCompression(optimizer, dtype=wire))
    tape = hvd.DistributedGradientTape(gradtape, **kwargs)
    reduce = tape.gradient

    def gradient(target: Any, sources: Any, *args: Any, **kw: Any) -> Any:
        # Horovod's tape keys the sources by tf.Variable.ref(), which a Keras 3 variable lacks
        # ("'Variable' object has no attribute 'ref'"): differentiate by the tf.Variable it holds
        out = reduce(target, [_tf_variable(v) for v in sources], *args, **kw)
        optimizer.mark_reduced()
        return out

    tape.gradient = gradient
    return tape


def _tf_variable(v: Any) -> Any:
    """The ``tf.Variable`` a Keras 3 variable holds (its ``value`` outside an autocast scope),
    or ``v`` itself."""
    if hasattr(v, "ref") or not isinstance(getattr(v, "value", None), tf.Variable):
        return v
    return v.value


def broadcast_state(optimizer: Any, root_rank: int = 0) -> None:
    """Copies ``root_rank``'s loss-scale state to every rank (a collective: call it on every
    rank, e.g. after restoring a checkpoint on some of them). The config must already match.

    Args:
        optimizer: a unimp LossScaleOptimizer (this module's or the backend's).
        root_rank: the rank whose state every rank takes.

    Raises:
        TypeError: ``optimizer`` is not a unimp LossScaleOptimizer.
    """
    if not isinstance(optimizer, _LossScaleOptimizer):
        raise TypeError(f"broadcast_state needs a unimp LossScaleOptimizer, got {type(optimizer).__name__}.")
    broadcast_variables(optimizer.loss_scale_state_variables(), root_rank=root_rank)


def broadcast_variables(variables: Any, root_rank: int = 0) -> None:
    """``hvd.broadcast_variables`` for Keras 3 variables (``model.variables``,
    ``optimizer.variables``): every rank takes ``root_rank``'s values, eagerly, one broadcast
    per variable (a collective: call it on every rank with the same variables in the same
    order).

    Args:
        variables: an iterable of variables (``keras.Variable`` or ``tf.Variable``).
        root_rank: the rank whose values every rank takes.

    Raises:
        TypeError: an entry that is not a variable (nothing is assigned then).
    """
    variables = list(variables)
    bad = [type(v).__name__ for v in variables if not hasattr(v, "assign")]
    if bad:
        raise TypeError(f"broadcast_variables needs variables (with assign), got {bad[:3]}.")
    for v in variables:
        v.assign(hvd.broadcast(tf.convert_to_tensor(v), root_rank=root_rank))
