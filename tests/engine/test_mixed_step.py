"""A step with decodes and a prefill chunk is one forward, planned so by the
scheduler: the decode tokens ride in the prefill pass as one-token extends
(SGLang's mixed chunk), exact against transformers; ``Allocation.concat`` is the allocation one call would
have made. [[RFC-0001:C-FLATTENED-ORDER]] [[RFC-0001:C-NO-PLANNER-COLLECTIVE]]"""

import numpy as np
import torch

from cpkv import OwnerLaneAllocator
from cpkv.contract.allocation import Allocation
from cpkv.engine import EngineConfig, run_engine_threads
from cpkv.engine import engine as engine_mod


def test_a_mixed_step_is_one_forward_and_exact(llama, monkeypatch):
    """The scheduler plans a step's decodes and prefill chunks as one forward
    (the decodes first, as one-token extends); the executor runs it as it is.
    Exact against transformers."""
    calls = {}  # per executor (one per rank thread): forwards run
    real, real_run, seen = engine_mod.RankExecutor._forward, engine_mod.RankExecutor.run, []

    def counted(self, b):
        calls[id(self)] = calls.get(id(self), 0) + 1
        return real(self, b)

    def run(self, plan):
        before = calls.get(id(self), 0)
        out = real_run(self, plan)
        f = plan.forward
        if f is not None and f.kind == "mixed":
            d = f.decodes
            assert all(r.computed - 1 == int(p) for r, p in zip(f.requests[:d], f.alloc.prefix_lens[:d]))
            assert f.alloc.extend_lens[:d].tolist() == [1] * d and not f.decode
        seen.append((f is not None and f.kind == "mixed", calls.get(id(self), 0) - before))
        return out

    monkeypatch.setattr(engine_mod.RankExecutor, "_forward", counted)
    monkeypatch.setattr(engine_mod.RankExecutor, "run", run)
    r = run_engine_threads(EngineConfig(cp_size=2, page_size=16, device_pages=12, host_pages=0, requests=4,
                                        scale=0.08, chunk=24, check=True), llama)
    assert r["check"]["requests_matched"] == r["check"]["requests"] and r["check"]["max_abs_diff"] < 1e-4
    mixed = [n for both, n in seen if both]
    assert mixed, "the trace never mixed a decode with a prefill chunk"
    assert all(n == 1 for n in mixed), "a mixed step ran more than one forward"


def test_concat_is_the_allocation_of_one_call():
    """Two extends allocated one after the other, concatenated, hold the same
    fields as their requests back to back (offsets shifted)."""
    S, N = 4, 2
    alloc = OwnerLaneAllocator(N * 16 * S, S, N)
    a = alloc.allocate_extend([0, 0], [5, 9], torch.tensor([-1, -1]))
    b = alloc.allocate_extend([0], [6], torch.tensor([-1]))
    c = Allocation.concat(a, b)
    assert c.out_cache_loc.tolist() == a.out_cache_loc.tolist() + b.out_cache_loc.tolist()
    assert c.extend_start_loc.tolist() == a.extend_start_loc.tolist() + [a.out_cache_loc.numel()]
    assert c.new_page_start.tolist() == a.new_page_start.tolist() + [a.new_pages.numel()]
    assert c.seq_lens.tolist() == [5, 9, 6] and c.prefix_lens.tolist() == [0, 0, 0]
    assert np.array_equal(c.request_of_token.numpy(), np.repeat([0, 1, 2], [5, 9, 6]))
    assert c.positions.tolist() == list(range(5)) + list(range(9)) + list(range(6))
