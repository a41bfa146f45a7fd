import inspect
import math

import jax
import jax.numpy as jnp

from pallas_tune import keys


def f(x, y, *, causal=False, sm_scale=None, bq):
    pass


SIG = inspect.signature(f)


def test_default_key_format_and_defaults_applied():
    x = jax.ShapeDtypeStruct((2, 8, 1024, 128), jnp.bfloat16)
    k1 = keys.call_key(SIG, frozenset({"bq"}), (x, x), {})
    k2 = keys.call_key(SIG, frozenset({"bq"}), (x,), {"y": x, "causal": False})
    assert k1 == k2 == ("x=2x8x1024x128:bfloat16,y=2x8x1024x128:bfloat16,"
                        "causal=false,sm_scale=null")
    k3 = keys.call_key(SIG, frozenset({"bq"}), (x, x), {"causal": True})
    assert k3 != k1


def test_optional_parameters_are_keyed_only_off_their_default():
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32)
    base = keys.call_key(SIG, frozenset({"bq"}), (x, x), {})
    opt = frozenset({"sm_scale"})
    assert keys.call_key(SIG, frozenset({"bq"}), (x, x), {}, optional=opt) == (
        "x=8x128:float32,y=8x128:float32,causal=false")
    assert keys.call_key(SIG, frozenset({"bq"}), (x, x), {"sm_scale": 0.5},
                         optional=opt) == base.replace("null", "0.5")


def test_parse_roundtrip():
    parsed = keys.parse_key("x=1024x512:bfloat16,causal=true,n=3,mode=\"a,b\"")
    assert parsed["x"] == ("array", (1024, 512), "bfloat16")
    assert parsed["causal"] == ("static", True)
    assert parsed["n"] == ("static", 3)
    assert parsed["mode"] == ("static", "a,b")


def test_distance():
    a = "x=1024x1024:bfloat16,y=1024x1024:bfloat16"
    assert keys.key_distance(a, a) == 0
    assert keys.key_distance(a, "x=2048x1024:bfloat16,y=1024x1024:bfloat16") == 1
    assert math.isinf(keys.key_distance(a, "x=1024x1024:float32,y=1024x1024:float32"))
    assert math.isinf(keys.key_distance("x=8:int32,c=true", "x=8:int32,c=false"))


def test_shape_signature_groups_keys_at_finite_distance():
    sig, dims = keys.shape_signature("x=8x128:float32,y=(4:int32;2x2:bfloat16),c=true,n=3")
    assert sig == "x=#x#:float32,y=(#:int32;#x#:bfloat16),c=true,n=3"
    assert dims == (8, 128, 4, 2, 2)
    a, b = "x=1024x384:bfloat16,f=2.0", "x=2048x96:bfloat16,f=2.0"
    assert keys.shape_signature(a)[0] == keys.shape_signature(b)[0]
    assert keys.key_distance(a, b) == 3.0
    assert keys.shape_signature("x=scalar:float32") == ("x=scalar:float32", ())
    # Different statics, dtypes or ranks: different signatures (and infinite distance).
    for other in ("x=1024x384:bfloat16,f=3.0", "x=1024x384:float32,f=2.0",
                  "x=1024x384x1:bfloat16,f=2.0"):
        assert keys.shape_signature(other)[0] != keys.shape_signature(a)[0]
        assert math.isinf(keys.key_distance(a, other))


def test_statics_take_the_type_of_their_default():
    import inspect

    def f(x, *, alpha=2.0, groups=1, scale=None, b):
        return x

    sig, x = inspect.signature(f), jnp.zeros((4, 8), jnp.float32)

    def key(**kw):
        return keys.call_key(sig, frozenset({"b"}), (x,), kw)

    assert key(alpha=2) == key(alpha=2.0) == "x=4x8:float32,alpha=2.0,groups=1,scale=null"
    assert key(groups=1.0) == key()  # An int default: a whole float is that int.
    assert key(scale=3.0) == key(scale=3)  # No numeric default: whole floats are ints.
    assert key(scale=0.5).endswith("scale=0.5") and key(alpha=True).count("alpha=true") == 1
    assert key(alpha=2.5) != key(alpha=2.0)


def test_split_statics():
    assert keys.split_statics("x=4x8:float32,alpha=2.0,c=null") == (
        "x=4x8:float32", {"alpha": "2.0", "c": "null"})
    assert keys.split_statics("q=(2x3:float32;4:int32),causal=true") == (
        "q=(2x3:float32;4:int32)", {"causal": "true"})
