"""The allocator benchmark: extend, decode and free against a bare per-lane
deque, the cost of writing ``out_cache_loc`` itself, and cp 1."""

from __future__ import annotations

import gc

import numpy as np
import torch

from ...contract.allocator import OwnerLaneAllocator
from .baseline import DequeBaseline, slots_of_pages
from .timing import median_seconds

#: The most each row may cost, as a multiple of the bare deque's time (``cp/deque``).
GOALS = {"extend bs=1 ": 0.6, "extend": 0.4, "decode": 0.5, "free": 1.0}
#: The most an extend may cost, as a multiple of writing its ``out_cache_loc`` (``cp/arange``).
ARANGE_GOAL = 2.0


def _lengths(bs: int, tokens: int, ragged: bool) -> torch.Tensor:
    if ragged:  # lengths spread over [per/2, 3per/2), summing to ``tokens``
        g = torch.Generator().manual_seed(1)
        w = torch.rand(bs, generator=g) + 0.5
        seq = (w / w.sum() * tokens).to(torch.int64).clamp_(min=1)
        seq[0] += tokens - int(seq.sum())
        return seq
    per = tokens // bs
    seq = torch.full((bs,), per, dtype=torch.int64)
    seq[: tokens - per * bs] += 1
    return seq


def _extend_case(alloc: OwnerLaneAllocator, seq: torch.Tensor):
    bs = seq.numel()
    prefix = torch.zeros(bs, dtype=torch.int64)
    last = torch.full((bs,), -1, dtype=torch.int64)

    def run():
        return alloc.allocate_extend(prefix, seq, last).out_cache_loc

    return run, alloc.clear


def _decode_prompts(bs: int, page: int) -> torch.Tensor:
    """Prompt lengths: half end on a page boundary (their decode takes a page), half do not."""
    g = torch.Generator().manual_seed(0)
    pages = torch.randint(1, 8, (bs,), generator=g)
    off = torch.randint(1, page, (bs,), generator=g)
    return torch.where(torch.arange(bs) % 2 == 0, pages * page, pages * page - off)


def _decode_case(alloc: OwnerLaneAllocator, prompt: torch.Tensor):
    bs = prompt.numel()
    state = {}

    def setup():
        alloc.clear()
        a = alloc.allocate_extend(torch.zeros(bs, dtype=torch.int64), prompt, torch.full((bs,), -1))
        state["last"] = a.out_cache_loc[a.extend_start_loc + a.extend_lens - 1]

    seq = prompt + 1

    def run():
        return alloc.allocate_decode(seq, state["last"]).out_cache_loc

    return run, setup


def _free_case(alloc: OwnerLaneAllocator, tokens: int, by_pages: bool):
    state = {}

    def setup():
        alloc.clear()
        slots = alloc.allocate_extend([0], [tokens], [-1]).out_cache_loc
        state["x"] = slots[:: alloc.page_size] // alloc.page_size if by_pages else slots

    def run():
        (alloc.free_pages if by_pages else alloc.free)(state["x"])

    return run, setup


def bench_alloc(page: int = 64, cp: int = 8, pool_pages: int = 32768, tokens: int = 262144,
                batch_sizes=(1, 32, 256), decode_bs: int = 1024, repeats: int = 21) -> list[dict]:
    """``OwnerLaneAllocator`` at ``cp`` on a pool of ``pool_pages`` pages against,
    in the same interleaved rounds: a bare per-lane free list in plain Python
    with the same lane rule and the same ``out_cache_loc``
    (:class:`~cpkv.tools.bench.baseline.DequeBaseline`: one pop per page),
    writing that ``out_cache_loc`` from the same pages with ``torch.arange``
    (:func:`~cpkv.tools.bench.baseline.slots_of_pages`, extend rows) and the
    same allocator at cp 1. Rows: extend of ``tokens`` fresh tokens at each
    batch size and a ragged batch, decode at ``decode_bs`` (half the requests
    take a new page), and a free of ``tokens`` slots by slots and by pages
    (the pages as a tensor; the deque takes a list). Each row names its goal,
    the most ``cp/deque`` may be (:data:`GOALS`; extend also
    ``cp/arange <= 2``), and whether the row meets it (``met``,
    :func:`goals_met`), so no reader compares figures by hand.

    Conditions, the same for every case: torch runs one thread (on a shared
    machine a second intra-op thread that is not scheduled stalls a 2 MB op for
    milliseconds); the garbage collector is off while timing, as ``timeit``
    does; and one 8 MB buffer is taken and given back first, so the C
    allocator serves 2 MB results from its heap as a long-running engine's
    does, instead of mapping fresh pages for the first rows only."""
    threads, collecting = torch.get_num_threads(), gc.isenabled()
    torch.set_num_threads(1)
    np.ones(8 << 20, dtype=np.uint8).sum()  # taken, touched, given back
    gc.collect()
    gc.disable()
    try:
        return _bench_alloc(page, cp, pool_pages, tokens, batch_sizes, decode_bs, repeats)
    finally:
        torch.set_num_threads(threads)
        if collecting:
            gc.enable()


def goals_met(per_deque: float, per_arange: float | str, goal: float) -> str:
    """A row's verdict, as the table prints it: ``yes`` when ``cp/deque`` is at
    most ``goal`` and (extend rows, where ``per_arange`` is a number)
    ``cp/arange`` at most :data:`ARANGE_GOAL`; otherwise ``no``, naming the
    ratio that missed (``no (deque)``, ``no (arange)``, ``no (both)``)."""
    missed = [what for what, bad in (("deque", per_deque > goal),
                                     ("arange", per_arange != "-" and per_arange > ARANGE_GOAL)) if bad]
    return "yes" if not missed else f"no ({missed[0] if len(missed) == 1 else 'both'})"


def _goal(name: str) -> float:
    return next(v for k, v in GOALS.items() if name.startswith(k))


def _bench_alloc(page, cp, pool_pages, tokens, batch_sizes, decode_bs, repeats) -> list[dict]:
    size, S, N = pool_pages * page, page, cp
    rows = []

    def allocs():
        return OwnerLaneAllocator(size, S, N), DequeBaseline(pool_pages, S, N), OwnerLaneAllocator(size, S, 1)

    def row(name, cases):
        t = median_seconds(cases, repeats)
        r = {"case": name, f"cp{N} ms": t["cp"] * 1e3, "deque ms": t["deque"] * 1e3,
             "arange ms": t["arange"] * 1e3 if "arange" in t else "-", "cp1 ms": t["cp1"] * 1e3,
             f"cp{N}/deque": t["cp"] / t["deque"], "goal": f"<= {_goal(name)}",
             f"cp{N}/arange": t["cp"] / t["arange"] if "arange" in t else "-", f"cp{N}/cp1": t["cp"] / t["cp1"]}
        r["met"] = goals_met(r[f"cp{N}/deque"], r[f"cp{N}/arange"], _goal(name))
        rows.append(r)

    shapes = [(f"extend bs={bs}", bs, False) for bs in batch_sizes]
    shapes.append((f"extend bs={batch_sizes[-1]} ragged", batch_sizes[-1], True))
    for name, bs, ragged in shapes:
        seq = _lengths(bs, tokens, ragged)
        ours, deq, one = allocs()
        lens = seq.tolist()
        run, setup = _extend_case(ours, seq)
        setup()
        out = run()
        assert torch.equal(out, deq.alloc_extend(lens)), "the deque baseline disagrees"
        setup()
        a = ours.allocate_extend([0] * bs, seq, [-1] * bs)  # the plan of the same batch, from a cleared allocator
        setup()
        pages, used = a.to_host("new_pages").copy(), None
        if any(n % S for n in lens):  # slots each page holds: S, the last page of each request its tail
            n_pages = -(-seq.numpy() // S)
            used = np.full(pages.size, S, dtype=np.int64)
            used[a.to_host("new_page_start") + n_pages - 1] = seq.numpy() - (n_pages - 1) * S
        assert torch.equal(slots_of_pages(pages, used, S), out), "the arange floor disagrees"
        row(f"{name} ({tokens // page} pages)", {
            "cp": (run, setup),
            "deque": (lambda d=deq, l=lens: d.alloc_extend(l), deq.clear),
            "arange": (lambda p=pages, u=used: slots_of_pages(p, u, S), None),
            "cp1": _extend_case(one, seq),
        })

    prompt = _decode_prompts(decode_bs, page)
    ours, deq, one = allocs()
    run, setup = _decode_case(ours, prompt)
    held = {}

    def deque_setup(d=deq):
        d.clear()
        slots = d.alloc_extend(prompt.tolist())
        held["last"] = slots[torch.cumsum(prompt, 0) - 1].tolist()

    setup(), deque_setup()
    assert torch.equal(run(), deq.alloc_decode(held["last"])), "the deque baseline disagrees on decode"
    row(f"decode bs={decode_bs} (half take a page)", {
        "cp": (run, setup),
        "deque": (lambda d=deq: d.alloc_decode(held["last"]), deque_setup),
        "cp1": _decode_case(one, prompt),
    })

    for by_pages in (False, True):
        ours, deq, one = allocs()

        def deque_free_setup(d=deq, by_pages=by_pages):
            d.clear()
            slots = d.alloc_extend([tokens])
            held["free"] = (slots[::page] // page).tolist() if by_pages else slots

        what = f"free_pages of {tokens // page} pages" if by_pages else \
            f"free of {tokens // page} pages by slots ({tokens} slots)"
        row(what, {
            "cp": _free_case(ours, tokens, by_pages),
            "deque": (lambda d=deq, f=deq.free_pages if by_pages else deq.free: f(held["free"]), deque_free_setup),
            "cp1": _free_case(one, tokens, by_pages),
        })
    return rows
