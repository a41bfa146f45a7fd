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
