"""The package's shape: arrows one way, one class one file.

Three rules read off the source (no import of cpkv needed):

* no import circle between cpkv modules, imports under ``TYPE_CHECKING`` and
  inside functions included (such an import marks a class whose parts live in
  modules that need each other);
* no cpkv class composed of two or more cpkv base classes (mixins that call each
  other's privates);
* no cpkv base class in one module whose only use is to be the base of one
  class in another module (one class split across files); a real base with a
  use of its own (an interface named in annotations, an error caught by name, a
  second subclass) is fine.
"""

import ast
from collections import Counter, defaultdict
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"


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


# -- the checks themselves, on made-up graphs and classes --------------------------------
def test_the_cycle_finder_sees_a_circle_and_nothing_else():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    assert find_cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []
