"""The allocator benchmark: extend, decode and free against the per-block baseline, cp 1 and a floor."""

from __future__ import annotations

import gc

import numpy as np
import torch

from ...contract.allocator import OwnerLaneAllocator
from .baseline import BlockListBaseline
from .timing import median_seconds


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
    bs, tokens = seq.numel(), int(seq.sum())
    prefix = torch.zeros(bs, dtype=torch.int64)
    last = torch.full((bs,), -1, dtype=torch.int64)

    def run():
        return alloc.alloc_extend(prefix, prefix, seq, seq, last, tokens)

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
        return alloc.alloc_decode(seq, seq, state["last"])

    return run, setup


def _free_case(alloc: OwnerLaneAllocator, tokens: int, by_pages: bool):
    state = {}

    def setup():
        alloc.clear()
        slots = alloc.alloc_extend(*(torch.zeros(1, dtype=torch.int64),) * 2, *(torch.tensor([tokens]),) * 2,
                                   torch.tensor([-1]), tokens)
        state["x"] = slots[:: alloc.page_size] // alloc.page_size if by_pages else slots

    def run():
        (alloc.free_pages if by_pages else alloc.free)(state["x"])

    return run, setup


def bench_alloc(page: int = 64, cp: int = 8, pool_pages: int = 32768, tokens: int = 262144,
                batch_sizes=(1, 32, 256), decode_bs: int = 1024, repeats: int = 21) -> list[dict]:
    """``OwnerLaneAllocator`` at ``cp`` on a pool of ``pool_pages`` pages against,
    in the same interleaved rounds: a per-block Python free list with the same
    lane rule and the same ``out_cache_loc`` (:class:`BlockListBaseline`), the
    same allocator at cp 1, and the floor (``torch.arange`` of the output's
    length). Rows: extend of ``tokens`` tokens at each batch size and a ragged
    batch, decode at ``decode_bs`` (half the requests take a new page), and a
    free of ``tokens`` slots by slots and by pages.

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


def _bench_alloc(page, cp, pool_pages, tokens, batch_sizes, decode_bs, repeats) -> list[dict]:
    size, S, N = pool_pages * page, page, cp
    rows = []

    def allocs():
        return OwnerLaneAllocator(size, S, N), BlockListBaseline(pool_pages, S, N), OwnerLaneAllocator(size, S, 1)

    def row(name, cases, n, check=None):
        t = median_seconds(cases | {"floor": (lambda: torch.arange(n, dtype=torch.int64), None)}, repeats)
        rows.append({"case": name, f"cp{N} ms": t["cp"] * 1e3, "per-block ms": t["block"] * 1e3,
                     "cp1 ms": t["cp1"] * 1e3, "floor ms": t["floor"] * 1e3,
                     f"cp{N}/per-block": t["cp"] / t["block"], f"cp{N}/cp1": t["cp"] / t["cp1"],
                     f"cp{N}/floor": t["cp"] / t["floor"]})

    shapes = [(f"alloc_extend bs={bs}", bs, False) for bs in batch_sizes]
    shapes.append((f"alloc_extend bs={batch_sizes[-1]} ragged", batch_sizes[-1], True))
    for name, bs, ragged in shapes:
        seq = _lengths(bs, tokens, ragged)
        ours, block, one = allocs()
        lens = seq.tolist()
        run, setup = _extend_case(ours, seq)
        setup()
        assert torch.equal(run(), block.alloc_extend(lens)), "the per-block baseline disagrees"
        row(f"{name} ({tokens // page} pages)", {
            "cp": (run, setup),
            "block": (lambda b=block, l=lens: b.alloc_extend(l), block.clear),
            "cp1": _extend_case(one, seq),
        }, tokens)

    prompt = _decode_prompts(decode_bs, page)
    ours, block, one = allocs()
    run, setup = _decode_case(ours, prompt)
    held = {}

    def block_setup(b=block):
        b.clear()
        slots = b.alloc_extend(prompt.tolist())
        held["last"] = slots[torch.cumsum(prompt, 0) - 1].tolist()

    setup(), block_setup()
    assert torch.equal(run(), block.alloc_decode(held["last"])), "the per-block baseline disagrees on decode"
    row(f"alloc_decode bs={decode_bs} (half take a page)", {
        "cp": (run, setup),
        "block": (lambda b=block: b.alloc_decode(held["last"]), block_setup),
        "cp1": _decode_case(one, prompt),
    }, decode_bs)

    for by_pages in (False, True):
        ours, block, one = allocs()

        def block_free_setup(b=block):
            b.clear()
            held["pages"] = (b.alloc_extend([tokens])[::page] // page).tolist()

        what = f"free of {tokens // page} pages by " + ("pages" if by_pages else f"slots ({tokens} slots)")
        row(what, {
            "cp": _free_case(ours, tokens, by_pages),
            "block": (lambda b=block: b.free_pages(held["pages"]), block_free_setup),
            "cp1": _free_case(one, tokens, by_pages),
        }, tokens // page if by_pages else tokens)
    return rows
