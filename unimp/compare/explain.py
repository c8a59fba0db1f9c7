"""``unimp explain``: how a recipe maps onto each framework's native objects, and how the
frameworks' and the large-scale trainers' (DeepSpeed, Megatron-LM, fairseq) own loss scalers
would differ on the same steps. Framework-free."""

from __future__ import annotations

import random
from typing import Any

from unimp.loss_scale import DynamicLossScale, loss_scale_from_dict, simulate
from unimp.recipe import Recipe
from unimp.registry import cast_mode_refusal, resolve_cast_mode

__all__ = ["PRESETS", "explain_recipe", "scaler_table", "scaler_sequence"]

#: The frameworks' native dynamic scalers, as unimp presets, with what each stands for.
PRESETS = {
    "unimp": "unimp's DynamicLossScale defaults",
    "torch": "torch.amp.GradScaler()",
    "keras": "keras.optimizers.LossScaleOptimizer (Keras 3)",
    "tf_keras": "tf.keras 2 mixed_precision.LossScaleOptimizer",
    "jmp": "jmp.DynamicLossScale(2**15)",
    "flax": "flax.training.dynamic_scale.DynamicScale()",
    "apex": "apex.amp dynamic loss scaler",
    "deepspeed": "DeepSpeed fp16 DynamicLossScaler (hysteresis 2)",
    "megatron": "Megatron-LM DynamicGradScaler (hysteresis 2)",
    "fairseq": "fairseq DynamicLossScaler (FP16Optimizer)",
}

_TORCH_DTYPE = {
    "float16": "torch.float16",
    "bfloat16": "torch.bfloat16",
    "float32": "torch.float32",
    "float64": "torch.float64",
}
_JNP_DTYPE = {
    "float16": "jnp.float16",
    "bfloat16": "jnp.bfloat16",
    "float32": "jnp.float32",
    "float64": "jnp.float64",
}


def _scaler_text(recipe: Recipe) -> str:
    ls = recipe.loss_scale
    if ls.kind == "none":
        return "no loss scaling (scale 1.0; non-finite steps are still skipped)"
    if ls.kind == "static":
        return f"static loss scale {ls.scale:g}"
    return (
        f"dynamic loss scale init={ls.init_scale:g}, growth x{ls.growth_factor:g} after "
        f"{ls.growth_interval} finite steps"
        + (" (one more after the start or an overflow)" if ls.delayed_first_growth else "")
        + f", backoff x{ls.backoff_factor:g}, "
        f"min={'2**-126' if ls.min_scale is None else f'{ls.min_scale:g}'}, "
        f"max={'none' if ls.max_scale is None else f'{ls.max_scale:g}'}"
        + (f", hysteresis {ls.hysteresis}" if ls.hysteresis > 1 else "")
        + (f", overflow tolerance {ls.overflow_tolerance:g}" if ls.overflow_tolerance else "")
        + (f", {ls.floor_action} at the floor" if ls.floor_action != "keep" else "")
    )


def _keras_policy_name(recipe: Recipe) -> str:
    p = recipe.policy
    if p.param_dtype == "float32" and p.compute_dtype in ("float16", "bfloat16"):
        return f"mixed_{p.compute_dtype}"
    return p.compute_dtype


def explain_recipe(recipe: Recipe) -> list[tuple[str, list[str]]]:
    """Per framework, the native objects the recipe becomes.

    Returns:
        ``[(framework, [lines...]), ...]`` for torch, tensorflow and jax.
    """
    p = recipe.policy
    scaler = _scaler_text(recipe)
    torch_lines = []
    if resolve_cast_mode(recipe, "torch") in ("autocast", "none"):  # torch's own choice
        torch_lines.append(
            f"torch.autocast(device_type, dtype={_TORCH_DTYPE[p.compute_dtype]}) around the forward pass"
            + ("" if p.compute_dtype != "float32" else " (disabled: float32 compute)")
        )
    elif p.param_dtype != p.compute_dtype:
        torch_lines.append(
            f"model.to({_TORCH_DTYPE[p.compute_dtype]}) with normalization layers kept float32, "
            f"{p.param_dtype} master weights in the optimizer (Apex O2 style)"
        )
    else:
        torch_lines.append(
            f"model.to({_TORCH_DTYPE[p.param_dtype]}): every parameter and the optimizer state in "
            f"{p.param_dtype}, no master weights (Apex O3 style)"
        )
    torch_lines.append(
        f"parameters stored in {_TORCH_DTYPE[p.param_dtype]}; outputs cast to {_TORCH_DTYPE[p.output_dtype]}"
    )
    torch_lines.append(f"unimp.backends.torch.GradScaler: {scaler}")
    keras_lines = [
        f'keras.DTypePolicy("{_keras_policy_name(recipe)}") for layers built under mp.autocast()',
        f"every layer computes in {p.compute_dtype}"
        + (", but those the overrides below cover" if p.overrides else ", the output layer too")
        + f"; model outputs cast to "
        f"{p.output_dtype} by mp.prepare (loss in {p.output_dtype})",
        f"unimp.backends.tensorflow.LossScaleOptimizer(inner_optimizer): {scaler}",
    ]
    jax_lines = [
        f"jmp-style policy: params {_JNP_DTYPE[p.param_dtype]}, compute {_JNP_DTYPE[p.compute_dtype]}, "
        f"output {_JNP_DTYPE[p.output_dtype]} (mp.apply(fn) / mp.cast_to_compute)",
        f"flax modules: dtype={_JNP_DTYPE[p.compute_dtype]}, param_dtype={_JNP_DTYPE[p.param_dtype]} (mp.module_kwargs())",
        f"unimp.backends.jax.LossScale (a pytree) + optax transformation: {scaler}",
    ]
    for pattern, v in p.overrides:
        torch_lines.append(
            f"modules matching {pattern!r}: " + (
                f"torch.autocast(dtype={_TORCH_DTYPE[v.compute_dtype]}) around their forward"
                if v.is_mixed else
                f"autocast off (torch.autocast(enabled=False)), inputs cast to {_TORCH_DTYPE[v.compute_dtype]}"
            ) + f", outputs {_TORCH_DTYPE[v.output_dtype]}"
        )
        keras_lines.insert(-1, f"layers matching {pattern!r}: dtype policy "
                           f'"{_keras_policy_name(Recipe(v))}" (keras.dtype_policies.DTypePolicyMap)')
        jax_lines.insert(-1, f"paths matching {pattern!r}: params {_JNP_DTYPE[v.param_dtype]}, compute "
                         f"{_JNP_DTYPE[v.compute_dtype]} (mp.cast_to_compute(x, path=...), flax mp.module_kwargs(path) for each path it covers)")
    if recipe.fp8 is not None:
        what = f"{recipe.fp8.describe()} (emulated float8 matmuls; mp.fp8_layers(model) lists them)"
        torch_lines.append(f"mp.prepare swaps the selected nn.Linear for unimp FP8Dense (same Parameters): {what}")
        keras_lines.append(f"mp.prepare puts unimp's float8 matmul into the selected Dense layers: {what}")
        jax_lines.append(f"mp.fp8_layers(paths); flax mp.module_kwargs(path) adds dot_general_cls, "
                         f"plain JAX mp.fp8_matmul(states, path, x, w): {what}")
    if recipe.block is not None:
        what = f"{recipe.block.describe()} (emulated block-scaled matmuls, unimp.blockscale_linear)"
        torch_lines.append(f"mp.prepare swaps the selected nn.Linear for BlockScaledLinear (same Parameters): {what}")
        keras_lines.append(f"mp.prepare puts the block-scaled matmul into the selected Dense layers "
                           f"(every Keras engine): {what}")
        jax_lines.append(f"mp.fp8_layers(paths) selects them; plain JAX mp.block_matmul(path, x, w, step), "
                         f"flax mp.module_kwargs(path, step=step) adds dot_general (nvfp4 without a step: a "
                         f"dot_general_cls counting steps in _overwrite_with_gradient): {what}")
    extra = _policy_v2_lines(p)
    for fw, lines in extra.items():
        lines.append(_adam_bytes(recipe, fw))
    out = [
        ("torch", torch_lines + extra["torch"]),
        ("tensorflow", keras_lines + extra["tensorflow"]),
        ("jax", jax_lines + extra["jax"]),
    ]
    # a framework without the recipe's cast mode refuses it: say so, not what it would build
    return [(fw, [f"refused: {why}"] if (why := cast_mode_refusal(recipe, fw)) else lines) for fw, lines in out]


_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def _adam_bytes(recipe: Recipe, framework: str) -> str:
    """What training with Adam holds between steps, per parameter, as ``framework`` holds it
    (``benchmarks.memory`` measures the same figure: its last column)."""
    p = recipe.policy
    size = _BYTES[p.param_dtype]
    parts = []
    masters = (
        framework == "torch"
        and resolve_cast_mode(recipe, "torch") == "module"
        and p.param_dtype != p.compute_dtype
    )
    if masters:  # Apex O2: a half model, float32 masters in the optimizer
        parts += [(f"model {p.compute_dtype}", _BYTES[p.compute_dtype]), (f"master weights {p.param_dtype}", size)]
    else:
        parts.append((f"parameters {p.param_dtype}", size))
    parts.append((f"Adam moments {p.param_dtype}", 2 * size))  # kept in the parameters' dtype
    if p.update == "kahan":
        parts.append((f"compensation {p.param_dtype}", size))
    total = sum(n for _, n in parts)
    text = " + ".join(f"{n} ({what})" for what, n in parts)
    tail = "; stochastic rounding adds an int32 counter per " + (
        "parameter tensor" if framework == "torch" else "optimizer"
    ) if p.update == "stochastic" else ""
    return f"with Adam, {total} bytes per parameter between steps: {text}{tail}"


def _policy_v2_lines(p: Any) -> dict[str, list[str]]:
    """The lines of the optional policy fields (matmul precision, reduce and accum dtypes, the
    update rule)."""
    from unimp.precision import MATMUL_PRECISION_TABLE

    out: dict[str, list[str]] = {"torch": [], "tensorflow": [], "jax": []}
    if p.matmul_precision is not None:
        row = MATMUL_PRECISION_TABLE[p.matmul_precision]
        scope = "for the train step and mp.autocast(), restored after"
        switches = ", ".join(f'{k} = "{v}"' for k, v in row.torch_fp32_precision.items())
        out["torch"].append(
            f"torch >= 2.9: torch.backends' fp32_precision switches {switches}; older torch: "
            f'torch.set_float32_matmul_precision("{row.torch_matmul}") and '
            f"torch.backends.cudnn.allow_tf32 = {row.torch_cudnn_tf32}; {scope}"
        )
        out["tensorflow"].append(
            f"tf.config.experimental.enable_tensor_float_32_execution({row.tensorflow_tf32}) "
            f"{scope} (one process-global switch)"
        )
        out["jax"].append(f'jax.default_matmul_precision("{row.jax}") {scope} (read at trace time)')
    if p.reduce_dtype is not None:
        out["torch"].append(
            f"gradients all-reduced in {p.reduce_dtype}: DDP register_comm_hook(None, "
            "unimp.distributed.torch.reduce_hook(policy)); FSDP2 fsdp_mixed_precision(policy)"
        )
        out["tensorflow"].append(
            f"gradients all-reduced in {p.reduce_dtype} under tf.distribute (cast around the all-reduce)"
        )
        out["jax"].append(f"gradients all-reduced (psum) in {p.reduce_dtype} in the replica step")
    if p.accum_dtype is not None:
        for lines in out.values():
            lines.append(f"grad_accum_steps sums the micro-batch gradients in {p.accum_dtype}")
    if p.update != "nearest":
        how = (
            f"each update Kahan-compensated (a {p.param_dtype} compensation buffer per parameter)"
            if p.update == "kahan"
            else "each update stochastically rounded (random bits hashed from the seed, the step, "
            "the parameter's index and the element's: the same in every framework)"
        )
        f32 = f"the optimizer computes in float32 from the {p.param_dtype} parameters, {how}"
        out["torch"].append(
            f"unimp.backends.torch.half_update(optimizer, {p.update!r}) by mp.prepare / train_step "
            f"(hooks on optimizer.step): {f32}"
        )
        out["tensorflow"].append(
            f"unimp.backends.tensorflow.LossScaleOptimizer(inner_optimizer, update={p.update!r}): {f32}"
        )
        out["jax"].append(
            f"unimp.backends.jax.half_update(optimizer, {p.update!r}) inside the optax chain: {f32}"
        )
    return out


def scaler_sequence(steps: int, overflow_rate: float, seed: int, burst: int = 0) -> list[bool]:
    """A reproducible sequence of clean (True) and overflowing (False) steps.

    Args:
        steps: length of the sequence.
        overflow_rate: probability of an overflow at each step.
        seed: random seed.
        burst: that many overflows in a row from the middle of the sequence on (shows the
            floors: a scaler without one keeps halving).
    """
    rng = random.Random(seed)
    flags = [rng.random() >= overflow_rate for _ in range(steps)]
    start = steps // 2
    for i in range(start, min(steps, start + burst)):
        flags[i] = False
    return flags


def scaler_table(
    flags: list[bool],
    presets: list[str] | None = None,
    growth_interval: int | None = None,
    recipe: tuple[str, Any] | None = None,
) -> dict[str, Any]:
    """Simulates each framework's native scaler (its unimp preset) on the same steps.

    Args:
        flags: per step, True for a clean step, False for an overflow.
        presets: preset names (default: all of :data:`PRESETS`).
        growth_interval: override every preset's interval (the frameworks' 2000 rarely shows
            within a short sequence); flax keeps its one-step lag.
        recipe: ``(label, loss-scale config)``: the recipe's own scaler, simulated first (the
            others' differences are against it).

    Returns:
        ``{"steps": n, "scalers": {name: {"native": str, "config": dict, "scale": [...],
        "skips": int, "stops_at": int | None}}, "differences": [str, ...]}``; ``stops_at`` is
        the step where a scaler that stops at its floor (DeepSpeed, fairseq) would end the run.
    """
    names = list(PRESETS) if presets is None else list(presets)
    out: dict[str, Any] = {"steps": len(flags), "scalers": {}, "differences": []}
    own: dict[str, Any] = {}
    if recipe is not None:
        label, config = recipe
        if config.kind == "dynamic" and growth_interval is not None:
            config = loss_scale_from_dict({**config.to_dict(), "growth_interval": growth_interval})
        own[label] = config
        names = [label, *(n for n in names if n != label)]
    for name in names:
        overrides = {}
        if growth_interval is not None:
            overrides["growth_interval"] = growth_interval + (1 if name == "flax" else 0)
        if name in own:
            cfg = own[name]
        elif name == "unimp":
            cfg = DynamicLossScale(**overrides)
        else:
            cfg = DynamicLossScale.preset(name, **overrides)
        states = simulate(cfg, flags)
        raises = getattr(cfg, "floor_action", "keep") == "raise"
        out["scalers"][name] = {
            "native": PRESETS.get(name, "the recipe's own loss scale" if name in own else name),
            "config": cfg.to_dict(),
            "scale": [float(cfg.initial_scale())] + [float(s.scale) for s in states],
            "skips": int(states[-1].total_skips) if states else 0,
            # the step (0-based) where the scaler would stop the run at its floor, as the trainer
            "stops_at": next((i for i, s in enumerate(states) if raises and s.floor_hits), None),
        }
    base = names[0]
    for name in names[1:]:
        a, b = out["scalers"][base]["scale"], out["scalers"][name]["scale"]
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        if first is None:
            out["differences"].append(f"{name}: same scale as {base} at every step")
        else:
            out["differences"].append(
                f"{name}: first differs from {base} at step {first} ({b[first]:g} vs {a[first]:g}); "
                f"final {b[-1]:g} vs {a[-1]:g}"
            )
        stop = out["scalers"][name]["stops_at"]
        if stop is not None:
            out["differences"][-1] += f"; stops the run at step {stop} (an overflow at its floor)"
    return out
