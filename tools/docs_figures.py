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
  were measured on, and no test compares them.

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
