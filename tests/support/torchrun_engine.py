"""The engine under torchrun: ``python -m torch.distributed.run ... -m support.torchrun_engine KIND OUT M [N]``
(``PYTHONPATH=src:tests``). ``KIND`` is ``engine`` (a CP group of M ranks) or ``disagg`` (M prefill ranks, N decode
ranks); a small trace with ``--check`` on; the rank that has the report writes it to ``OUT/report.json``."""

import json
import os
import sys

from cpkv import DisaggConfig
from cpkv.engine.engine import EngineConfig
from cpkv.engine.joined import run_disagg_joined, run_engine_joined


def main(argv):
    kind, out, *sizes = argv
    if kind == "engine":
        report = run_engine_joined(EngineConfig(cp_size=int(sizes[0]), device_pages=8, host_pages=96, requests=2,
                                                check=True, timeout=200))
    else:
        report = run_disagg_joined(DisaggConfig(prefill_size=int(sizes[0]), decode_size=int(sizes[1]), requests=2,
                                                check=True, timeout=200))
    if report is not None:
        keep = {k: v for k, v in report.items() if isinstance(v, (int, float, str, bool, dict))}
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump({**keep, "rank": int(os.environ["RANK"])}, f, default=str)


if __name__ == "__main__":
    main(sys.argv[1:])
