"""The audit's reading of statistics (framework-free): where an overflow starts, what underflows."""

import numpy as np
import pytest

from unimp.compare.audit import audit_stats, findings_table, initial_scale
from unimp.stats import StepStats, layer_of, reference_stats

S = 2.0**15


def _step(i, acts, grads, scale=S):
    return StepStats(
        i,
        {k: reference_stats(v, scale) for k, v in grads.items()},
        {k: reference_stats(v, 1.0) for k, v in acts.items()},
    )


def test_initial_scales_are_the_recipes():
    assert initial_scale("float16") == 32768.0
    assert initial_scale("bfloat16") == 1.0


@pytest.mark.parametrize(
    ("name", "layer"), [("l1.weight", "l1"), ("l1/kernel", "l1"), ("block/attn/q/w", "block/attn/q"), ("w1", "w1")]
)
def test_layer_of(name, layer):
    assert layer_of(name) == layer


def test_a_clean_run_has_no_findings():
    ok = np.linspace(-3, 3, 100)
    steps = [_step(i, {"l1": ok, "l2": ok}, {"l1.weight": ok * 1e-3, "l2.weight": ok * 1e-3}) for i in range(3)]
    assert audit_stats(steps, "float16") == []


def test_an_overflow_is_flagged_where_it_starts_and_downstream_layers_follow_it():
    ok, big = np.ones(10), np.full(10, 1e5)
    steps = [_step(0, {"l0": ok, "l1": big, "l2": big, "ln": ok, "l3": ok}, {})]
    (f,) = audit_stats(steps, "float16")
    assert (f.layer, f.kind, f.downstream, f.fraction) == ("l1", "activation overflow", ("l2",), 1.0)
    assert f.headroom == pytest.approx(np.log2(65504 / 1e5))
    assert "float32" in f.fix
    # bfloat16 holds 1e5: nothing to flag
    assert audit_stats(steps, "bfloat16") == []


def test_gradient_overflow_and_underflow_name_the_fix():
    steps = [_step(0, {}, {"l1/kernel": np.full(4, 4.0), "l2/kernel": np.full(4, 2.0**-45)})]
    over, under = audit_stats(steps, "float16")
    assert (over.layer, over.kind) == ("l1", "gradient overflow")
    # 4 * 2**15 = 2**17 overflows float16 by 2 bits: start at 2**13
    assert "start the loss scale at 8192" in over.fix
    assert (under.layer, under.kind, under.fraction) == ("l2", "gradient underflow", 1.0)
    assert "larger loss scale" in under.fix
    rows = findings_table({"torch": [over, under]})
    assert rows[0][:3] == ["torch", "l1", "gradient overflow"]


def test_the_underflow_tolerance_and_bad_arguments():
    x = np.concatenate([np.ones(99), [2.0**-45]])  # 1 % flushes at scale 2**15
    steps = [_step(0, {}, {"l1.weight": x})]
    assert audit_stats(steps, "float16", underflow_tolerance=0.01) == []
    assert [f.kind for f in audit_stats(steps, "float16", underflow_tolerance=0.005)] == ["gradient underflow"]
    with pytest.raises(ValueError, match="float16, bfloat16"):
        audit_stats(steps, "float8")
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        audit_stats(steps, "float16", underflow_tolerance=1.0)


def test_a_gradient_overflow_downstream_of_an_activation_overflow_points_at_it():
    ok, big = np.ones(10), np.full(10, 1e5)
    steps = [_step(0, {"l0": ok, "l1": big, "l2": big}, {"l2/kernel": np.full(4, 4.0), "l0/kernel": np.full(4, 4.0)})]
    act, *grads = audit_stats(steps, "float16")
    assert (act.layer, act.downstream) == ("l1", ("l2",))
    by_layer = {f.layer: f.fix for f in grads}
    assert by_layer["l2"].startswith("it follows from the activation overflow in l1: fix that first")
    assert by_layer["l0"].startswith("start the loss scale at 8192")  # before l1: its own


def test_values_already_non_finite_in_float32_are_findings_named_first():
    # a run broken before any cast (issue 28 item 6): the audit said "clean" on it, because an
    # inf overflows no dtype's range by a countable fraction and NaN overflows nothing
    ok = np.ones(8)
    bad = np.array([1.0, np.inf, np.nan, 1.0])
    steps = [_step(0, {"l1": bad, "l2": np.full(8, np.nan)}, {"l1.weight": ok, "l2.weight": np.full(4, np.nan)})]
    for target in ("float16", "bfloat16"):  # whatever the target, float32 itself is broken
        found = audit_stats(steps, target)
        kinds = [(f.layer, f.kind) for f in found]
        assert kinds[:3] == [("l1", "activation non-finite"), ("l2", "activation non-finite"),
                             ("l2", "gradient non-finite")], kinds
        assert found[0].fraction == 0.5 and "already non-finite in float32" in found[0].fix
    assert audit_stats([_step(0, {"l1": ok}, {"l1.weight": ok * 1e-3})], "float16") == []
