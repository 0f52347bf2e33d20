"""The governance trail follows govctl's layout, and every normative clause is
cited by at least one test (govctl itself cannot be installed here)."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GOV = ROOT / "gov"
RFC = GOV / "rfc" / "RFC-0001"
CITE = re.compile(r"\[\[RFC-0001:(C-[A-Z0-9-]+)\]\]")


def load(path):
    with open(path, "rb") as f:
        return tomllib.load(f)


def clauses():
    return {p.stem: load(p) for p in sorted((RFC / "clauses").glob("*.toml"))}


def test_config_and_rfc_metadata():
    cfg = load(GOV / "config.toml")
    assert cfg["paths"]["gov_root"] == "gov"
    rfc = load(RFC / "rfc.toml")
    for key in ("rfc_id", "title", "version", "status", "phase", "owners", "created"):
        assert rfc.get(key), f"rfc.toml lacks {key}"
    assert rfc["rfc_id"] == "RFC-0001"
    assert rfc["status"] in {"draft", "normative", "deprecated"}
    assert rfc["phase"] in {"spec", "impl", "test", "stable"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", rfc["version"])
    assert any(c["version"] == rfc["version"] for c in rfc["changelog"]), "no changelog entry for the version"
    listed = [c for s in rfc["sections"] for c in s["clauses"]]
    assert len(listed) == len(set(listed))
    assert sorted(listed) == sorted(f"clauses/{n}.toml" for n in clauses())


def test_clause_files():
    assert clauses()
    for stem, c in clauses().items():
        meta = c["govctl"]
        assert meta["id"] == stem
        assert meta["title"] and meta["since"]
        assert meta["kind"] in {"normative", "informative"}
        assert meta["status"] in {"active", "deprecated", "superseded"}
        assert len(c["content"]["text"].strip()) > 40


def test_work_items():
    items = sorted((GOV / "work").glob("*.toml"))
    assert items
    ids = set()
    for path in items:
        m = re.fullmatch(r"(\d{4})-(\d{2})-(\d{2})-[a-z0-9-]+", path.stem)
        assert m, path.name
        wi = load(path)
        meta, content = wi["govctl"], wi["content"]
        assert re.fullmatch(rf"WI-{m[1]}-{m[2]}-{m[3]}-\d{{3}}", meta["id"]), meta["id"]
        assert meta["id"] not in ids
        ids.add(meta["id"])
        assert meta["title"] and meta["created"] and content["description"]
        assert meta["status"] in {"queue", "active", "done", "cancelled"}
        crit = content["acceptance_criteria"]
        assert crit
        for c in crit:
            assert c["text"] and c["status"] in {"pending", "done", "cancelled"}
            assert c["category"] in {"added", "changed", "deprecated", "removed", "fixed", "security", "chore"}
        if meta["status"] == "done":
            assert all(c["status"] == "done" for c in crit), f"{path.name} is done with open criteria"


def _citations(folder):
    found = {}
    for p in (ROOT / folder).rglob("*.py"):
        for name in CITE.findall(p.read_text()):
            found.setdefault(name, set()).add(p.name)
    return found


def test_every_normative_clause_is_cited_by_a_test():
    cited = _citations("tests")
    missing = [n for n, c in clauses().items() if c["govctl"]["kind"] == "normative" and n not in cited]
    assert not missing, f"normative clauses no test cites: {missing}"


def test_citations_name_existing_clauses():
    names = set(clauses())
    for folder in ("src", "tests"):
        dangling = set(_citations(folder)) - names
        assert not dangling, f"{folder} cites unknown clauses {dangling}"
