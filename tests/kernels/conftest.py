"""Shared settings and case builders of the kernel tests.

Where torch sees no CUDA device, ``TRITON_INTERPRET=1`` is set at import,
before anything imports triton, so the triton backend runs its kernels on CPU
tensors in Triton's interpreter (an explicit setting wins); where it sees one,
nothing is set, so the ``gpu`` tests (and the ranks they spawn, which inherit
the environment) compile their kernels. Cases are small: the interpreter runs
one program after another.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from cpkv.contract.layout import SharedKVLayout  # noqa: E402

torch.set_num_threads(1)

# (cp_size, page size): every N of 1, 2, 3, 4, 8 and every page size of 1, 16, 64 appear
GEOMETRIES = [(1, 16), (2, 1), (3, 64), (4, 16), (8, 1), (8, 64), (3, 16)]
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


@dataclass
class Batch:
    """A ragged batch over a random owner-lane layout.

    ``table [B, L]`` logical slots by position (``-1`` after each request's
    length, and in a few holes), ``q_req``/``q_pos [T]`` its queries: a
    prefill block after a prefix that ends mid-page, a decode token, a
    request of length 0 whose query sees nothing (``q_pos = -1``), and a query
    whose every visible slot is padding. ``lens [B]`` the requests' lengths."""

    layout: SharedKVLayout
    table: torch.Tensor
    q_req: torch.Tensor
    q_pos: torch.Tensor
    lens: torch.Tensor
    gen: torch.Generator

    @property
    def rows(self) -> int:
        """Rows of the rank-major view: ``cp_size * slots_per_rank``."""
        return self.layout.cp_size * self.layout.slots_per_rank

    def randn(self, *shape, dtype=torch.float32) -> torch.Tensor:
        """Seeded standard normal values of ``dtype``."""
        return torch.randn(*shape, generator=self.gen).to(dtype)


def make_batch(cp_size: int, page_size: int, seed: int, holes: bool = True) -> Batch:
    """A :class:`Batch` on ``SharedKVLayout(cp_size, page_size, ...)`` with just enough pages."""
    gen = torch.Generator().manual_seed(seed)
    S = page_size
    prefix = int(torch.randint(1, 2 * S + 3, (), generator=gen))
    prefix += (prefix % S == 0 and S > 1)  # ends mid-page
    extend = int(torch.randint(2, 6, (), generator=gen))
    decode_len = int(torch.randint(1, 2 * S + 4, (), generator=gen))
    lens = torch.tensor([prefix + extend, decode_len, 0, 3])
    pages_needed = int(((lens + S - 1) // S).sum())
    layout = SharedKVLayout(cp_size, S, -(-(pages_needed + 2) // cp_size) + 1)
    pages = torch.randperm(layout.num_pages - 1, generator=gen)[:pages_needed] + 1  # page 0 is padding's
    L = int(lens.max())
    pos = torch.arange(L)
    table = torch.full((4, L), -1, dtype=torch.int64)
    start = 0
    for r, n in enumerate(lens.tolist()):  # builds the fixture only; kernels see one tensor
        k = -(-n // S)
        table[r, :n] = pages[start : start + k].repeat_interleave(S)[:n] * S + pos[:n] % S
        start += k
    if holes:
        table[torch.rand(table.shape, generator=gen) < 0.1] = -1
    table[3, :3] = -1  # request 3: every visible slot is padding
    q_req = torch.tensor([0] * extend + [1, 2, 3])
    q_pos = torch.tensor(list(range(prefix, prefix + extend)) + [decode_len - 1, -1, 2])
    return Batch(layout, table, q_req, q_pos, lens, gen)


@pytest.fixture
def batch_of():
    """:func:`make_batch` as a fixture."""
    return make_batch


@pytest.fixture
def close():
    """``close(got, want, dtype)``: equal within the dtype's tolerance (float32
    1e-5, float16 2e-3), ``-inf`` exactly where the other has it."""
    def check(got, want, dtype):
        torch.testing.assert_close(got, want, **TOL[dtype])
    return check
