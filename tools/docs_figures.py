"""Rewrite every figure in README.md and docs/*.md from the command that produces it (``make docs-figures``).

A figure is the text between two markers, the first naming its command::

    <!-- figure: cpkv bytes --model deepseek-v3.2 --cp 8 -->
    ```text
    (what the command prints)
    ```
    <!-- /figure -->

The script runs the command (``python -m cpkv ...`` with this interpreter, on the CPU, one torch thread) and
writes its standard output between the markers. Two kinds:

- ``figure:`` deterministic (counts, hit rates, lane gaps, bytes): the same code prints the same text on any
  machine; ``tests/docs/test_docs_figures.py`` re-runs each one and fails when the docs and the code disagree.
- ``figure timed:`` timings, which no two runs repeat: the script writes them with the date and the machine they
  were measured on; ``tests/docs/test_docs_figures.py`` runs each one's command at a small size (one timed round,
  :func:`small_command`) and compares every count it prints (:func:`counts`), not the times.

Usage: ``python tools/docs_figures.py [--only deterministic|timed] [--check] [--match TEXT] [FILE ...]``;
``--check`` rewrites nothing and exits 1 when a figure differs from what its command prints now."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIGURE = re.compile(r"^<!-- figure( timed)?: (?P<cmd>[^\n]*?) -->\n(?P<body>.*?)^<!-- /figure -->$", re.S | re.M)
STAMP = re.compile(r"^Measured (?P<when>[^\n]*)\n", re.M)


@dataclass(frozen=True)
class Figure:
    """One figure of a file: its command, whether it is a timing, and the text now between its markers."""

    path: Path
    command: str
    timed: bool
    body: str

    @property
    def printed(self) -> str:
        """What the docs show as the command's output (the fenced block's content)."""
        m = re.search(r"^```text\n(.*?)^```\n", self.body, re.S | re.M)
        if m is None:
            raise ValueError(f"{self.path.name}: the figure of {self.command!r} has no ```text block")
        return m.group(1)


def doc_files() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def figures(path: Path) -> list[Figure]:
    """The figures of one file, in order."""
    text = path.read_text()
    return [Figure(path, m.group("cmd"), bool(m.group(1)), m.group("body")) for m in FIGURE.finditer(text)]


def argv_of(command: str) -> list[str]:
    """The interpreter's argv for a figure's command: ``cpkv ARGS`` runs as ``python -m cpkv ARGS``."""
    words = shlex.split(command)
    if words[:1] != ["cpkv"]:
        raise ValueError(f"a figure's command runs cpkv: {command!r}")
    return [sys.executable, "-m", "cpkv", *words[1:]]


def run(command: str, timeout: float = 1800) -> str:
    """What the command prints on its standard output (a failure raises, with its standard error)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run(argv_of(command), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{command} exited {r.returncode}:\n{r.stderr[-3000:]}")
    return r.stdout.rstrip("\n") + "\n"


#: The name of a column, or the label of a report line, that holds a time, a ratio of times, or the rounds that
#: set them: its figures are not counts.
TIMED = re.compile(r"\bms\b|\bus\b|\bs\b|/s\b|speed|ratio|^vs\b|per second|\bcpu\b|\bmet\b|TTFT|TPOT|\btime\b|"
                   r"behind|wait|rounds|^cp\d+/")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
#: In prose (a title, a summary line): a number that is a time, the rounds, or the machine's load.
PROSE_TIME = re.compile(r"-?\d[\d,.]*\s*(?:ms|s|us|min|step/s)\b|\d+ (?:interleaved )?rounds|median of \d+|"
                        r"load average [\d./ ]+")


def counts(text: str) -> list[str]:
    """Every count a figure's text prints, in order, each with where it stands (a table's column, a report
    line's label): each table's columns and every number but the times (in a column or on a report line that
    :data:`TIMED` names, a time in prose). What a timed figure is compared on.

    A table is a line of column names (three or more, or indented: right-aligned, as
    :func:`cpkv.tools.table.format_rows` writes them; no number among them) followed by rows of as many cells,
    or one more (a row's label first); a report line is a label and a value, two or more spaces apart."""
    lines = text.splitlines()
    out, header = [], None
    for i, line in enumerate(lines):
        cells = re.split(r"\s{2,}", line.strip())
        if header is not None and len(cells) in (len(header), len(header) + 1):
            named = list(zip(header if len(cells) == len(header) else ["row", *header], cells))
            out += [f"{h}={c}" for h, c in named if not TIMED.search(h)]
            continue
        header = None
        following = next((x for x in lines[i + 1:] if x.strip()), "")
        width = len(re.split(r"\s{2,}", following.strip()))
        if ((len(cells) >= 3 or line.startswith(" ")) and len(cells) >= 2 and width in (len(cells), len(cells) + 1)
                and not any(NUMBER.fullmatch(c) for c in cells)):
            header = cells
            out.append("columns: " + " | ".join(cells))
        elif len(cells) == 2:
            out.append(cells[0] if TIMED.search(cells[0]) else f"{cells[0]}={cells[1]}")
        elif line.strip():
            out.append(PROSE_TIME.sub("<time>", line.strip()))
    return out


def small_command(command: str) -> str:
    """A timed figure's command at a small size that prints the same counts: a benchmark with one timed round."""
    words = shlex.split(command)
    if words[1:2] == ["bench"] and "--repeats" not in words and words[2:3] != ["kernels"]:
        words += ["--repeats", "1"]
    return shlex.join(words)


def machine() -> str:
    """This machine in one line: CPU count, architecture, torch build."""
    import torch

    return f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}"


def body_for(printed: str, timed: bool, when: str | None = None) -> str:
    """The text between the markers for what a command printed (a timed one stamped with its date and machine)."""
    stamp = ""
    if timed:
        stamp = f"Measured {when or f'{datetime.date.today().isoformat()} on {machine()}'}\n"
    return f"{stamp}```text\n{printed}```\n"


def rewrite(path: Path, only: str | None, match: str | None, check: bool) -> list[str]:
    """Rewrite (or with ``check``, compare) the chosen figures of one file; the commands whose figure differed."""
    text = path.read_text()
    differ: list[str] = []

    def one(m: re.Match) -> str:
        timed = bool(m.group(1))
        fig = Figure(path, m.group("cmd"), timed, m.group("body"))
        chosen = (only is None or only == ("timed" if timed else "deterministic")) and (match is None
                                                                                      or match in fig.command)
        if not chosen:
            return m.group(0)
        print(f"{path.name}: {fig.command}", file=sys.stderr, flush=True)
        printed = run(fig.command)
        if printed != fig.printed:
            differ.append(fig.command)
        return m.group(0).replace(m.group("body"), body_for(printed, timed))

    new = FIGURE.sub(one, text)
    if not check and new != text:
        path.write_text(new)
    return differ


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="*", type=Path, help="files to rewrite (default: README.md and docs/*.md)")
    p.add_argument("--only", choices=("deterministic", "timed"), help="only this kind of figure")
    p.add_argument("--match", help="only figures whose command contains this text")
    p.add_argument("--check", action="store_true", help="rewrite nothing; exit 1 where a figure differs")
    a = p.parse_args(argv)
    only = a.only or ("deterministic" if a.check else None)  # a timing never compares equal
    differ = []
    for path in [f.resolve() for f in a.files] or doc_files():
        differ += [f"{path.name}: {c}" for c in rewrite(path, only, a.match, a.check)]
    for d in differ:
        print(("differs: " if a.check else "rewritten: ") + d)
    return 1 if (a.check and differ) else 0


if __name__ == "__main__":
    sys.exit(main())
