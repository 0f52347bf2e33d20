"""The package's shape: arrows one way, one class one file, no history kept as code.

Rules read off the source (no import of cpkv needed):

* no import circle between cpkv modules, imports under ``TYPE_CHECKING`` and
  inside functions included (such an import marks a class whose parts live in
  modules that need each other);
* no cpkv class composed of two or more cpkv base classes (mixins that call each
  other's privates);
* no cpkv base class in one module whose only use is to be the base of one
  class in another module (one class split across files); a real base with a
  use of its own (an interface named in annotations, an error caught by name, a
  second subclass) is fine;
* no attribute set on a cpkv class from outside its body (``setattr(C, ...)``,
  ``C.x = ...``): a class's calls live in that class (an adapter's in the
  adapter), not attached to another by the module that imports it;
* no module-level ``__getattr__`` but a package's lazy import (``cpkv``'s,
  ``cpkv.engine``'s, ``cpkv.runtime``'s: an ``__init__`` that imports nothing
  heavy), which resolves the names of its public tables and nothing else: no
  shim answering a former name;
* no alias of a cpkv class or function (``Old = New`` at module level, a
  method named twice in its class), and none of the names the history layer
  kept (checked on the imported package);
* no ``DeprecationWarning`` in cpkv while no release is published
  (``CHANGELOG.md``): deprecation is owed only for what a release shipped;
* one registry per extension point (models, eviction policies, kernel
  backends: :class:`cpkv.contract.registry.Registry`), every entry reachable
  by its name through the call that takes it, no hand-written list of a
  registry's names anywhere in cpkv, and every ``cpkv`` flag that chooses
  among a registry's names takes them from it, ``--help`` showing each one's
  summary.
"""

import ast
import re
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
#: Code outside the package that may touch its classes (the repository's scripts).
SCRIPTS = sorted((ROOT / "tools").glob("*.py"))


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "cpkv").rglob("*.py")):
        name = ".".join(p.with_suffix("").relative_to(SRC).parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()
TREES = {m: ast.parse(p.read_text(), filename=str(p)) for m, p in MODULES.items()}


def _package(module: str) -> str:
    return module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]


def _imports(module: str):
    """(target module, imported name or None) for every cpkv import in ``module``."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("cpkv"):
                    yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package(module).split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.startswith("cpkv"):
                for a in node.names:
                    yield base, a.name


def import_graph() -> dict[str, set[str]]:
    """Module -> the cpkv modules it imports (a name that is a submodule counts as that module).

    ``from . import x`` inside a package's ``__init__`` and the top ``cpkv``
    package itself are left out: re-exports are not dependencies of the parts."""
    graph = {m: set() for m in MODULES}
    for m in MODULES:
        for base, name in _imports(m):
            target = f"{base}.{name}" if name and f"{base}.{name}" in MODULES else base
            if target in MODULES and target != m and target != "cpkv":
                graph[m].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by a depth-first walk (one per back edge)."""
    cycles, state, stack = [], {}, []

    def visit(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


@cache
def _classes():
    """(module, class name) -> list of base names as written, resolved to cpkv classes where imported."""
    defined = {(m, n.name) for m, t in TREES.items() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    by_name = defaultdict(set)
    for m, name in defined:
        by_name[name].add(m)
    out = {}
    for m, tree in TREES.items():
        imported = {}
        for base, name in _imports(m):
            if name and name in by_name:
                owners = {o for o in by_name[name] if o == base or o.startswith(base + ".")}
                if len(owners) == 1:
                    imported[name] = owners.pop()
        for n in ast.walk(tree):
            if not isinstance(n, ast.ClassDef):
                continue
            bases = []
            for b in n.bases:
                bname = b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None
                if bname is None:
                    continue
                if (m, bname) in defined:
                    bases.append((m, bname))
                elif bname in imported:
                    bases.append((imported[bname], bname))
            out[(m, n.name)] = bases
    return out


@cache
def _read_names() -> Counter:
    """How often each name is read anywhere in src, outside class bases and import statements (a name, an
    attribute, or a string: an annotation)."""
    count = Counter()
    for tree in TREES.values():
        base_nodes = {id(b) for n in ast.walk(tree) if isinstance(n, ast.ClassDef) for b in n.bases}
        for n in ast.walk(tree):
            if id(n) in base_nodes:
                continue
            if isinstance(n, ast.Name):
                count[n.id] += 1
            elif isinstance(n, ast.Attribute):
                count[n.attr] += 1
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                count[n.value] += 1
    return count


def _uses(name: str) -> int:
    """How often ``name`` is read anywhere in src, outside class bases and import statements."""
    return _read_names()[name]


def test_no_import_circle_between_cpkv_modules():
    cycles = find_cycles(import_graph())
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_class_is_composed_of_two_cpkv_bases():
    mixed = {f"{m}.{c}": [f"{bm}.{b}" for bm, b in bases] for (m, c), bases in _classes().items() if len(bases) >= 2}
    assert not mixed, f"classes composed of several cpkv bases (one class split across mixins): {mixed}"


def test_no_base_class_exists_only_to_split_one_class_across_files():
    subclasses = defaultdict(list)
    for (m, c), bases in _classes().items():
        for base in bases:
            subclasses[base].append((m, c))
    split = [f"{bm}.{b} only as the base of {subs[0][0]}.{subs[0][1]}"
             for (bm, b), subs in subclasses.items()
             if len(subs) == 1 and subs[0][0] != bm and _uses(b) == 0]
    assert not split, f"a class split across files: {split}"


@cache
def _cpkv_names() -> tuple[frozenset, frozenset]:
    """Every class, and every class or function, defined anywhere in cpkv."""
    classes = {n.name for t in TREES.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    defs = classes | {n.name for t in TREES.values() for n in ast.walk(t)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return frozenset(classes), frozenset(defs)


def class_patches(tree: ast.AST, classes: frozenset) -> list[str]:
    """Where ``tree`` sets or deletes an attribute of a class named in ``classes``
    from outside its body: ``setattr``/``delattr``/``X.__setattr__`` on it, or an
    assignment to ``C.x``."""
    out = []

    def cls(node) -> bool:
        return isinstance(node, ast.Name) and node.id in classes

    for n in ast.walk(tree):
        if isinstance(n, ast.Call) and n.args and cls(n.args[0]):
            f = n.func
            if (isinstance(f, ast.Name) and f.id in ("setattr", "delattr")) or (
                    isinstance(f, ast.Attribute) and f.attr in ("__setattr__", "__delattr__")):
                out.append(f"line {n.lineno}: {ast.unparse(n)}")
        targets = (n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, (ast.AugAssign, ast.AnnAssign))
                   else n.targets if isinstance(n, ast.Delete) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and cls(t.value):
                out.append(f"line {n.lineno}: {ast.unparse(t)} set from outside class {t.value.id}")
    return out


#: The tables a package's lazy import (its ``__init__``'s ``__getattr__``) may read: nothing else answers.
LAZY_TABLES = {"_PUBLIC", "_SUBPACKAGES"}


def module_shims(tree: ast.AST, lazy: bool) -> list[str]:
    """Module-level ``__getattr__`` in ``tree``: any at all unless ``lazy``; in
    the lazy import, any lookup but ``name in`` one of :data:`LAZY_TABLES`, or a
    warning."""
    out = []
    for f in tree.body:
        if not (isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "__getattr__"):
            continue
        if not lazy:
            out.append(f"line {f.lineno}: a module __getattr__ (a shim answering names the module does not define)")
            continue
        for n in ast.walk(f):
            if isinstance(n, ast.If) and not (
                    isinstance(n.test, ast.Compare) and len(n.test.ops) == 1 and isinstance(n.test.ops[0], ast.In)
                    and isinstance(n.test.comparators[0], ast.Name) and n.test.comparators[0].id in LAZY_TABLES):
                out.append(f"line {n.lineno}: the lazy import answers more than {sorted(LAZY_TABLES)}: "
                           f"{ast.unparse(n.test)}")
            if isinstance(n, ast.Call) and "warn" in ast.unparse(n.func):
                out.append(f"line {n.lineno}: the lazy import warns: {ast.unparse(n)}")
    return out


def aliases(tree: ast.AST, defs: frozenset) -> list[str]:
    """Second names in ``tree``: ``A = B`` at module level with ``B`` a class or
    function named in ``defs`` (a bare name or ``module.B``), and a method bound
    to a second name in its class's body."""
    out = []
    for n in tree.body:
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and n.value is not None:
            v = n.value
            name = v.id if isinstance(v, ast.Name) else v.attr if isinstance(v, ast.Attribute) else None
            if name in defs:
                out.append(f"line {n.lineno}: {ast.unparse(n)} (an alias of {name})")
    for c in ast.walk(tree):
        if isinstance(c, ast.ClassDef):
            methods = {m.name for m in c.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
            for n in c.body:
                if isinstance(n, ast.Assign) and isinstance(n.value, ast.Name) and n.value.id in methods:
                    out.append(f"line {n.lineno}: {c.name}.{ast.unparse(n)} (a method under a second name)")
    return out


def _every_source() -> dict[str, ast.AST]:
    return {**TREES, **{f"tools/{p.name}": ast.parse(p.read_text(), filename=str(p)) for p in SCRIPTS}}


def test_no_attribute_is_set_on_a_cpkv_class_from_outside_it():
    classes, _ = _cpkv_names()
    found = {m: bad for m, t in _every_source().items() if (bad := class_patches(t, classes))}
    assert not found, f"a cpkv class patched from outside its body (put the calls in the class, or an adapter): {found}"


def test_no_module_getattr_shim():
    found = {m: bad for m, t in TREES.items() if (bad := module_shims(t, lazy=MODULES[m].name == "__init__.py"))}
    assert not found, f"module __getattr__ shims: {found}"


def test_no_alias_of_a_cpkv_class_or_function():
    _, defs = _cpkv_names()
    found = {m: bad for m, t in TREES.items() if (bad := aliases(t, defs))}
    assert not found, f"aliases (history kept as code): {found}"


#: Names the history layer kept working after they went (0.2, never released): none may answer again.
FORMER_NAMES = {
    "cpkv": ("ExtendAllocation", "RankSplit", "split_page", "split_interleave", "run_engine", "EngineConfig",
             "RunConfig", "DisaggConfig", "run_disagg", "format_disagg", "DisaggFailure", "TransferAborted",
             "TraceError", "RankFailure", "GroupTooLarge"),
    "cpkv.contract.allocation": ("ExtendAllocation",),
    "cpkv.contract.allocator": ("ExtendAllocation",),
    "cpkv.consumers.kv_events": ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
                                 "KVEventBatch"),
    "cpkv.models": ("attend", "merge_partials", "paged_attention"),
    "cpkv.models.attention": ("attend", "merge_partials", "paged_attention", "query_groups", "QueryGroups",
                              "PAD_LIMIT"),
    "cpkv.OwnerLaneAllocator": ("alloc_extend", "alloc_decode", "alloc", "get_num_new_pages", "free_segment",
                                "free_segments", "available_size", "get_cpu_copy", "load_cpu_copy", "last_allocation"),
    "cpkv.PrefixCache": ("acquire", "insert", "insert_tail", "insert_tails", "release", "cache_pages_many",
                         "lane_need", "evictable_pages", "lane_cached_pages", "cached_pages", "layout", "num_pages",
                         "lane_pages", "lane_free_pages", "is_allocated"),
    "cpkv.Allocation": ("rank_split",),
    "cpkv.PageTable": ("rows",),
    "cpkv.SharedKVPool": ("write", "write_at", "read_index", "gather", "check", "row", "num_layers"),
    "cpkv.runtime.runner.CPRunner": ("allocate", "extend", "finish", "record", "release", "last_loc", "lens", "table",
                                     "req_to_token"),
}


def test_no_former_name_answers():
    """The deleted history stays deleted: each former name is an ``AttributeError``."""
    import importlib
    import warnings

    answered = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for where, names in FORMER_NAMES.items():
            try:
                obj = importlib.import_module(where)
            except ModuleNotFoundError:
                mod, attr = where.rsplit(".", 1)
                obj = getattr(importlib.import_module(mod), attr)
            answered += [f"{where}.{n}" for n in names if hasattr(obj, n)]
    assert not answered, f"former names answer again: {answered}"


def test_no_deprecation_before_a_release():
    """STYLE: deprecation (a release of ``DeprecationWarning``) is owed only for
    what a published release shipped. While every version of ``CHANGELOG.md``
    is unreleased, nothing in cpkv warns of one."""
    versions = re.findall(r"^## (\S+)(.*)$", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert versions, "CHANGELOG.md lists no version"
    if any("unreleased" not in rest for _, rest in versions):
        return  # a release is published: its deprecations are owed (see STYLE)
    warned = [f"{m}: line {n.lineno}" for m, t in TREES.items() for n in ast.walk(t)
              if isinstance(n, ast.Name) and n.id in ("DeprecationWarning", "PendingDeprecationWarning")]
    assert not warned, f"deprecations before any release (delete the old form instead): {warned}"


#: The extension points: registry (module, name) -> how a name reaches its entry through the call that takes it.
EXTENSION_POINTS = {
    ("cpkv.models.base", "MODELS"): "cpkv.models.model_config",
    ("cpkv.consumers.eviction", "EVICTION_POLICIES"): "cpkv.consumers.eviction.eviction_policy",
    ("cpkv.kernels", "BACKENDS"): "cpkv.kernels.get",
}


def registries_in(tree: ast.AST) -> list[str]:
    """Module-level names bound to a ``Registry(...)`` in ``tree``."""
    out = []
    for n in tree.body:
        value = n.value if isinstance(n, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Registry":
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out += [t.id for t in targets if isinstance(t, ast.Name)]
    return out


def name_lists(tree: ast.AST, names: set) -> list[str]:
    """Tuple, list and set literals in ``tree`` holding two or more of ``names`` as strings: a registry's names
    written out by hand."""
    out = []
    for n in ast.walk(tree):
        if isinstance(n, (ast.Tuple, ast.List, ast.Set)):
            got = [e.value for e in n.elts if isinstance(e, ast.Constant) and e.value in names]
            if len(got) >= 2:
                out.append(f"line {n.lineno}: {ast.unparse(n)}")
    return out


def _registry(where: tuple[str, str]):
    import importlib

    return getattr(importlib.import_module(where[0]), where[1])


def _call(path: str):
    import importlib

    mod, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(mod), name)


def test_each_extension_point_has_one_registry():
    found = {(m, name) for m, t in TREES.items() for name in registries_in(t)}
    assert found == set(EXTENSION_POINTS), f"registries in cpkv: {sorted(found)}; expected {sorted(EXTENSION_POINTS)}"


def test_every_registry_entry_is_reachable_by_its_name():
    from cpkv.contract.registry import Registry
    from cpkv.kernels.backend import Backend

    for where, call in EXTENSION_POINTS.items():
        reg = _registry(where)
        assert isinstance(reg, Registry) and len(reg) >= 2, f"{where}: {reg!r}"
        for name in reg:
            if where[1] == "BACKENDS":
                try:
                    got = _call(call)(name)
                except RuntimeError as e:  # an optional extra not installed here: the name still reaches it
                    assert "needs the" in str(e), e
                    continue
                assert isinstance(got, Backend) and got.name == name
            elif where[1] == "MODELS":
                got = _call(call)(name, seed=3)
                assert got.seed == 3 and callable(got.adapter) and callable(got.build)
                assert type(got.with_released_cache()) is type(got)
            else:
                got = _call(call)(name)
                assert got is reg.get(name) and got.name == name
            assert reg.summary(name)


def test_no_registry_names_written_out_by_hand():
    for where in EXTENSION_POINTS:
        names = set(_registry(where))
        found = {m: bad for m, t in TREES.items() if (bad := name_lists(t, names))}
        assert not found, f"{where[1]}'s names written by hand (ask the registry): {found}"


def test_every_flag_choosing_a_registered_name_asks_the_registry_and_help_lists_each():
    import argparse

    from cpkv.tools.cli import build_parser

    def actions(parser):
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for sub in a.choices.values():
                    yield from actions(sub)
            else:
                yield parser.prog, a

    regs = [_registry(w) for w in EXTENSION_POINTS]
    seen = set()
    for prog, a in actions(build_parser()):
        for reg in regs:
            names = set(reg)
            if a.choices is None or len(names & set(a.choices)) < 2:
                continue
            assert set(a.choices) - {"all"} <= names, f"{prog} {a.option_strings}: {a.choices} beyond {reg!r}"
            if set(a.choices) == names:
                seen.add(reg.what)
                help_text = " ".join(a.help.split())
                missing = [n for n in reg if " ".join(f"{n}: {reg.summary(n)}".split()) not in help_text]
                assert not missing, f"{prog} {a.option_strings} --help does not describe {missing}"
    assert seen == {r.what for r in regs}, f"no flag of cpkv lists every name of {set(r.what for r in regs) - seen}"


# -- the checks themselves, on made-up graphs and classes --------------------------------
def test_the_cycle_finder_sees_a_circle_and_nothing_else():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_history_checks_see_a_patch_a_shim_and_an_alias_and_nothing_else():
    classes, defs = frozenset({"Core", "Adapter"}), frozenset({"Core", "Adapter", "helper"})
    patched = ast.parse("for n in M:\n    setattr(Core, n, f)\nCore.last = property(g)\nobject.__setattr__(Core, 'x', 1)\n"
                        "delattr(Adapter, 'y')\n")
    assert len(class_patches(patched, classes)) == 4
    fine = ast.parse("setattr(self, 'x', 1)\nobject.__setattr__(self, 'd', 2)\ncore.x = 1\nclass Core:\n    x = 1\n")
    assert class_patches(fine, classes) == []
    shim = ast.parse("def __getattr__(name):\n    if name == 'Old':\n        warn('x')\n        return New\n")
    assert len(module_shims(shim, lazy=False)) == 1 and len(module_shims(shim, lazy=True)) == 2
    lazy = ast.parse("def __getattr__(name):\n    if name in _PUBLIC:\n        return 1\n"
                     "    if name in _SUBPACKAGES:\n        return 2\n    raise AttributeError(name)\n")
    assert module_shims(lazy, lazy=True) == [] and len(module_shims(lazy, lazy=False)) == 1
    aliased = ast.parse("Old = Core\nold_helper = mod.helper\nclass C:\n    def f(self): pass\n    g = f\n")
    assert len(aliases(aliased, defs)) == 3
    assert aliases(ast.parse("X = 3\nT = torch.Tensor\nclass C:\n    Inner = Core\n"), defs) == []


def test_the_registry_checks_see_a_registry_and_a_written_list_and_nothing_else():
    tree = ast.parse("A = Registry('a')\nB: Registry[int] = Registry('b')\nC = dict()\n"
                     "class K:\n    D = Registry('d')\n")
    assert registries_in(tree) == ["A", "B"]
    listed = ast.parse("X = ('torch', 'triton')\nY = ['torch', 'all']\nZ = {'torch': 1, 'triton': 2}\n"
                       "W = {'torch', 'triton', 'x'}\n")
    assert len(name_lists(listed, {"torch", "triton"})) == 2
