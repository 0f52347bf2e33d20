"""The engine under torchrun through the command a user types: ``python -m torch.distributed.run ... -m
support.torchrun_engine KIND OUT M [N]`` (``PYTHONPATH=src:tests``) runs ``cpkv run ... --check --json`` in every rank.
``KIND`` is ``engine`` (a CP group of M ranks; ``engine-cuda`` on the GPU) or ``disagg`` (M prefill ranks, N decode
ranks); the one rank that
prints the report writes it, with its world rank and how many ranks printed, to ``OUT/report.json``."""

import contextlib
import io
import json
import os
import sys

from cpkv.tools.cli import main as cpkv_main


def main(argv):
    kind, out, *sizes = argv
    common = ["--requests", "2", "--check", "--timeout", "200", "--json", "--no-progress"]
    if kind in ("engine", "engine-cuda"):
        args = ["run", "--cp", sizes[0], "--device-pages", "8", "--host-pages", "96", *common]
        args += ["--device", "cuda"] if kind == "engine-cuda" else []
    else:
        args = ["run", "--disagg", f"{sizes[0]}:{sizes[1]}", *common]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = cpkv_main(args)
    if code:
        raise SystemExit(code)
    if buf.getvalue().strip():  # the rank that holds the report; every other rank prints nothing
        report = json.loads(buf.getvalue())
        with open(os.path.join(out, f"report.{os.environ['RANK']}.json"), "w") as f:
            json.dump({**report, "rank": int(os.environ["RANK"])}, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
