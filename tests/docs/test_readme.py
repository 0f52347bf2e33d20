"""Every command the README and the pages of docs/ show is real.

Reads README.md and docs/*.md (one text: "the README" below), finds each ``cpkv ...`` / ``python -m cpkv ...`` /
``.venv/bin/cpkv ...`` / ``make ...`` command in its code (fenced blocks and
inline code) and every ``--flag`` it names on its own, then checks that argparse
accepts each command as written (same subcommand, same flags, no abbreviation),
that each flag exists, that each make target exists and its recipe's ``cpkv``
calls parse too, and runs the cheap commands for real (``--help``, a simulate of
one workload). Nothing here lists today's commands: whatever the README shows
is what is checked."""

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.tools.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
TEXT = "\n".join(p.read_text() for p in PAGES)
SHELL_LANGS = {"", "bash", "sh", "shell", "console", "zsh"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")


def _cpkv_argv(tokens: list[str]) -> list[str] | None:
    """The cpkv arguments of a command, or None when it does not run cpkv."""
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):  # FOO=1 cpkv ...
        tokens = tokens[1:]
    if not tokens:
        return None
    head = tokens[0]
    if head == "cpkv" or head.endswith("/cpkv"):
        return tokens[1:]
    if re.fullmatch(r"(.*/)?python(3(\.\d+)?)?", head) and tokens[1:3] == ["-m", "cpkv"]:
        return tokens[3:]
    return None


def _split_commands(line: str) -> list[list[str]]:
    """Shell words of each command of a line (split at ``&&``, ``||``, ``;``, ``|``)."""
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        words = list(lex)
    except ValueError:
        return []
    out, cur = [], []
    for w in words:
        if w in ("&&", "||", ";", "|", "&"):
            out.append(cur)
            cur = []
        else:
            cur.append(w)
    return [c for c in out + [cur] if c]


def readme_commands(text: str):
    """``(kind, words, source)`` for every command the README shows, ``kind``
    being ``cpkv`` (words: its arguments), ``make`` (words: make's arguments) or
    ``flag`` (words: a flag named on its own in inline code)."""
    found = []

    def take(line, source, inline=False):
        for words in _split_commands(line):
            argv = _cpkv_argv(words)
            if inline and len(words) == 1:  # `cpkv` or `make` alone in prose names the tool
                continue
            if argv is not None:
                found.append(("cpkv", argv, source))
            elif words[0] == "make":
                found.append(("make", words[1:], source))

    for lang, body in FENCE.findall(text):
        for raw in body.splitlines():
            line = raw.strip()
            if line.startswith("$ "):
                take(line[2:], raw)
            elif lang.lower() in SHELL_LANGS and line:
                take(line, raw)
    for span in INLINE.findall(FENCE.sub("", text)):
        span = span.strip()
        if span.startswith("--"):
            found.append(("flag", span.split()[:1], f"`{span}`"))
        else:
            take(span, f"`{span}`", inline=True)
    return found


COMMANDS = readme_commands(TEXT)
CPKV_SHOWN = list({tuple(a): (a, s) for k, a, s in reversed(COMMANDS) if k == "cpkv"}.values())[::-1]


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _all_flags() -> set[str]:
    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for p in _subparsers(parser).values():
        flags |= {s for a in p._actions for s in a.option_strings}
    return flags


def _parses(argv, source):
    """argparse accepts ``argv`` (``--help`` counts: it exits 0)."""
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 0, f"README shows {source!r}: cpkv {' '.join(argv)} is refused by argparse"


def _cheap(argv) -> bool:
    """``--help``, or a simulate of one built-in workload (a Mooncake replay runs for minutes)."""
    if "-h" in argv or "--help" in argv:
        return True
    if argv[:1] == ["simulate"] and "--plot" not in argv:
        from cpkv.tools.simulate import SIM_WORKLOADS

        w = argv[argv.index("--workload") + 1] if "--workload" in argv[:-1] else "all"
        return w in SIM_WORKLOADS
    return False


def _skip_without_shared_data(argv) -> None:
    """Skip, with the reason, a command that reads ``../shared/data`` where this checkout has none beside it."""
    missing = [a for a in argv if "shared/data/" in a and not (ROOT / a.split(":", 1)[-1]).exists()]
    if missing:
        pytest.skip(f"the README's command reads {missing[0]}, absent beside this checkout")


def test_the_readme_shows_commands():
    kinds = {k for k, _, _ in COMMANDS}
    assert "cpkv" in kinds, "no cpkv command found in README.md: has the extractor gone wrong?"


@pytest.mark.parametrize("argv,source", CPKV_SHOWN, ids=[" ".join(a) or "cpkv" for a, _ in CPKV_SHOWN])
def test_each_cpkv_command_parses(argv, source, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    _skip_without_shared_data(argv)
    _parses(argv, source)


def test_each_flag_named_alone_exists():
    flags = _all_flags()
    missing = [(w[0], s) for k, w, s in COMMANDS if k == "flag" and w[0].split("=")[0] not in flags]
    assert not missing, f"README names flags no subcommand has: {missing}"


def test_each_make_target_exists_and_its_cpkv_calls_parse(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    makefile = (ROOT / "Makefile").read_text()
    defined = set(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", makefile, re.M))
    targets = sorted({t for k, w, _ in COMMANDS if k == "make" for t in w if not t.startswith("-") and "=" not in t})
    missing = [t for t in targets if t not in defined]
    assert not missing, f"README shows make targets the Makefile lacks: {missing}"
    if not targets or shutil.which("make") is None:
        return
    for t in targets:
        r = subprocess.run(["make", "-n", t], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"make -n {t}: {r.stderr}"
        for line in r.stdout.splitlines():
            for words in _split_commands(line):
                argv = _cpkv_argv(words)
                if argv is not None:
                    _parses(argv, f"make {t}: {line}")


def test_each_subcommand_shown_has_help(monkeypatch, capsys):
    subs = {a[0] for k, a, _ in COMMANDS if k == "cpkv" and a and not a[0].startswith("-")}
    assert subs <= set(_subparsers(build_parser())), subs
    for sub in sorted(subs):
        with pytest.raises(SystemExit) as e:
            main([sub, "--help"])
        assert e.value.code == 0 and f"usage: cpkv {sub}" in capsys.readouterr().out


CHEAP = sorted({tuple(a) for k, a, _ in COMMANDS if k == "cpkv" and _cheap(a)})


@pytest.mark.parametrize("argv", CHEAP, ids=[" ".join(a) or "cpkv" for a in CHEAP])
def test_the_cheap_commands_run_for_real(argv, tmp_path):
    r = subprocess.run([sys.executable, "-m", "cpkv", *argv], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"cpkv {' '.join(argv)} exited {r.returncode}: {r.stderr[-2000:]}"
    assert r.stdout.strip()


def test_the_extractor_finds_what_a_readme_shows():
    """The extractor on a made-up README: prompts, shell blocks, chains, env
    prefixes, inline commands and flags; prose, output and Python are not commands."""
    text = "\n".join([
        "Run `cpkv run --cp 2` or `python -m cpkv simulate --json`; `--admission none` is a flag; `cpkv` a name.",
        "```bash", "make demo   # the main job", "CPKV=1 .venv/bin/cpkv bench all && make test", "```",
        "```", "$ cpkv --help", "CP group of 4 ranks", "```",
        "```python", "cpkv = 3", "```",
        "Plain prose about cpkv run is not code.",
    ])
    got = [(k, w) for k, w, _ in readme_commands(text)]
    assert got == [("make", ["demo"]), ("cpkv", ["bench", "all"]), ("make", ["test"]), ("cpkv", ["--help"]),
                   ("cpkv", ["run", "--cp", "2"]), ("cpkv", ["simulate", "--json"]), ("flag", ["--admission"])]


# -- the Python the README shows ------------------------------------------------------------------
PYTHON_BLOCKS = [body for lang, body in FENCE.findall(TEXT) if lang in ("python", "py")]


def test_the_readme_shows_python():
    assert len(PYTHON_BLOCKS) >= 3  # the allocator, the prefix cache, disaggregation


@pytest.mark.parametrize("i", range(len(PYTHON_BLOCKS)), ids=[f"block{i}" for i in range(len(PYTHON_BLOCKS))])
def test_each_python_block_runs_as_written(i, tmp_path):
    """Each ```python block of the README, as written, as a script of its own in a
    fresh interpreter (so a ``__main__`` guard and spawned ranks behave as a
    reader's would), on the CPU with one torch thread."""
    import os

    script = tmp_path / f"readme_block{i}.py"
    script.write_text(PYTHON_BLOCKS[i])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, f"README python block {i} failed:\n{PYTHON_BLOCKS[i]}\n--- stderr ---\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), "each block prints what it shows"
