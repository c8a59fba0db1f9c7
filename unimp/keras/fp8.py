"""Float8 Dense layers on Keras: which layers an FP8 recipe selects in a Keras model (every
engine), and unimp's emulated float8 matmul swapped into them on Keras's JAX and torch
backends (the TensorFlow backend has its own, :mod:`unimp.backends.tensorflow.fp8`, with
``tf.distribute`` and the XLA native path).

The rule is :mod:`unimp.fp8`'s, run over the engine's own FP8 array namespace (the JAX or torch
backend's ``FP8Ops``), so a Keras layer quantizes exactly as the framework's own unimp layer
does. The matmul is a ``keras.ops.custom_gradient``: the input and the float32 kernel are
quantized to the forward format with their own scales, the output gradient (as it flows in,
scaled when a loss scale is on) to the backward format; the float8 values are multiplied in
float32 and the result scaled once (``y = (Q(x) @ Q(w)) * (x.scale_inv * w.scale_inv)``, as a
float8 GEMM scales its accumulator).

The scaling states are what Keras's own float8 ``Dense`` makes them on every engine: trainable
float32 variables with ``overwrite_with_gradient`` (``<input|kernel|grad>_<scale|scale_inv|
amax_history>``), whose "gradient" is the state after the step, so the step is a function of
values on JAX (one compilation, no host callback) and the optimizer writes them, or not: a
skipped step leaves them as they were, as every backend puts its states back. The loss scale
never unscales them, and they take no part in the finite check, the global norm, clipping or
the statistics (:func:`is_state`).
"""

from __future__ import annotations

import types
import warnings
from typing import Any

import keras
import numpy as np
from keras import ops

from unimp import fp8 as _fp8
from unimp.attached import attach, peek
from unimp.fp8 import FP8State

__all__ = [
    "add_state_variables",
    "check_loads",
    "check_model_loads",
    "checked_load",
    "fp8_model_layers",
    "fp8_ops",
    "fp8_select",
    "fp8_swap",
    "is_state",
    "keep_unrun",
    "state_groups",
    "swap_layers",
    "swappable",
    "window_states",
]

_TENSORS, _FIELDS = _fp8.LAYER_TENSORS, _fp8.STATE_FIELDS


def fp8_ops(like: Any = None) -> Any:
    """The FP8 rule's array namespace of the running Keras engine: the JAX or torch backend's
    ``FP8Ops`` (the same bit-level scale rules the framework's own unimp layers run); on torch
    the one for ``like``'s device (Keras's device without it).

    Raises:
        ValueError: Keras runs on TensorFlow, where the float8 layers are
            :class:`unimp.backends.tensorflow.FP8Dense` and the rule's namespace is
            ``unimp.backends.tensorflow.FP8Ops`` (that backend builds on this module, so this
            module does not reach back into it).
    """
    engine = keras.backend.backend()
    if engine == "jax":
        from unimp.backends.jax.fp8 import FP8Ops

        return FP8Ops
    if engine == "torch":
        from unimp.backends.torch.fp8 import FP8Ops as TorchFP8Ops

        if like is None:
            from keras.src.backend.torch.core import get_device

            return TorchFP8Ops.on(get_device())
        return TorchFP8Ops.on(like.device)
    raise ValueError(
        f"unimp.keras.fp8.fp8_ops serves Keras's JAX and torch engines; Keras runs on {engine!r}, "
        "where unimp's float8 layers are unimp.backends.tensorflow.FP8Dense: use "
        "unimp.backends.tensorflow.FP8Ops."
    )


def fp8_model_layers(model: Any, dense: tuple[type, ...] = ()) -> list[tuple[str, str, Any]]:
    """``(dotted path, kind, layer)`` of every layer of a Keras model, depth first in
    definition order, paths joined from layer names (``"mlp.fc1"``); ``keras.layers.Dense``
    and its subclasses, and the classes in ``dense`` (a backend's own float8 Dense), are
    ``"Dense"``."""
    out: list[tuple[str, str, Any]] = []
    kinds = (keras.layers.Dense, *dense)

    def walk(layer: Any, prefix: str) -> None:
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            path = f"{prefix}{sub.name}"
            out.append((path, "Dense" if isinstance(sub, kinds) else type(sub).__name__, sub))
            walk(sub, path + ".")

    walk(model, "")
    return out


def _call_sites(container: Any, sub: Any) -> int:
    """How many times ``container``'s graph calls ``sub``: its nodes in a functional model
    (Keras keys them ``"<id(layer)>_ib-<i>"``), its entries in a Sequential; else 1."""
    nodes = getattr(container, "_nodes", None)
    if isinstance(container, keras.Sequential):
        return sum(layer is sub for layer in container.layers)
    if isinstance(nodes, set):
        return max(1, sum(str(k).split("_ib-")[0] == str(id(sub)) for k in nodes))
    return 1


def fp8_select(model: Any, recipe: Any, dense: tuple[type, ...] = ()) -> tuple[str, ...]:
    """The paths ``recipe`` selects in ``model`` (:meth:`unimp.fp8.recipe.FP8Recipe.select`);
    a selected layer called at several places (twice in a functional model or a Sequential,
    or under two parents) is refused (:func:`unimp.fp8.recipe.refuse_shared`).

    Raises:
        ValueError: a shared selected layer, named with its places.
    """
    from unimp.fp8.recipe import refuse_shared

    found = fp8_model_layers(model, dense)
    selected = recipe.select([(p, k) for p, k, _ in found])
    places: dict[int, list[str]] = {}

    def walk(layer: Any, prefix: str) -> None:
        for sub in layer._flatten_layers(include_self=False, recursive=False):
            path = f"{prefix}{sub.name}"
            n = _call_sites(layer, sub)
            places.setdefault(id(sub), []).extend([path] if n == 1 else [f"{path} (call {i + 1})" for i in range(n)])
            walk(sub, path + ".")

    walk(model, "")
    refuse_shared(selected, {p: places[id(layer)] for p, _, layer in found if len(places[id(layer)]) > 1})
    return selected


# -- the states ------------------------------------------------------------------------------


def is_state(v: Any) -> bool:
    """Whether ``v`` takes its "gradient" as its new value (``overwrite_with_gradient``: unimp's
    float8 states here, Keras's own float8 scales and histories): never unscaled, checked,
    clipped or counted in the norm."""
    return bool(getattr(v, "overwrite_with_gradient", False))


def _add_states(layer: Any, config: _fp8.FP8Config) -> None:
    """The nine scaling states of a swapped Dense, ``<tensor>_<field>``: trainable float32
    variables with ``overwrite_with_gradient``, never autocast, added the way Keras's own
    ``Dense.quantize`` adds its float8 variables (tracker unlocked, then locked); each marked
    with its place, ``(tensor, field)``, for :func:`state_groups`."""
    layer._tracker.unlock()
    try:
        add_state_variables(layer, config, as_gradients=True)
    finally:
        layer._tracker.lock()


def add_state_variables(layer: Any, config: _fp8.FP8Config, as_gradients: bool) -> None:
    """Adds a float8 layer's nine scaling states, float32 and never autocast, initialized to
    :meth:`unimp.fp8.FP8State.initial`, as ``layer.<tensor>_<field>``: with ``as_gradients``
    trainable and ``overwrite_with_gradient`` (here), else non-trainable (the TensorFlow
    backend's, written in the step)."""
    init = FP8State.initial(config)
    for name in _TENSORS:
        for f in _FIELDS:
            value = np.asarray(getattr(init, f), np.float32)
            var = layer.add_weight(
                name=f"{name}_{f}", shape=value.shape, dtype="float32", trainable=as_gradients,
                initializer=lambda shape, dtype=None, v=value: ops.convert_to_tensor(v), autocast=False,
            )  # fmt: skip
            if as_gradients:
                var.overwrite_with_gradient = True
                attach(var).fp8_state = (id(layer), name, f)
            setattr(layer, f"{name}_{f}", var)


def state_groups(variables: list[Any]) -> list[tuple[int, int, int]]:
    """The float8 states among ``variables``: per (layer, tensor), the indices of its
    ``(scale, scale_inv, amax_history)`` variables."""
    at: dict[tuple[int, str], dict[str, int]] = {}
    for i, v in enumerate(variables):
        mark = peek(v, "fp8_state", None)
        if mark is not None:
            at.setdefault(mark[:2], {})[mark[2]] = i
    return [tuple(d[f] for f in _FIELDS) for d in at.values() if len(d) == len(_FIELDS)]  # type: ignore[misc]


def keep_unrun(grads: list[Any], variables: list[Any], values: list[Any]) -> list[Any]:
    """The states' "gradients" with a layer that did not run kept as it was: on JAX its
    states' gradients are 0 (a scale is never 0), which would overwrite them (the JAX
    backend's ``fp8_update`` rule); ``values`` are the variables' values before the step."""
    out = list(grads)
    for group in state_groups(variables):
        g_scale = out[group[0]]
        if g_scale is None:
            continue
        ran = ops.not_equal(g_scale, 0.0)
        for i in group:
            out[i] = ops.where(ran, out[i], values[i])
    return out


def window_states(per_micro: list[list[Any]], variables: list[Any]) -> dict[int, Any]:
    """Gradient accumulation: each float8 state after a window (:func:`unimp.fp8.window_merge`),
    from the states' "gradients" of its micro-batches (``per_micro[m][i]``; every micro-batch
    quantized with the states the window started from, as the variables are not written
    between micro-batches). Returns ``{index: new value}``; a state whose layer ran in no
    micro-batch is left out (None), and one it ran in some of is merged over those."""
    out: dict[int, Any] = {}
    for group in state_groups(variables):
        best = None
        for grads in per_micro:
            fields = [grads[i] for i in group]
            if any(g is None for g in fields):
                continue
            new = FP8State(*fields)
            F = fp8_ops(fields[0])
            best = _fp8.window_merge(F, best, new, _fp8.recorded_amax(F, new))
        if best is not None:
            for i, f in zip(group, _FIELDS, strict=True):
                out[i] = getattr(best[0], f)
    return out


def _numpy(v: Any) -> np.ndarray:
    return np.asarray(ops.convert_to_numpy(v.value if isinstance(v, keras.Variable) else v))


def checked_load(layer: Any, config: _fp8.FP8Config, load: Any, where: str) -> None:
    """Runs ``load`` (Keras's ``set_weights`` / ``load_own_variables``, which assign every
    variable unchecked), then checks the three scaling states of ``layer`` as
    ``load_fp8_state`` does (:func:`unimp.fp8.check_state`); on a bad one every weight of
    ``layer`` is put back as it was before ``load`` and the error names ``where``. Host work
    once per load, never per step.

    Raises:
        ValueError: a bad scaling state (the tensor and the preset named).
    """
    before = [np.array(_numpy(v), copy=True) for v in layer.weights]
    try:
        load()
        for name in _TENSORS:
            state = FP8State(*(np.asarray(_numpy(getattr(layer, f"{name}_{f}")), np.float32) for f in _FIELDS))
            _fp8.check_state(state, config, name)
    except ValueError as err:
        for var, value in zip(layer.weights, before, strict=True):
            var.assign(value)
        raise ValueError(f"{where}: {err} The layer's weights are unchanged.") from None


def check_loads(layer: Any, config: _fp8.FP8Config, path: str) -> None:
    """Gives a swapped Dense ``layer`` checked ``set_weights`` / ``load_own_variables``
    (:func:`checked_load`), as instance methods like its ``call``.

    Keras's ``Dense.save_own_variables`` writes the kernel and bias only, and that stays so: a
    ``.keras`` file of a prepared model loads as the plain model it is (``keras.models
    .load_model`` builds a plain Dense). Its load counts every variable of the layer, the
    states included, so ``model.save_weights`` then ``load_weights`` into a prepared model
    would fail: a store with the Dense entries only loads the kernel and bias and keeps the
    states as they are. A store that holds the states too (entries after the Dense ones, in
    :data:`unimp.fp8.LAYER_TENSORS` x :data:`unimp.fp8.STATE_FIELDS` order) loads them, checked.
    """
    set_weights, load_own = layer.set_weights, layer.load_own_variables
    states = [getattr(layer, f"{name}_{f}") for name in _TENSORS for f in _FIELDS]

    def checked_set_weights(weights: Any) -> None:
        checked_load(layer, config, lambda: set_weights(weights), f"layer {path!r} set_weights")

    def checked_load_own_variables(store: Any) -> None:
        keys = list(store.keys())
        dense = len(keys) - len(states)  # the entries Keras's Dense wrote
        if len(keys) == len(layer.weights) - len(states):  # Dense entries only: states stay
            full = {k: store[k] for k in keys}
            full.update({str(len(keys) + i): _numpy(var) for i, var in enumerate(states)})
            store, dense = full, len(keys)

        def load() -> None:
            load_own(store)  # Keras's Dense reads its own entries, after counting them all
            for i, var in enumerate(states):
                var.assign(np.asarray(store[str(dense + i)], np.float32).reshape(var.shape))

        checked_load(layer, config, load, f"layer {path!r} load_own_variables")

    layer.set_weights = checked_set_weights
    layer.load_own_variables = checked_load_own_variables


def check_model_loads(model: Any, swapped: list[tuple[str, Any]]) -> None:
    """Gives ``model`` a ``set_weights`` that checks the scaling states of its float8 layers
    (``swapped``: ``(path, layer)``) after Keras's own, which assigns every variable directly
    without the layers' checked ``set_weights`` (:func:`check_loads`); on a bad state every
    weight of the model is put back. Once per model.

    Raises:
        ValueError: (from ``set_weights``) a bad scaling state, the layer named.
    """
    if not swapped or peek(model, "fp8_checked_set_weights", False):
        return
    attach(model).fp8_checked_set_weights = True
    plain = model.set_weights

    def checked_set_weights(weights: Any) -> None:
        before = [np.array(_numpy(v), copy=True) for v in model.weights]
        try:
            plain(weights)
            for path, layer in swapped:
                config = peek(layer, "fp8_config", None) or layer.config
                for name in _TENSORS:
                    state = FP8State(*(np.asarray(_numpy(getattr(layer, f"{name}_{f}")), np.float32) for f in _FIELDS))
                    try:
                        _fp8.check_state(state, config, name)
                    except ValueError as err:
                        raise ValueError(f"model set_weights, layer {path!r}: {err} The model's weights are unchanged.") from None
        except ValueError:
            for var, value in zip(model.weights, before, strict=True):
                var.assign(value)
            raise

    model.set_weights = checked_set_weights


# -- the matmul ------------------------------------------------------------------------------


def _warn_once(layer: Any) -> None:
    if peek(layer, "fp8_warned", False):
        return
    attach(layer).fp8_warned = True
    engine = keras.backend.backend()
    device = "cpu"
    if engine == "torch":
        from keras.src.backend.torch.core import get_device

        device = str(get_device()).split(":")[0]
    elif engine == "jax":
        import jax

        device = jax.default_backend()
    _fp8.warn_emulated(f"keras-{engine}", "gpu" if device in ("cuda", "gpu") else device)


def _refuse_repeated_call(layer: Any) -> None:
    """A float8 layer runs once per call of the model: its states' "gradients" are the states
    after the step, which autodiff would add up over several calls (a ``TimeDistributed``
    Dense, a sub-model called twice, a ``call`` running the layer twice). Checked at trace
    time against Keras's call context (one per outermost layer call: no cost per step).

    Raises:
        ValueError: the layer already ran in this call, naming it and the fix.
    """
    from keras.src.backend.common import global_state

    ctx = global_state.get_global_attribute("current_call_ctx")
    if ctx is None:
        return
    seen = peek(ctx, "fp8_calls", None)
    if seen is None:
        seen = attach(ctx).fp8_calls = set()
    if id(layer) in seen:
        name = peek(layer, "fp8_path", layer.name)
        raise ValueError(
            f"float8 layer {name!r} runs more than once in one call of the model (a "
            "TimeDistributed layer, a sub-model called twice, or a call() that runs it twice): "
            "its scaling states take the step's new values as their gradient, which would be "
            "added up over the calls. Exclude it from the recipe (FP8Recipe(exclude=(...,))) "
            "or give each call a layer of its own."
        )
    seen.add(id(layer))


def _fp8_matmul(layer: Any, config: _fp8.FP8Config, inputs: Any, kernel: Any, training: Any) -> Any:
    """``inputs @ kernel`` (kernel ``(in, units)``, read in float32) as an emulated float8
    matmul with ``layer``'s states; output in ``inputs``' dtype (the compute dtype for an
    integer input, as Keras's Dense promotes it) and leading shape."""
    _warn_once(layer)
    # training=None (a call without the argument, Keras's default) records as training does:
    # the states change only where gradients are taken and applied, as Keras's own float8
    # Dense; training=False (evaluation) quantizes with the stored scale and records nothing
    training = training is not False
    if training:
        _refuse_repeated_call(layer)
    x = ops.convert_to_tensor(inputs)
    F = fp8_ops(x)
    if "float" not in keras.backend.standardize_dtype(x.dtype):
        x = ops.cast(x, layer.compute_dtype)
    units = int(kernel.shape[-1])
    n_in = int(kernel.shape[0])
    fwd, bwd = config.dtype("forward"), config.dtype("backward")
    keep_delayed = not training and isinstance(config, _fp8.DelayedScaling)
    states = [getattr(layer, f"{t}_{f}").value for t in _TENSORS for f in _FIELDS]

    def step(state: list[Any], amax: Any, role: str) -> tuple[tuple[Any, Any], list[Any]]:
        used, new = _fp8.step_arrays(F, config, role, *state, F.f32(amax))
        if keep_delayed:  # evaluation: the stored scale, nothing recorded
            return (state[0], state[1]), list(state)
        return used, list(new)

    @ops.custom_gradient
    def matmul(x_: Any, w_: Any, *st: Any) -> Any:
        (sx, ix), new_i = step(list(st[0:3]), _fp8.amax_of(F, x_, config), "forward")
        (sw, iw), new_k = step(list(st[3:6]), _fp8.amax_of(F, w_, config), "forward")
        qx = ops.reshape(_fp8.quantize_arrays(F, x_, sx, fwd, _fp8.FP8_MAX[fwd]), (-1, n_in))
        qw = _fp8.quantize_arrays(F, w_, sw, fwd, _fp8.FP8_MAX[fwd])
        y = ops.cast(ops.multiply(ops.matmul(qx, qw), ops.multiply(ix, iw)), x_.dtype)
        y = ops.reshape(y, (*ops.shape(x_)[:-1], units))

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            g = args[0] if upstream is None else upstream
            g2 = ops.reshape(g, (-1, units))
            (sg, ig), new_g = step(list(st[6:9]), _fp8.amax_of(F, g2, config), "backward")
            qg = _fp8.quantize_arrays(F, g2, sg, bwd, _fp8.FP8_MAX[bwd])
            dx = ops.multiply(ops.matmul(qg, ops.transpose(qw)), ops.multiply(ig, iw))
            dw = ops.multiply(ops.matmul(ops.transpose(qx), qg), ops.multiply(ix, ig))
            return (
                ops.cast(ops.reshape(dx, ops.shape(x_)), x_.dtype),
                ops.cast(dw, w_.dtype),
                *new_i, *new_k, *new_g,
            )  # fmt: skip

        return y, grad

    return matmul(x, ops.convert_to_tensor(kernel), *states)


def _fp8_dense_call(self: Any, inputs: Any, training: Any = None) -> Any:
    """``keras.layers.Dense.call`` with the matmul replaced by :func:`_fp8_matmul` (bias and
    activation as Keras adds them)."""
    y = _fp8_matmul(self, self._unimp.fp8_config, inputs, self._kernel.value, training)
    if self.bias is not None:
        y = ops.add(y, ops.cast(self.bias, y.dtype))
    if self.activation is not None:
        y = self.activation(y)
    return y


def swappable(model: Any, recipe: Any, dense: tuple[type, ...] = ()) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The paths ``recipe`` selects in ``model`` (:func:`fp8_select`) and every layer by path,
    once each selected Dense can take the float8 matmul (every engine's swap checks this
    first, so a refusal changes nothing).

    Raises:
        ValueError: a selected layer is not built (build the model first), uses LoRA
            (``enable_lora``) or Keras's own quantization, or is called at several places.
    """
    selected = fp8_select(model, recipe, dense)
    layers = {p: layer for p, _, layer in fp8_model_layers(model, dense)}
    unbuilt = [p for p in selected if not layers[p].built]
    if unbuilt:
        raise ValueError(f"float8 layers {unbuilt} are not built yet: build the model (call it once "
                         "or give its Input shapes) before mp.prepare.")
    odd = [p for p in selected if isinstance(layers[p], keras.layers.Dense)
           and peek(layers[p], "fp8_config", None) is None
           and (getattr(layers[p], "lora_enabled", False) or getattr(layers[p], "quantization_mode", None))]
    if odd:
        raise ValueError(f"float8 layers {odd} use LoRA or Keras's own quantization, which unimp's "
                         "float8 matmul does not run: exclude them from the recipe "
                         "(FP8Recipe(exclude=...)) or prepare before enable_lora / quantize.")
    return selected, layers


def fp8_swap(model: Any, recipe: Any) -> tuple[str, ...]:
    """Puts unimp's float8 matmul into the Dense layers of a built Keras model that ``recipe``
    (an :class:`unimp.fp8.recipe.FP8Recipe`) selects, in place, on Keras's JAX or torch
    backend, and returns their paths: each gets its nine scaling states (module docstring)
    and a ``call`` whose matmul is emulated float8. Layers already done are kept; a selected
    layer that is not a Dense stays as it is, with a warning naming it. The native float8
    GEMM (``UNIMP_FP8_NATIVE``) is the framework backends' (torch, JAX, TensorFlow): here
    the matmul is emulated.

    Raises:
        ValueError: a selected Dense layer is not built yet (build the model first), uses
            LoRA (``enable_lora``) or Keras's own quantization, or is called at several places
            (:func:`fp8_select`); nothing is changed.
    """
    def install(layer: Any, path: str) -> None:
        if not layer.trainable:
            warnings.warn(
                f"float8 layer {path!r} is frozen (trainable=False): on Keras-{keras.backend.backend()} "
                "its scaling states are trainable variables, as Keras's own float8 Dense keeps "
                "them, so they stay at their initial values while it is frozen. Exclude it from "
                "the recipe, or unfreeze it.", UserWarning, stacklevel=5,
            )  # fmt: skip
        _add_states(layer, recipe.scaling)
        layer.call = types.MethodType(_fp8_dense_call, layer)

    return swap_layers(model, recipe, (), install)


def swap_layers(model: Any, recipe: Any, dense: tuple[type, ...], install: Any) -> tuple[str, ...]:
    """Every engine's swap: the selected Dense layers (:func:`swappable`; ``dense`` counts a
    backend's own float8 class, kept as it is) each get ``install(layer, path)`` (its states
    and its float8 ``call``), then the recipe's scaling, the checked loaders and a kernel read
    in float32 (as torch's FP8Dense quantizes the float32 master weight; Keras's own float8
    Dense reads it autocast); a selected layer that is not a Dense stays as it is, with a
    warning. Returns the paths done.

    Raises:
        ValueError: as :func:`swappable`; nothing is changed.
    """
    selected, layers = swappable(model, recipe, dense)
    done = []
    for path in selected:
        layer = layers[path]
        if isinstance(layer, dense) or peek(layer, "fp8_config", None) is not None:
            done.append(path)
        elif isinstance(layer, keras.layers.Dense):
            install(layer, path)
            attach(layer).fp8_config = recipe.scaling
            attach(layer).fp8_path = path
            check_loads(layer, recipe.scaling, path)
            layer._kernel._autocast = False
            done.append(path)
        else:
            warnings.warn(f"layer {path!r} ({type(layer).__name__}): only Dense layers run float8 "
                          "here; it runs in the recipe's compute dtype.", UserWarning, stacklevel=4)
    check_model_loads(model, [(p, layers[p]) for p in done])
    return tuple(done)
