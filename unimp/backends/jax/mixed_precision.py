"""JAX :class:`MixedPrecision`: a recipe bound to JAX (jmp-style casting, ``apply``, flax
``module_kwargs``, ``prepare``, ``train_step``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from unimp.backends._base import MixedPrecisionBase
from unimp.backends.jax.blockscale import (
    block_flax_dot_general_cls,
    block_matmul,
    block_scaled_dot_general,
)
from unimp.backends.jax.casting import cast_tree, to_dtype
from unimp.backends.jax.devices import _as_device
from unimp.backends.jax.fp8 import (
    fp8_flax_dot_general_cls,
    fp8_initial_states,
    fp8_matmul,
    fp8_update,
)
from unimp.backends.jax.optimizer import half_update, loss_scaling
from unimp.backends.jax.overrides import apply_overrides, cast_by_path, check_half_leaves
from unimp.backends.jax.precision import matmul_precision
from unimp.backends.jax.scaling import LossScale
from unimp.backends.jax.step import TrainStep
from unimp.steprecorder import with_log
from unimp.trainstep import StepOptions


class MixedPrecision(MixedPrecisionBase):
    """A recipe bound to JAX.

    JAX has no autocast: casts happen at function boundaries (:meth:`apply`, as jmp) and inside
    flax modules given :meth:`module_kwargs`.

    Args:
        recipe: a :class:`unimp.Recipe` or anything :func:`unimp.get_recipe` accepts.
        device: where :meth:`train_step` runs: ``"cpu"``, ``"gpu"`` / ``"cuda"``, ``"tpu"``
            with an optional ``":N"`` index, or a ``jax.Device`` (the same option as torch's);
            ``None`` (default) follows JAX's default device. The step's state is committed
            there and each batch is put there.

    Raises:
        ValueError: an unknown recipe, a float64 policy while JAX runs in 32-bit mode, or a
            device JAX does not have (the message lists the ones it has).

    Example:
        >>> import jax.numpy as jnp
        >>> mp = MixedPrecision("mixed_float16")
        >>> mp.cast_to_compute({"x": jnp.ones(2), "n": jnp.int32(1)})["x"].dtype
        dtype('float16')
    """

    _cast_tree = staticmethod(cast_tree)

    backend = "jax"

    def __init__(self, recipe: Any = "mixed_float16", device: Any = None) -> None:
        resolved = None if device is None else _as_device(device)  # before anything is kept
        super().__init__(recipe)
        p = self.policy
        self._dtypes = tuple(to_dtype(d) for d in (p.param_dtype, p.compute_dtype, p.output_dtype))
        self._device = resolved

    @property
    def device(self) -> jax.Device | None:
        """The bound device, or None (JAX's default device)."""
        return self._device

    @property
    def param_dtype(self) -> np.dtype:
        """The JAX dtype parameters are stored in."""
        return self._dtypes[0]

    @property
    def compute_dtype(self) -> np.dtype:
        """The JAX dtype the maths runs in."""
        return self._dtypes[1]

    @property
    def output_dtype(self) -> np.dtype:
        """The JAX dtype floating outputs are returned in."""
        return self._dtypes[2]

    def cast_to_compute(self, tree: Any, path: str = "") -> Any:
        """Floating leaves of ``tree`` cast to the compute dtype of the policy at their key path
        (:mod:`unimp.backends.jax.overrides`: an override's where one covers the path); others
        pass through.

        Args:
            tree: any pytree.
            path: the dotted path the tree sits at: ``cast_to_compute(h, path="l2")`` casts an
                activation entering layer ``l2`` to ``l2``'s compute dtype.

        Raises:
            ValueError: an override conflict at some path.
        """
        return cast_by_path(tree, self.policy, "compute_dtype", path)

    def cast_to_param(self, tree: Any, path: str = "") -> Any:
        """Floating leaves of ``tree`` cast to the param dtype of the policy at their key path
        (``path`` as in :meth:`cast_to_compute`).

        Raises:
            ValueError: an override conflict at some path.
        """
        return cast_by_path(tree, self.policy, "param_dtype", path)

    def autocast(self) -> contextlib.AbstractContextManager:
        """JAX has no autocast (use :meth:`apply` or :meth:`module_kwargs`): a context manager
        that only sets the policy's ``matmul_precision`` (``jax.default_matmul_precision``,
        read when a function is traced) for the block, a no-op without one. Provided so
        framework-neutral code runs unchanged."""
        return matmul_precision(self.policy.matmul_precision)

    def apply(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wraps ``fn(params, *inputs)`` jmp-style.

        Params and floating inputs are cast to the compute dtype, floating outputs to the
        output dtype; integer and boolean leaves pass through.

        Raises:
            TypeError: ``fn`` is not callable.
        """
        if not callable(fn):
            raise TypeError(
                f"apply() needs a function fn(params, *inputs), got {type(fn).__name__}."
            )

        @functools.wraps(fn)
        def wrapped(params: Any, *inputs: Any) -> Any:
            out = fn(self.cast_to_compute(params), *self.cast_to_compute(inputs))
            return self.cast_to_output(out)

        return wrapped

    def module_kwargs(self, path: str | None = None, step: Any = None) -> dict[str, Any]:
        """``{"dtype": compute, "param_dtype": param}`` for flax linen and nnx modules.

        With ``path`` (the module's dotted path, e.g. ``"head"`` or ``"blocks.0.attn"``), the
        dtypes of ``policy.policy_for(path)``: an override's where one covers it (flax's own
        per-module ``dtype`` / ``param_dtype``).

        The dtype is explicit: flax's ``dtype=None`` promotes half inputs back to float32 when
        parameters are float32. Normalization layers given these keep float32 parameters and
        statistics (flax computes mean and variance in at least float32) and return the
        compute dtype.

        With an FP8 recipe and the dotted ``path`` of a flax linen ``Dense`` that
        :meth:`fp8_layers` selected, ``dot_general_cls=`` is added: unimp's emulated float8
        ``dot_general`` with its scaling states in flax's ``_overwrite_with_gradient``
        collection (:func:`unimp.backends.jax.fp8.fp8_flax_dot_general_cls`). With a
        block-scaled recipe, ``dot_general=`` is added for the selected paths
        (:func:`unimp.backends.jax.blockscale.block_scaled_dot_general`). A rule that rounds
        its gradients stochastically (``nvfp4``) needs fresh random bits each step: give
        ``step`` (an int, or a traced int32 such as the optimizer's count, passed into the
        model's ``__call__``), or leave it out and ``dot_general_cls=`` is added instead, a
        ``dot_general`` keeping its step counter in flax's ``_overwrite_with_gradient``
        collection as the float8 states are kept, advanced by overwriting that collection
        with its "gradient" (:func:`unimp.backends.jax.blockscale.block_flax_dot_general_cls`).
        The same seed and step give the same bits. Other rules ignore ``step``.

        Raises:
            ValueError: a ``path`` under an FP8 recipe before :meth:`fp8_layers` was called
                (the first and last layers are only known from the whole list).
        """
        if path is None:
            return {"dtype": self.compute_dtype, "param_dtype": self.param_dtype}
        p = self.policy.policy_for(path)
        out = {"dtype": to_dtype(p.compute_dtype), "param_dtype": to_dtype(p.param_dtype)}
        if self._recipe.fp8 is not None and path in self._fp8_paths():
            out["dot_general_cls"] = fp8_flax_dot_general_cls(self._recipe.fp8.scaling, name=path)
        block = self._recipe.block
        if block is not None and path in self._fp8_paths():
            if step is None and block.rule.stochastic("gradient"):
                out["dot_general_cls"] = block_flax_dot_general_cls(block.rule, block.seed)
            else:
                out["dot_general"] = block_scaled_dot_general(block.rule, block.seed, 0 if step is None else step)
        return out

    def fp8_layers(self, layers: Any) -> tuple[str, ...]:
        """Declares the model's layers and returns the dotted paths of those that run float8
        matmuls (the same rule and names as torch's and Keras's ``fp8_layers``:
        :meth:`unimp.fp8.recipe.FP8Recipe.select`, first and last Dense out by default);
        :meth:`module_kwargs`, :meth:`fp8_states` and :meth:`fp8_matmul` use the selection.

        Args:
            layers: in model order, dotted paths of Dense layers (``"attn.q"``) or
                ``(path, kind)`` pairs (``("ln1", "LayerNorm")``).

        Returns:
            The selected paths (a block-scaled recipe's, under one: the same rule); ``()``
            without an FP8 or block-scaled recipe.

        Raises:
            TypeError: ``layers`` is a string or not a list/tuple, or an entry that is neither
                a path string nor a ``(path, kind)`` pair of strings (named by position).
        """
        if not isinstance(layers, (list, tuple)):
            raise TypeError(f"mp.fp8_layers(layers) takes a list of dotted layer paths or (path, kind) "
                            f"pairs, in model order, got {type(layers).__name__}.")
        pairs = []
        for i, x in enumerate(layers):
            if isinstance(x, str):
                pairs.append((x, "Dense"))
            elif isinstance(x, (list, tuple)) and len(x) == 2 and all(isinstance(v, str) for v in x):
                pairs.append(tuple(x))
            else:
                raise TypeError(f"mp.fp8_layers(layers): layers[{i}] must be a dotted path or a "
                                f"(path, kind) pair of strings, got {x!r}.")
        recipe = self._recipe.fp8 if self._recipe.fp8 is not None else self._recipe.block
        if recipe is None:
            return ()
        self._fp8_selected = recipe.select(pairs)
        return self._fp8_selected

    def _fp8_paths(self) -> tuple[str, ...]:
        selected = getattr(self, "_fp8_selected", None)
        if selected is None:
            raise ValueError("an FP8 recipe selects layers from the whole model: call "
                             "mp.fp8_layers([...every Dense path, in model order...]) first.")
        return selected

    def fp8_states(self) -> dict[str, Any]:
        """Plain JAX: the initial scaling states of the selected layers, ``{path: (input,
        kernel, grad)}`` of :class:`unimp.fp8.FP8State` (a pytree). Pass them to the loss
        next to the params and differentiate with respect to both: the states' "gradients"
        are the states after the step (:meth:`fp8_matmul`). ``{}`` without an FP8 recipe."""
        if self._recipe.fp8 is None:
            return {}
        return fp8_initial_states(self._recipe.fp8.scaling, self._fp8_paths())

    def fp8_matmul(self, states: Any, path: str, x: jax.Array, w: jax.Array,
                   native: bool | None = None) -> jax.Array:
        """Plain JAX: ``x @ w`` for the layer at ``path`` (``w``: ``(in, out)``), a float8
        matmul with ``states[path]`` when the recipe selected it
        (:func:`unimp.backends.jax.fp8.fp8_matmul`: emulated, or with ``native`` the float8
        GEMM; ``None`` reads ``UNIMP_FP8_NATIVE`` when traced), else the plain matmul."""
        if self._recipe.fp8 is None:
            return x @ w
        return fp8_matmul(self._recipe.fp8.scaling, states, path, x, w, native=native)

    def block_matmul(self, path: str, x: jax.Array, w: jax.Array, step: Any = 0) -> jax.Array:
        """Plain JAX: ``x @ w`` for the layer at ``path`` (``w``: ``(in, out)``), the
        block-scaled matmul of the recipe's rule when :meth:`fp8_layers` selected it
        (:func:`unimp.backends.jax.blockscale.block_matmul`; ``step``, an int or a traced int32
        counter, seeds the stochastic rounding with the recipe's seed), else the plain matmul."""
        if self._recipe.block is None:
            return x @ w
        return block_matmul(self._recipe.block, self._fp8_paths(), path, x, w, step)

    def fp8_update(self, states: Any, new_states: Any) -> Any:
        """Plain JAX: the states after a step from their "gradients"
        (:func:`unimp.backends.jax.fp8.fp8_update`): a layer that did not run in the step
        (``lax.cond``, ``stop_gradient``) keeps its states, where taking the gradients as
        they are would give it zeros. ``mp.train_step(..., model_state=states)`` applies it."""
        return fp8_update(states, new_states)

    def init_loss_scale(self) -> LossScale:
        """The recipe's loss scale as a pytree in its initial state."""
        return LossScale(self.loss_scale)

    def prepare(self, params: Any, optimizer: optax.GradientTransformation | None = None) -> Any:
        """Applies the recipe to parameters and an optax optimizer.

        Args:
            params: a pytree; floating leaves are cast to the param dtype of their path
                (:func:`apply_overrides`: an unmatched override pattern warns here).
            optimizer: an optax optimizer, wrapped with :func:`loss_scaling` using the recipe's
                loss scale (and first with :func:`half_update` when the policy's ``update``
                is ``"kahan"`` or ``"stochastic"``, seed 0; wrap it yourself for another
                seed); ``None`` to skip.

        Returns:
            The parameters alone when no optimizer is given, else ``(params, optimizer)``: the
            shape of every backend's ``prepare``. Scale the loss with
            ``get_loss_scale(opt_state).scale``.
        """
        params = apply_overrides(self, params)
        check_half_leaves(params, self.loss_scale)
        if optimizer is None:
            return params
        if self.policy.update != "nearest":
            optimizer = half_update(optimizer, self.policy.update)
        return params, loss_scaling(optimizer, self.loss_scale)

    def train_step(
        self,
        loss_fn: Callable[[Any, Any], Any],
        optimizer: optax.GradientTransformation,
        params: Any,
        *,
        grad_accum_steps: int = 1,
        max_grad_norm: float | None = None,
        axis_name: Any = None,
        mesh: Any = None,
        donate: bool = False,
        model_state: Any = None,
        stats_every: int | None = None,
        log: Any = None,
        log_every: int = 100,
        rounding_seed: int = 0,
        stats_formats: Any = (),
        schedule_counts: str = "applied",
    ) -> TrainStep:
        """A jitted training step holding params, optimizer state and loss-scale state.

        See :class:`TrainStep` (``axis_name`` / ``mesh``: data parallelism under ``shard_map``)
        and, for the options every backend takes (``grad_accum_steps``, ``max_grad_norm``,
        ``stats_every``, ``schedule_counts``, ``log``, ``log_every``, ``rounding_seed``,
        ``stats_formats``), :class:`unimp.trainstep.StepOptions`. ``loss_fn(params, batch)`` returns a scalar
        loss; make it run in the compute dtype with :meth:`apply` or flax modules built with
        :meth:`module_kwargs`. ``stats_every=k`` adds tensor statistics (:mod:`unimp.stats`)
        of the gradients and observed activations (:func:`observe`, flax linen module outputs)
        to the results of steps 0, k, 2k, ... (``result.stats``).

        ``log=path`` (or a :class:`unimp.steplog.StepLogWriter`) writes a JSON Lines step log
        (``docs/steplog.md``; ``unimp doctor`` reads it): one record per step, kept on the
        device and written every ``log_every`` steps (default 100; the only waits it adds), the
        rest on ``step.close()``, garbage collection or exit. With ``stats_every`` the records
        carry the statistics, and a non-finite step's first non-finite layer.
        """
        options = StepOptions(
            grad_accum_steps, max_grad_norm, stats_every, schedule_counts, log, log_every, rounding_seed,
            stats_formats=stats_formats,
        )
        step = TrainStep(
            self, loss_fn, optimizer, params, options=options, axis_name=axis_name, mesh=mesh,
            donate=donate, model_state=model_state,
        )  # fmt: skip
        return with_log(step, self, log, options.log_every, step.loss_scale.config, jax.device_get)
