"""One registry per extension point: where a model family, an eviction policy or a kernel backend is named once.

A :class:`Registry` maps a name to an entry (a factory, a policy object, a
backend's maker) and a one-line summary, in the order entries were added. The
three of cpkv are :data:`cpkv.models.MODELS`,
:data:`cpkv.consumers.eviction.EVICTION_POLICIES` and
:data:`cpkv.kernels.BACKENDS`; each entry is added beside the code it names, and
everything that lists or checks those names (the ``cpkv`` command's
``choices`` and ``--help``, the constructors that take a name) asks the
registry, so a new model, policy or backend is one ``add`` in one place. As
SGLang's attention-backend registry (``register_attention_backend(name)``
over a dict) and vLLM's ``ModelRegistry`` (architecture name to class).

A name is added once (a second ``add`` of it is a ``ValueError``, so two
entries never answer one name); an unknown name is a one-line ``ValueError``
naming the choices.
"""

from __future__ import annotations

import re
from typing import Callable, Generic, Iterator, TypeVar

T = TypeVar("T")

_NAME = re.compile(r"[a-z0-9][a-z0-9.\-]*")  # what a command line takes as one choice: no space, no comma


class Registry(Generic[T]):
    """Names to entries for one extension point (``what``: ``"model"``,
    ``"eviction policy"``, ``"kernel backend"``, used in messages)."""

    def __init__(self, what: str):
        self.what = what
        self._entries: dict[str, tuple[T, str]] = {}

    def add(self, name: str, entry: T, summary: str) -> T:
        """Register ``entry`` under ``name`` (lower case letters, digits, ``.``
        and ``-``) with a one-line ``summary`` (what ``--help`` shows); returns
        ``entry``. ``ValueError`` for a name taken already, a malformed name or
        an empty summary; nothing is added then."""
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"a {self.what} name is lower case letters, digits, '.' and '-', got {name!r}")
        if name in self._entries:
            raise ValueError(f"{self.what} {name!r} is registered already")
        if not isinstance(summary, str) or not summary.strip() or "\n" in summary:
            raise ValueError(f"{self.what} {name!r}: the summary must be one non-empty line")
        self._entries[name] = (entry, summary)
        return entry

    def register(self, name: str, summary: str) -> Callable[[T], T]:
        """:meth:`add` as a decorator: ``@REGISTRY.register("name", "what it is")``."""
        return lambda entry: self.add(name, entry, summary)

    def get(self, name: str) -> T:
        """The entry of ``name``; ``ValueError`` naming the choices for an unknown one."""
        try:
            return self._entries[name][0]
        except (KeyError, TypeError):
            raise ValueError(f"unknown {self.what} {name!r}; choose from {', '.join(self._entries)}") from None

    def check(self, name: str) -> str:
        """``name`` itself when it is registered; ``ValueError`` naming the choices otherwise."""
        self.get(name)
        return name

    def summary(self, name: str) -> str:
        """The one-line summary of ``name`` (``ValueError`` for an unknown one)."""
        self.get(name)
        return self._entries[name][1]

    def names(self) -> tuple[str, ...]:
        """Every name, in the order they were added (the first is the default where one is needed)."""
        return tuple(self._entries)

    def describe(self) -> str:
        """Every name with its summary, ``"a: what a is; b: what b is"``: the text ``--help`` shows."""
        return "; ".join(f"{n}: {s}" for n, (_, s) in self._entries.items())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"
