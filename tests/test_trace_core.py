"""The framework-free half of dtype tracing: compute dtypes, summaries, the cross-framework diff."""

import json

import pytest

from unimp.trace import OPS, DiffRow, OpRecord, Trace, compute_dtype, diff


@pytest.mark.parametrize(
    ("op", "inputs", "outputs", "expected"),
    [
        ("matmul", ("float16", "float16"), ("float16",), "float16"),
        # a float16 matmul with a float32 result (JAX's preferred_element_type) is float16 maths
        ("matmul", ("float16", "float16"), ("float32",), "float16"),
        ("cast", ("float32",), ("bfloat16",), "bfloat16"),
        # mixed operands (a float16 tensor times a float32 0-d tensor in torch): the result's
        ("mul", ("float16", "float32"), ("float16",), "float16"),
        ("compare", ("float16", "float32"), ("bool",), "float32"),
        ("gather", ("float32", "int32"), ("float32",), "float32"),
        ("add", ("int32", "int32"), ("int32",), "int32"),
        ("fill", (), (), ""),
    ],
)
def test_compute_dtype(op, inputs, outputs, expected):
    assert compute_dtype(op, inputs, outputs) == expected


def _rec(fw, op, layer, dtype, phase="forward"):
    return OpRecord(fw, op, op.upper(), layer, phase, (dtype, dtype), (dtype,))


def _trace(fw, rows):
    return Trace([_rec(fw, *r) for r in rows], fw, "mixed_float16")


def test_record_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match="phase must be one of"):
        OpRecord("torch", "matmul", "aten.mm", "", "optimizer", ("float16",), ("float16",))


def test_summary_counts_maths_only_and_round_trips_through_json():
    t = Trace(
        [
            _rec("jax", "matmul", "l1", "float16"),
            _rec("jax", "reshape", "l1", "float16"),  # data movement: listed, not counted
            OpRecord("jax", "cast", "convert_element_type", "l1", "forward", ("float32",), ("float16",)),
            _rec("jax", "matmul", "l1", "float16", "backward"),
            _rec("jax", "add", "", "float32", "update"),
        ],
        "jax",
        "mixed_float16",
    )
    s = t.summary()
    assert s["ops"] == 5 and s["casts"] == 1
    assert s["by_dtype"] == {"float16": 2, "float32": 1}
    assert s["by_phase"] == {"forward": 3, "backward": 1, "update": 1}
    assert t.by_layer() == {"l1": {"float16": 1}}
    assert [r.op for r in t.select(layer="l1", phase="forward")] == ["matmul", "reshape", "cast"]
    back = Trace.from_dict(json.loads(t.to_json()))
    assert list(back) == list(t) and back.summary() == s


def test_diff_lists_only_what_differs_with_the_backends_notes():
    traces = {
        "torch": _trace("torch", [("matmul", "l1", "float16"), ("softmax", "attn", "float32")]),
        "tensorflow": _trace("tensorflow", [("matmul", "l1", "float16"), ("softmax", "attn", "float16")]),
        "jax": _trace("jax", [("matmul", "l1", "float16"), ("softmax", "attn", "float16"), ("pow", "attn", "float16")]),
    }
    rows = diff(traces, notes={"torch": {"softmax": ("float32", "autocast's float32 list")}})
    assert [(r.kind, r.key) for r in rows] == [("op", "softmax"), ("layer", "attn")]
    assert str(rows[0]) == (
        "softmax: torch float32 (autocast's float32 list), tensorflow float16, jax float16"
    )
    assert str(rows[1]) == "layer attn: torch float32, tensorflow float16, jax float16"
    # pow is JAX's alone: no counterpart, so not an op row (its layer row shows the dtypes)
    assert all(r.key != "pow" for r in rows)
    assert isinstance(rows[0], DiffRow) and rows[0].to_dict()["dtypes"]["torch"] == ["float32"]


def test_a_note_shows_only_where_the_op_ran_in_its_dtype():
    traces = {
        "torch": _trace("torch", [("softmax", "", "float16")]),
        "jax": _trace("jax", [("softmax", "", "float32")]),
    }
    (row,) = diff(traces, notes={"torch": {"softmax": ("float32", "autocast's float32 list")}})
    assert row.notes == {}


def test_identical_traces_have_no_diff_and_bad_calls_are_refused():
    t = _trace("torch", [("matmul", "l1", "float16")])
    assert diff({"a": t, "b": t}) == []
    with pytest.raises(ValueError, match="two traces"):
        diff({"a": t})
    with pytest.raises(ValueError, match="phase"):
        diff({"a": t, "b": t}, phase="sideways")


def test_vocabulary_has_the_issue_names():
    for name in ("matmul", "conv", "add", "mul", "exp", "softmax", "log_softmax", "layer_norm",
                 "batch_norm", "reduce_sum", "reduce_max", "cast"):  # fmt: skip
        assert name in OPS


def test_an_op_missing_from_one_trace_is_no_difference_by_itself():
    traces = {
        "torch": _trace("torch", [("matmul", "l1", "float32")]),  # the bias folded into addmm
        "jax": _trace("jax", [("matmul", "l1", "float32"), ("add", "l1", "float32")]),
        "tensorflow": _trace("tensorflow", [("matmul", "l1", "float32"), ("add", "l1", "float32")]),
    }
    assert diff(traces) == []
    traces["jax"] = _trace("jax", [("matmul", "l1", "float32"), ("add", "l1", "float16")])
    (row, layer) = diff(traces)
    assert str(row) == "add: torch -, jax float16, tensorflow float32"
    assert layer.key == "l1"
