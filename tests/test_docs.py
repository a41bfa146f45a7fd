"""The README's and the documentation's promises, re-read against the code.

Every page (README.md and docs/**/*.md) is checked the same way:

- its ```python blocks run as written: blocks titled as a file (```python title="my_kernels.py")
  are written to that file in a fresh directory; the others run there in order, in one fresh
  process, with the user cache in a temporary directory; then the command lines of the
  ```bash blocks marked `<!-- test: run -->` (the line before the block) run in order, in the
  same directory (`python X.py`, `pallas-tune ...`). A block marked `<!-- test: libtpu -->`
  (it compiles for a TPU) runs only where libtpu is installed (CI installs it);
- the tutorial is walked as a reader follows it instead: every line of its ```bash blocks, in
  order, in one shell, each file written where the reader stands when the page gives it, with
  no Python on PATH but the virtual environment the page makes (its install lines stood in for:
  no network here);
- every `pallas-tune ...` line in a ```bash block parses with the CLI's own parser;
- every `pt.NAME` and `pallas_tune.NAME` it mentions exists, and so does every repository path
  it names in code (`examples/...`, `benchmarks/...`);
- it names no internal issue numbers.

And: the site builds with `mkdocs build --strict` (a warning fails it); the API reference
documents every public name; the README's two commands are the ones CI runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from conftest import subprocess_env

REPO = pathlib.Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]

# A fence at any indentation: its language, the rest of its info string, its body.
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>\w+)(?P<info>[^\n]*)\n(?P<body>.*?)^(?P=indent)```",
    re.DOTALL | re.MULTILINE)
MARK = re.compile(r"<!--\s*test:\s*([\w-]+)\s*-->\s*$")
TITLE = re.compile(r'title="([^"]+)"')


@dataclasses.dataclass(frozen=True)
class Block:
    lang: str
    body: str
    title: str | None
    mark: str | None


def _rel(page: pathlib.Path) -> str:
    return str(page.relative_to(REPO))


def _blocks(page: pathlib.Path) -> list[Block]:
    text = page.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        title = TITLE.search(m["info"])
        indent = len(m["indent"])
        body = "\n".join(line[indent:] for line in m["body"].splitlines()) + "\n"
        out.append(Block(m["lang"], body, title and title[1], mark and mark[1]))
    return out


def _libtpu() -> bool:
    from pallas_tune.feasibility.compile import libtpu_available

    return libtpu_available()


RUN_PAGES = [p for p in PAGES if any(b.lang == "python" for b in _blocks(p))]


def test_pages_have_examples():
    assert README in RUN_PAGES, "the README lost its example"
    assert DOCS / "tutorial.md" in RUN_PAGES
    assert len(RUN_PAGES) >= 8, [_rel(p) for p in RUN_PAGES]
    for page in PAGES:
        for b in _blocks(page):
            assert b.mark in (None, "run", "libtpu"), f"{_rel(page)}: unknown mark {b.mark!r}"
            assert b.mark != "run" or b.lang == "bash", f"{_rel(page)}: `run` marks bash blocks"


def _commands(block: Block) -> list[str]:
    out = []
    for line in block.body.replace("\\\n", " ").splitlines():
        line = line.split("  #")[0].strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


TUTORIAL = DOCS / "tutorial.md"
WALKED = [TUTORIAL]  # Pages walked whole by test_tutorial_runs_as_written.


@pytest.mark.parametrize("page", [p for p in RUN_PAGES if p not in WALKED], ids=_rel)
def test_python_blocks_run_as_written(page, tmp_path):
    blocks = _blocks(page)
    libtpu = _libtpu()
    script = []
    for i, b in enumerate(blocks):
        if b.lang != "python" or (b.mark == "libtpu" and not libtpu):
            continue
        if b.title:
            path = tmp_path / b.title
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.body)
        else:
            script.append(f"print('--- block {i}', flush=True)\n{b.body}")
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache")
    env.pop("PALLAS_TUNE_MODE", None)
    if script:
        (tmp_path / "page_blocks.py").write_text("\n".join(script))
        r = subprocess.run([sys.executable, "page_blocks.py"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=600, env=env, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    for b in blocks:
        if b.mark != "run":
            continue
        for line in _commands(b):
            words = shlex.split(line)
            if words[0] == "python":
                argv = [sys.executable, *words[1:]]
            elif words[0] == "pallas-tune":
                argv = [sys.executable, "-m", "pallas_tune", *words[1:]]
            else:
                pytest.fail(f"{_rel(page)}: a `run` block runs python or pallas-tune: {line}")
            r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                               env=env, check=False)
            assert r.returncode == 0, f"{line}\n" + r.stdout[-3000:] + r.stderr[-5000:]


# The tutorial's install lines and what the walk runs in their place. The venv is made as the
# page says, from this test's Python; the install makes the environment see this one's
# packages (pallas-tune, installed editable, included) and gives it a `pallas-tune` command, as
# `pip install -e '.[tpu]'` would: through whichever `python` the shell finds, so that an
# environment never activated gets nothing.
INSTALL = ("python3 -m venv .venv", "pip install -e '.[tpu]'")
STAND_IN = """
import os, sys, sysconfig
with open(os.path.join(sysconfig.get_paths()["purelib"], "walk_install.pth"), "w") as f:
    f.write("import site; " + "; ".join(f"site.addsitedir({d!r})" for d in SITES) + "\\n")
script = os.path.join(os.path.dirname(sys.executable), "pallas-tune")
with open(script, "w") as f:
    f.write(f"#!{sys.executable}\\nimport sys\\nfrom pallas_tune.cli import main\\n"
            "sys.exit(main())\\n")
os.chmod(script, 0o755)
"""


def _walk(page: pathlib.Path) -> str:
    """A bash script of the page as a reader follows it: each ```bash line as written (the
    install lines stood in for), each titled ```python block written to its file in the
    directory the reader is in at that point."""
    import site

    sites = [*site.getsitepackages(), site.getusersitepackages()]
    out, installs = ["set -exo pipefail"], []
    for b in _blocks(page):
        if b.lang == "python":
            assert b.title, f"{_rel(page)}: a walked page gives its Python as files"
            out.append(f"cat > {shlex.quote(b.title)} <<'END_OF_{b.title}'\n{b.body}"
                       f"END_OF_{b.title}")
            continue
        for line in _commands(b) if b.lang == "bash" else ():
            if line in INSTALL:
                installs.append(line)
                code = f"SITES = {sites!r}\n{STAND_IN}"
                line = (f"{shlex.quote(sys.executable)} -m venv --without-pip .venv"
                        if line == INSTALL[0] else f"python -c {shlex.quote(code)}")
            out.append(line)
    assert installs == list(INSTALL), f"{_rel(page)}: the install lines changed: {installs}"
    return "\n".join(out) + "\n"


def test_tutorial_runs_as_written(tmp_path):
    """The tutorial, literally: from a clone (here an empty directory), the venv made and
    activated as the page says, the files written where it says, the commands run as written.
    PATH holds no Python but the one the page's venv adds: a step that forgot to activate it
    fails here as it does for a reader."""
    clone = tmp_path / "clone"
    clone.mkdir()
    (tmp_path / "walk.sh").write_text(_walk(TUTORIAL))
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=tmp_path / "cache", PATH="/usr/bin:/bin")
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PALLAS_TUNE_MODE"):
        env.pop(name, None)
    r = subprocess.run(["bash", str(tmp_path / "walk.sh")], cwd=clone, capture_output=True,
                       text=True, timeout=900, env=env, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    here = tmp_path / "pallas-tune-tutorial"  # Where the page says its files go.
    assert {p.name for p in here.glob("*.py")} == {"my_kernels.py", "tune.py", "serve.py"}
    assert (tmp_path / "cache" / "cpu" / "my_kernels.matmul.json").is_file()
    assert "source='cache'" in r.stdout and "optuna imported: False" in r.stdout, r.stdout
    assert "my_kernels.matmul" in r.stdout.split("optuna imported: False")[-1]  # show's table.


def _cli_lines() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for b in _blocks(page):
            if b.lang != "bash":
                continue
            for line in _commands(b):
                if "pallas-tune " in line:
                    out.append((_rel(page), line[line.index("pallas-tune "):]))
    return out


@pytest.mark.parametrize("page,line", _cli_lines())
def test_cli_lines_parse(page, line):
    """Each command line shown parses with the CLI's own parser (placeholders such as
    `...` or `[--flag]` are dropped first); running them is the other tests' work."""
    from pallas_tune.cli import build_parser

    words = []
    for w in shlex.split(line)[1:]:
        if w == "...":  # A placeholder: a value after a flag, else nothing.
            if words and words[-1].startswith("--"):
                words.append("PLACEHOLDER")
            continue
        if not (w.startswith("[") or w.endswith("]")):
            words.append(w)
    try:
        build_parser().parse_args(words)
    except SystemExit as e:
        pytest.fail(f"{page}: command does not parse ({e.code}): pallas-tune {' '.join(words)}")


NAME = re.compile(r"\b(pt|pallas_tune)((?:\.[A-Za-z_]\w*)+)")


def _resolve(dotted: str) -> object:
    """`pallas_tune.a.b.c` as Python finds it: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def _public_names() -> list[str]:
    names = set()
    for page in PAGES:
        for m in NAME.finditer(page.read_text()):
            names.add("pallas_tune" + m[2])
    return sorted(names)


@pytest.mark.parametrize("name", _public_names())
def test_names_used_exist(name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"the docs use {name}, which does not exist: {e}")


def test_api_reference_documents_every_public_name():
    import pallas_tune

    api = (DOCS / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^::: pallas_tune\.(\w+)$", api, re.MULTILINE))
    assert set(pallas_tune.__all__) <= documented, set(pallas_tune.__all__) - documented


REPO_PATH = re.compile(r"`((?:benchmarks|examples|search_spaces|caches|kernels|tests|docs)/[^`\s]*)`")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_repository_paths_exist(page):
    """Files and folders of the repository that a page names in `code` still exist."""
    missing = sorted({p for p in REPO_PATH.findall(page.read_text())
                      if not (REPO / p.rstrip(".,")).exists()})
    assert not missing, f"{_rel(page)} names paths that do not exist: {missing}"


ISSUE = re.compile(r"\bissues? #?\d+|\(#\d+\)|\bPR #?\d+", re.IGNORECASE)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_internal_issue_numbers(page):
    hits = [m[0] for m in ISSUE.finditer(page.read_text())]
    assert not hits, f"{_rel(page)} names internal issues: {hits}"


def test_readme_commands_are_what_ci_runs():
    """The README's first two commands: install with CI's extras and run CI's test command."""
    readme = _blocks(README)[0]
    assert readme.lang == "bash"
    install, test = _commands(readme)[:2]
    ci = (REPO / ".ci" / "run").read_text()
    ci_extras = re.findall(r"pip install .*-e '\.\[([\w,]+)\]'", ci)
    readme_extras = re.findall(r"pip install .*-e '\.\[([\w,]+)\]'", install)
    assert ci_extras and readme_extras == ci_extras, (readme_extras, ci_extras)
    assert "examples/tune_matmul.py" in install
    ci_pytest = [line.strip() for line in ci.splitlines()
                 if line.strip().startswith(".venv/bin/python -m pytest")]
    assert ci_pytest == [test], (ci_pytest, test)


def test_site_builds_without_warnings(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None or (
                "." in module and importlib.util.find_spec(module) is None):
            pytest.skip(f"{module} is not installed: `pip install -e '.[docs]'` builds the site")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                        "-f", str(REPO / "mkdocs.yml"), "-d", str(tmp_path / "site")],
                       cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
                       check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()
    assert "WARNING" not in r.stderr, r.stderr[-5000:]
