"""Help texts read as terminal text (issue 26.9): no reST markup, one description per flag."""

from __future__ import annotations

import contextlib
import io

import pytest

from pallas_tune.cli import main


def _help(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return out.getvalue()


@pytest.mark.parametrize("command", ["sweep", "show", "check", "merge", "report"])
def test_help_has_no_rest_markup(command):
    text = _help(command)
    assert "``" not in text and ":class:" not in text and ":func:" not in text, text


def test_each_flag_has_its_own_description():
    text = " ".join(_help("sweep").split())  # argparse wraps; compare the words.
    storage = text.split("--storage STORAGE ", 1)[1].split(" --study-name", 1)[0]
    study = text.split("--study-name STUDY_NAME ", 1)[1].split(" --timer", 1)[0]
    assert storage != study and "name in --storage" in study, (storage, study)


def test_top_level_usage_lines_match_the_commands():
    """Every `pallas-tune CMD ...` line of the top-level help parses as that command's usage
    (it once showed `merge OUT.json IN.json`, which merge never took)."""
    import shlex

    from pallas_tune import cli

    lines = [ln.split("#")[0].strip() for ln in (cli.__doc__ or "").splitlines()
             if ln.strip().startswith("pallas-tune merge")]
    assert lines, cli.__doc__
    for line in lines:
        usage = _help("merge")
        words = [w for w in shlex.split(line)[2:] if not w.startswith("[")]
        assert words[0] == "FILE" and "FILE [FILE ...]" in usage, (line, usage)


@pytest.mark.parametrize("dtype,guess", [("bf16", "bfloat16"), ("flaot32", "float32")])
def test_unknown_dtype_suggests_the_name(dtype, guess, capsys):
    """`x=8x128:bf16` names the dtype it probably meant (issue 26.9)."""
    code = main(["sweep", "pallas_tune.kernels.matmul:matmul", "--shapes",
                 f"x=8x128:{dtype},y=128x128:{dtype}", "--no-storage", "--no-write"])
    assert code == 2
    assert f"did you mean {guess!r}" in capsys.readouterr().err


def test_database_errors_are_one_clean_line(monkeypatch):
    """A refused PostgreSQL connection's message reads as one line, with no literal tab
    escapes from the driver's multi-line text (issue 26.9)."""
    pytest.importorskip("psycopg", reason="needs the postgres extra")
    from pallas_tune.errors import TuneOptionError
    from pallas_tune.tuning import storage

    monkeypatch.setattr(storage, "_RETRIES", 1)
    with pytest.raises(TuneOptionError) as info:
        storage.open_storage("postgresql://nobody@127.0.0.1:1/db")
    text = str(info.value)
    assert "\t" not in text and "\\t" not in text and "\n" not in text, text
    assert "Connection refused" in text or "connection" in text.lower()
