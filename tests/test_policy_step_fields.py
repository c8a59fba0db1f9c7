"""The policy's whole-step fields in the core: the float32 matmul precision, the all-reduce dtype
and the gradient-accumulation dtype (``matmul_precision``, ``reduce_dtype``, ``accum_dtype``)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from unimp import Policy, Recipe, get_policy, get_recipe
from unimp.precision import MATMUL_PRECISION_TABLE, MATMUL_PRECISIONS, check_matmul_precision

DTYPES = ("float64", "float32", "float16", "bfloat16")


def test_new_fields_default_to_none_meaning_as_before():
    p = Policy("float32", "float16", "float32")
    assert (p.matmul_precision, p.reduce_dtype, p.accum_dtype) == (None, None, None)
    assert str(p) == "params=float32,compute=float16,output=float32"


def test_fields_are_normalised_and_printed_only_when_set():
    p = Policy("f32", "bf16", "f32", matmul_precision=" High", reduce_dtype="bf16", accum_dtype="fp32")
    assert (p.matmul_precision, p.reduce_dtype, p.accum_dtype) == ("high", "bfloat16", "float32")
    assert str(p) == "params=float32,compute=bfloat16,output=float32,matmul=high,reduce=bfloat16,accum=float32"
    assert str(Policy(accum_dtype="bf16")) == "params=float32,compute=float32,output=float32,accum=bfloat16"


@given(
    st.sampled_from(DTYPES), st.sampled_from(DTYPES), st.sampled_from(DTYPES),
    st.sampled_from((None, *MATMUL_PRECISIONS)),
    st.sampled_from((None, *DTYPES)), st.sampled_from((None, *DTYPES)),
)
def test_str_parses_back_to_an_equal_policy(param, compute, output, matmul, reduce, accum):
    p = Policy(param, compute, output, matmul, reduce, accum)
    assert get_policy(str(p)) == p
    assert hash(get_policy(str(p))) == hash(p)


@given(
    st.sampled_from(DTYPES), st.sampled_from(("float32", "bfloat16")),
    st.sampled_from((None, *MATMUL_PRECISIONS)),
    st.sampled_from((None, *DTYPES)), st.sampled_from((None, *DTYPES)),
)
def test_an_override_sets_dtypes_only(param, d, matmul, reduce, accum):
    # the matmul precision, the all-reduce and the accumulation are whole-step fields: an
    # override that sets one is refused (no backend could apply it to one layer)
    value = Policy(param, d, d, matmul, reduce, accum)
    if (matmul, reduce, accum) == (None, None, None):
        p = Policy("float32", "float16", overrides={"head": value, "*norm*": "float32"})
        assert get_policy(str(p)) == p
    else:
        with pytest.raises(ValueError, match="applies to the whole step: set it on the top-level"):
            Policy("float32", "float16", overrides={"head": value, "*norm*": "float32"})


def test_grammar_keys_and_jmp_defaulting_unchanged():
    p = get_policy("c=f16,reduce=f16,accum=f32,matmul=medium")
    assert p == Policy("float32", "float16", "float16", "medium", "float16", "float32")
    assert get_policy("matmul_precision=highest,reduce_dtype=bf16,accum_dtype=f32").reduce_dtype == "bfloat16"


def test_the_float32_recipe_asks_for_highest():
    # so float32 runs agree across frameworks on a GPU as they do on a CPU
    assert get_policy("float32").matmul_precision == "highest"
    assert get_recipe("f32").policy.matmul_precision == "highest"
    assert get_recipe("float32").is_noop
    assert get_policy("mixed_float16").matmul_precision is None
    assert get_policy("bfloat16").matmul_precision is None


def test_recipe_dict_and_file_keep_the_fields(tmp_path):
    r = Recipe(Policy("float32", "bfloat16", "float32", "high", "bfloat16", "float32"))
    assert Recipe.from_dict(r.to_dict()) == r
    path = tmp_path / "r.toml"
    path.write_text('policy = "params=float32,compute=bfloat16,output=float32,matmul=high,reduce=bf16,accum=f32"\n')
    assert Recipe.from_file(path) == r


def test_with_replaces_the_new_fields():
    p = get_policy("mixed_bfloat16").with_(reduce_dtype="f32", matmul_precision="high")
    assert (p.reduce_dtype, p.matmul_precision) == ("float32", "high")
    with pytest.raises(TypeError, match="accum_dtype"):
        p.with_(accum="f32")


@pytest.mark.parametrize("bad", ["tf32", "HIGHER", "", 3])
def test_unknown_precision_name_lists_the_valid_names(bad):
    with pytest.raises(ValueError, match="'highest', 'high', 'medium'"):
        Policy(matmul_precision=bad)
    with pytest.raises(ValueError, match="'highest', 'high', 'medium'"):
        get_policy(f"c=bf16,matmul={bad}")


def test_close_precision_name_is_suggested():
    with pytest.raises(ValueError, match="Did you mean 'highest'"):
        check_matmul_precision("hightest")


@pytest.mark.parametrize("field", ["reduce_dtype", "accum_dtype"])
@pytest.mark.parametrize("bad", ["int8", "float8", "complex64"])
def test_unsupported_reduce_or_accum_dtype_is_a_value_error_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=f"Policy.{field}"):
        Policy(**{field: bad})


def test_one_mapping_table_with_a_row_per_name():
    assert tuple(MATMUL_PRECISION_TABLE) == MATMUL_PRECISIONS
    highest = MATMUL_PRECISION_TABLE["highest"]
    # true float32 everywhere: torch's switches "ieee" (legacy: "highest" + cuDNN TF32 off),
    # TF32 off, JAX "float32"
    assert dict(highest.torch_fp32_precision) == dict.fromkeys(
        ("cuda.matmul", "mkldnn.matmul", "cudnn.conv", "cudnn.rnn"), "ieee"
    )
    assert highest[1:] == ("highest", False, False, "float32")
    assert MATMUL_PRECISION_TABLE["high"].jax == "tensorfloat32"
    assert MATMUL_PRECISION_TABLE["medium"].jax == "bfloat16"


def test_explain_keeps_the_new_fields():
    from unimp.compare.explain import explain_recipe

    lines = dict(explain_recipe(get_recipe("p=f32,c=bf16,o=f32,matmul=high,reduce=bf16,accum=f32")))
    assert any('set_float32_matmul_precision("high")' in line for line in lines["torch"])
    assert any("enable_tensor_float_32_execution(True)" in line for line in lines["tensorflow"])
    assert any('default_matmul_precision("tensorfloat32")' in line for line in lines["jax"])
    for fw in ("torch", "tensorflow", "jax"):
        assert any("all-reduced" in line and "bfloat16" in line for line in lines[fw])
        assert any("sums the micro-batch gradients in float32" in line for line in lines[fw])
    jax = dict(explain_recipe(get_recipe("mixed_float16")))["jax"]
    assert len([x for x in jax if not x.startswith("with Adam, ")]) == 3  # no optional field's line


@pytest.mark.parametrize(
    "backend,current,device,text",
    [
        ("torch", {"api": "fp32_precision (torch>=2.9)", "cuda.matmul": "none", "mkldnn.matmul": "none",
                   "cudnn.conv": "tf32", "cudnn.rnn": "tf32"}, "cuda:0",
         "fp32_precision (torch>=2.9): cuda.matmul none, mkldnn.matmul none, cudnn.conv tf32, cudnn.rnn tf32 "
         "(matmul float32, conv TF32)"),
        ("torch", {"api": "fp32_precision (torch>=2.9)", "cuda.matmul": "tf32", "mkldnn.matmul": "bf16",
                   "cudnn.conv": "tf32", "cudnn.rnn": "tf32"}, "cpu",
         "fp32_precision (torch>=2.9): cuda.matmul tf32, mkldnn.matmul bf16, cudnn.conv tf32, cudnn.rnn tf32 "
         "(matmul TF32 (oneDNN: bf16), conv TF32); a CPU computes full float32"),
        ("torch", {"api": "set_float32_matmul_precision + cudnn.allow_tf32 (torch<2.9)", "matmul": "highest",
                   "conv_tf32": True}, "cuda:0",
         "set_float32_matmul_precision + cudnn.allow_tf32 (torch<2.9): matmul highest (float32), conv TF32"),
        ("tensorflow", {"api": "enable_tensor_float_32_execution", "tf32": True}, "/physical_device:GPU:0",
         "enable_tensor_float_32_execution: TF32 on (matmuls and convolutions)"),
        ("jax", {"api": "default_matmul_precision", "default_matmul_precision": None}, "cuda:0",
         "default_matmul_precision: unset (TF32 on Ampere+ GPUs, bfloat16 on TPU)"),
        ("jax", {"api": "default_matmul_precision", "default_matmul_precision": "float32"}, "cpu:0",
         "default_matmul_precision: float32; a CPU computes full float32"),
        ("jax", {"api": "default_matmul_precision", "default_matmul_precision": "BF16_BF16_F32"}, "cuda:0",
         "default_matmul_precision: BF16_BF16_F32 (a DotAlgorithmPreset: every dot's operands cast to it, "
         "convolutions at DEFAULT)"),
    ],
)
def test_info_describes_each_frameworks_default(backend, current, device, text):
    from unimp.precision import describe_matmul_precision

    assert describe_matmul_precision(backend, current, device) == text


def test_a_named_policy_takes_the_optional_fields_after_it():
    p = get_policy("mixed_float16,matmul=high,accum=float32")
    assert p == get_policy("mixed_float16").with_(matmul_precision="high", accum_dtype="float32")
    assert get_policy(str(p)) == p
    assert get_policy("mixed_float16,reduce=bf16;l2:float32").overrides[0][0] == "l2"
    with pytest.raises(ValueError, match="after a named policy only matmul=, reduce=, accum="):
        get_policy("mixed_float16,compute=float32")
    with pytest.raises(ValueError, match="matmul must be one of"):
        get_policy("mixed_float16,matmul=fast")


def test_policy_strings_spell_none_take_a_dtype_head_and_name_recipes():
    # "or None" in the message: the string spelling is "none", the framework's own setting
    assert get_policy("float32,matmul=none").matmul_precision is None
    assert get_policy("mixed_float16,matmul=none") == get_policy("mixed_float16")
    # a dtype name is a policy too, so it takes the optional fields after it
    assert get_policy("float16,matmul=high") == get_policy("float16").with_(matmul_precision="high")
    # an override cannot set a whole-step field: said as such, not as "is not key=dtype"
    with pytest.raises(ValueError, match="matmul_precision='high' applies to the whole step"):
        get_policy("mixed_float16;l2:float16,matmul=high")
    # 'fp8' is a recipe, with or without fields after it (was: "Did you mean 'fp64'?")
    with pytest.raises(ValueError, match="'fp8' is a recipe, not a dtype policy"):
        get_policy("fp8,matmul=high")


# -- update: how half parameters take their updates (issue 32) ------------------------------


@given(
    st.sampled_from(("bfloat16", "float16")), st.sampled_from(DTYPES),
    st.sampled_from(("nearest", "kahan", "stochastic")), st.sampled_from((None, "bfloat16")),
)
def test_update_is_printed_when_set_and_parses_back(param, compute, update, accum):
    if update == "stochastic" and param == "float16":
        with pytest.raises(ValueError, match="use update='kahan' for them, or bfloat16 parameters"):
            Policy(param, compute, compute, accum_dtype=accum, update=update)
        return
    p = Policy(param, compute, compute, accum_dtype=accum, update=update)
    assert (f",update={update}" in str(p)) == (update != "nearest")
    assert get_policy(str(p)) == p and Recipe.from_dict(Recipe(p).to_dict()).policy == p


def test_update_in_strings_names_and_recipe_files(tmp_path):
    assert get_policy("bf16-true,update=Kahan") == Policy("bfloat16", "bfloat16", "bfloat16", update="kahan")
    assert get_policy("p=bf16,update=stochastic").update == "stochastic"
    for name, mode in (("bf16-kahan", "kahan"), ("bf16-stochastic", "stochastic")):
        r = get_recipe(name)
        assert (r.policy.param_dtype, r.policy.compute_dtype, r.policy.update) == ("bfloat16", "bfloat16", mode)
        assert r.loss_scale.kind == "none"
    assert get_policy("bf16-true").update == "nearest"
    path = tmp_path / "r.toml"
    path.write_text('[policy]\nname = "bf16-true"\nupdate = "kahan"\n')
    assert Recipe.from_file(path).policy == get_policy("bf16-kahan")


@pytest.mark.parametrize(
    "text, message",
    [
        ("mixed_bfloat16,update=kahan", "these parameters are float32 \\(master weights\\).*no compensation"),
        ("float32,update=stochastic", "these parameters are float32"),
        ("float16,update=stochastic", "rounds float32 to bfloat16"),
        ("bf16-true,update=round", "update must be one of \\('nearest', 'kahan', 'stochastic'\\)"),
        ("bf16-true;head:params=bfloat16,update=kahan", "update='kahan' applies to the whole step"),
    ],
)
def test_update_refusals_say_why(text, message):
    with pytest.raises(ValueError, match=message):
        get_policy(text)


def test_the_rounding_seed_is_an_integer():
    from unimp.trainstep import StepOptions

    assert StepOptions(rounding_seed=2**40).rounding_seed == 2**40
    for bad in (1.5, True, "0"):
        with pytest.raises(TypeError, match="rounding_seed must be an integer"):
            StepOptions(rounding_seed=bad)
