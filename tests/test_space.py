import pytest

import pallas_tune as pt
from pallas_tune.space import Config, SearchSpace, load_space


def test_unknown_parameter_is_named():
    with pytest.raises(pt.SearchSpaceError, match="'bq'.*not a parameter"):

        @pt.tunable(bq=[128])
        def f(x, *, bm):
            return x


def test_positional_parameter_must_be_keyword_only():
    with pytest.raises(pt.SearchSpaceError, match="'bm'.*not keyword-only"):

        @pt.tunable(bm=[128])
        def f(x, bm):
            return x


def test_empty_choices():
    with pytest.raises(pt.SearchSpaceError, match="'bm' has no choices"):

        @pt.tunable(bm=[])
        def f(x, *, bm):
            return x


def test_unhashable_choice():
    with pytest.raises(pt.SearchSpaceError, match="unhashable"):

        @pt.tunable(opts=[{"a": 1}])
        def f(x, *, opts):
            return x


def test_scalar_instead_of_list():
    with pytest.raises(pt.SearchSpaceError, match="must be a list"):

        @pt.tunable(bm=128)
        def f(x, *, bm):
            return x


def test_invalid_default():
    with pytest.raises(pt.SearchSpaceError, match="not one of the declared choices"):

        @pt.tunable(bm=[128, 256], default={"bm": 512})
        def f(x, *, bm):
            return x


def test_lists_become_tuples_and_iteration_order():
    s = SearchSpace.from_choices({"a": [1, 2], "sem": [["parallel", "arbitrary"]]})
    assert s.size == 2
    assert list(s) == [{"a": 1, "sem": ("parallel", "arbitrary")},
                       {"a": 2, "sem": ("parallel", "arbitrary")}]
    assert {"a": 2, "sem": ("parallel", "arbitrary")} in s
    assert {"a": 3, "sem": ("parallel", "arbitrary")} not in s


def test_config_is_hashable_mapping_with_source():
    c = Config({"bm": 128, "sem": ["a", "b"]}, source="cache")
    assert c == {"bm": 128, "sem": ("a", "b")}
    assert hash(c) == hash(Config({"sem": ("a", "b"), "bm": 128}))
    assert c.source == "cache"
    assert c.replace(bm=256)["bm"] == 256


def test_shipped_space_file_loads():
    loaded = load_space("matmul")
    space = loaded["space"]
    assert space.names == ("vmem_limit_bytes", "bm", "bn", "bk", "buffering", "semantics")
    assert space.default["semantics"] == ("parallel", "parallel", "arbitrary")
    assert loaded["kernel"] == "pallas_tune.kernels.matmul:matmul"
    assert loaded["shapes"]


def test_bad_space_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[params\nbm = [")
    with pytest.raises(pt.SearchSpaceError, match="not valid TOML"):
        load_space(str(p))
    with pytest.raises(pt.SearchSpaceError, match="no search-space file"):
        load_space("does_not_exist")


# ---- constraints ---------------------------------------------------------------------------

import jax
import jax.numpy as jnp

from pallas_tune.constraints import Constraint


def test_constraint_expressions_are_checked_when_declared():
    x = jax.ShapeDtypeStruct((128, 384), jnp.bfloat16)
    c = Constraint(name="bk_divides_k", check="x.shape[1] % bk == 0 or bk >= x.shape[1]")
    assert c.reads == {"x", "bk"}
    assert c.holds({"x": x, "bk": 128}) and not c.holds({"x": x, "bk": 256})
    assert c.holds({"x": x, "bk": 512})
    assert Constraint(name="c", check="x.dtype.itemsize * bm <= 4096 and x.ndim == 2").holds(
        {"x": x, "bm": 2048})
    assert Constraint(name="c", check="min(x.shape[-2:]) >= 128").holds({"x": x})
    for bad, message in [
        ("x.__class__", "may read only"),
        ("__import__('os')", "may call only"),
        ("open('f')", "may call only"),
        ("(lambda: 1)()", "Lambda|may call only"),
        ("[a for a in x.shape]", "ListComp"),
        ("x is None", "uses `is`"),
        ("bk >", "not an expression"),
        ("", "empty"),
    ]:
        with pytest.raises(pt.SearchSpaceError, match=message):
            Constraint(name="bad", check=bad)
    with pytest.raises(pt.SearchSpaceError, match="not an identifier"):
        Constraint(name="bk divides k", check="True")
    with pytest.raises(ValueError, match="out of range"):
        Constraint(name="c", check="2 ** bk > 0").holds({"bk": 10**6})


def test_constraints_name_parameters_of_the_kernel():
    with pytest.raises(pt.SearchSpaceError, match=r"reads \['K'\].*x.shape\[1\]"):

        @pt.tunable(bk=[128], constraints={"c": "K % bk == 0"}, name="t.c1")
        def f(x, *, bk):
            return x

    with pytest.raises(pt.SearchSpaceError, match="reads.*'k'"):

        @pt.tunable(bk=[128], constraints={"c": lambda k, bk: k % bk == 0}, name="t.c2")
        def g(x, *, bk):
            return x

    with pytest.raises(pt.SearchSpaceError, match="must map names"):

        @pt.tunable(bk=[128], constraints=["x.shape[1] % bk == 0"], name="t.c3")
        def h(x, *, bk):
            return x


def test_constraints_refuse_configs_in_violations():
    @pt.tunable(bk=[128, 256], name="t.c4",
                constraints={"bk_divides_k": "x.shape[1] % bk == 0",
                             "small": lambda x, bk, **_: bk * x.shape[0] <= 2048})
    def f(x, *, bk):
        return x

    x = jax.ShapeDtypeStruct((8, 384), jnp.float32)
    assert f.violations({"bk": 128}, (x,), {}) == []
    (problem,) = f.violations({"bk": 256}, (x,), {})
    assert problem.startswith("constraint bk_divides_k (x.shape[1] % bk == 0) does not hold")
    assert "bk=256" in problem and "x=8x384:float32" in problem
    y = jax.ShapeDtypeStruct((32, 384), jnp.float32)
    assert "constraint small" in f.violations({"bk": 128}, (y,), {})[0]


def test_space_file_constraints_and_validation_before_any_import(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('kernel = "pkg.mod:kern"\n[params]\nbk = [128, 256]\n'
                 '[constraints]\nbk_divides_k = "x.shape[1] % bk == 0"\n')
    loaded = load_space(str(p))
    (c,) = loaded["space"].constraints
    assert c.name == "bk_divides_k" and loaded["kernel"] == "pkg.mod:kern"
    for text, message in [
        ('kernel = "os; rm -rf /"\n[params]\nbk = [1]\n', "is not MODULE:NAME"),
        ('kernel = 5\n[params]\nbk = [1]\n', "is not MODULE:NAME"),
        ('[params]\nbk = [1]\n[constraints]\nc = "x.__dict__"\n', "may read only"),
        ('[params]\nbk = [1]\n[constraints]\nc = 5\n', "expression strings"),
        ('[params]\nbk = [1]\n[[shapes]]\n"x y" = "8:int32"\n', "argument names"),
        ('default = 3\n[params]\nbk = [1]\n', "must be a table"),
    ]:
        p.write_text(text)
        with pytest.raises(pt.SearchSpaceError, match=message):
            load_space(str(p))
    p.write_bytes(b"\xff[params]")
    with pytest.raises(pt.SearchSpaceError, match="not valid TOML"):
        load_space(str(p))


def test_typed_membership():
    s = SearchSpace.from_choices({"bm": [128, 256], "flag": [True, False]})
    assert {"bm": 128, "flag": True} in s
    assert {"bm": 128.0, "flag": True} not in s
    assert {"bm": 128, "flag": 1} not in s
    assert s.config_problems({"bm": 512, "flag": True}, outside_ok=True) == []
    assert "is a float" in s.config_problems({"bm": 512.0, "flag": True}, outside_ok=True)[0]
