"""Case 9: bad input gets a clear error that names the fix, and the failed call changes nothing
(model, optimizer, loss-scale state). Every case runs on every backend under test."""

from __future__ import annotations

import copy

import kits
import numpy as np
import pytest
from conftest import edited_state_dict

import unimp
from unimp import DynamicLossScale, StaticLossScale, get_recipe, registry

# (name, needle in the message)
BAD_BACKENDS = [
    ("pytroch", "Did you mean 'pytorch'"),
    ("tensorflw", "Did you mean 'tensorflow'"),
    ("mxnet", "Valid backends"),
]
BAD_POLICIES = [
    ("mixed_float61", "Did you mean 'mixed_float16'"),
    ("bf16-mixd", "Did you mean 'bf16-mixed'"),
    ("transformer-engine-float16", "FP8 with float16 compute"),  # "fp8" itself is a recipe now
    ("transformer_engine", "Did you mean the FP8 recipe 'transformer-engine'"),  # TE's package name
    ("fp8-delayd", "Did you mean the FP8 recipe 'fp8-delayed'"),
    ("c=f17", "c=f17 is not a dtype. Did you mean 'f16'"),
    ("p=f32,p=f16", "given twice"),
    ("x=f16", "Keys are p|params"),
]
BAD_LOSS_SCALES = [
    ({"growth_factor": 1.0}, "growth_factor"),
    ({"growth_factor": float("nan")}, "growth_factor"),
    ({"backoff_factor": 1.5}, "backoff_factor"),
    ({"backoff_factor": 0}, "backoff_factor"),
    ({"growth_interval": 0}, "growth_interval"),
    ({"growth_interval": 1.5}, "growth_interval"),
    ({"min_scale": 8.0, "max_scale": 4.0, "init_scale": 6.0}, "min_scale"),
    ({"init_scale": 0.25}, "init_scale"),
    ({"init_scale": float("inf")}, "init_scale"),
    ({"max_consecutive_skips": 0}, "max_consecutive_skips"),
]


def _sd(**changes):
    return edited_state_dict(DynamicLossScale(init_scale=1024, growth_interval=4), **changes)


BAD_STATE_DICTS = [
    ("not-a-dict", [1, 2], "dict"),
    ("empty", {}, "format"),
    (
        "torch-gradscaler",
        {
            "scale": 65536.0,
            "growth_factor": 2.0,
            "backoff_factor": 0.5,
            "growth_interval": 2000,
            "_growth_tracker": 0,
        },
        None,
    ),
    ("keras-checkpoint", {"dynamic_scale": 1024.0, "step_counter": 3}, "format"),
    # a mixed_bfloat16 run's state ({"kind": "none"}) would turn a float16 step's scaling off,
    # silently (torch.amp.GradScaler refuses a disabled scaler's state as well)
    (
        "no-loss-scaling",
        unimp.loss_scale.state_dict(get_recipe("mixed_bfloat16").loss_scale),
        r"saved by a run without loss scaling \(kind 'none'.*this step scales its loss \(dynamic.*"
        r"Nothing was changed",
    ),
    ("future-format", _sd(format="unimp.loss_scale/3"), "one state format, 'unimp.loss_scale/1'"),
    ("config-a-name", _sd(config="dynamic"), "'config' must be a dict"),
    ("kind-a-list", _sd(config__kind=["dynamic"]), "'kind' must be one of"),
    ("static-with-a-count", edited_state_dict(StaticLossScale(8.0), state__counter=7), r"\['counter'\] must be 0"),
    ("missing-state", _sd(state=KeyError), "state"),
    ("bad-kind", _sd(config__kind="adaptive"), "kind"),
    ("bad-growth", _sd(config__growth_factor=0.9), "growth_factor"),
    ("unknown-config-key", _sd(config__period=10), "period"),
    ("counter-too-big", _sd(state__counter=4), "counter"),
    ("negative-counter", _sd(state__counter=-1), "counter"),
    ("scale-inf", _sd(state__scale=float("inf")), "scale"),
    ("scale-string", _sd(state__scale="1024"), "scale"),
    ("scale-above-max", _sd(state__scale=2.0**30), "scale"),
    ("skips-inconsistent", _sd(state__consecutive_skips=3), "consecutive_skips"),
]

BAD_STEP_OPTIONS = [
    ({"grad_accum_steps": 0}, "grad_accum_steps"),
    ({"grad_accum_steps": -2}, "grad_accum_steps"),
    ({"grad_accum_steps": 1.5}, "grad_accum_steps"),
    ({"grad_accum_steps": "2"}, "grad_accum_steps"),
    ({"max_grad_norm": 0.0}, "max_grad_norm"),
    ({"max_grad_norm": -1.0}, "max_grad_norm"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm"),
    ({"max_grad_norm": float("inf")}, "max_grad_norm"),
    ({"max_grad_norm": "1"}, "max_grad_norm"),
    # the norm is float32 everywhere: 1e39 was inf there (inf / inf: NaN weights, applied) and
    # 1e-50 was 0 (0 / 0 on zero gradients); 10**400 raised OverflowError; complex passed as 1.0
    ({"max_grad_norm": 1e39}, "float32's positive range"),
    ({"max_grad_norm": 1e-50}, "float32's positive range"),
    ({"max_grad_norm": 10**400}, "max_grad_norm"),
    ({"max_grad_norm": np.complex128(1 + 5j)}, "max_grad_norm"),
]


def test_there_are_at_least_40_distinct_bad_inputs():
    total = (
        len(BAD_BACKENDS)
        + len(BAD_POLICIES)
        + len(BAD_LOSS_SCALES)
        + len(BAD_STATE_DICTS)
        + len(BAD_STEP_OPTIONS)
    )
    assert total >= 40


@pytest.mark.parametrize("name,needle", BAD_BACKENDS, ids=[b[0] for b in BAD_BACKENDS])
def test_unknown_backend(name, needle):
    with pytest.raises(ValueError, match=needle):
        unimp.mixed_precision("mixed_float16", backend=name)


@pytest.mark.parametrize("name,needle", BAD_POLICIES, ids=[p[0] for p in BAD_POLICIES])
def test_unknown_policy(backend, name, needle):
    with pytest.raises(ValueError, match=needle):
        unimp.mixed_precision(name, backend=backend)


@pytest.mark.parametrize(
    "kwargs,field", BAD_LOSS_SCALES, ids=[f"{k}" for k in range(len(BAD_LOSS_SCALES))]
)
def test_invalid_loss_scale_config(backend, kwargs, field):
    with pytest.raises(ValueError, match=field):
        unimp.mixed_precision(
            get_recipe("mixed_float16", loss_scale=DynamicLossScale(**kwargs)), backend=backend
        )


#: The cast modes each framework has ("auto" aside): torch.autocast is torch's alone.
CAST_MODES = {"torch": {"autocast", "module"}, "tensorflow": {"module"}, "jax": {"module"}}


def test_the_registry_holds_the_cast_mode_table():
    assert {b: set(registry.backend_info(b).cast_modes) for b in CAST_MODES} == CAST_MODES


@pytest.mark.parametrize("mode", ["auto", "autocast", "module"])
def test_cast_mode_is_honoured_or_refused_in_one_line(backend, mode):
    recipe = get_recipe("mixed_float16", cast_mode=mode)
    if mode == "auto" or mode in CAST_MODES[backend]:
        assert unimp.mixed_precision(recipe, backend=backend).recipe.cast_mode == mode
    else:
        with pytest.raises(ValueError, match=rf"^{backend} has no cast_mode='{mode}': use cast_mode 'auto' or 'module'") as e:
            unimp.mixed_precision(recipe, backend=backend)
        assert "\n" not in str(e.value)
    # a float32 policy casts nothing, so every mode runs (Apex O0 is "autocast")
    assert unimp.mixed_precision(get_recipe("float32", cast_mode=mode), backend=backend)


@pytest.fixture
def used_run(backend):
    run = kits.build(
        backend,
        get_recipe(
            "mixed_float16", loss_scale=DynamicLossScale(init_scale=1024, growth_interval=4)
        ),
    )
    run.step(kits.batch(0))
    run.step(kits.batch(1, poison=float("inf")))
    return run


@pytest.mark.parametrize("case,d,needle", BAD_STATE_DICTS, ids=[c[0] for c in BAD_STATE_DICTS])
def test_corrupt_or_foreign_state_dict_changes_nothing(used_run, case, d, needle):
    before_state, before_params = used_run.loss_scale_state(), used_run.params()
    if needle is None:  # a torch GradScaler dict: the torch backend converts it, the others refuse
        if used_run.backend == "torch":
            used_run.load_state_dict(copy.deepcopy(d))
            assert float(used_run.loss_scale_state().scale) == 65536.0
            return
        needle = "GradScaler"
    with pytest.raises(ValueError, match=needle):
        used_run.load_state_dict(copy.deepcopy(d))
    assert used_run.loss_scale_state() == before_state
    for k, v in used_run.params().items():
        np.testing.assert_array_equal(v, before_params[k])
    assert used_run.step(kits.batch(2)).applied  # still usable


@pytest.mark.parametrize(
    "kwargs,needle",
    BAD_STEP_OPTIONS,
    ids=[f"{next(iter(k))}={next(iter(k.values()))!r}" for k, _ in BAD_STEP_OPTIONS],
)
def test_bad_train_step_options(backend, kwargs, needle):
    w = kits.weights()
    with pytest.raises(ValueError, match=needle):
        kits.build(backend, "mixed_float16", w=w, **kwargs)
    np.testing.assert_array_equal(w["w1"], kits.weights()["w1"])


def test_a_tuple_is_one_batch_never_a_window_of_micro_batches(backend):
    """``step((x, y))`` with ``grad_accum_steps=2`` took ``x`` and ``y`` as two micro-batches
    and failed deep in the framework (torch: ``mat1 and mat2 shapes cannot be multiplied``):
    a window is a list; a tuple gets one line saying so, and nothing changes."""
    run = kits.build(backend, "mixed_float16", grad_accum_steps=2)
    b = run._convert(kits.batch(0))
    before_state, before_params = run.loss_scale_state(), run.params()
    with pytest.raises(ValueError, match=r"takes a list of 2 micro-batches, got a tuple \(one batch"):
        run._step_fn((b, run._convert(kits.batch(1))))
    assert run.loss_scale_state() == before_state
    for k, v in run.params().items():
        np.testing.assert_array_equal(v, before_params[k])
    assert run._step_fn([b, run._convert(kits.batch(1))]).applied  # the list form runs


def test_uneven_micro_batches_are_refused_alike_in_every_backend(backend):
    """Micro-batches of 5 and 3 rows: torch and TensorFlow averaged the two means with equal
    weights (2e-3 off the full batch's parameters after two Adam steps), JAX refused with a
    message of its own. One rule: refused in every backend with one message, nothing changed
    (issue 28 item 11)."""
    run = kits.build(backend, "mixed_float16", grad_accum_steps=2)
    before_state, before_params = run.loss_scale_state(), run.params()
    uneven = [run._convert(kits.batch(0, size=5)), run._convert(kits.batch(1, size=3))]
    with pytest.raises(
        ValueError, match=r"^with grad_accum_steps=2, micro-batch 1 has 3 rows where micro-batch 0 "
        r"has 5: every micro-batch's mean loss weighs the same.*Split the batch evenly"
    ):
        run._step_fn(uneven)
    assert run.loss_scale_state() == before_state
    for k, v in run.params().items():
        np.testing.assert_array_equal(v, before_params[k])
    even = [run._convert(kits.batch(0, size=4)), run._convert(kits.batch(1, size=4))]
    assert run._step_fn(even).applied
