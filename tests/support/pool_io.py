"""One layer of a :class:`~cpkv.consumers.kv_pool.SharedKVPool` written and read in one call, for tests.

The pool has no such call: a forward plans its writes once (:meth:`SharedKVPool.write_index`, ownership
checked) and its data plane stores each layer into the rank's segment (:func:`cpkv.kernels.store`) and reads
the rank-major view. :func:`write` and :func:`read` are those paths, for a test that wants one layer's values
in or out.
"""

import torch

from cpkv import kernels


def write(pool, layer: int, slots: torch.Tensor, **values: torch.Tensor) -> None:
    """``values[name] [T, *shape]`` of logical ``slots [T]`` (padding skipped) into ``pool``'s own segment of
    each named family at model ``layer``, as a forward writes them: every family's layer (``KeyError``) and
    shape (``ValueError``) checked first, then :meth:`~SharedKVPool.write_index` (a slot another rank owns:
    ``ContractViolation``), nothing written on any refusal; then the torch data plane's store, a formatted
    family encoded there. [[RFC-0001:C-DIRECT-WRITE]]"""
    segments = {n: pool.segment(n, layer) for n in values}
    for n, x in values.items():
        f = pool.families[n]
        if tuple(x.shape) != (slots.numel(), *f.shape):
            raise ValueError(f"{n}: values of shape {tuple(x.shape)} for {slots.numel()} slots of {f.shape}")
    pool.write_index(slots)
    for n, x in values.items():
        kernels.store(segments[n], x, slots, pool.layout, pool.rank, fmt=pool.families[n].format, backend="torch")


def read(pool, layer: int, slots: torch.Tensor, *names: str) -> tuple[torch.Tensor, ...]:
    """The values at logical ``slots`` (no padding, any shape) of each named family (default every family
    ``layer`` keeps, in the pool's order), each ``[*slots.shape, *family.shape]``, read through the rank-major
    view (:meth:`~SharedKVPool.read_all_layers`); a formatted family's rows decoded to float32.
    [[RFC-0001:C-READ-PATH]]"""
    names = names or tuple(n for n, f in pool.families.items() if layer in f.layers)
    rows = pool.read_all_layers(slots.reshape(-1))
    out = []
    for n in names:
        f = pool.families[n]
        x = rows[n][list(f.layers).index(layer)]
        out.append((x if f.format is None else f.format.decode(x)).reshape(*slots.shape, *f.shape))
    return tuple(out)
