"""The allocator benchmark: extend, decode and free against a bare per-lane
deque, the cost of writing ``out_cache_loc`` itself, cp 1, and decode against
vLLM's ``BlockPool``; where a row misses its goal, the profile that says why."""

from __future__ import annotations

import cProfile
import gc
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from ...contract.allocator import OwnerLaneAllocator
from .baseline import BlockPoolBaseline, DequeBaseline, slots_of_pages
from .timing import median_seconds

#: The most each row may cost, as a multiple of the bare deque's time (``cp/deque``).
GOALS = {"extend bs=1 ": 0.6, "extend": 0.4, "decode": 0.5, "free": 1.0}
#: The most an extend may cost, as a multiple of writing its ``out_cache_loc`` (``cp/arange``).
ARANGE_GOAL = 2.0
#: The most a decode may cost, as a multiple of vLLM's ``BlockPool`` on the same batch (``cp/vllm``).
VLLM_GOAL = 1.0
#: Calls profiled for a row that misses its goal (each after its setup, as the timed ones).
PROFILE_CALLS = 60


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
    (:func:`~cpkv.tools.bench.baseline.slots_of_pages`, extend rows), the
    same allocator at cp 1, and, for decode, vLLM v1's ``BlockPool`` on the
    same batch (:class:`~cpkv.tools.bench.baseline.BlockPoolBaseline`: one
    free queue, no owner lanes, no checks). Rows: extend of ``tokens`` fresh
    tokens at each batch size and a ragged batch, decode at ``decode_bs``
    (half the requests take a new page), and a free of ``tokens`` slots by
    slots and by pages (the pages as a tensor; the deque takes a list). Each
    row names its goal, the most ``cp/deque`` may be (:data:`GOALS`; extend
    also ``cp/arange <= 2``, decode ``cp/vllm <= 1``), and whether the row
    meets it (``met``, :func:`goals_met`), so no reader compares figures by
    hand. A row that misses its goal carries ``profile`` (:func:`profile_case`):
    where its time goes, measured in the same run.

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


def goals_met(per_deque: float, per_arange: float | str, goal: float, per_vllm: float | str = "-") -> str:
    """A row's verdict, as the table prints it: ``yes`` when ``cp/deque`` is at
    most ``goal``, (extend rows, where ``per_arange`` is a number)
    ``cp/arange`` at most :data:`ARANGE_GOAL` and (decode, where
    ``per_vllm`` is a number) ``cp/vllm`` at most :data:`VLLM_GOAL`;
    otherwise ``no``, naming the ratios that missed (``no (deque)``,
    ``no (arange)``, ``no (deque, vllm)``, ...)."""
    missed = [what for what, bad in (("deque", per_deque > goal),
                                     ("arange", per_arange != "-" and per_arange > ARANGE_GOAL),
                                     ("vllm", per_vllm != "-" and per_vllm > VLLM_GOAL)) if bad]
    return "yes" if not missed else f"no ({', '.join(missed)})"


def profile_case(run, setup, alloc: OwnerLaneAllocator, calls: int = PROFILE_CALLS) -> dict:
    """Where one case's time goes, measured now: ``cold ms``, the median of
    ``calls`` calls of ``run`` each after ``setup`` (as the row times it: the
    setup's own writes, a 2 MB ``out_cache_loc`` among them, have just
    pushed the allocator's state out of the caches), and ``warm ms``, the
    same call again on the state the setup left, put back with
    ``restore_state`` (which brings it into the caches): their difference is
    first touch of memory, the rest is the call's own work. ``functions``:
    the cold calls under ``cProfile``, every function's own time given to the
    cpkv function that called it (a numpy or torch call counts in the cpkv
    function that made it), each function's median over the calls (so a call
    the machine preempted moves nothing), the cpkv functions of 3% or more by
    share, largest first (``[{"where": "contract/rules.py:check_decode",
    "share": 0.18}, ...]``; the profiler's own cost per call leans the shares
    towards code that calls often)."""
    cold, warm, own = [], [], []
    for i in range(calls):
        if setup is not None:
            setup()
        state = alloc.backup_state()
        prof = cProfile.Profile() if i % 2 else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        run()
        if prof is not None:
            prof.disable()
            own.append(_own_times(pstats.Stats(prof).stats))
        else:
            cold.append(time.perf_counter() - t0)
        alloc.restore_state(state)
        t0 = time.perf_counter()
        run()
        warm.append(time.perf_counter() - t0)
    # each function's median over the profiled calls: a call the machine preempted moves no share
    med = {w: statistics.median([o.get(w, 0.0) for o in own]) for w in {w for o in own for w in o}}
    total = sum(med.values()) or 1.0
    shares = sorted(((t / total, w) for w, t in med.items()), reverse=True)
    return {"cold ms": statistics.median(cold) * 1e3, "warm ms": statistics.median(warm) * 1e3,
            "functions": [{"where": w, "share": round(x, 3)} for x, w in shares if x >= 0.03]}


def _own_times(stats: dict) -> dict[str, float]:
    """cProfile's ``stats`` of one call: seconds by cpkv function, each other
    function's own time given to the cpkv functions that called it."""
    mine = {k: _where(k[0], k[2]) for k in stats if "/cpkv/" in k[0].replace("\\", "/")}
    own: dict[str, float] = {}

    def give(key, t: float, depth: int = 0) -> None:
        if key in mine:
            own[mine[key]] = own.get(mine[key], 0.0) + t
            return
        callers = stats[key][4] if key in stats else {}
        spent = sum(c[2] for c in callers.values())  # time spent in this function per caller
        if not callers or spent <= 0 or depth > 20:
            own["(outside cpkv)"] = own.get("(outside cpkv)", 0.0) + t
            return
        for caller, c in callers.items():
            give(caller, t * c[2] / spent, depth + 1)

    for key, (_, _, tt, _, _) in stats.items():
        give(key, tt)
    return own


def _where(path: str, fn: str) -> str:
    """``contract/rules.py:check_decode`` for a function of cpkv."""
    parts = Path(path).parts
    return f"{'/'.join(parts[parts.index('cpkv') + 1:])}:{fn}"


def format_alloc(rows: list[dict], title: str) -> str:
    """The table (:func:`~cpkv.tools.table.format_rows`), without the rows' profiles."""
    from ..table import format_rows

    return format_rows([{k: v for k, v in r.items() if k != "profile"} for r in rows], title)


def format_why(rows: list[dict]) -> str:
    """One line per row that missed its goal (empty when none did): its time,
    what the goal allows, its floor (writing ``out_cache_loc``, extend rows),
    cold against warm, and where the time goes (its ``profile``). The command
    prints it on standard error: it changes from run to run, the table's
    counts do not."""
    missed = [r for r in rows if "profile" in r]
    lines = ["why, where a goal is missed (cProfile shares of the allocator's call, this run):"] if missed else []
    for r in missed:
        p, cp_ms = r["profile"], next(v for k, v in r.items() if k.endswith(" ms"))
        floor = f", floor (writing out_cache_loc) {p['floor ms']:.3f} ms" if p["floor ms"] else ""
        where = ", ".join(f"{f['where']} {f['share']:.0%}" for f in p["functions"])
        lines.append(f"  {r['case']}: {cp_ms:.3f} ms ({p['cold ms']:.3f} cold, {p['warm ms']:.3f} with its state in "
                     f"cache), the goal allows {p['goal ms']:.3f} ms{floor}; {where}")
    return "\n".join(lines)


def _check_decode_slots(out: torch.Tensor, pool: BlockPoolBaseline, seq: np.ndarray, S: int) -> None:
    """vLLM's decode slots are its own (its pages are not the allocator's): each
    at the new token's offset, on a block its request holds, none twice."""
    out = out.numpy()
    assert np.array_equal(out % S, (seq - 1) % S), "the BlockPool baseline put a token at another offset"
    assert np.unique(out).size == out.size, "the BlockPool baseline gave a slot twice"
    held = pool.table[np.arange(seq.size), (seq - 1) // S]
    assert np.array_equal(out // S, held), "the BlockPool baseline wrote a slot outside its request's blocks"


def _goal(name: str) -> float:
    return next(v for k, v in GOALS.items() if name.startswith(k))


def _bench_alloc(page, cp, pool_pages, tokens, batch_sizes, decode_bs, repeats) -> list[dict]:
    size, S, N = pool_pages * page, page, cp
    rows = []

    def allocs():
        return OwnerLaneAllocator(size, S, N), DequeBaseline(pool_pages, S, N), OwnerLaneAllocator(size, S, 1)

    def row(name, cases, alloc):
        t = median_seconds(cases, repeats)
        goal = _goal(name)
        r = {"case": name, f"cp{N} ms": t["cp"] * 1e3, "deque ms": t["deque"] * 1e3,
             "arange ms": t["arange"] * 1e3 if "arange" in t else "-",
             "vllm ms": t["vllm"] * 1e3 if "vllm" in t else "-", "cp1 ms": t["cp1"] * 1e3,
             f"cp{N}/deque": t["cp"] / t["deque"], "goal": f"<= {goal}",
             f"cp{N}/arange": t["cp"] / t["arange"] if "arange" in t else "-",
             f"cp{N}/vllm": t["cp"] / t["vllm"] if "vllm" in t else "-", f"cp{N}/cp1": t["cp"] / t["cp1"]}
        r["met"] = goals_met(r[f"cp{N}/deque"], r[f"cp{N}/arange"], goal, r[f"cp{N}/vllm"])
        if r["met"] != "yes":  # what the goal allows, the floor the row cannot go under, and where the time goes
            r["profile"] = {"goal ms": goal * t["deque"] * 1e3,
                            "floor ms": t["arange"] * 1e3 if "arange" in t else 0.0,
                            **profile_case(*cases["cp"], alloc)}
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
        }, ours)

    prompt = _decode_prompts(decode_bs, page)
    ours, deq, one = allocs()
    run, setup = _decode_case(ours, prompt)
    held = {}

    def deque_setup(d=deq):
        d.clear()
        slots = d.alloc_extend(prompt.tolist())
        held["last"] = slots[torch.cumsum(prompt, 0) - 1].tolist()

    setup(), deque_setup()
    ours_out = run()
    assert torch.equal(ours_out, deq.alloc_decode(held["last"])), "the deque baseline disagrees on decode"
    pool = BlockPoolBaseline(pool_pages, S, decode_bs, -(-int(prompt.max()) // S) + 1)
    seq = (prompt + 1).numpy()
    vllm_setup = lambda p=pool: (p.clear(), p.alloc_extend(prompt.tolist()))  # noqa: E731
    vllm_setup()
    _check_decode_slots(pool.alloc_decode(seq), pool, seq, S)
    row(f"decode bs={decode_bs} (half take a page)", {
        "cp": (run, setup),
        "deque": (lambda d=deq: d.alloc_decode(held["last"]), deque_setup),
        "vllm": (lambda p=pool: p.alloc_decode(seq), vllm_setup),
        "cp1": _decode_case(one, prompt),
    }, ours)

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
        }, ours)
    return rows
