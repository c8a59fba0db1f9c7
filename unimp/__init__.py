"""unimp: one mixed-precision recipe for PyTorch, TensorFlow/Keras and JAX.

``import unimp`` imports no framework; a backend is imported when first asked for.

Example:
    >>> import unimp
    >>> recipe = unimp.get_recipe("mixed_float16")
    >>> recipe.policy.compute_dtype
    'float16'
"""

from unimp.dtypes import canonical_dtype
from unimp.loss_scale import (
    DynamicLossScale,
    LossScaleError,
    LossScaleState,
    NoLossScale,
    ReplicaDesyncWarning,
    StaticLossScale,
    from_state_dict,
    simulate,
    state_dict,
    update,
)
from unimp.policy import Policy, get_policy
from unimp.recipe import Recipe, get_recipe
from unimp.registry import (
    available_backends,
    detect_backend,
    get_backend,
    list_backends,
    mixed_precision,
)
from unimp.stats import StepStats, TensorStats, reference_stats
from unimp.step import HalfOptimizerStateWarning, StepResult

__version__ = "0.1.0"

__all__ = [
    "DynamicLossScale",
    "HalfOptimizerStateWarning",
    "LossScaleError",
    "LossScaleState",
    "NoLossScale",
    "Policy",
    "Recipe",
    "ReplicaDesyncWarning",
    "StaticLossScale",
    "StepResult",
    "StepStats",
    "TensorStats",
    "__version__",
    "available_backends",
    "canonical_dtype",
    "detect_backend",
    "from_state_dict",
    "get_backend",
    "get_policy",
    "get_recipe",
    "list_backends",
    "mixed_precision",
    "reference_stats",
    "simulate",
    "state_dict",
    "update",
]
