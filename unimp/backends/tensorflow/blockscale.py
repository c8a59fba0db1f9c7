"""TensorFlow block-scaled linear layers: :mod:`unimp.blockscale_linear`'s rule (MXFP8, block
FP8, NVFP4, MXFP4) on TensorFlow tensors, as a custom-gradient matmul
(:func:`block_scaled_matmul`, a ``tf.custom_gradient``) and :class:`BlockScaledDense`, a Keras
Dense layer running it. Emulated: the operands are quantized and dequantized to float32 and
multiplied in float32; the result is cast to the input's dtype (the compute dtype).

Bit for bit with the NumPy reference eagerly and compiled by XLA
(``tf.function(jit_compile=True)``); TensorFlow's graphs without XLA are not promised, as for
:mod:`unimp.blockscale` (their CPU kernels divide vectors an ulp off; Grappler reassociates
MX's two power-of-two factors).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from unimp import blockscale_linear as _bl
from unimp.attached import peek
from unimp.backends.tensorflow.fp8 import FP8Ops
from unimp.backends.tensorflow.optimizer import UpdateOps
from unimp.fp8 import layer_flag, layer_size


class BlockOps(FP8Ops):
    """:mod:`unimp.blockscale_linear`'s namespace over TensorFlow tensors: the FP8 rule's
    ``FP8Ops`` plus ``matmul`` and ``transpose``."""

    @staticmethod
    def matmul(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.matmul(a, b)

    @staticmethod
    def transpose(a: tf.Tensor) -> tf.Tensor:
        return tf.transpose(a)


def block_scaled_matmul(x: Any, w: Any, rule: Any, layout: str = "in_out", seed: int = 0,
                        step: Any = 0, backward: bool = True) -> tf.Tensor:
    """``x @ W`` as an emulated block-scaled GEMM with its gradients by the same rule
    (:data:`unimp.blockscale_linear.GEMMS`); the contract is the torch backend's
    ``block_scaled_matmul``. An integer or bool ``x`` is cast to ``w``'s dtype first, as
    Keras's Dense promotes it. Shapes must be static (inside a ``tf.function``, a known batch).
    With ``backward=False`` (inference: Keras's ``training=False``) only the forward GEMM runs
    and the batch rows need not split into blocks; a gradient taken through it then raises.

    Raises:
        ValueError: an unknown rule or layout, sizes that do not split into the rule's blocks,
            or an input whose shape is not known.
    """
    rule = _bl.block_linear_rule(rule)
    x = tf.convert_to_tensor(x)
    w = tf.convert_to_tensor(w)
    if not x.dtype.is_floating:
        x = tf.cast(x, w.dtype)
    if not (x.shape.is_fully_defined() or (not backward and x.shape[-1:].is_fully_defined())):
        raise ValueError(f"block_scaled_matmul: x's shape {x.shape} is not fully known; the block checks "
                         "need static shapes: give the tf.function an input_signature with the batch size "
                         "(with backward=False only the last dimension must be known).")
    shape = x.shape.as_list()

    @tf.custom_gradient
    def matmul(x_: tf.Tensor, w_: tf.Tensor) -> Any:
        y, saved = _bl.linear_forward(BlockOps, tf.reshape(x_, [-1, shape[-1]]), w_, rule, layout, backward)
        n = int(y.shape[-1])

        def grad(g: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            if saved is None:
                raise ValueError("block_scaled_matmul ran with backward=False (Keras training=False): it "
                                 "made no columnwise copies for a backward pass; call it with "
                                 "backward=True (training=True) to take gradients.")
            g2 = tf.reshape(g, [-1, n])
            bits = _bl.gradient_bits(UpdateOps, seed, step, *g2.shape) if rule.stochastic("gradient") else None
            dx, dw = _bl.linear_backward(BlockOps, saved, g2, rule, layout, bits)
            return tf.cast(tf.reshape(dx, shape), x_.dtype), tf.cast(dw, w_.dtype)

        out_shape = [*shape[:-1], n] if None not in shape else tf.concat([tf.shape(x_)[:-1], [n]], 0)
        return tf.cast(tf.reshape(y, out_shape), x_.dtype), grad

    return matmul(x, w)


def _keras_layer_base() -> type:
    import keras

    return keras.layers.Layer


def _keras_serializable() -> Any:
    import keras

    return keras.saving.register_keras_serializable(package="unimp")


@_keras_serializable()
class BlockScaledDense(_keras_layer_base()):  # type: ignore[misc]
    """A Keras Dense layer whose matmul is an emulated block-scaled GEMM
    (:func:`block_scaled_matmul`, kernel ``(in, units)`` read in float32); the bias is added in
    the compute dtype. A rule that rounds gradients stochastically takes its bits from
    ``seed`` and the layer's step counter (``block_step``, a non-trainable int32 variable
    advanced by every training call).

    Args:
        units: output features; use_bias: add a bias.
        rule: a :class:`unimp.blockscale_linear.BlockLinearRule` or its name.
        seed: the stochastic rounding's seed (an int).

    Saved models round-trip (:meth:`get_config` holds ``units``, ``use_bias``, the rule's name
    and ``seed``; registered as ``"unimp>BlockScaledDense"``).

    Raises:
        TypeError: ``units`` not an int, ``use_bias`` not True or False.
        ValueError: ``units`` below 1, an unknown rule.
    """

    def __init__(self, units: int, use_bias: bool = True, rule: Any = "mxfp8", seed: int = 0,
                 **kwargs: Any) -> None:
        units = layer_size(units, "units", "BlockScaledDense")
        use_bias = layer_flag(use_bias, "use_bias", "BlockScaledDense")
        super().__init__(**kwargs)
        self.units = units
        self.use_bias = use_bias
        self.rule = _bl.block_linear_rule(rule)
        self.seed = int(seed)

    def build(self, input_shape: Any) -> None:
        n_in = int(input_shape[-1])
        self.kernel = self.add_weight(name="kernel", shape=(n_in, self.units), initializer="glorot_uniform",
                                      autocast=False)
        self.bias = self.add_weight(name="bias", shape=(self.units,), initializer="zeros") if self.use_bias else None
        self.block_step = self.add_weight(name="block_step", shape=(), dtype="int32", initializer="zeros",
                                          trainable=False, autocast=False)

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        """``(..., units)``: Keras builds a model symbolically (unknown batch) without calling."""
        return (*tuple(input_shape)[:-1], self.units)

    def get_config(self) -> dict[str, Any]:
        """Keras's layer config plus ``units``, ``use_bias``, ``rule`` (its name) and ``seed``."""
        return {**super().get_config(), "units": self.units, "use_bias": self.use_bias,
                "rule": self.rule.name, "seed": self.seed}

    def call(self, inputs: Any, training: bool | None = None) -> tf.Tensor:
        return _block_call(self, inputs, training, self.kernel, self.rule, self.seed)


def _block_call(layer: Any, inputs: Any, training: Any, kernel: Any, rule: Any, seed: int) -> tf.Tensor:
    """``inputs @ kernel`` (+ bias) by :func:`block_scaled_matmul` with ``layer``'s step counter,
    advanced by a training call; an integer input is cast to the compute dtype."""
    step = tf.identity(tf.convert_to_tensor(layer.block_step))
    if training:
        layer.block_step.assign_add(1)
    x = tf.convert_to_tensor(inputs)
    if not x.dtype.is_floating:
        x = tf.cast(x, layer.compute_dtype)
    y = block_scaled_matmul(x, tf.convert_to_tensor(kernel), rule, "in_out", seed, step,
                            backward=training is not False)
    if layer.bias is not None:
        y = y + tf.cast(layer.bias, y.dtype)
    return y


def _block_dense_call(self: Any, inputs: Any, training: Any = None) -> tf.Tensor:
    """``keras.layers.Dense.call`` with the matmul replaced by :func:`block_scaled_matmul`
    (bias and activation as Keras adds them; the step counter as :class:`BlockScaledDense`'s)."""
    recipe = peek(self, "block_recipe")
    y = _block_call(self, inputs, training, self._kernel, recipe.rule, recipe.seed)
    if self.activation is not None:
        y = self.activation(y)
    return y


def block_swap(model: Any, recipe: Any) -> tuple[str, ...]:
    """Puts the block-scaled matmul into the Dense layers of a built Keras model that
    ``recipe`` (an :class:`unimp.blockscale_recipe.BlockRecipe`) selects, in place, and returns
    their paths: Keras's swap (:func:`unimp.keras.blockscale.swap_block_layers`: the FP8
    recipes' selection, a ``block_step`` counter, the float32 kernel, a loader of what Keras's
    Dense saves) with a ``call`` whose matmul is :func:`block_scaled_matmul`. Layers already
    done (or BlockScaledDense) are kept.

    Raises:
        ValueError: as :func:`unimp.keras.blockscale.swap_block_layers` (a selected layer not
            built, shared, using LoRA or Keras's quantization, or whose sizes do not split into
            the rule's blocks, named with the fix); nothing is changed.
    """
    from unimp.keras.blockscale import swap_block_layers

    return swap_block_layers(model, recipe, (BlockScaledDense,), _block_dense_call)
