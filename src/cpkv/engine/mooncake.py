"""Mooncake FAST'25 request traces as cpkv traces.

The Mooncake traces (``../shared/data/mooncake``; SGLang's bench_serving
``--dataset-name mooncake`` and vLLM's ``bench serve --dataset-name
timed_trace`` replay them) carry no text. One JSON object a line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, 3]}

``timestamp`` (ms since the trace start, never decreasing), ``input_length``
and ``output_length`` (tokens, >= 1) and ``hash_ids`` (one id >= 0 per
``BLOCK_TOKENS``-token block of the input, so ``ceil(input_length / 512)``
of them; equal ids are the same prefix block, so an id always follows the same
id, or starts the request). A line that breaks one of these rules, or has
another field, is refused with ``path:line`` and the reason
(:class:`~cpkv.engine.trace.TraceError`), as a cpkv JSONL trace is.

Each hash id becomes a fixed block of token ids (:func:`block_tokens`):

* equal ids give equal tokens, wherever they appear;
* unequal ids never share an accidental prefix: the blocks that follow one
  block (its *siblings*) are numbered, and a block starts with its number
  written in base ``vocab`` (one token when the vocabulary holds every
  sibling count, always without a vocabulary), so two siblings differ in
  their first token and a prefix match stops exactly at the block where
  their ids differ. A vocabulary smaller than a block's siblings needs
  ``d`` leading digits; siblings then share at most ``d - 1`` tokens
  (:attr:`MooncakeTrace.accidental_tokens`); a block shorter than ``d``
  tokens is refused (``ValueError``);
* a request's last block is cut to its ``input_length``.

``block_tokens`` (:func:`scale_lengths`) scales the 512-token block down for
model runs on the CPU: every full block becomes ``block_tokens`` tokens, the
partial last block ``ceil(last * block_tokens / 512)`` and the output
``ceil(output_length * block_tokens / 512)``, so the blocks, and with them
every shared prefix, stay intact. ``requests`` (the first K) and
``window_ms`` (those arriving before that many ms) take a slice;
``max_output`` caps the outputs (after scaling).

For the engine, a request arrives at step ``timestamp // step_ms``
(:func:`load_mooncake`); the simulator replays the milliseconds themselves
(:attr:`MooncakeTrace.arrival_ms`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .trace import RequestSpec, TraceError, json_object, trace_lines

__all__ = ["BLOCK_TOKENS", "BlockPrompt", "FULL_SCALE_CHUNK", "MOONCAKE_FIELDS", "MOONCAKE_PREFIX", "MooncakeRecord",
           "MooncakeTrace", "block_tokens", "is_mooncake", "load_mooncake", "mooncake_path", "read_mooncake",
           "scale_lengths", "scaled_chunk", "take"]

#: Tokens per hash id in the released traces.
BLOCK_TOKENS = 512
#: The fields of a Mooncake line, all required, no other.
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
#: ``--workload mooncake:PATH`` names a Mooncake trace explicitly.
MOONCAKE_PREFIX = "mooncake:"
#: A vocabulary large enough that every sibling count fits one token (the simulator's: no model).
NO_VOCAB = 2**31 - 1
#: Prefill tokens per step at the traces' own scale: the simulator's default (``ReplayConfig.chunk``).
FULL_SCALE_CHUNK = 8192


def scaled_chunk(block: int) -> int:
    """The prefill chunk for a trace read at ``block`` tokens a hash id: :data:`FULL_SCALE_CHUNK` scaled as the
    blocks are (``8192 * block / 512``, at least 1), so that a scaled slice prefills in as many steps as the
    trace would at full scale (16-token blocks: 256)."""
    _check_block(block)
    return max(1, FULL_SCALE_CHUNK * block // BLOCK_TOKENS)


@dataclass(frozen=True)
class MooncakeRecord:
    """One line of a Mooncake trace (see the module docstring); ``line`` is its line number."""

    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    line: int = 0


def _int(obj: dict, k: str, lo: int) -> int:
    v = obj[k]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{k!r} must be an int, got {type(v).__name__}")
    if v < lo:
        raise TraceError(f"{k!r} must be >= {lo}, got {v}")
    return v


def parse_record(text: str, line: int = 0) -> MooncakeRecord:
    """One Mooncake line as a :class:`MooncakeRecord`; raises ``TraceError``
    with the reason (the caller adds ``path:line``)."""
    obj = json_object(text, MOONCAKE_FIELDS, MOONCAKE_FIELDS, "a Mooncake line")
    ts, n_in, n_out = _int(obj, "timestamp", 0), _int(obj, "input_length", 1), _int(obj, "output_length", 1)
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in ids):
        raise TraceError("'hash_ids' must be a list of ints")
    if ids and min(ids) < 0:
        raise TraceError(f"'hash_ids' must be >= 0, got {min(ids)}")
    blocks = -(-n_in // BLOCK_TOKENS)
    if len(ids) != blocks:
        raise TraceError(f"'hash_ids' has {len(ids)} ids but input_length {n_in} takes {blocks} blocks of "
                         f"{BLOCK_TOKENS} tokens")
    return MooncakeRecord(ts, n_in, n_out, tuple(ids), line)


def read_mooncake(path: str, limit: int | None = None, before_ms: int | None = None) -> list[MooncakeRecord]:
    """The requests of the Mooncake trace at ``path``, validated line by line
    and across lines (timestamps never decrease; an id always follows the same
    id): ``TraceError`` naming ``path:line`` and the reason. Reading stops
    after ``limit`` requests or at the first arriving at ``before_ms`` or
    later (a slice reads only its own lines; ``None``: the whole file)."""
    out: list[MooncakeRecord] = []
    parent: dict[int, tuple[int, int]] = {}  # id -> (the id before it, -1 at the start; the line that said so)
    last_ts, lines = 0, 0
    for n, text in trace_lines(path):
        if not text.strip():
            continue
        lines += 1
        try:
            rec = parse_record(text, n)
            if rec.timestamp < last_ts:
                raise TraceError(f"timestamp {rec.timestamp} is before the previous line's {last_ts}; a trace "
                                 "is in arrival order")
            before = -1
            for h in rec.hash_ids:
                got = parent.setdefault(h, (before, n))
                if got[0] != before:
                    where = "starts a request" if got[0] < 0 else f"follows id {got[0]}"
                    now = "starts it" if before < 0 else f"follows id {before}"
                    raise TraceError(f"hash id {h} {now} here but {where} on line {got[1]}; equal ids are "
                                     "the same prefix block")
                before = h
        except TraceError as e:
            raise TraceError(f"{path}:{n}: {e}") from None
        last_ts = rec.timestamp
        if before_ms is not None and rec.timestamp >= before_ms:
            break
        out.append(rec)
        if limit is not None and len(out) >= limit:
            break
    if not lines:
        raise TraceError(f"{path}: no requests")
    return out


def take(records: list[MooncakeRecord], requests: int | None = None, window_ms: int | None = None) -> list[MooncakeRecord]:
    """A slice from the trace's start: the requests arriving before
    ``window_ms``, then the first ``requests`` of them (``None``: no limit).
    ``ValueError`` for a limit below 1, ``TraceError`` for a slice with no request."""
    for name, v in (("requests", requests), ("window_ms", window_ms)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {v!r}")
    out = records if window_ms is None else [r for r in records if r.timestamp < window_ms]
    out = out[:requests] if requests is not None else out
    if not out:
        raise TraceError(f"no request arrives in the first {window_ms} ms")
    return list(out)


def scale_lengths(records: list[MooncakeRecord], block: int = BLOCK_TOKENS,
                  max_output: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Input and output lengths (int64 ``[n]`` each) with ``block`` tokens a
    hash id: full blocks ``block``, the partial last block
    ``ceil(last * block / 512)``, outputs ``ceil(output_length * block /
    512)`` capped at ``max_output``; at ``block = 512`` the trace's own."""
    _check_block(block)
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1):
        raise ValueError(f"max_output must be None or an int >= 1, got {max_output!r}")
    n_in = np.fromiter((r.input_length for r in records), np.int64, len(records))
    n_out = np.fromiter((r.output_length for r in records), np.int64, len(records))
    full = (n_in - 1) // BLOCK_TOKENS
    last = n_in - full * BLOCK_TOKENS
    inputs = full * block + -(-last * block // BLOCK_TOKENS)
    outputs = -(-n_out * block // BLOCK_TOKENS)
    if max_output is not None:
        outputs = np.minimum(outputs, max_output)
    return inputs, outputs


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be an int in 1..{BLOCK_TOKENS}, got {block!r}")


class TokenBook:
    """How every hash id of a trace becomes tokens (see the module docstring):
    its number among its siblings (``number[id]``) and the base-``vocab``
    digits its siblings need (``digits[id]``), both numpy arrays indexed by
    id. Built once per trace, O(its ids); :meth:`tokens` is vectorised."""

    def __init__(self, records: list[MooncakeRecord], block: int, vocab: int | None):
        _check_block(block)
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 2):
            raise ValueError(f"vocab must be None or an int >= 2, got {vocab!r}")
        self.block, self.vocab = block, NO_VOCAB if vocab is None else vocab
        top = max((max(r.hash_ids) for r in records), default=0)
        self.number = np.full(top + 1, -1, dtype=np.int64)
        parent = np.full(top + 1, -2, dtype=np.int64)
        kids: dict[int, int] = {}
        for r in records:
            before = -1
            for h in r.hash_ids:
                if self.number[h] < 0:
                    self.number[h] = kids.get(before, 0)
                    kids[before] = self.number[h] + 1
                    parent[h] = before
                before = h
        digits_of = {p: _digits(c, self.vocab) for p, c in kids.items()}
        most = max(digits_of.values(), default=1)
        if most > block:
            raise ValueError(f"a vocabulary of {self.vocab} tokens cannot tell {max(kids.values())} sibling blocks "
                             f"apart within {block} tokens a block: raise block_tokens to {most} or more")
        self.digits = np.zeros(top + 1, dtype=np.int64)
        seen = parent > -2
        self.digits[seen] = [digits_of[int(p)] for p in parent[seen]]
        #: The longest prefix two sibling blocks may share (0: none).
        self.accidental_tokens = int(self.digits.max(initial=1)) - 1 if seen.any() else 0

    def tokens(self, ids, length: int) -> np.ndarray:
        """The tokens (int32 ``[length]``) of a request whose blocks are
        ``ids``: each block ``block`` tokens, the last cut to ``length``."""
        ids = np.asarray(ids, dtype=np.int64)
        B, V = self.block, self.vocab
        j = np.arange(B, dtype=np.int64)
        toks = (ids[:, None] * 2654435761 + (j[None, :] + 1) * 40503 + ids[:, None] * j[None, :]) % V  # the body
        num, dig = self.number[ids], self.digits[ids]
        for k in range(int(dig.max(initial=0))):  # the sibling number, most significant digit first
            rows = np.flatnonzero(dig > k)
            toks[rows, k] = (num[rows] // V ** (dig[rows] - 1 - k)) % V
        return toks.ravel()[:length].astype(np.int32)


def _digits(count: int, vocab: int) -> int:
    """Base-``vocab`` digits that number ``count`` siblings (at least 1)."""
    d, cap = 1, vocab
    while cap < count:
        d, cap = d + 1, cap * vocab
    return d


def block_tokens(records: list[MooncakeRecord], block: int = BLOCK_TOKENS, vocab: int | None = None) -> list[np.ndarray]:
    """Every request's prompt (int32 arrays) at ``block`` tokens a hash id
    (lengths from :func:`scale_lengths`)."""
    book = TokenBook(records, block, vocab)
    inputs, _ = scale_lengths(records, block)
    return [book.tokens(r.hash_ids, int(n)) for r, n in zip(records, inputs)]


class BlockPrompt(Sequence):
    """A request's prompt built when read: ``len()`` at no cost, the tokens
    (``np.asarray``, iteration, indexing) from its :class:`TokenBook` on each
    read. The simulator holds a whole trace (145M tokens) this way; each
    request's tokens exist only while the scheduler keeps them."""

    __slots__ = ("_book", "_ids", "_len")

    def __init__(self, book: TokenBook, ids: tuple[int, ...], length: int):
        self._book, self._ids, self._len = book, ids, int(length)

    def __len__(self) -> int:
        return self._len

    def __array__(self, dtype=None, copy=None):
        a = self._book.tokens(self._ids, self._len)
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, i):
        return np.asarray(self)[i]

    def __iter__(self):
        return iter(np.asarray(self).tolist())

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockPrompt) and (self._book, self._ids, self._len) == (other._book, other._ids,
                                                                                          other._len)

    def __hash__(self) -> int:
        return hash((id(self._book), self._ids, self._len))


@dataclass(frozen=True)
class MooncakeTrace:
    """A Mooncake trace read for a run: the cpkv ``specs`` (ids ``line<N>``,
    arrival step ``timestamp // step_ms``), each request's ``arrival_ms`` and
    ``records``, and the bound on accidental shared tokens between sibling
    blocks (``accidental_tokens``, 0 unless the vocabulary is smaller than a
    block's siblings)."""

    specs: list[RequestSpec]
    arrival_ms: np.ndarray
    records: list[MooncakeRecord]
    accidental_tokens: int
    block_tokens: int


def load_mooncake(path: str, *, block: int = BLOCK_TOKENS, requests: int | None = None, window_ms: int | None = None,
                  max_output: int | None = None, step_ms: float = 1000.0, vocab: int | None = None,
                  lazy: bool = False) -> MooncakeTrace:
    """Read (only the slice's lines), slice (:func:`take`), scale (:func:`scale_lengths`) and turn into
    tokens the Mooncake trace at ``path`` (``mooncake:`` prefix allowed).
    ``lazy``: prompts are :class:`BlockPrompt` (built when read), else
    tuples. ``TraceError`` for a malformed line (``path:line``),
    ``ValueError`` for a bad option."""
    if not step_ms > 0:
        raise ValueError(f"step_ms must be > 0, got {step_ms!r}")
    path = path.removeprefix(MOONCAKE_PREFIX)
    records = take(read_mooncake(path, requests, window_ms), requests, window_ms)
    inputs, outputs = scale_lengths(records, block, max_output)
    book = TokenBook(records, block, vocab)
    specs = []
    for r, n, m in zip(records, inputs.tolist(), outputs.tolist()):
        tokens = BlockPrompt(book, r.hash_ids, n) if lazy else tuple(book.tokens(r.hash_ids, n).tolist())
        specs.append(RequestSpec(f"line{r.line}", int(r.timestamp // step_ms), tokens, m))
    arrival = np.fromiter((r.timestamp for r in records), np.int64, len(records))
    return MooncakeTrace(specs, arrival, records, book.accidental_tokens, block)


def is_mooncake(path: str) -> bool:
    """Whether the file's first non-empty line is a JSON object with the
    Mooncake fields (``hash_ids`` among them): the format recognised by its
    fields. False for a file that cannot be read or parsed."""
    try:
        for _, text in trace_lines(path):
            if text.strip():
                obj = json.loads(text)
                return isinstance(obj, dict) and "hash_ids" in obj and "tokens" not in obj
    except (OSError, TraceError, json.JSONDecodeError, RecursionError):
        return False
    return False


def mooncake_path(workload: str) -> str | None:
    """The path of the Mooncake trace ``workload`` names (``mooncake:PATH``,
    or a file recognised by its fields), else ``None``."""
    if workload.startswith(MOONCAKE_PREFIX):
        return workload.removeprefix(MOONCAKE_PREFIX)
    return workload if Path(workload).is_file() and is_mooncake(workload) else None
