"""Block-scaled Dense layers on Keras's JAX and torch engines: :mod:`unimp.blockscale_linear`'s
rule (MXFP8, block FP8, NVFP4, MXFP4) swapped into the Dense layers a block-scaled recipe
selects (``mp.prepare``), as :mod:`unimp.keras.fp8` swaps the float8 matmul in. Keras's
TensorFlow engine has the TensorFlow backend's layers (:mod:`unimp.backends.tensorflow.blockscale`,
which builds on the swap written here).

The rule runs over the engine's own framework backend: the JAX or torch backend's ``BlockOps``
(the quantizers and float32 GEMMs) and ``UpdateOps`` (the stochastic rounding's bits), the
namespaces that backend's own ``block_scaled_matmul`` runs, so a Keras layer computes what the
framework's layer computes, bit for bit wherever the GEMMs' sums are exact. The matmul is a
``keras.ops.custom_gradient``: the forward GEMM and the columnwise copies
(:func:`unimp.blockscale_linear.linear_forward`), then the input-gradient and weight-gradient
GEMMs of the output gradient as it flows in (:func:`~unimp.blockscale_linear.linear_backward`).

Each swapped layer gets a step counter, ``block_step``: a non-trainable int32 variable,
advanced by each training call, whose value before the call is the stochastic rounding's step
(NVFP4's gradients), as the TensorFlow backend's ``BlockScaledDense`` and torch's
``BlockScaledLinear`` keep it. On Keras-JAX it travels through the compiled step as any
non-trainable variable (BatchNormalization's statistics): one compilation, no host callback. A
skipped step of unimp's ``train_step`` puts it back with the rest of the forward state.
"""

from __future__ import annotations

import types
from typing import Any

import keras
from keras import ops

from unimp import blockscale_linear as _bl
from unimp.attached import attach, peek

__all__ = ["block_dense_call", "block_ops", "block_scaled_matmul", "block_swap", "swap_block_layers"]


def block_ops(like: Any = None) -> tuple[Any, Any]:
    """The block rule's namespaces on the running Keras engine: ``(BlockOps, UpdateOps)`` of
    the JAX or torch backend (:mod:`unimp.backends.jax.blockscale`,
    :mod:`unimp.backends.torch.blockscale`); on torch the ones for ``like``'s device (Keras's
    device without it).

    Raises:
        ValueError: Keras runs on TensorFlow, whose block-scaled layers are the TensorFlow
            backend's (that backend builds on this module, so this module does not reach back
            into it).
    """
    engine = keras.backend.backend()
    if engine == "jax":
        from unimp.backends.jax.blockscale import BlockOps
        from unimp.backends.jax.optimizer import UpdateOps

        return BlockOps, UpdateOps
    if engine == "torch":
        from unimp.backends.torch.blockscale import BlockOps as TorchBlockOps
        from unimp.backends.torch.optimizer import UpdateOps as TorchUpdateOps

        if like is None:
            from keras.src.backend.torch.core import get_device

            device = get_device()
        else:
            device = like.device
        return TorchBlockOps.on(device), TorchUpdateOps(device)
    raise ValueError(
        f"unimp.keras.blockscale serves Keras's JAX and torch engines; Keras runs on {engine!r}, "
        "where the block-scaled layers are unimp.backends.tensorflow.BlockScaledDense and "
        "unimp.backends.tensorflow.block_scaled_matmul."
    )


def block_scaled_matmul(x: Any, w: Any, rule: Any, layout: str = "in_out", seed: int = 0, step: Any = 0,
                        backward: bool = True) -> Any:
    """``x @ W`` as an emulated block-scaled GEMM with its gradients by the same rule, on
    Keras's JAX or torch engine; the contract is the TensorFlow backend's
    ``block_scaled_matmul`` (an integer or bool ``x`` is cast to ``w``'s dtype, as Keras's
    Dense promotes it; with ``backward=False``, Keras's ``training=False``, only the forward
    GEMM runs, any batch, and a gradient taken through it raises).

    Args:
        x: floating tensor ``(..., K)`` (the compute dtype), static shape.
        w: floating tensor, ``(K, N)`` with ``layout="in_out"`` (a Dense kernel, read in
            float32), ``(N, K)`` with ``"out_in"``.
        rule: a :class:`unimp.blockscale_linear.BlockLinearRule` or its name.
        layout: one of :data:`unimp.blockscale_linear.LAYOUTS`.
        seed, step: the stochastic rounding's bits for rules that round gradients so
            (:func:`unimp.blockscale_linear.gradient_bits`): ints or int32 scalars (a traced
            counter is fine).
        backward: whether a backward pass follows.

    Returns:
        ``(..., N)`` in ``x``'s dtype; ``x``'s gradient in its dtype, ``w``'s in its dtype.

    Raises:
        ValueError: an unknown rule or layout, sizes that do not split into the rule's blocks,
            Keras on TensorFlow (:func:`block_ops`); a gradient through a ``backward=False``
            call.
    """
    rule = _bl.block_linear_rule(rule)
    x, w = ops.convert_to_tensor(x), ops.convert_to_tensor(w)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        x = ops.cast(x, w.dtype)
    B, U = block_ops(x)
    shape = tuple(int(d) for d in x.shape)

    @ops.custom_gradient
    def matmul(x_: Any, w_: Any) -> Any:
        y, saved = _bl.linear_forward(B, ops.reshape(x_, (-1, shape[-1])), w_, rule, layout, backward)
        n = int(y.shape[-1])

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, Any]:
            if saved is None:
                raise ValueError("block_scaled_matmul ran with backward=False (Keras training=False): it "
                                 "made no columnwise copies for a backward pass; call it with "
                                 "backward=True (training=True) to take gradients.")
            g2 = ops.reshape(args[0] if upstream is None else upstream, (-1, n))
            bits = _bl.gradient_bits(U, seed, step, *g2.shape) if rule.stochastic("gradient") else None
            dx, dw = _bl.linear_backward(B, saved, g2, rule, layout, bits)
            return ops.cast(ops.reshape(dx, shape), x_.dtype), ops.cast(dw, w_.dtype)

        return ops.cast(ops.reshape(y, (*shape[:-1], n)), x_.dtype), grad

    return matmul(x, w)


def block_dense_call(self: Any, inputs: Any, training: Any = None) -> Any:
    """``keras.layers.Dense.call`` with the matmul replaced by :func:`block_scaled_matmul` of
    the float32 kernel with the layer's step counter (read, then advanced by a training call);
    the bias and activation as Keras adds them, an integer input cast to the compute dtype."""
    recipe = peek(self, "block_recipe")
    step = ops.copy(self.block_step.value)  # a copy: torch's assign writes the tensor in place
    if training:
        self.block_step.assign(ops.add(step, 1))
    x = ops.convert_to_tensor(inputs)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        x = ops.cast(x, self.compute_dtype)
    y = block_scaled_matmul(x, self._kernel.value, recipe.rule, "in_out", recipe.seed, step,
                            backward=training is not False)
    if self.bias is not None:
        y = ops.add(y, ops.cast(self.bias, y.dtype))
    if self.activation is not None:
        y = self.activation(y)
    return y


def _counted_loads(layer: Any) -> None:
    """Gives a swapped Dense a ``load_own_variables`` that takes what Keras's ``Dense`` saves
    (its kernel and bias, never the step counter, so a ``.keras`` file of a prepared model
    loads as the plain model it is): Keras's own load counts every variable of the layer, so
    ``model.save_weights`` then ``load_weights`` into a prepared model would fail; a store with
    the Dense entries only loads them and keeps the counter as it is."""
    plain = layer.load_own_variables

    def load_own_variables(store: Any) -> None:
        keys = list(store.keys())
        if len(keys) == len(layer.weights) - 1:  # Keras's Dense entries: the counter stays
            store = {**{k: store[k] for k in keys}, str(len(keys)): ops.convert_to_numpy(layer.block_step.value)}
        plain(store)  # Keras's Dense reads its own entries, after counting them all

    layer.load_own_variables = load_own_variables


def swap_block_layers(model: Any, recipe: Any, dense: tuple[type, ...], call: Any) -> tuple[str, ...]:
    """Every engine's swap: the Dense layers of a built Keras model that ``recipe`` selects
    (:func:`unimp.keras.fp8.fp8_select`; ``dense`` counts a backend's own block-scaled class,
    kept as it is) each get a ``block_step`` counter (a non-trainable int32 variable, added the
    way Keras's own ``Dense.quantize`` adds variables), ``call`` as their ``call`` method, a
    kernel read in float32 and a loader of what Keras's Dense saves. Layers already done are
    kept. Returns the selected paths.

    Raises:
        ValueError: a selected layer not built yet, called at several places, using LoRA or
            Keras's own quantization, or whose sizes do not split into the rule's blocks (named,
            with the fix); nothing is changed.
    """
    from unimp.keras.fp8 import fp8_model_layers, fp8_select

    selected = fp8_select(model, recipe, dense)
    layers = {p: layer for p, _, layer in fp8_model_layers(model, dense)}
    unbuilt = [p for p in selected if not layers[p].built]
    if unbuilt:
        raise ValueError(f"block-scaled layers {unbuilt} are not built yet: build the model (call it once "
                         "or give its Input shapes) first.")
    odd = [p for p in selected if isinstance(layers[p], keras.layers.Dense)
           and peek(layers[p], "block_recipe", None) is None
           and (getattr(layers[p], "lora_enabled", False) or getattr(layers[p], "quantization_mode", None))]
    if odd:
        raise ValueError(f"block-scaled layers {odd} use LoRA or Keras's own quantization, which the "
                         "block-scaled matmul does not run: exclude them from the recipe "
                         "(BlockRecipe(exclude=[...])) or prepare before enable_lora / quantize.")
    _bl.check_layer_sizes(recipe.rule, [(p, *(int(d) for d in layers[p]._kernel.shape)) for p in selected
                                        if isinstance(layers[p], keras.layers.Dense)])
    done = []
    for path in selected:
        layer = layers[path]
        if isinstance(layer, dense) or peek(layer, "block_recipe", None) is not None:
            done.append(path)
        elif isinstance(layer, keras.layers.Dense):
            layer._tracker.unlock()
            try:
                layer.block_step = layer.add_weight(name="block_step", shape=(), dtype="int32",
                                                    initializer="zeros", trainable=False, autocast=False)
            finally:
                layer._tracker.lock()
            attach(layer).block_recipe = recipe
            layer._kernel._autocast = False  # quantized from the float32 kernel, as torch's layer
            layer.call = types.MethodType(call, layer)
            _counted_loads(layer)
            done.append(path)
    return tuple(done)


def block_swap(model: Any, recipe: Any) -> tuple[str, ...]:
    """Puts the block-scaled matmul into the Dense layers of a built Keras model that
    ``recipe`` (an :class:`unimp.blockscale_recipe.BlockRecipe`) selects, in place, on Keras's
    JAX or torch engine, and returns their paths (the FP8 recipes' selection: first and last
    out by default): each gets a ``block_step`` counter and a ``call`` whose matmul is
    :func:`block_scaled_matmul` of its float32 kernel (:func:`block_dense_call`). Layers
    already done are kept; a selected layer that is not a Dense stays as it is.

    Raises:
        ValueError: Keras on TensorFlow (use ``backend="tensorflow"``), or what
            :func:`swap_block_layers` refuses (named, with the fix); nothing is changed.
    """
    block_ops()  # the engine's namespaces: Keras on TensorFlow is refused before anything changes
    return swap_block_layers(model, recipe, (), block_dense_call)
