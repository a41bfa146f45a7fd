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
    assert space.names == ("bm", "bn", "bk", "buffering", "semantics")
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
