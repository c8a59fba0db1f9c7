"""What every backend module provides: the neutral face, framework-free.

Each backend module (``unimp.backends.torch``, ``.tensorflow``, ``.jax``) exports at least
:data:`COMMON_API` under the same names (a test checks it), plus its framework's own pieces
(torch's ``GradScaler``, Keras's ``LossScaleOptimizer``, JAX's ``LossScale`` pytree).
"""

from __future__ import annotations

from typing import Any

from unimp.recipe import Recipe, get_recipe
from unimp.registry import cast_mode_refusal

__all__ = ["BACKEND_MODULES", "COMMON_API", "FP8_API", "MixedPrecisionBase", "export"]

#: Public names every backend module exports, meaning the same thing in each:
#:
#: * ``MixedPrecision``: a recipe bound to the framework (subclass of :class:`MixedPrecisionBase`).
#: * ``StepResult``: :class:`unimp.step.StepResult`.
#: * ``cast_tree(tree, dtype)``: casts floating array leaves of a nested structure, passes
#:   integers, booleans, Python scalars and non-arrays through.
#: * ``all_finite(tree)``: a device bool scalar, every floating leaf is finite (no host sync).
#: * ``to_dtype(name)``: the framework dtype for a canonical dtype name.
#: * ``framework_version()``: the installed framework version string.
#: * ``device_info()``: list of dicts ``{"device", "float16", "bfloat16", "recommended"}``
#:   for ``unimp info``: which half dtypes each device runs and the recommended recipe name.
#: * ``tensor_stats(x, scale, formats=())``: ``(counts, magnitudes)``, int32
#:   ``(len(count_fields(formats)),)`` and float32 ``(len(magnitude_fields(formats)),)`` device
#:   arrays: :mod:`unimp.stats`'s statistics of ``x``, with the block formats' errors (no host
#:   sync).
#: * ``layer_paths(model)``: the dotted paths a policy's ``overrides`` match in this framework.
#: * ``apply_overrides(mp, model)``: the overrides applied to a model (torch modules, Keras
#:   layers) or a parameter tree (JAX, returning the cast tree); ``prepare`` calls it.
#: * ``matmul_precision(name)``: a context manager setting the framework's float32 matmul /
#:   convolution precision from :data:`unimp.precision.MATMUL_PRECISION_TABLE`, restored after.
#: * ``current_matmul_precision()``: the framework's current setting, a dict whose ``"api"``
#:   names the framework API unimp sets (``unimp info``), beside that API's values.
#: * ``half_update(optimizer, update, seed=0)``: the framework's optimizer applying its updates
#:   to half-precision parameters by :func:`unimp.rounding.update_half` (``"kahan"``,
#:   ``"stochastic"``): torch's in place, Keras's and optax's as a wrapper.
COMMON_API = (
    "MixedPrecision",
    "StepResult",
    "all_finite",
    "apply_overrides",
    "cast_tree",
    "current_matmul_precision",
    "matmul_precision",
    "device_info",
    "framework_version",
    "half_update",
    "layer_paths",
    "tensor_stats",
    "to_dtype",
)


class MixedPrecisionBase:
    """A recipe bound to a framework. Backends subclass this and add:

    * ``compute_dtype``, ``param_dtype``, ``output_dtype``: framework dtypes.
    * ``cast_to_compute(tree)``, ``cast_to_param(tree)``, ``cast_to_output(tree)``.
    * ``autocast()``: a context manager (the framework's autocast, a policy scope, or a no-op).
    * ``prepare(...)``: applies the recipe to a model / optimizer.
    * ``train_step(...)``: returns a compiled ``step(batch) -> StepResult``; its
      ``stats_every=k`` option puts :class:`unimp.stats.StepStats` in ``result.stats`` on
      steps 0, k, 2k, ...

    Args:
        recipe: a :class:`~unimp.Recipe` or anything :func:`~unimp.get_recipe` accepts.
    """

    backend: str = ""

    def __init__(self, recipe: Any = "mixed_float16") -> None:
        recipe = get_recipe(recipe)
        # the registry's cast_modes table (the framework-free base binds to no backend)
        why = cast_mode_refusal(recipe, self.backend) if self.backend else None
        if why:
            raise ValueError(f"{why} (e.g. get_recipe(name, cast_mode='auto')).")
        self._recipe: Recipe = recipe

    @property
    def recipe(self) -> Recipe:
        """The bound :class:`~unimp.Recipe`."""
        return self._recipe

    @property
    def policy(self):
        """The recipe's :class:`~unimp.Policy`."""
        return self._recipe.policy

    @property
    def loss_scale(self):
        """The recipe's loss-scale config."""
        return self._recipe.loss_scale

    # -- casting: the same rule in every backend, through that backend's ``cast_tree``
    # (floating array leaves only; integers, booleans, Python scalars and non-arrays pass).

    def _cast_tree(self, tree: Any, dtype: Any) -> Any:
        raise NotImplementedError

    def cast_to_compute(self, tree: Any) -> Any:
        """Floating array leaves of ``tree`` cast to the compute dtype; others pass through."""
        return self._cast_tree(tree, self.policy.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Floating array leaves of ``tree`` cast to the param dtype; others pass through."""
        return self._cast_tree(tree, self.policy.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Floating array leaves of ``tree`` cast to the output dtype; others pass through."""
        return self._cast_tree(tree, self.policy.output_dtype)

    def trace(self, step_or_fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Which ops of one step ran in which dtype: :class:`unimp.trace.Trace`.

        torch runs the call under a dispatch mode (a train step's model, optimizer and loss
        scale are put back afterwards, so no step is taken); TensorFlow and JAX trace it to a
        graph / jaxpr and run nothing.

        Args:
            step_or_fn: a train step of this backend (then ``args`` is ``(batch,)``), or any
                function of the framework's tensors.
            *args, **kwargs: what it is called with; ``model=`` (torch, TensorFlow) names the
                layers of a plain function's ops.

        Returns:
            The :class:`unimp.trace.Trace` (records, ``summary()``, ``to_json()``).
        """
        import importlib

        module = importlib.import_module(f"unimp.backends.{self.backend}.trace")
        kwargs.setdefault("recipe", self._recipe.describe())
        return module.trace(step_or_fn, *args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__module__}.{type(self).__name__}({self._recipe.describe()})"


#: The modules of every backend package, in dependency order: the same concept under the same
#: name in ``unimp.backends.torch``, ``.tensorflow`` and ``.jax`` (a test checks it).
BACKEND_MODULES = (
    "devices",  # framework_version, device parsing and placement, device_info
    "precision",  # matmul_precision: the core's matmul precision table set on the framework
    "casting",  # to_dtype, cast_tree, the framework's autocast / module mode / master weights
    "overrides",  # per-layer overrides (unimp.overrides) mapped to the framework's mechanism
    "overflow",  # all_finite and its replica reduction, the global norm; select / keep-unless (JAX)
    "scaling",  # the loss-scale state on device tensors: the rule's array namespace, the scaler
    "optimizer",  # the optimizer wrapped so a skipped step changes nothing
    "stats",  # tensor_stats on the device; what a statistics step records (unimp.stats)
    "step",  # TrainStep, and StepOps: the phases unimp.trainstep.run_step runs (one algorithm)
    "mixed_precision",  # MixedPrecision: the recipe bound to the framework
    "trace",  # the dtype trace of one step: ops with input / compute / output dtypes
    "fp8",  # unimp.fp8's scaling and quantize-dequantize rules on device tensors, FP8 layers
    "blockscale",  # unimp.blockscale_linear's block-scaled GEMM rule as a custom-gradient matmul, layers
)

#: FP8 names every backend's ``fp8`` module exports (and its package re-exports), the same
#: meaning in each: ``FP8Ops`` (the rule's array namespace), ``fp8_initial_state``,
#: ``fp8_state_from_numpy`` / ``fp8_state_to_numpy`` (to and from :class:`unimp.fp8.FP8State`
#: of NumPy values, for the portable state_dict), ``fp8_amax``, ``fp8_step`` and
#: ``fp8_quantize_dequantize`` (:func:`unimp.fp8.step_arrays` / :func:`unimp.fp8.qdq_arrays` on
#: native tensors).
FP8_API = (
    "FP8Ops",
    "fp8_amax",
    "fp8_initial_state",
    "fp8_quantize_dequantize",
    "fp8_state_from_numpy",
    "fp8_state_to_numpy",
    "fp8_step",
)


def export(package: str, namespace: dict[str, Any]) -> None:
    """Gives the public classes and functions of a backend package (its ``__all__``) the package
    as their ``__module__``, as NumPy and JAX do for theirs.

    Pickles, Keras configs (``"module": ...``) and reprs then name the public path
    (``unimp.backends.torch.GradScaler``), which stays the same when a class moves between the
    package's modules.
    """
    for name in namespace["__all__"]:
        obj = namespace[name]
        mod = getattr(obj, "__module__", None)
        if isinstance(mod, str) and mod.startswith(package + "."):
            try:
                obj.__module__ = package
            except (AttributeError, TypeError):  # pragma: no cover - a builtin or a slot type
                pass
