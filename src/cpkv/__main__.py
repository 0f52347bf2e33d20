"""``python -m cpkv ...`` is the ``cpkv`` command.

Started by torchrun (``torchrun ... -m cpkv run``: any of :data:`TORCHRUN_ENV`
set), the process first asks Linux for SIGKILL when its parent thread ends
(``PR_SET_PDEATHSIG``; torchrun's agent starts its ranks from its main
thread), before it imports anything else: a rank whose agent dies while the
rank still imports torch, ``transformers`` or the engine ends with it instead
of living until its rendezvous gives up. Only here: importing cpkv, or this
module, changes nothing; :func:`cpkv.runtime.torchrun.join` asks the same for
the time of the run, whoever started the rank. Left open: the interpreter's
own start-up, before this module's first line.
"""

import os
import sys

#: torchrun's variables (:data:`cpkv.runtime.torchrun.TORCHRUN_ENV`, written
#: again here so that nothing is imported before the signal is asked for).
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun(environ=os.environ) -> bool:
    """Whether any of torchrun's variables is set in ``environ``."""
    return any(environ.get(k, "") != "" for k in TORCHRUN_ENV)


if __name__ == "__main__":
    if sys.platform.startswith("linux") and under_torchrun():
        import ctypes

        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL

    try:
        from .tools.cli import main
    except KeyboardInterrupt:  # Ctrl-C while the command's first modules load: one line, as from main()
        print("cpkv: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(main())
