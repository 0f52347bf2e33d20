"""Benchmarks: every figure is a median ratio against a baseline measured in the
same run (the machine is noisy; timed tests are not used). One module per benchmark:

* :mod:`~cpkv.tools.bench.alloc` - the allocator against a bare per-lane deque
  (:mod:`~cpkv.tools.bench.baseline`), writing its output, and cp 1;
* :mod:`~cpkv.tools.bench.kv` - the shared KV pool's write and read paths;
* :mod:`~cpkv.tools.bench.kvdtype` - bytes and accuracy of each ``--kv-dtype``;
* :mod:`~cpkv.tools.bench.layer_syncs` - host synchronisations per layer and step time, batch planned once or per layer;
* :mod:`~cpkv.tools.bench.serving` - the engine against ``transformers``' ``generate()``;
* :mod:`~cpkv.tools.bench.splits` - prefill and decode splits on a process group;
* :mod:`~cpkv.tools.bench.timing` - interleaved rounds and their medians.

Their rows print through the one table formatter, :func:`cpkv.tools.table.format_rows`.
"""

from .alloc import bench_alloc
from .baseline import DequeBaseline, slots_of_pages
from .kv import bench_kv
from .kvdtype import bench_kvdtype, format_kvdtype
from .layer_syncs import bench_plan
from .serving import bench_engine
from .splits import (SPLIT_MODELS, SplitsSpec, bench_splits, default_split_tokens, measure_splits, splits_model,
                     splits_title)
from .timing import median_rounds, median_seconds

__all__ = ["DequeBaseline", "SPLIT_MODELS", "SplitsSpec", "bench_alloc", "bench_engine", "bench_kv", "bench_kvdtype",
           "bench_plan", "format_kvdtype",
           "bench_splits", "default_split_tokens", "measure_splits", "median_rounds", "median_seconds",
           "slots_of_pages", "splits_model", "splits_title"]
