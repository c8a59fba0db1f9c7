"""Pure float16 parameters give an adaptive optimizer float16 state: its second moment flushes
below ~2.4e-4 and Adam's epsilon of 1e-8 becomes 0 in float16. Every backend says so with one
``HalfOptimizerStateWarning`` (``unimp.step.warn_half_optimizer_state``) when the model and
optimizer are prepared and the train step is built, and says nothing where the state is safe: an
epsilon of at least 6.1e-5, an optimizer without a second moment, float32 parameters (a mixed
recipe) or bfloat16 (float32's range). What each framework adds (optax's unreadable epsilon,
Keras's prebuilt optimizers, torch's tensor epsilon) is in tests/backends/<fw>/test_optimizer.py."""

from __future__ import annotations

import warnings

import kits
import pytest

import unimp


def _warnings_while_building(backend, recipe, optimizer, eps=1e-8):
    """The HalfOptimizerStateWarnings of preparing and building the linear kit's train step."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kits.build_linear(backend, recipe, w=[1.0, 2.0, 3.0], lr=1e-3, optimizer=optimizer, eps=eps)
    return [w for w in caught if issubclass(w.category, unimp.HalfOptimizerStateWarning)]


@pytest.mark.parametrize("recipe", ["float16", "O3"])  # pure float16: no scaling; Apex's static 1.0
def test_adam_on_float16_parameters_warns_once(backend, recipe):
    said = _warnings_while_building(backend, recipe, "adam")
    assert len(said) == 1, [str(w.message) for w in said]
    assert "keeps its moments in float16" in str(said[0].message)
    assert "epsilon=1e-08 becomes 0 in float16" in str(said[0].message)


@pytest.mark.parametrize(
    "recipe, optimizer, eps",
    [
        ("float16", "adam", 1e-4),  # the pure-float16 mitigation
        ("float16", "momentum", 1e-8),  # SGD's momentum: no second moment
        ("mixed_float16", "adam", 1e-8),  # float32 parameters and optimizer state
        ("bfloat16", "adam", 1e-8),  # bfloat16 has float32's range
    ],
    ids=["float16-adam-eps-1e-4", "float16-sgd-momentum", "mixed_float16-adam", "bfloat16-adam"],
)
def test_no_warning_where_the_half_state_is_safe(backend, recipe, optimizer, eps):
    assert _warnings_while_building(backend, recipe, optimizer, eps) == []
