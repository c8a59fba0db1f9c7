import pytest
from hypothesis import given
from hypothesis import strategies as st

from unimp import Policy, get_policy
from unimp.dtypes import CANONICAL_DTYPES

F32, F16, BF16, F64 = "float32", "float16", "bfloat16", "float64"


@pytest.mark.parametrize(
    "name,expected",
    [
        # jmp grammar and defaulting: params float32, compute follows params, output follows compute
        ("c=f16", (F32, F16, F16)),
        ("p=f32,c=bf16,o=f32", (F32, BF16, F32)),
        ("params=float32,compute=float16,output=float32", (F32, F16, F32)),
        ("p=f16", (F16, F16, F16)),
        ("o=f16", (F32, F32, F16)),
        ("compute=half", (F32, F16, F16)),
        ("half", (F16, F16, F16)),
        ("float16", (F16, F16, F16)),
        ("f32", (F32, F32, F32, "highest")),  # the float32 reference pins true float32 matmuls
        ("full", (F32, F32, F32, "highest")),
        # Keras
        ("mixed_float16", (F32, F16, F32)),
        ("mixed_bfloat16", (F32, BF16, F32)),
        ("float64", (F64, F64, F64)),
        ("bfloat16", (BF16, BF16, BF16)),
        # Apex
        ("O0", (F32, F32, F32)),
        ("O1", (F32, F16, F32)),
        ("O2", (F32, F16, F32)),
        ("O3", (F16, F16, F16)),
        ("o2", (F32, F16, F32)),
        # Lightning
        ("16-mixed", (F32, F16, F32)),
        ("bf16-mixed", (F32, BF16, F32)),
        ("32-true", (F32, F32, F32)),
        ("16-true", (F16, F16, F16)),
        ("bf16-true", (BF16, BF16, BF16)),
        ("64-true", (F64, F64, F64)),
        ("16", (F32, F16, F32)),
        ("bf16", (F32, BF16, F32)),
        ("32", (F32, F32, F32)),
        ("64", (F64, F64, F64)),
        # Accelerate
        ("no", (F32, F32, F32)),
        ("fp16", (F32, F16, F32)),
    ],
)
def test_get_policy(name, expected):
    assert get_policy(name) == Policy(*expected)


def test_half_on_tpu_is_bfloat16():
    assert get_policy("half", platform="tpu") == Policy(BF16, BF16, BF16)
    assert get_policy("c=half", platform="tpu") == Policy(F32, BF16, BF16)
    assert get_policy("c=half", platform="gpu") == Policy(F32, F16, F16)


@pytest.mark.parametrize("name", ["fp8", "FP8", "transformer-engine"])
def test_fp8_is_a_recipe_not_a_policy(name):
    with pytest.raises(ValueError, match=r"is a recipe, not a dtype policy: use unimp.get_recipe"):
        get_policy(name)


@pytest.mark.parametrize(
    "bad,closest",
    [
        ("mixed_float61", "mixed_float16"),
        ("mixed-bfloat16", "mixed_bfloat16"),
        ("bf16-mixd", "bf16-mixed"),
        ("flaot16", "float16"),
        ("c=flot16", "float16"),
    ],
)
def test_unknown_names_suggest_closest(bad, closest):
    with pytest.raises(ValueError, match=f"Did you mean '{closest}'"):
        get_policy(bad)


@pytest.mark.parametrize("bad", ["", "p=f32,p=f16", "x=f16", "c=f16,o", "f16,f32", "c=int8"])
def test_bad_grammar(bad):
    with pytest.raises(ValueError):
        get_policy(bad)


def test_suggested_names_parse():
    # jmp's error suggests a value its own parser rejects; ours must not: a bad value of a key
    # names the key, and every dtype the message offers parses in its place
    with pytest.raises(ValueError) as e:
        get_policy("c=f17")
    msg = str(e.value)
    assert "c=f17 is not a dtype" in msg and "Did you mean 'f16'" in msg
    offered = msg.split("A dtype is one of ")[1].rstrip(".").split(", ")
    assert "float16" in offered and "mixed_float16" not in offered
    for dtype in offered:
        get_policy(f"c={dtype}")
    with pytest.raises(ValueError) as e:
        get_policy("f17")  # a whole name: the named policies and the grammar are offered
    assert "params=float32,compute=float16,output=float32" in str(e.value)
    get_policy("params=float32,compute=float16,output=float32")


@pytest.mark.parametrize("name", ["half,matmul=high", "torch.float16,matmul=high", "HALF,matmul=none"])
def test_every_dtype_name_takes_the_optional_fields(name):
    # what names a whole policy as one dtype also heads one with optional fields
    head, _, rest = name.partition(",")
    assert get_policy(name) == get_policy(head).with_(
        matmul_precision=None if rest.endswith("none") else "high"
    )


def test_type_error():
    with pytest.raises(TypeError):
        get_policy(16)


dtypes = st.sampled_from(CANONICAL_DTYPES)


@given(dtypes, dtypes, dtypes)
def test_str_round_trips_and_hash(p, c, o):
    policy = Policy(p, c, o)
    assert get_policy(str(policy)) == policy
    assert hash(get_policy(str(policy))) == hash(policy)
    assert {policy: 1}[Policy(p, c, o)] == 1


def test_frozen_and_normalised():
    p = Policy("fp32", "bf16", "float")
    assert p == Policy(F32, BF16, F32)
    with pytest.raises(AttributeError):
        p.compute_dtype = F16  # type: ignore[misc]
    with pytest.raises(ValueError, match="compute_dtype"):
        Policy(F32, "int8", F32)
    assert p.is_mixed and not p.is_float32
    assert p.with_(compute_dtype="f16") == Policy(F32, F16, F32)
