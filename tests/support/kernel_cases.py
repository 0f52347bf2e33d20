"""Page tables for the kernel tests: requests of given lengths on random pages
of an owner-lane layout, and caches stored in each format."""

import torch

from cpkv.consumers.kv_format import TorchFormat, gqa_fp8, indexer_key_fp8, mla_latent_fp8
from cpkv.contract.layout import SharedKVLayout

FORMATS = ("plain", "bf16", "fp8")


def tables(lens: list[int], cp: int, page: int, seed: int, spare_pages: int = 2):
    """``(layout, table [B, max(lens)], gen)``: request r holds ``lens[r]``
    slots on random pages of a layout with just enough pages (page 0 left to
    padding), ``-1`` after its length."""
    gen = torch.Generator().manual_seed(seed)
    per = [-(-n // page) for n in lens]
    need = sum(per)
    layout = SharedKVLayout(cp, page, -(-(need + spare_pages) // cp) + 1)
    pages = torch.randperm(layout.num_pages - 1, generator=gen)[:need] + 1
    L = max(lens) if lens else 0
    table = torch.full((len(lens), L), -1, dtype=torch.int64)
    at = 0
    pos = torch.arange(L)
    for r, n in enumerate(lens):  # builds the fixture only
        table[r, :n] = pages[at : at + per[r]].repeat_interleave(page)[:n] * page + pos[:n] % page
        at += per[r]
    return layout, table, gen


def stored(values: torch.Tensor, kind: str, what: str = "gqa", rope: int = 8):
    """``(view, fmt)``: ``values [rows, *shape]`` as a cache stores them in
    ``kind`` (``plain``: the tensor itself; ``bf16``: bfloat16 bytes; ``fp8``:
    the model's scaled FP8 format for ``what``: ``gqa`` K/V ``[Hkv, D]``,
    ``mla`` latent ``[r + rope]``, ``index`` key ``[Di]``)."""
    shape = tuple(values.shape[1:])
    if kind == "plain":
        return values, None
    if kind == "bf16":
        fmt = TorchFormat(shape, torch.bfloat16)
    elif what == "gqa":
        fmt = gqa_fp8(*shape)
    elif what == "index":
        fmt = indexer_key_fp8(shape[0])
    else:
        fmt = mla_latent_fp8(shape[0] - rope, rope)
    return fmt.encode(values), fmt
