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
