import json
import re

import pytest

from unimp import get_recipe
from unimp.cli import main
from unimp.compare.explain import explain_recipe, scaler_sequence, scaler_table


def test_explain_maps_recipe_to_each_framework(capsys):
    assert main(["explain", "mixed_float16"]) == 0
    out = capsys.readouterr().out
    assert "torch.autocast(device_type, dtype=torch.float16)" in out
    assert 'keras.DTypePolicy("mixed_float16")' in out
    assert "compute jnp.float16" in out


def test_explain_apex_o2_is_module_mode(capsys):
    assert main(["explain", "O2"]) == 0
    assert "master weights" in capsys.readouterr().out


def _scaler_table(text):
    """``{scaler: {column: cell}}`` of explain --scalers' table, cut at its dashes line, and
    checking that no cell spills out of its column (long values misaligned the old text)."""
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if re.fullmatch(r"\s*-+(\s+-+)+", line))
    spans = [(m.start(), m.end()) for m in re.finditer(r"-+", lines[at])]
    header = [lines[at - 1][a:b].strip() for a, b in spans]
    rows = {}
    for line in lines[at + 1:]:
        if not line.startswith("  ") or line.startswith("  -"):
            break
        assert all(line[a - 1:a] in (" ", "") for a, _ in spans[1:]), line  # nothing spills
        cells = [line[a:b].strip() for a, b in spans[:-1]] + [line[spans[-1][0]:].strip()]
        rows[cells[0]] = dict(zip(header, cells, strict=True))
    return rows


@pytest.mark.parametrize(("recipe", "init"), [("bf16-mixed", "no loss scaling"), ("O3", "static 1")])
def test_scalers_table_for_a_recipe_without_a_dynamic_scale_and_long_values(capsys, recipe, init):
    # the recipe's own row was printed with the dynamic fields: KeyError 'init_scale'
    assert main(["explain", recipe, "--scalers", "--steps", "5"]) == 0
    rows = _scaler_table(capsys.readouterr().out)
    assert (rows[recipe]["init"], rows[recipe]["final"]) == (init, "1")
    # values as long as megatron's init and fairseq's floor stay in their columns
    assert rows["megatron"]["init"] == "4.29497e+09" and rows["fairseq"]["min"] == "0.00012207"
    assert rows["torch"]["min"] == "2**-126" and rows["deepspeed"]["hysteresis"] == "2"


def test_scalers_show_framework_differences(capsys):
    assert main(["explain", "mixed_float16", "--scalers", "--json", "--steps", "60"]) == 0
    data = json.loads(capsys.readouterr().out)["scalers"]
    s = data["scalers"]
    # initial scales differ: torch/apex/flax 2**16, Keras/jmp 2**15
    assert s["torch"]["scale"][0] == 65536.0 and s["keras"]["scale"][0] == 32768.0
    # the burst of 24 overflows: floors show (tf.keras and jmp stop at 1, keras and torch keep halving)
    assert min(s["tf_keras"]["scale"]) == 1.0 and min(s["jmp"]["scale"]) == 1.0
    assert min(s["keras"]["scale"]) < 1.0 and min(s["torch"]["scale"]) < 1.0


def test_flax_grows_one_step_later():
    table = scaler_table([True] * 5, presets=["keras", "flax"], growth_interval=2)
    keras = table["scalers"]["keras"]["scale"]
    flax = table["scalers"]["flax"]["scale"]
    assert [k / keras[0] for k in keras] == [1, 1, 2, 2, 4, 4]
    assert [f / flax[0] for f in flax] == [1, 1, 1, 2, 2, 2]


def test_sequence_has_burst():
    flags = scaler_sequence(40, 0.0, seed=1, burst=5)
    assert flags[20:25] == [False] * 5 and all(flags[:20]) and all(flags[25:])


@pytest.mark.parametrize(
    "argv",
    [
        ["explain", "mixed_flot16"],
        ["explain", "O2", "--scalers", "--steps", "0"],
        ["explain", "O2", "--scalers", "--steps", "1000000000"],  # used to run for hours
        ["explain", "O2", "--scalers", "--overflow-rate", "2"],
        ["explain", "transformer-engine-float16"],
        ["explain"],
        ["explain", "--fp8", "--amaxes", "1,x"],
        ["explain", "--fp8", "--amaxes", "1,-2"],
        ["explain", "--fp8", "--history-len", "0"],
        ["explain", "mixed_float16", "--fp8"],
        ["explain", "--fp8", "--scalers"],
    ],
)
def test_explain_bad_input_exit_2(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("unimp explain: error:") and "Traceback" not in err


def test_scalers_start_with_the_recipes_own(capsys):
    # O2's scaler is Apex's (init 2**16, floor none, cap 2**24), not unimp's defaults
    assert main(["explain", "O2", "--scalers", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)["scalers"]
    first, cfg = next(iter(data["scalers"].items()))
    assert first == "O2" and data["scalers"]["O2"]["native"] == "the recipe's own loss scale"
    assert data["scalers"]["O2"]["scale"][0] == 65536.0
    assert data["scalers"]["O2"]["scale"] == data["scalers"]["apex"]["scale"]
    assert data["differences"][0].startswith("unimp: first differs from O2")
    # a static recipe shows a flat line
    assert main(["explain", "O3", "--scalers", "--json"]) == 0
    o3 = json.loads(capsys.readouterr().out)["scalers"]["scalers"]["O3"]
    assert set(o3["scale"]) == {1.0}


def test_explain_o3_has_no_master_weights(capsys):
    assert main(["explain", "O3"]) == 0
    out = capsys.readouterr().out
    assert "no master weights (Apex O3 style)" in out and "Apex O2 style" not in out


def test_explain_fp8_shows_where_the_four_differ(capsys):
    assert main(["explain", "--fp8", "--amaxes", "3,5,0,4,2,inf,2,nan", "--json"]) == 0

    def strict(c):
        raise ValueError(f"not JSON: {c}")

    t = json.loads(capsys.readouterr().out, parse_constant=strict)  # no Infinity / NaN literals
    # one convention with report.json and the step log: null, named by JSON Pointer
    assert t["amaxes"][2] == 0.0 and t["amaxes"][5] is None and t["amaxes"][7] is None
    assert t["nonfinite"]["/amaxes/5"] == "inf" and t["nonfinite"]["/amaxes/7"] == "nan"
    s = {name: row["scale"] for name, row in t["presets"].items()}
    k = 448 / 5  # 89.6 in float32
    # the zero at step 3: TE does not record it, so its window still holds the 5 at step 6
    assert s["unimp_delayed"][5] == 112.0 and s["transformer_engine"][5] == pytest.approx(k)
    # Keras is one step later than flax and TE; flax keeps 1/(1/s) through the inf
    assert s["keras"][:3] == [1.0, 1.0, s["flax"][1]]
    assert s["flax"][6] == 111.99999237060547
    # current scaling: step t's own amax; torchao turns 0 into 448/1e-12 and inf into 0
    assert s["transformer_engine_current"][2] == 1.0 and s["torchao"][2] == pytest.approx(4.48e14)
    assert s["torchao"][5] == 0.0 and s["transformer_engine_current"][5] == 1.0
    assert t["differences"][0].startswith("transformer_engine: differs from unimp_delayed at step(s) 6")


def test_explain_fp8_compares_each_preset_with_unimps_rule_of_its_kind(capsys):
    # current scaling was compared with unimp's delayed rule ("differ at every step", 149.3 vs
    # 1 at step 1) and unimp's own current rule had no row (issue 28 item 7)
    assert main(["explain", "--fp8", "--json"]) == 0
    t = json.loads(capsys.readouterr().out)
    assert "unimp_current" in t["presets"]
    diffs = {d.split(":")[0]: d for d in t["differences"]}
    # the one real difference on current scaling: a tiny amax (step 13, 1e-40), TE's scale
    # the largest float32, unimp's capped at 2**126
    assert diffs["transformer_engine_current"] == (
        "transformer_engine_current: differs from unimp_current at step(s) 13; first at step 13 "
        "(amax 1e-40): 3.40282347e+38 vs 8.50705917e+37"
    )
    assert t["presets"]["unimp_current"]["scale"][12] == 2.0**126
    assert diffs["torchao"].startswith("torchao: differs from unimp_current at step(s) 3, 6, 13;")
    assert diffs["keras"].startswith("keras: differs from unimp_delayed")


def test_explain_fp8_table_text(capsys):
    assert main(["explain", "--fp8", "--amaxes", "4,0,inf,nan,2", "--history-len", "2"]) == 0
    out = capsys.readouterr().out
    assert "L=2" in out and "torchao" in out and "Differences:" in out


def test_scalers_show_the_large_scale_trainers(capsys):
    # 40 clean steps (no growth at interval 1000), then 40 overflows from step 40 on: with
    # hysteresis 2 the first is absorbed, 16 halve DeepSpeed's 2**16 to its floor 1 and the 18th
    # stops the run; Megatron (2**32) sits at its floor; fairseq stops on its 21st backoff
    assert main(["explain", "O1", "--scalers", "--json", "--steps", "80", "--burst", "40",
                 "--overflow-rate", "0", "--growth-interval", "1000"]) == 0
    s = json.loads(capsys.readouterr().out)["scalers"]["scalers"]
    assert {"deepspeed", "megatron", "fairseq"} <= set(s)
    assert s["deepspeed"]["config"]["hysteresis"] == s["megatron"]["config"]["hysteresis"] == 2
    assert s["deepspeed"]["stops_at"] == 57
    assert s["megatron"]["stops_at"] is None and min(s["megatron"]["scale"]) == 1.0
    assert s["fairseq"]["stops_at"] == 60 and min(s["fairseq"]["scale"]) == 2.0**-13


def test_explain_says_which_frameworks_refuse_the_recipes_cast_mode():
    # Apex O1 is autocast: torch builds it, TensorFlow and JAX refuse it (as MixedPrecision does)
    rows = dict(explain_recipe(get_recipe("O1")))
    assert rows["torch"][0].startswith("torch.autocast(")
    for fw in ("tensorflow", "jax"):
        assert rows[fw] == [f"refused: {fw} has no cast_mode='autocast': use cast_mode 'auto' or 'module'"]
    # torch's "auto" casts modules for a policy that is not mixed (float16 parameters)
    assert rows["torch"] != dict(explain_recipe(get_recipe("float16")))["torch"]
    assert dict(explain_recipe(get_recipe("float16")))["torch"][0].startswith("model.to(torch.float16)")


@pytest.mark.parametrize(
    "recipe, torch_bytes, other_bytes",
    [("mixed_bfloat16", 12, 12), ("O2", 14, 12), ("bfloat16", 6, 6), ("bf16-kahan", 8, 8), ("bf16-stochastic", 6, 6)],
)
def test_explain_states_bytes_per_parameter_with_adam_per_framework(recipe, torch_bytes, other_bytes):
    # benchmarks.memory measures the same figures (tests/conformance/test_half_update.py)
    lines = dict(explain_recipe(get_recipe(recipe)))
    for fw, want in (("torch", torch_bytes), ("tensorflow", other_bytes), ("jax", other_bytes)):
        (line,) = [x for x in lines[fw] if x.startswith("with Adam, ")]
        assert line.startswith(f"with Adam, {want} bytes per parameter")
        parts = [int(n) for n in re.findall(r"(?:: | \+ )(\d+) \(", line)]
        assert sum(parts) == want


def test_explain_names_each_frameworks_update_rule():
    lines = dict(explain_recipe(get_recipe("bf16-stochastic")))
    assert any("unimp.backends.torch.half_update(optimizer, 'stochastic')" in x for x in lines["torch"])
    assert any("LossScaleOptimizer(inner_optimizer, update='stochastic')" in x for x in lines["tensorflow"])
    assert any("unimp.backends.jax.half_update(optimizer, 'stochastic')" in x for x in lines["jax"])
    assert not any("half_update" in x for x in dict(explain_recipe(get_recipe("bfloat16")))["torch"])
