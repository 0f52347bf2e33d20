"""Dynamo's standalone KV indexer (``ai-dynamo-runtime``, ``python -m dynamo.indexer``) as a test
starts, asks and stops it: on 127.0.0.1, a free port, its log in a file, the process ended and waited for.

Its HTTP surface (Dynamo 1.6.1): ``POST /register {instance_id, endpoint, replay_endpoint, model_name,
block_size}`` connects a SUB to the worker's PUB and a DEALER to its replay ROUTER (it replays from the
first seq it missed when a live batch shows a gap, seq 0 included); ``POST /query {token_ids,
model_name}`` re-hashes the tokens per block and answers, per worker, the tokens of the longest prefix
of full blocks on the device (``gpu``) and on the device or the host (``cpu``)."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.util import find_spec

from support.ports import free_port

WHY_NOT = None if find_spec("dynamo") is not None and find_spec("dynamo.indexer") is not None else (
    "Dynamo's KV indexer is not installed: pip install ai-dynamo-runtime==1.6.1 (an x86_64 wheel; "
    "make test installs it with the test extra)")


class Indexer:
    """One ``python -m dynamo.indexer`` on a free loopback port; a context manager."""

    def __init__(self, log_path, start_timeout_s: float = 20.0):
        self.port = free_port()
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(self.port),
                                      "--threads", "1"], stdout=self._log, stderr=subprocess.STDOUT)
        end = time.monotonic() + start_timeout_s
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.close()
                    raise RuntimeError(f"the indexer did not start: {self.log()[-2000:]}")
                time.sleep(0.05)

    def post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            raise AssertionError(f"{path} {body}: HTTP {e.code} {e.read()[:500]!r}") from None

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str, block_size: int,
                 model: str = "m") -> None:
        self.post("/register", {"instance_id": instance_id, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
                                "model_name": model, "block_size": block_size})

    def matched(self, tokens, model: str = "m") -> dict[int, tuple[int, int]]:
        """Per worker: (tokens matched on the device, on the device or the host)."""
        got = self.post("/query", {"token_ids": [int(t) for t in tokens], "model_name": model})
        return {int(w): (v["gpu"], v["cpu"]) for w, v in got.get("instances", {}).items()}

    def log(self) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
