"""The figures of README.md and docs/ are what their commands print (``make docs-figures``, ``tools/docs_figures.py``).

Each deterministic figure (counts, hit rates, lane gaps, bytes) is re-run here and compared, whole; each timed
one must say when and where it was measured, and its command, run at a small size (one timed round), prints the
counts it shows (every number but the times: ``docs_figures.counts``). The rewriting itself is checked on a
made-up page."""

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cpkv.tools.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("docs_figures", ROOT / "tools" / "docs_figures.py")
docs_figures = sys.modules["docs_figures"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_figures)

FIGURES = [f for p in docs_figures.doc_files() for f in docs_figures.figures(p)]
DETERMINISTIC = [f for f in FIGURES if not f.timed]
_ID = lambda f: f"{f.path.name}: {f.command}"  # noqa: E731


def test_the_docs_have_figures_of_both_kinds():
    assert DETERMINISTIC and any(f.timed for f in FIGURES), "has the marker syntax changed?"


@pytest.mark.parametrize("fig", FIGURES, ids=[_ID(f) for f in FIGURES])
def test_each_figure_names_a_command_cpkv_accepts_and_shows_its_output(fig, capsys):
    argv = shlex.split(fig.command)
    assert argv[0] == "cpkv"
    build_parser().parse_args(argv[1:])  # argparse exits 2 on a flag it does not know
    assert fig.printed.strip(), f"{_ID(fig)}: an empty figure (run make docs-figures)"


@pytest.mark.parametrize("fig", FIGURES, ids=[_ID(f) for f in FIGURES])
def test_a_timed_figure_says_when_and_where_and_a_deterministic_one_does_not(fig):
    stamp = re.match(r"Measured (\d{4}-\d{2}-\d{2}) on \S", fig.body)
    if fig.timed:
        assert stamp, f"{_ID(fig)}: a timing without 'Measured YYYY-MM-DD on MACHINE' above it"
    else:
        assert stamp is None and fig.body.startswith("```text\n"), _ID(fig)


@pytest.mark.parametrize("fig", DETERMINISTIC, ids=[_ID(f) for f in DETERMINISTIC])
def test_each_deterministic_figure_is_what_its_command_prints_now(fig):
    printed = docs_figures.run(fig.command, timeout=600)
    assert printed == fig.printed, (f"{_ID(fig)} differs from what the command prints now; run "
                                    f"`make docs-figures FIGURES=deterministic`:\n{printed}")


TIMED = [f for f in FIGURES if f.timed]
#: Timed figures whose small command takes seconds (one round of a benchmark); the others (a CP group's runs, the
#: Mooncake replay, the scheduler's 3 GB matrix, the split benchmark's groups, the engine's) run with the slow tests.
QUICK = ("cpkv bench alloc", "cpkv bench kv", "cpkv bench plan")


@pytest.mark.parametrize("fig", [pytest.param(f, id=_ID(f), marks=() if f.command in QUICK else pytest.mark.slow)
                                 for f in TIMED])
def test_each_timed_figure_shows_the_counts_its_command_prints_now(fig):
    small = docs_figures.small_command(fig.command)
    printed = docs_figures.run(small, timeout=1800)
    assert docs_figures.counts(printed) == docs_figures.counts(fig.printed), (
        f"{_ID(fig)}: its counts (or its table's columns) differ from what `{small}` prints now; run `python "
        f"tools/docs_figures.py --only timed --match {fig.command.split(' ', 1)[1]!r}`:\n{printed}")


def test_counts_keep_every_count_and_no_time():
    text = ("plan: 4 layers; median of 7 interleaved rounds; load average 2.05 / 2.34\n"
            "  phase  layers  syncs per layer  step ms  vs before\n"
            "prefill       4           12.750   1047.0      1.000\n"
            "requests                  24 of 24 finished in 134 steps\n"
            "generated tokens per second   48.2 (5.56 s)\n"
            "24/24 requests, 21 transfers, transfer time 326.7 ms\n")
    assert docs_figures.counts(text) == [
        "plan: 4 layers; <time> interleaved rounds; <time>", "columns: phase | layers | syncs per layer | step ms | "
        "vs before", "phase=prefill", "layers=4", "syncs per layer=12.750", "requests=24 of 24 finished in 134 steps",
        "generated tokens per second", "24/24 requests, 21 transfers, transfer time <time>"]
    slower = text.replace("1047.0", "9.5").replace("48.2 (5.56 s)", "3.1 (0.2 s)").replace("326.7 ms", "2 ms")
    assert docs_figures.counts(slower) == docs_figures.counts(text)  # times move, counts stay
    for changed in (text.replace("12.750", "13.500"), text.replace("  vs before", "  vs before  GB/s").replace(
            "1.000\n", "1.000  3.0\n")):
        assert docs_figures.counts(changed) != docs_figures.counts(text)  # a count, a column
    assert docs_figures.small_command("cpkv bench kv") == "cpkv bench kv --repeats 1"
    assert docs_figures.small_command("cpkv run --check") == "cpkv run --check"


# -- the rewriting, on a made-up page -------------------------------------------------------------
PAGE = """Prose with a number: 7.
<!-- figure: cpkv bytes --model glm-5 --cp 2 -->
```text
stale
```
<!-- /figure -->
<!-- figure timed: cpkv bench alloc -->
Measured 2000-01-01 on an old machine
```text
0.5 ms
```
<!-- /figure -->
"""


def _fake_run(outputs):
    def run(command, timeout=1800):
        outputs.append(command)
        return f"printed by {command}\n"
    return run


def test_rewrite_puts_each_commands_output_between_its_markers_and_stamps_the_timed(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    ran = []
    monkeypatch.setattr(docs_figures, "run", _fake_run(ran))
    monkeypatch.setattr(docs_figures, "machine", lambda: "MACHINE")
    differ = docs_figures.rewrite(page, only=None, match=None, check=False)
    assert ran == differ == ["cpkv bytes --model glm-5 --cp 2", "cpkv bench alloc"]
    text = page.read_text()
    assert text.startswith("Prose with a number: 7.\n") and "stale" not in text and "0.5 ms" not in text
    figs = docs_figures.figures(page)
    assert [f.printed for f in figs] == [f"printed by {c}\n" for c in ran]
    assert re.match(r"Measured \d{4}-\d{2}-\d{2} on MACHINE\n```text\n", figs[1].body)
    assert docs_figures.rewrite(page, only=None, match=None, check=True) == [], "a second run changes nothing"


def test_check_rewrites_nothing_and_only_chooses_one_kind(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    ran = []
    monkeypatch.setattr(docs_figures, "run", _fake_run(ran))
    assert docs_figures.rewrite(page, only="deterministic", match=None, check=True) == [
        "cpkv bytes --model glm-5 --cp 2"]
    assert page.read_text() == PAGE and ran == ["cpkv bytes --model glm-5 --cp 2"]
    docs_figures.rewrite(page, only="timed", match=None, check=False)
    assert "stale" in page.read_text() and "0.5 ms" not in page.read_text()
    assert docs_figures.main(["--check", str(page)]) == 1  # --check compares the deterministic kind


def test_a_figure_of_another_program_or_without_a_text_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="runs cpkv"):
        docs_figures.argv_of("rm -rf /")
    page = tmp_path / "page.md"
    page.write_text("<!-- figure: cpkv bytes -->\nno block\n<!-- /figure -->\n")
    with pytest.raises(ValueError, match="no ```text block"):
        docs_figures.figures(page)[0].printed


# -- the pages themselves -------------------------------------------------------------------------
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("page", docs_figures.doc_files(), ids=lambda p: p.name)
def test_every_relative_link_of_the_docs_names_a_file_that_exists(page):
    missing = [t for t, _ in LINK.findall(page.read_text())
               if "://" not in t and not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to {missing}"


def test_the_readme_links_every_page_of_docs():
    linked = {Path(t).name for t, _ in LINK.findall((ROOT / "README.md").read_text())}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages and pages <= linked, f"docs pages the README does not link: {sorted(pages - linked)}"


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_docs_figures_runs_the_script():
    r = subprocess.run(["make", "-n", "docs-figures", "FIGURES=deterministic"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "tools/docs_figures.py --only deterministic" in r.stdout, r.stdout + r.stderr


def test_the_script_runs_as_a_program():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "docs_figures.py"), "--help"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and "--check" in r.stdout
