"""cpkv: one shared, owner-lane paged KV cache for a context-parallel group.

``cpkv`` is the cache, what an engine integrating it calls:

* the layout (:class:`SharedKVLayout`), the owner-lane allocator
  (:class:`OwnerLaneAllocator`; SGLang's call shapes over it,
  :class:`SGLangAllocator`) and its result (:class:`Allocation`);
* the shared KV pool (:class:`SharedKVPool` of :class:`Family` caches) and the
  page table (:class:`PageTable`);
* the prefix cache (:class:`PrefixCache`, :class:`PrefixHit`,
  :class:`PrefixMatch`) and the host tier (:class:`HostTier`, :class:`HostPool`);
* prefill -> decode transfer (:func:`plan_transfer`, :class:`TransferPlan`);
* the stored formats (:class:`KVFormat`, :class:`TorchFormat`,
  :class:`ScaledFp8Format`);
* the errors: :class:`UnsupportedPagePlan`, :class:`InvalidFree`,
  :class:`ContractViolation`, :class:`PrefixCacheMisuse`.

:mod:`cpkv.engine` is the engine (:func:`~cpkv.engine.run_engine`,
:func:`~cpkv.engine.run_disagg`), its configurations and its errors;
:mod:`cpkv.runtime` the CP group's processes; :mod:`cpkv.kernels` the data
plane; :mod:`cpkv.models` the model adapters; :mod:`cpkv.tools` the ``cpkv``
command.

``import cpkv`` imports nothing heavy: each name is imported from the module
that defines it on first use (torch and numpy; never the engine, the runtime,
``transformers``, triton, the KV-event wire or matplotlib), and importing cpkv
sets no environment variable. ``python -m cpkv`` under torchrun so asks the
kernel to end the rank with its agent before it imports anything
(:mod:`cpkv.__main__`).
"""

from importlib import import_module as _import_module

#: Every public name, by the module (under ``cpkv``) that defines it.
_PUBLIC = {
    "SharedKVLayout": "contract.layout",
    "OwnerLaneAllocator": "contract.allocator",
    "SGLangAllocator": "contract.sglang",
    "SGLangKVShardAllocator": "contract.sglang",
    "Allocation": "contract.allocation",
    "UnsupportedPagePlan": "contract.errors",
    "InvalidFree": "contract.errors",
    "ContractViolation": "contract.errors",
    "SharedKVPool": "consumers.kv_pool",
    "Family": "consumers.kv_pool",
    "PageTable": "consumers.page_table",
    "PrefixCache": "consumers.prefix_cache",
    "PrefixCacheMisuse": "consumers.prefix_cache",
    "PrefixHit": "consumers.prefix_cache",
    "PrefixMatch": "consumers.prefix_cache",
    "HostTier": "consumers.hicache",
    "HostPool": "consumers.hicache",
    "TransferPlan": "consumers.transfer",
    "plan_transfer": "consumers.transfer",
    "KVFormat": "consumers.kv_format",
    "TorchFormat": "consumers.kv_format",
    "ScaledFp8Format": "consumers.kv_format",
}

_SUBPACKAGES = ("consumers", "contract", "engine", "kernels", "models", "runtime", "tools")

__all__ = sorted(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    """A public name, imported from its module on first use (then kept here),
    or a subpackage: the lazy import that keeps ``import cpkv`` light. Every
    other name is an ``AttributeError``."""
    if name in _PUBLIC:
        value = getattr(_import_module(f"cpkv.{_PUBLIC[name]}"), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return _import_module(f"cpkv.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC, *_SUBPACKAGES})
