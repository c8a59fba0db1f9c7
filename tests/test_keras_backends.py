"""unimp.keras on every Keras backend: each backend runs tests/_keras_worker.py in a process of
its own (Keras's backend is fixed per process) and the results are compared here, with each
other, with Keras's own LossScaleOptimizer and with the NumPy reference rule."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from conftest import require_backend

from unimp import blockscale_linear as bl
from unimp.loss_scale import DynamicLossScale, simulate

HERE = pathlib.Path(__file__).resolve().parent
KERAS_BACKENDS = ("tensorflow", "jax", "torch")
CASES = {
    "tensorflow": ("rule", "half", "update_rules", "fit16", "losses32", "check", "misuse", "step16", "step_options", "stats16", "fp8", "block"),
    "jax": ("rule", "stateless", "half", "update_rules", "fit16", "losses32", "check", "misuse", "step16", "step_options", "refusals", "stats16", "fp8", "block"),
    "torch": ("rule", "stateless", "half", "update_rules", "fit16", "losses32", "check", "misuse", "syncs", "step16", "step_options", "refusals", "stats16", "fp8", "block"),
}
_REQUIRES = {"tensorflow": "tensorflow", "jax": "jax", "torch": "torch"}

sys.path.insert(0, str(HERE))
import _keras_worker as W  # noqa: E402  (the worker's tables; importing it imports Keras's default backend)


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    out = {}
    for b in KERAS_BACKENDS:
        require_backend(_REQUIRES[b])
        env = {
            **os.environ,
            "KERAS_BACKEND": b,
            "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]),
            "TF_CPP_MIN_LOG_LEVEL": "3",
        }
        p = subprocess.run(
            [sys.executable, str(HERE / "_keras_worker.py"), *CASES[b]],
            env=env, capture_output=True, text=True, timeout=600,
        )
        assert p.returncode == 0, f"KERAS_BACKEND={b}:\n{p.stderr[-4000:]}"
        res = json.loads(p.stdout.strip().splitlines()[-1])
        assert res["backend"] == b
        out[b] = res
    return out


def _events() -> list[bool]:
    return [bool(np.isfinite(e)) for e in W.EVENTS]


@pytest.mark.parametrize("rule", sorted(W.RULES))
def test_the_rule_is_the_reference_on_every_keras_backend(runs, rule):
    ref = simulate(W.RULES[rule], _events())
    applied = np.cumsum(_events())
    for b in KERAS_BACKENDS:
        rows = runs[b]["rule"][f"{rule}/unimp"]
        assert [r["scale"] for r in rows] == [float(s.scale) for s in ref], b
        # a skipped step changes neither the weights nor iterations (schedules count applied steps)
        assert [r["iterations"] for r in rows] == applied.tolist(), b
        for i, ok in enumerate(_events()):
            if not ok:
                before = rows[i - 1]["w"] if i else [1.0, 2.0, 3.0]
                assert rows[i]["w"] == before, (b, i)
            else:
                assert rows[i]["w"] != (rows[i - 1]["w"] if i else [1.0, 2.0, 3.0]), (b, i)


@pytest.mark.parametrize("name", sorted(W.HALF_OPTIMIZERS))
def test_half_variables_update_in_float32_alike_on_every_keras_backend(runs, name):
    """bfloat16 variables: the inner optimizer's update is computed in float32 and rounded once
    (unimp.keras.optimizer.Float32View), on every engine bit for bit what the TensorFlow
    backend's optimizer gives, stateful and stateless; the float32 variable beside them too."""
    want = runs["tensorflow"]["half"][f"{name}/tf_backend"]
    assert runs["tensorflow"]["half"][name] == want
    for b in ("jax", "torch"):
        assert runs[b]["half"][name] == want, b
        assert runs[b]["half"][f"{name}/stateless"] == want, b
    assert all(step != want["start"] for step in want["w"])  # every step moves them


def test_half_variables_alone_take_weight_decay_alike_on_every_keras_backend(runs):
    """Only bfloat16 variables under AdamW: their decay is in the float32 update, and Keras is
    given no variable to decay (on Keras-torch its torch._foreach decay raised on an empty list)."""
    want = runs["tensorflow"]["half"]["adamw/alone/tf_backend"]
    for b in KERAS_BACKENDS:
        assert runs[b]["half"]["adamw/alone"] == want, b


@pytest.mark.parametrize("mode", ["nearest", "kahan", "stochastic"])
def test_update_rules_give_the_tensorflow_backends_weights_on_every_keras_backend(runs, mode):
    """A policy's update rule (unimp.rounding over keras.ops) on bfloat16 variables: the
    TensorFlow backend's weights bit for bit on every engine, stateful and stateless, and its
    exported state (compensation buffers, counters); Kahan and stochastic rounding give other
    weights than round to nearest, and mp.prepare gives the rule on every engine."""
    want = runs["tensorflow"]["update_rules"][f"{mode}/tf_backend"]
    assert runs["tensorflow"]["update_rules"][mode] == want
    for b in ("jax", "torch"):
        assert runs[b]["update_rules"][mode] == want, b
        assert runs[b]["update_rules"][f"{mode}/stateless"] == want, b
    if mode != "nearest":
        assert want != runs["tensorflow"]["update_rules"]["nearest/tf_backend"]
        # the portable update state (export_update_state) is the TensorFlow backend's too
        state = runs["tensorflow"]["update_rules"][f"{mode}/tf_backend/export"]
        assert state["update"] == mode and state["seed"] == 7 and state["params"][1] is None
        for b in KERAS_BACKENDS:
            assert runs[b]["update_rules"][f"{mode}/export"] == state, b
    for b in KERAS_BACKENDS:
        assert runs[b]["update_rules"]["prepared"] == {"update": "kahan", "kernel": "bfloat16"}, b
        assert runs[b]["update_rules"]["import_continues"] is True, b
        assert "stochastic" in runs[b]["update_rules"]["import_other_mode"], b


def test_keras_own_adam_on_bfloat16_variables_learns_nothing(runs):
    """Why the view: Keras computes Adam in the variable's dtype, where beta_2 = 0.999 is 1.0
    in bfloat16 and the bias correction 1 - beta_2**t is 0 (the weights stay or turn NaN);
    unimp's optimizer moves them on every engine."""
    for b in KERAS_BACKENDS:
        start = runs[b]["half"]["adam"]["start"]
        own = runs[b]["half"]["adam/keras"]["w"][-1]
        assert own == start or not np.all(np.isfinite(own)), b
        assert runs[b]["half"]["adam"]["w"][-1] != start, b


def test_stateful_apply_gives_what_keras_own_optimizer_gives(runs):
    # Keras's own LossScaleOptimizer is stateful on TensorFlow and torch (on JAX its stateful
    # apply leaks tracers: Keras uses it through stateless_apply there, the next test)
    for b in ("tensorflow", "torch"):
        assert runs[b]["rule"]["keras/unimp"] == runs[b]["rule"]["keras/keras"], b


def test_stateless_apply_gives_what_keras_own_optimizer_gives(runs):
    for b in ("jax", "torch"):
        ours, theirs = runs[b]["stateless"]["unimp"], runs[b]["stateless"]["keras"]
        assert ours == theirs, b
        assert [r["scale"] for r in ours] == [float(s.scale) for s in simulate(W.RULES["keras"], _events())]


def test_fit_under_mixed_float16_skips_the_overflow_step_alike_on_every_backend(runs):
    cfg = DynamicLossScale.preset("keras", init_scale=2.0**15, growth_interval=4)
    flags = [i != 5 for i in range(12)]
    ref = simulate(cfg, flags)
    scales = {}
    for b in KERAS_BACKENDS:
        rows = runs[b]["fit16"]["rows"]
        assert len(rows) == 12, b
        assert [r["total_skips"] for r in rows] == [int(i >= 5) for i in range(12)], b
        assert [r["iterations"] for r in rows] == [i + 1 - (i >= 5) for i in range(12)], b
        assert np.isfinite(rows[5]["loss"]), b  # the forward was finite: a gradient overflow
        scales[b] = [r["scale"] for r in rows]
        assert scales[b] == [float(s.scale) for s in ref], b
        assert runs[b]["fit16"]["state"]["state"]["total_skips"] == 1
    # Keras's JAX trainer compiles its step once: applied and skipped steps share it
    compiles = [r["compilations"] for r in runs["jax"]["fit16"]["rows"]]
    assert compiles[-1] == compiles[0], compiles
    # ... and nothing in it reaches the host (no callback, infeed or outfeed)
    assert runs["jax"]["fit16"]["primitives"] > 50 and runs["jax"]["fit16"]["host_primitives"] == []


@pytest.mark.parametrize("model", ["mlp", "attention"])
def test_float32_losses_agree_across_keras_backends(runs, model):
    ref = np.array(runs["tensorflow"]["losses32"][model])
    assert ref.shape == (50,) and np.all(np.isfinite(ref))
    for b in ("jax", "torch"):
        got = np.array(runs[b]["losses32"][model])
        np.testing.assert_allclose(got, ref, rtol=1e-4, err_msg=b)


def test_keras_torch_steps_read_nothing_to_the_host(runs):
    # Keras's own LossScaleOptimizer decides with ops.cond, a Python if on torch: a host read
    # for the finite flag and one for the growth counter, every step
    counts = runs["torch"]["syncs"]
    assert counts["unimp"] == 0.0
    assert counts["keras"] >= 1.0


def test_train_step_follows_the_rule_and_skips_alike_on_every_keras_backend(runs):
    # step 3: the float16 backward overflows (finite loss): skipped, scale halved; step 6: the
    # loss is inf: skipped, scale kept (the forward-overflow rule)
    events = [(w != 3e4, bool(np.isfinite(w))) for w in W.STEP_WEIGHTS]
    assert events[3] == (False, True) and events[6] == (True, False)
    ref = simulate(W.STEP_RULE, [(g and f, f) for g, f in events])
    before = [float(W.STEP_RULE.initial_state().scale)] + [float(s.scale) for s in ref[:-1]]
    assert before[4] == before[3] / 2 and before[7] == before[6]
    skipped = [i for i, (g, f) in enumerate(events) if not (g and f)]
    for b in KERAS_BACKENDS:
        got = runs[b]["step16"]
        rows = got["rows"]
        assert [r["scale"] for r in rows] == before, b
        assert [r["total_skips"] for r in rows] == [int(s.total_skips) for s in ref], b
        assert [i for i, r in enumerate(rows) if not r["applied"]] == skipped, b
        assert [r["loss_finite"] for r in rows] == [f for _, f in events], b
        assert [r["grads_finite"] for r in rows][3] is False, b
        assert [r["iterations"] for r in rows] == [i + 1 - sum(j <= i for j in skipped) for i in range(len(rows))], b
        for i in skipped:  # nothing moved: weights, optimizer, the BN statistics
            assert rows[i]["w"] == rows[i - 1]["w"] and rows[i]["bn_mean"] == rows[i - 1]["bn_mean"], (b, i)
        for i in (1, 2, 4, 5):
            assert rows[i]["w"] != rows[i - 1]["w"] and rows[i]["bn_mean"] != rows[i - 1]["bn_mean"], (b, i)
        # prepare's overrides and output cast, the same on every engine
        assert got["policies"] == {"fc1": "mixed_float16", "bn": "mixed_float16", "head": "float32"}, b
        assert got["output_dtype"] == "float32", b
    assert runs["tensorflow"]["step16"]["class"] == "unimp.backends.tensorflow.MixedPrecision"
    for b in ("jax", "torch"):
        assert runs[b]["step16"]["class"] == "unimp.keras.mixed_precision.MixedPrecision"
        ours = [r["loss"] for r in runs[b]["step16"]["rows"]]
        theirs = [r["loss"] for r in runs["tensorflow"]["step16"]["rows"]]
        np.testing.assert_allclose(ours, theirs, rtol=2e-2, err_msg=b)  # float16 compute
    # JAX: one compilation of the step, none after the first call (skips included); torch:
    # no host read per step
    assert runs["jax"]["step16"]["compilations_after_first"] == 0
    assert runs["torch"]["step16"]["host_reads_per_step"] == 0.0
    assert runs["torch"]["step16"]["applied_under_no_grad"] is True  # as unimp's torch step


def test_train_step_options_run_alike_on_every_keras_backend(runs):
    # accumulation over 2 micro-batches (one overflowing at step 3 skips the window), clipping
    # at 0.5 (grad_norm before the clip), skipped steps counted in iterations, a step log
    ref = simulate(W.STEP_RULE, [i != 3 for i in range(8)])
    before = [float(W.STEP_RULE.initial_state().scale)] + [float(s.scale) for s in ref[:-1]]
    tf_rows = runs["tensorflow"]["step_options"]["rows"]
    for b in KERAS_BACKENDS:
        got = runs[b]["step_options"]
        rows = got["rows"]
        assert [r["scale"] for r in rows] == before, b
        assert [r["applied"] for r in rows] == [i != 3 for i in range(8)], b
        assert [r["iterations"] for r in rows] == list(range(1, 9)), b  # "attempted"
        norms = [r["grad_norm"] for r in rows]
        assert norms[3] is None or not np.isfinite(norms[3]), b
        assert all(n > 0.5 for n in norms[:3]), (b, norms)  # the clip was active
        np.testing.assert_allclose(
            [r["loss"] for i, r in enumerate(rows) if i != 3],
            [r["loss"] for i, r in enumerate(tf_rows) if i != 3], rtol=2e-2, err_msg=b,
        )  # fmt: skip
        np.testing.assert_allclose(
            [n for i, n in enumerate(norms) if i != 3],
            [r["grad_norm"] for i, r in enumerate(tf_rows) if i != 3], rtol=2e-2, err_msg=b,
        )  # fmt: skip
        assert got["log_steps"] == list(range(8)), b


def test_statistics_and_the_step_log_name_the_same_tensors_on_every_keras_backend(runs):
    ref = runs["tensorflow"]["stats16"]  # the TensorFlow backend's traced statistics step
    for b in KERAS_BACKENDS:
        rows = runs[b]["stats16"]["rows"]
        assert [r["stats"] is None for r in rows] == [False, True, False, True], b
        for i in (0, 2):
            got, want = rows[i]["stats"], ref["rows"][i]["stats"]
            assert got["step"] == i
            assert list(got["gradients"]) == list(want["gradients"]) == [
                "fc1/kernel", "fc1/bias", "bn/gamma", "bn/beta", "head/kernel", "head/bias"], b
            assert list(got["activations"]) == list(want["activations"]) == ["fc1", "bn", "head"], b
            for kind in ("gradients", "activations"):
                for name, t in got[kind].items():
                    w = want[kind][name]
                    assert t["size"] == w["size"] and t["scale"] == w["scale"], (b, name)
                    assert t["counts"]["nonfinite"] == w["counts"]["nonfinite"], (b, name)
                    if i == 0:  # a clean step: the same magnitudes up to float16 compute
                        np.testing.assert_allclose(t["amax"], w["amax"], rtol=2e-2, err_msg=f"{b} {name}")
        # the overflow at step 2: every engine finds it in the same phase and layer
        assert rows[0]["first"] is None and rows[2]["first"] == ref["rows"][2]["first"], b
        assert rows[2]["first"][0] == "backward", b
        log = runs[b]["stats16"]["log"]
        assert [rec["step"] for rec in log] == [0, 1, 2, 3], b
        assert [rec["applied"] for rec in log] == [True, True, False, True], b


def test_keras_jax_and_torch_refuse_what_they_do_not_run_and_change_nothing_on_error(runs):
    for b, other in (("jax", "torch"), ("torch", "jax")):
        got = runs[b]["refusals"]
        assert f"runs Keras on '{b}'" in got["other_engine"] and f"KERAS_BACKEND={other}" in got["other_engine"]
        assert got["fp8"] == "accepted", b  # float8 Dense layers run there (unimp.keras.fp8)
        assert got["integer_loss"].startswith("TypeError: loss_fn must return a floating loss"), b
        assert got["unchanged"] is True, b
        # float32's matmul_precision="highest" is the engine's own switch, in force in the block
        f32 = got["float32"]
        assert f32["backend"] == f"keras-{b}"
        inside, after = f32["inside"], f32["after"]
        if b == "jax":
            assert inside["default_matmul_precision"] == "float32" and after["default_matmul_precision"] is None
        else:
            assert inside["mkldnn.matmul"] == "ieee" and inside != after
        assert got["tuple_loss"].startswith("TypeError") and "a tuple of 2" in got["tuple_loss"], b
        assert got["other_recipe"].startswith("ValueError: this model was prepared with the overrides none"), b
        assert got["built_outside_warned"] is True, b
        eager, stepped = got["regularized"]
        assert stepped == pytest.approx(eager, rel=1e-6), b  # add_loss terms reach loss_fn
        assert got["frozen_later"].startswith("ValueError: the model's trainable variables changed"), b
    # a metric made outside the model: JAX's compiled step cannot carry the write, and says so
    assert runs["jax"]["refusals"]["foreign_metric"].startswith("ValueError: loss_fn writes 2 Keras variable")  # Mean: total, count
    assert runs["torch"]["refusals"]["foreign_metric"] == "accepted"
    assert runs["torch"]["refusals"]["no_gradient"].startswith("ValueError: loss_fn's loss does not depend")
    # mp.trace: the jaxpr on Keras-JAX (fc1 in float16, fc2 built float32, both passes); on
    # Keras-torch the step runs once under torch's dispatcher and is put back. There Keras's
    # torch matmul widens float16 operands to float32 on a CPU (keras.ops.matmul), which the
    # trace shows as it is
    for b in ("jax", "torch"):
        tr = runs[b]["refusals"]["trace"]
        assert tr["framework"] == f"keras-{b}" and tr["phases"] == ["backward", "forward", "update"], b
        assert tr["put_back"] is True, b
    fc1 = {"jax": "float16", "torch": "float32"}
    for b in ("jax", "torch"):
        assert [tuple(m) for m in runs[b]["refusals"]["trace"]["matmuls"]] == [
            ("fc1", "backward", fc1[b]), ("fc1", "forward", fc1[b]),
            ("fc2", "backward", "float32"), ("fc2", "forward", "float32"),
        ], b  # fmt: skip


def test_loss_scale_check_stops_fit_after_max_consecutive_skips(runs):
    # batches 3, 4, 5 overflow: the third consecutive skip exceeds max_consecutive_skips=2
    for b in KERAS_BACKENDS:
        got = runs[b]["check"]
        assert got["raised"] == "LossScaleError", (b, got)
        assert got["batches"] == 6, (b, got)
        assert "max_consecutive_skips" in got["message"], b


def test_what_keras_code_does_with_an_optimizer_works_or_fails_cleanly(runs):
    for b in KERAS_BACKENDS:
        got = runs[b]["misuse"]
        # a subset of the variables: only those move (8.0 / 8.0 = 1 through Adam lr 0.1)
        assert got["subset"][0] == [1.0, 1.0] and got["subset"][1][0] < 1.0, b
        assert got["failed_apply"] is True, b  # nothing half-changed
        assert "another loss-scale config" in got["other_config"], b
        if b != "tensorflow":
            assert "1 gradients for 2 trainable variables" in got["stateless_count"], b
            assert got["stateless_empty"] is True, b
    assert runs["jax"]["misuse"]["jit_scale_loss"] == 8.0


def test_float8_layers_take_the_same_states_on_every_keras_backend(runs):
    from unimp import fp8

    config = fp8.DelayedScaling(amax_history_len=4)
    initial = fp8.FP8State.initial(config)
    for b in KERAS_BACKENDS:
        got = runs[b]["fp8"]
        assert got["selected"] == ["a"], b  # first and last out, the same names as every backend
        # one window of 3 micro-batches (3, 1, 2 times ones): one scaling step on the largest
        # amax (tests/conformance/test_fp8_accumulation.py's right values)
        states = got["window"]["states"]
        for tensor, amax, role in (("input", 3.0, "forward"), ("kernel", 0.5, "forward"), ("grad", 0.5, "backward")):
            want = fp8.step(config, initial, amax, role)[1]
            scale, scale_inv, history = states[tensor]
            assert history == [amax, 0.0, 0.0, 0.0], (b, tensor)
            assert (scale[0], scale_inv[0]) == (float(want.scale), float(want.scale_inv)), (b, tensor)
        assert states["grad"][0] == [114688.0], b  # 57344 / 0.5: the own gradient's amax
        assert got["window"]["kernel"] == [[np.float32(0.4)] * 2] * 2, b
        untouched = {t: [[float(initial.scale)], [float(initial.scale_inv)], [0.0] * 4] for t in fp8.LAYER_TENSORS}
        assert got["unrun"]["q"] == untouched and got["unrun"]["p"] != untouched, b
        # a dynamic loss scale: the scaled loss overflows at step 3, the loss is inf at step 6
        sk = got["skips"]
        assert sk["selected"] == ["fc1", "mid"], b
        rows = sk["rows"]
        skipped = [i for i, w in enumerate(W.FP8_WEIGHTS) if w != 1.0]
        assert skipped == [3, 6]
        assert [i for i, r in enumerate(rows) if not r["applied"]] == skipped, b
        for i, r in enumerate(rows[1:], 1):
            if i in skipped:  # a skipped step leaves the states (and the weights) as they were
                assert r["states"] == rows[i - 1]["states"] and r["w"] == rows[i - 1]["w"], (b, i)
            else:  # an applied step pushes one amax per tensor into every history
                for layer in ("fc1", "mid"):
                    for t in fp8.LAYER_TENSORS:
                        assert r["states"][layer][t][2][1:] == rows[i - 1]["states"][layer][t][2][:3], (b, i, layer, t)
        # model.fit through prepare: Keras's own trainer steps the states too
        fit = got["fit"]
        assert fit["before"]["grad"][0] == [1.0] and fit["after"]["grad"][0] != [1.0], b
        assert all(h > 0 for h in fit["after"]["input"][2]), b  # 4 batches a epoch, history 4
        if b != "tensorflow":  # (the TensorFlow backend's states are no variables Keras merges)
            assert "grad_accum_steps=k" in got["inner_accumulation"], b
        # a layer run twice in one call would have its states summed: refused on JAX / torch
        # (TensorFlow's layer takes one step per call: a scaling step per timestep)
        if b != "tensorflow":
            assert "runs more than once in one call" in got["time_distributed"], b
            assert "grad_accum_steps=k" in got["prepare_accumulation"], b
            assert got["prepare_accumulation_unchanged"] is True, b
        # Keras's Model.set_weights assigns every variable directly: the states are checked
        # there too, and a bad one leaves every weight as it was
        msw = got["model_set_weights"]
        assert "layer 'b'" in msw["said"] and "unchanged" in msw["said"] and msw["unchanged"] is True, b
        assert got["bf16_input"] == runs["tensorflow"]["fp8"]["bf16_input"], b
        loaders = got["loaders"]
        assert "grad" in loaders["refused"] and "unchanged" in loaders["refused"], (b, loaders)
        assert loaders["unchanged"] and loaders["round_trip"] and loaders["states_kept"], b
    # the loss-scale state bit for bit on every engine; the states and losses agree to the
    # engines' bfloat16 rounding (Keras-JAX's bfloat16 matmuls round differently on the CPU)
    tf_rows = runs["tensorflow"]["fp8"]["skips"]["rows"]
    for b in ("jax", "torch"):
        rows = runs[b]["fp8"]["skips"]["rows"]
        assert [r["scale"] for r in rows] == [r["scale"] for r in tf_rows], b
        for r, t in zip(rows, tf_rows, strict=True):
            for layer in ("fc1", "mid"):
                np.testing.assert_allclose(r["states"][layer]["grad"][0], t["states"][layer]["grad"][0], rtol=2e-2, err_msg=b)
                np.testing.assert_allclose(r["states"][layer]["kernel"][0], t["states"][layer]["kernel"][0], rtol=2e-2, err_msg=b)
        np.testing.assert_allclose([r["loss"] for r in rows if np.isfinite(r["loss"])],
                                   [r["loss"] for r in tf_rows if np.isfinite(r["loss"])], rtol=1e-2, err_msg=b)
        np.testing.assert_allclose(runs[b]["fp8"]["fit"]["loss"], runs["tensorflow"]["fp8"]["fit"]["loss"], rtol=1e-2)
    # Keras-JAX compiles the step once through applied and skipped steps; Keras-torch reads
    # nothing to the host
    assert runs["jax"]["fp8"]["skips"]["compilations_after_first"] == 0
    assert runs["torch"]["fp8"]["skips"]["host_reads_per_step"] == 0.0


@pytest.mark.parametrize("rule", sorted(bl.BLOCK_LINEAR_RULES))
def test_block_scaled_dense_is_the_reference_bit_for_bit_on_every_keras_backend(runs, rule):
    """A block-scaled recipe's swapped Dense (unimp.keras.blockscale on JAX and torch, the
    TensorFlow backend's swap on TensorFlow): y, dx and dW of two training calls (the
    stochastic rounding's steps 0 and 1) are the NumPy reference's bits, as the TensorFlow
    backend's BlockScaledDense gives them, on inputs whose GEMM sums are exact."""
    x, w, g = W.block_inputs()
    want = [[W.digest(a) for a in bl.block_linear_reference(x, w, g, rule, "in_out", W.BLOCK_SEED, step)]
            for step in (0, 1)]
    assert runs["tensorflow"]["block"]["layer"][rule]["tf_backend"] == want
    for b in KERAS_BACKENDS:
        got = runs[b]["block"]["layer"][rule]
        assert got["selected"] == ["b"], b  # mp.fp8_layers lists the swapped layer
        assert got["steps"] == want, b
        assert got["counter"] == 2, b  # each training call advanced it
    # the counter is the stochastic rounding's step: NVFP4's dW differs between the calls
    assert (want[0][2] != want[1][2]) == bl.block_linear_rule(rule).stochastic("gradient")
    if rule == "nvfp4":  # inference (predict): the forward GEMM alone, on 37 rows
        y = bl.linear_forward(bl.NumpyLinearOps, x[:37], w, rule, backward=False)[0]
        for b in KERAS_BACKENDS:
            assert runs[b]["block"]["layer"][rule]["inference"] == W.digest(y), b


def test_block_scaled_recipe_trains_skips_and_loads_alike_on_every_keras_backend(runs):
    """nvfp4 through mp.prepare in the middle two of four Dense layers: unimp's train_step with
    a dynamic loss scale (step 2's scaled loss overflows, step 4's loss is inf) skips the same
    steps with the reference's scales on every engine, and a skipped step changes nothing (the
    weights, the rounding counters); Keras-JAX compiles the step once and Keras-torch reads
    nothing to the host (nor in fit's step); mxfp8's fit compiles once on JAX and advances the
    counters once a batch; the weights save and load into a model prepared again, and a .keras file loads as the plain
    model. A selected Dense with LoRA is refused before anything changes."""
    events = [(w != 1e36 and bool(np.isfinite(w)), bool(np.isfinite(w))) for w in W.BLOCK_WEIGHTS]
    ref = simulate(W.STEP_RULE, events)
    before = [float(W.STEP_RULE.initial_state().scale)] + [float(s.scale) for s in ref[:-1]]
    assert before[3] == before[2] / 2 and before[5] == before[4]
    for b in KERAS_BACKENDS:
        got = runs[b]["block"]
        sk = got["skips"]
        assert sk["selected"] == sk["after"] == sk["swapped"] == ["fc2", "fc3"], b
        rows = sk["rows"]
        assert [r["applied"] for r in rows] == [g for g, _ in events], b
        assert [r["scale"] for r in rows] == before, b
        counters, w = [0, 0], None
        for i, r in enumerate(rows):
            if r["applied"]:
                assert r["counters"] == [c + 1 for c in counters] and r["w"] != w, (b, i)
            else:  # nothing moved
                assert r["counters"] == counters and r["w"] == w, (b, i)
            counters, w = r["counters"], r["w"]
        np.testing.assert_allclose(rows[0]["loss"], runs["tensorflow"]["block"]["skips"]["rows"][0]["loss"],
                                   rtol=2e-2, err_msg=b)  # bfloat16 around the block-scaled layers
        assert "['fc2'] use LoRA" in got["lora"] and got["lora_unchanged"] is True, b
        fit = got["fit"]
        assert fit["counters"] == [6, 6] and np.isfinite(fit["loss"][0]), b
        assert got["loaders"] == {"kernels": True, "counters_kept": [0, 0], "plain": ["Dense"] * 4,
                                  "plain_kernels": True}, b
    assert runs["jax"]["block"]["skips"]["compilations_after_first"] == 0
    compiles = runs["jax"]["block"]["fit"]["compilations"]
    assert len(compiles) == 6 and compiles[-1] == compiles[0], compiles
    assert runs["torch"]["block"]["skips"]["host_reads_per_step"] == 0.0
    assert runs["torch"]["block"]["fit"]["host_reads_per_step"] == 0.0
