"""The ``cpkv`` command's flag checkers and shared flags.

* value checkers (:func:`int_at_least`, :func:`finite_float`, :func:`comma_choices`,
  :func:`output_file`, :func:`workload_arg`, :func:`disagg_arg`) are ``type=``
  callables: a bad value is refused while parsing, by argparse itself, naming the flag;
* :func:`add_group_flags` adds the flags of anything that starts a CP group
  (``--cp``/``--ranks``, ``--timeout``), and :func:`refuse_unless_fits` refuses,
  with the reason, groups this machine cannot hold
  (:func:`cpkv.runtime.sizing.check_capacity`).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path


def int_at_least(lo: int):
    """A ``type=`` for integers ``>= lo``."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def finite_float(lo: float, *, inclusive: bool = True):
    """A ``type=`` for finite floats ``>= lo`` (``> lo`` unless ``inclusive``)."""
    rel = ">=" if inclusive else ">"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number {rel} {lo:g}, got {text!r}") from None
        if not math.isfinite(v) or v < lo or (v == lo and not inclusive):
            raise argparse.ArgumentTypeError(f"must be a finite number {rel} {lo:g}, got {text}")
        return v

    parse.__name__ = f"number {rel} {lo:g}"
    return parse


def comma_choices(choices):
    """A ``type=`` for a comma list of distinct values out of ``choices``."""
    choices = tuple(choices)

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",")]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))}; a comma list of "
                                             f"{', '.join(choices)}")
        if len(set(items)) != len(items):
            raise argparse.ArgumentTypeError(f"{text!r} names a value twice")
        return items

    parse.__name__ = "comma list"
    return parse


def positive_list(text: str) -> list[int]:
    """A ``type=`` for a comma list of integers ``>= 1`` (``64,256``)."""
    parse = int_at_least(1)
    items = [t.strip() for t in text.split(",")]
    try:
        return [parse(t) for t in items]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"a comma list of integers >= 1: {e}") from None


positive_list.__name__ = "comma list of integers >= 1"


def output_file(*suffixes: str):
    """A ``type=`` for a file to write: its folder must exist, its suffix be one of ``suffixes``."""

    def parse(text: str) -> str:
        p = Path(text)
        if p.suffix.lower() not in suffixes:
            raise argparse.ArgumentTypeError(f"{text!r}: the file must end in {' or '.join(suffixes)}")
        if not p.parent.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: folder {str(p.parent)!r} does not exist")
        if p.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a folder")
        return text

    parse.__name__ = "output file"
    return parse


positive = int_at_least(1)
non_negative = int_at_least(0)


def add_group_flags(p: argparse.ArgumentParser, *, cp: int = 4, timeout: float = 300.0) -> None:
    """Flags of a subcommand that starts a CP group: ``--cp``/``--ranks`` and ``--timeout``."""
    p.add_argument("--cp", "--ranks", dest="cp", type=positive, default=cp, metavar="N",
                   help=f"ranks in the CP group, one process each (default {cp})")
    p.add_argument("--timeout", type=finite_float(0, inclusive=False), default=timeout, metavar="SECONDS",
                   help=f"seconds before the group is stopped (default {timeout:g})")


def refuse_unless_fits(parser: argparse.ArgumentParser, *footprints, timeout: float, capacity=None) -> None:
    """``parser.error`` (exit 2) with the reason when the groups described by
    ``footprints`` (:class:`~cpkv.runtime.sizing.GroupFootprint`) cannot run
    together on this machine within ``timeout``."""
    from ..runtime.sizing import GroupTooLarge, check_capacity

    try:
        check_capacity(*footprints, timeout=timeout, capacity=capacity)
    except GroupTooLarge as e:
        parser.error(f"refused before starting: {e}")


def workload_arg(text: str) -> str:
    """A ``type=`` for ``--workload``: a built-in trace name or an existing JSONL file."""
    from ..engine.trace import WORKLOADS

    if text in WORKLOADS or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a built-in workload ({', '.join(WORKLOADS)}) "
                                     "nor a file")


def disagg_arg(text: str) -> tuple[int, int]:
    """A ``type=`` for ``--disagg``: ``M:N`` prefill and decode ranks, both >= 1."""
    from ..engine.config import parse_disagg

    try:
        return parse_disagg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
