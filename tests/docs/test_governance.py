"""The governance trail follows govctl 0.14's layout and schema, and every
normative clause is cited by at least one test (govctl itself cannot be
installed here, so its rules are checked here).

The rules, from govctl's own sources: the wire models (``[govctl]`` metadata
tables for RFCs, clauses and work items), the JSON schemas it validates them
against (required fields, enums, id and version patterns, ISO dates, no
unknown fields), and ``govctl check``'s cross-checks (RFC id = folder, clause
id = file name, one changelog entry for the current version, forbidden
status/phase pairs, superseded clauses name their successor, a done work item
has no pending criterion)."""

import datetime as dt
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GOV = ROOT / "gov"
RFC_DIRS = sorted(p for p in (GOV / "rfc").iterdir() if p.is_dir())
CITE = re.compile(r"\[\[(RFC-\d{4}):(C-[A-Z0-9-]+)\]\]")

SEMVER = re.compile(r"\d+\.\d+\.\d+")
RFC_ID = re.compile(r"RFC-\d{4}")
CLAUSE_ID = re.compile(r"C-[A-Z0-9-]+")
WI_ID = re.compile(r"WI-(\d{4}-\d{2}-\d{2})-(?:[a-f0-9]{4}(?:-\d{3})?|\d{3})")
REF = re.compile(rf"{RFC_ID.pattern}(?::C-[A-Z][A-Z0-9-]*)?|ADR-\d{{4}}|{WI_ID.pattern}")
TAG = re.compile(r"[a-z][a-z0-9-]*")

RFC_STATUS = {"draft", "normative", "deprecated"}
RFC_PHASE = ["spec", "impl", "test", "stable"]
CLAUSE_KIND = {"normative", "informative"}
CLAUSE_STATUS = {"active", "deprecated", "superseded"}
WI_STATUS = {"queue", "active", "done", "cancelled"}
CRITERION_STATUS = {"pending", "done", "cancelled"}
CATEGORIES = {"added", "changed", "deprecated", "removed", "fixed", "security", "chore"}
CHANGE_LISTS = ("added", "changed", "deprecated", "removed", "fixed", "security")

RFC_META = {"required": {"id", "title", "version", "status", "phase", "owners", "created"},
            "optional": {"updated", "supersedes", "refs", "tags", "signature"}}
CLAUSE_META = {"required": {"id", "title", "kind"}, "optional": {"status", "anchors", "superseded_by", "since", "tags"}}
WI_META = {"required": {"id", "title", "status", "created"},
           "optional": {"schema", "started", "completed", "refs", "depends_on", "tags"}}


def load(path):
    with open(path, "rb") as f:
        return tomllib.load(f)


# -- field checkers: each returns the problems it found ------------------------------
def _keys(table, where, required, optional):
    if not isinstance(table, dict):
        return [f"{where} must be a table"]
    out = [f"{where} lacks {k}" for k in sorted(required - set(table))]
    out += [f"{where} has unknown field {k}" for k in sorted(set(table) - required - optional)]
    return out


def _text(v, where):
    return [] if isinstance(v, str) and v.strip() else [f"{where} must be a non-empty string"]


def _match(v, pattern, where):
    return [] if isinstance(v, str) and pattern.fullmatch(v) else [f"{where} = {v!r} does not match {pattern.pattern}"]


def _date(v, where):
    """An ISO date written as a string (govctl's schemas: type string, format date)."""
    if not isinstance(v, str):
        return [f"{where} = {v!r} must be a quoted YYYY-MM-DD string"]
    try:
        dt.date.fromisoformat(v)
    except ValueError:
        return [f"{where} = {v!r} is not a date (YYYY-MM-DD)"]
    return [] if re.fullmatch(r"\d{4}-\d{2}-\d{2}", v) else [f"{where} = {v!r} is not YYYY-MM-DD"]


def _enum(v, allowed, where):
    return [] if v in allowed else [f"{where} = {v!r} is not one of {sorted(allowed)}"]


def _strings(v, where, pattern=None, min_items=0):
    if not isinstance(v, list) or len(v) < min_items:
        return [f"{where} must be a list of at least {min_items} strings"]
    out = [p for i, x in enumerate(v) for p in _text(x, f"{where}[{i}]")]
    if pattern is not None:
        out += [p for i, x in enumerate(v) if isinstance(x, str) for p in _match(x, pattern, f"{where}[{i}]")]
    return out


def _version(v):
    return tuple(int(x) for x in v.split("."))


def check_rfc(doc, folder: str) -> list[str]:
    """Problems of an RFC's rfc.toml (its folder name given)."""
    out = _keys(doc, "rfc.toml", {"govctl", "sections"}, {"changelog"})
    meta = doc.get("govctl")
    if not isinstance(meta, dict):
        return out
    out += _keys(meta, "[govctl]", RFC_META["required"], RFC_META["optional"])
    if "id" in meta:
        out += _match(meta["id"], RFC_ID, "govctl.id")
        if meta["id"] != folder:
            out.append(f"govctl.id {meta['id']!r} is not its folder {folder!r}")
    out += _text(meta.get("title"), "govctl.title")
    out += _match(meta.get("version"), SEMVER, "govctl.version")
    out += _enum(meta.get("status"), RFC_STATUS, "govctl.status")
    out += _enum(meta.get("phase"), set(RFC_PHASE), "govctl.phase")
    out += _strings(meta.get("owners"), "govctl.owners", min_items=1)
    for k in ("created", "updated"):
        if k in meta or k == "created":
            out += _date(meta.get(k), f"govctl.{k}")
    if not out and meta.get("updated", meta["created"]) < meta["created"]:
        out.append("govctl.updated is before govctl.created")
    for k, pat in (("supersedes", RFC_ID),):
        if k in meta:
            out += _match(meta[k], pat, f"govctl.{k}")
    if "refs" in meta:
        out += _strings(meta["refs"], "govctl.refs", REF)
    if "tags" in meta:
        out += _strings(meta["tags"], "govctl.tags", TAG)
    status, phase = meta.get("status"), meta.get("phase")
    if status == "draft" and phase == "stable":
        out.append("status draft with phase stable is forbidden")
    if status == "deprecated" and phase in ("impl", "test"):
        out.append(f"status deprecated with phase {phase} is forbidden")
    if status == "draft" and phase in RFC_PHASE[1:]:
        out.append(f"phase {phase} before the RFC is normative (the phase gate)")
    sections = doc.get("sections")
    if not isinstance(sections, list) or not sections:
        out.append("sections must be a non-empty list")
        sections = []
    for i, s in enumerate(sections):
        out += _keys(s, f"sections[{i}]", {"title"}, {"clauses"})
        if isinstance(s, dict):
            out += _text(s.get("title"), f"sections[{i}].title")
            out += _strings(s.get("clauses", []), f"sections[{i}].clauses", re.compile(r"clauses/C-[A-Z0-9-]+\.toml"))
    log = doc.get("changelog", [])
    if not isinstance(log, list):
        return out + ["changelog must be a list"]
    seen = []
    for i, e in enumerate(log):
        out += _keys(e, f"changelog[{i}]", {"version", "date"}, {"notes", *CHANGE_LISTS})
        if not isinstance(e, dict):
            continue
        out += _match(e.get("version"), SEMVER, f"changelog[{i}].version") + _date(e.get("date"), f"changelog[{i}].date")
        if "notes" in e:
            out += _text(e["notes"], f"changelog[{i}].notes")
        out += [p for k in CHANGE_LISTS if k in e for p in _strings(e[k], f"changelog[{i}].{k}")]
        seen.append(e.get("version"))
    if isinstance(meta.get("version"), str) and seen.count(meta["version"]) != 1:
        out.append(f"changelog needs exactly one entry for version {meta['version']}, has {seen.count(meta['version'])}")
    if len(seen) != len(set(seen)):
        out.append("changelog lists a version twice")
    return out


def check_clause(doc, stem: str, rfc_version: str | None = None) -> list[str]:
    """Problems of a clause file (its file name without .toml given)."""
    out = _keys(doc, stem, {"govctl", "content"}, set())
    meta, content = doc.get("govctl"), doc.get("content")
    if isinstance(meta, dict):
        out += _keys(meta, f"{stem} [govctl]", CLAUSE_META["required"], CLAUSE_META["optional"])
        out += _match(meta.get("id"), CLAUSE_ID, f"{stem} govctl.id")
        if meta.get("id") != stem:
            out.append(f"{stem}: govctl.id {meta.get('id')!r} is not its file name")
        out += _text(meta.get("title"), f"{stem} govctl.title")
        out += _enum(meta.get("kind"), CLAUSE_KIND, f"{stem} govctl.kind")
        status = meta.get("status", "active")
        out += _enum(status, CLAUSE_STATUS, f"{stem} govctl.status")
        if "since" not in meta:
            out.append(f"{stem} has no govctl.since")
        else:
            out += _match(meta["since"], SEMVER, f"{stem} govctl.since")
            if rfc_version and SEMVER.fullmatch(str(meta["since"])) and _version(meta["since"]) > _version(rfc_version):
                out.append(f"{stem}: since {meta['since']} is after the RFC's version {rfc_version}")
        if "superseded_by" in meta:
            out += _match(meta["superseded_by"], re.compile(r"(RFC-\d{4}:)?C-[A-Z0-9-]+"), f"{stem} govctl.superseded_by")
        if (status == "superseded") != ("superseded_by" in meta):
            out.append(f"{stem}: a superseded clause, and only one, names superseded_by")
        if "anchors" in meta:
            out += _strings(meta["anchors"], f"{stem} govctl.anchors")
        if "tags" in meta:
            out += _strings(meta["tags"], f"{stem} govctl.tags", TAG)
    if isinstance(content, dict):
        out += _keys(content, f"{stem} [content]", {"text"}, set())
        out += _text(content.get("text"), f"{stem} content.text")
    return out


PLACEHOLDERS = {"todo", "tbd", "fill in later", "placeholder", "fixme"}


def check_work_item(doc, stem: str) -> list[str]:
    """Problems of a work item file (its file name without .toml given)."""
    out = _keys(doc, stem, {"govctl", "content"}, {"verification"})
    meta, content = doc.get("govctl"), doc.get("content")
    if isinstance(meta, dict):
        out += _keys(meta, f"{stem} [govctl]", WI_META["required"], WI_META["optional"])
        m = WI_ID.fullmatch(meta.get("id", "")) if isinstance(meta.get("id"), str) else None
        out += [] if m else [f"{stem}: govctl.id {meta.get('id')!r} does not match {WI_ID.pattern}"]
        if "schema" in meta and meta["schema"] != 1:
            out.append(f"{stem}: govctl.schema must be 1")
        out += _text(meta.get("title"), f"{stem} govctl.title")
        status = meta.get("status")
        out += _enum(status, WI_STATUS, f"{stem} govctl.status")
        for k in ("created", "started", "completed"):
            if k in meta or k == "created":
                out += _date(meta.get(k), f"{stem} govctl.{k}")
        if m and isinstance(meta.get("created"), str):
            if m[1] != meta["created"]:
                out.append(f"{stem}: the id's date {m[1]} is not govctl.created {meta['created']}")
            if not stem.startswith(meta["created"] + "-"):
                out.append(f"{stem}: the file name does not start with its created date")
        dates = [meta.get(k) for k in ("created", "started", "completed") if isinstance(meta.get(k), str)]
        if dates != sorted(dates):
            out.append(f"{stem}: created <= started <= completed does not hold")
        if status in ("active", "done") and "started" not in meta:
            out.append(f"{stem}: {status} without govctl.started")
        if status == "done" and "completed" not in meta:
            out.append(f"{stem}: done without govctl.completed")
        if status == "queue" and ({"started", "completed"} & set(meta)):
            out.append(f"{stem}: queued yet started or completed")
        for k in ("refs", "depends_on"):
            if k in meta:
                out += _strings(meta[k], f"{stem} govctl.{k}", REF if k == "refs" else WI_ID)
    if isinstance(content, dict):
        out += _keys(content, f"{stem} [content]", {"description"}, {"journal", "acceptance_criteria", "notes"})
        d = content.get("description")
        out += _text(d, f"{stem} content.description")
        if isinstance(d, str) and d.strip().strip("[]<>").lower() in PLACEHOLDERS:
            out.append(f"{stem}: content.description is a placeholder")
        crit = content.get("acceptance_criteria", [])
        if not isinstance(crit, list):
            crit, out = [], out + [f"{stem}: acceptance_criteria must be a list"]
        for i, c in enumerate(crit):
            w = f"{stem} acceptance_criteria[{i}]"
            out += _keys(c, w, {"text"}, {"status", "category"})
            if isinstance(c, dict):
                out += _text(c.get("text"), f"{w}.text")
                out += _enum(c.get("status", "pending"), CRITERION_STATUS, f"{w}.status")
                out += _enum(c.get("category", "added"), CATEGORIES, f"{w}.category")
        if isinstance(meta, dict) and meta.get("status") == "done":
            pending = [c.get("text") for c in crit if isinstance(c, dict) and c.get("status", "pending") == "pending"]
            if pending:
                out.append(f"{stem} is done with pending criteria {pending}")
        if "notes" in content:
            out += _strings(content["notes"], f"{stem} content.notes")
    return out


# -- the trail itself -----------------------------------------------------------------
def clauses(rfc_dir):
    return {p.stem: load(p) for p in sorted((rfc_dir / "clauses").glob("*.toml"))}


def all_clause_refs() -> set[str]:
    return {f"{d.name}:{stem}" for d in RFC_DIRS for stem in clauses(d)}


def work_items():
    return {p.stem: load(p) for p in sorted((GOV / "work").glob("*.toml"))}


def test_config():
    cfg = load(GOV / "config.toml")
    assert cfg["paths"]["gov_root"] == "gov"
    assert isinstance(cfg["project"]["name"], str) and cfg["project"]["name"]
    # govctl >= 0.14 reads schema 3 (the [govctl] wire format of schema 2, plus RFC signatures it may add)
    assert cfg["schema"]["version"] == 3
    scan = cfg.get("source_scan", {})
    assert set(scan) <= {"enabled", "include", "exclude"} and all(isinstance(g, str) for g in scan.get("include", []))


@pytest.mark.parametrize("rfc_dir", RFC_DIRS, ids=[d.name for d in RFC_DIRS])
def test_rfc_metadata(rfc_dir):
    doc = load(rfc_dir / "rfc.toml")
    assert check_rfc(doc, rfc_dir.name) == []
    listed = [c for s in doc["sections"] for c in s.get("clauses", [])]
    assert len(listed) == len(set(listed)), "a clause is listed twice"
    assert sorted(listed) == sorted(f"clauses/{n}.toml" for n in clauses(rfc_dir)), "sections and clause files differ"


@pytest.mark.parametrize("rfc_dir", RFC_DIRS, ids=[d.name for d in RFC_DIRS])
def test_clause_files(rfc_dir):
    version = load(rfc_dir / "rfc.toml")["govctl"]["version"]
    found = clauses(rfc_dir)
    assert found
    problems = [p for stem, c in found.items() for p in check_clause(c, stem, version)]
    assert problems == []
    for stem, c in found.items():  # a successor must exist
        target = c["govctl"].get("superseded_by")
        if target:
            assert (target if ":" in target else f"{rfc_dir.name}:{target}") in all_clause_refs(), stem


def test_work_items():
    items = work_items()
    assert items
    assert [p for stem, wi in items.items() for p in check_work_item(wi, stem)] == []
    ids = [wi["govctl"]["id"] for wi in items.values()]
    assert len(ids) == len(set(ids)), "two work items share an id"
    known = {d.name for d in RFC_DIRS} | all_clause_refs() | set(ids)
    for stem, wi in items.items():
        dangling = [r for r in wi["govctl"].get("refs", []) + wi["govctl"].get("depends_on", [])
                    if not r.startswith("ADR-") and r not in known]
        assert not dangling, f"{stem} refers to what does not exist: {dangling}"


def _citations(folder):
    found = {}
    for p in (ROOT / folder).rglob("*.py"):
        for rfc, name in CITE.findall(p.read_text()):
            found.setdefault(f"{rfc}:{name}", set()).add(p.name)
    return found


def test_every_normative_clause_is_cited_by_a_test():
    cited = _citations("tests")
    missing = [f"{d.name}:{n}" for d in RFC_DIRS for n, c in clauses(d).items()
               if c["govctl"]["kind"] == "normative" and f"{d.name}:{n}" not in cited]
    assert not missing, f"normative clauses no test cites: {missing}"


def test_citations_name_existing_clauses():
    names = all_clause_refs()
    for folder in ("src", "tests"):
        dangling = set(_citations(folder)) - names
        assert not dangling, f"{folder} cites unknown clauses {dangling}"


# -- the checkers catch what govctl would refuse ----------------------------------------
GOOD_RFC = {"govctl": {"id": "RFC-0007", "title": "T", "version": "1.2.0", "status": "normative", "phase": "impl",
                       "owners": ["@o"], "created": "2026-01-02", "updated": "2026-02-03"},
            "sections": [{"title": "S", "clauses": ["clauses/C-A.toml"]}],
            "changelog": [{"version": "1.2.0", "date": "2026-02-03", "added": ["x"]},
                          {"version": "1.0.0", "date": "2026-01-02", "notes": "first"}]}
GOOD_CLAUSE = {"govctl": {"id": "C-A", "title": "A", "kind": "normative", "status": "active", "since": "1.0.0"},
               "content": {"text": "The system MUST do A."}}
GOOD_WI = {"govctl": {"id": "WI-2026-01-02-001", "title": "W", "status": "done", "created": "2026-01-02",
                      "started": "2026-01-02", "completed": "2026-01-03", "refs": ["RFC-0007:C-A"]},
           "content": {"description": "Do the work.",
                       "acceptance_criteria": [{"text": "c", "status": "done", "category": "fixed"}]}}


def _with(doc, path, value):
    """A deep copy of ``doc`` with ``path`` (keys / indexes) set to ``value`` (``...`` deletes it)."""
    import copy

    doc = copy.deepcopy(doc)
    node = doc
    for k in path[:-1]:
        node = node[k]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


def test_the_checkers_pass_good_documents():
    assert check_rfc(GOOD_RFC, "RFC-0007") == []
    assert check_clause(GOOD_CLAUSE, "C-A", "1.2.0") == []
    assert check_work_item(GOOD_WI, "2026-01-02-the-work") == []


OLD_LAYOUT = {"rfc_id": "RFC-0007", "title": "T", "version": "1.0.0", "status": "normative", "phase": "impl",
              "owners": ["@o"], "created": "2026-01-02", "sections": [{"title": "S"}],
              "changelog": [{"version": "1.0.0", "date": "2026-01-02"}]}
BAD_RFC = [
    (OLD_LAYOUT, "lacks govctl"),
    (_with(GOOD_RFC, ["govctl", "id"], "RFC-7"), "does not match"),
    (_with(GOOD_RFC, ["govctl", "id"], "RFC-0008"), "is not its folder"),
    (_with(GOOD_RFC, ["govctl", "title"], ...), "lacks title"),
    (_with(GOOD_RFC, ["govctl", "version"], "1.2"), "govctl.version"),
    (_with(GOOD_RFC, ["govctl", "status"], "final"), "govctl.status"),
    (_with(GOOD_RFC, ["govctl", "phase"], "done"), "govctl.phase"),
    (_with(GOOD_RFC, ["govctl", "owners"], []), "govctl.owners"),
    (_with(GOOD_RFC, ["govctl", "created"], dt.date(2026, 1, 2)), "quoted YYYY-MM-DD"),
    (_with(GOOD_RFC, ["govctl", "created"], "2026-02-30"), "not a date"),
    (_with(GOOD_RFC, ["govctl", "updated"], "2025-12-31"), "before govctl.created"),
    (_with(GOOD_RFC, ["govctl", "rfc_id"], "RFC-0007"), "unknown field rfc_id"),
    (_with(_with(GOOD_RFC, ["govctl", "status"], "draft"), ["govctl", "phase"], "stable"), "draft with phase stable"),
    (_with(GOOD_RFC, ["govctl", "status"], "deprecated"), "deprecated with phase impl"),
    (_with(GOOD_RFC, ["govctl", "status"], "draft"), "phase gate"),
    (_with(GOOD_RFC, ["sections"], []), "sections must be"),
    (_with(GOOD_RFC, ["sections", 0, "clauses"], ["C-A.toml"]), "sections[0].clauses[0]"),
    (_with(GOOD_RFC, ["changelog", 0, "version"], "1.1.0"), "exactly one entry for version 1.2.0"),
    (_with(GOOD_RFC, ["changelog", 1, "summary"], "old key"), "unknown field summary"),
    (_with(GOOD_RFC, ["changelog", 1, "date"], "yesterday"), "changelog[1].date"),
]
BAD_CLAUSE = [
    ({"clause_id": "C-A", "title": "A", "kind": "normative", "text": "x"}, "lacks govctl"),
    (_with(GOOD_CLAUSE, ["govctl", "id"], "C-B"), "is not its file name"),
    (_with(GOOD_CLAUSE, ["govctl", "kind"], "binding"), "govctl.kind"),
    (_with(GOOD_CLAUSE, ["govctl", "status"], "gone"), "govctl.status"),
    (_with(GOOD_CLAUSE, ["govctl", "since"], "v1"), "govctl.since"),
    (_with(GOOD_CLAUSE, ["govctl", "since"], "2.0.0"), "after the RFC's version"),
    (_with(GOOD_CLAUSE, ["govctl", "since"], ...), "no govctl.since"),
    (_with(GOOD_CLAUSE, ["govctl", "status"], "superseded"), "superseded_by"),
    (_with(GOOD_CLAUSE, ["govctl", "superseded_by"], "C-B"), "superseded_by"),
    (_with(GOOD_CLAUSE, ["content", "text"], "  "), "content.text"),
    (_with(GOOD_CLAUSE, ["content", "extra"], "x"), "unknown field extra"),
]
BAD_WI = [
    (_with(GOOD_WI, ["govctl", "id"], "WI-2026-1-2-1"), "does not match"),
    (_with(GOOD_WI, ["govctl", "id"], "WI-2026-01-05-001"), "is not govctl.created"),
    (_with(GOOD_WI, ["govctl", "status"], "finished"), "govctl.status"),
    (_with(GOOD_WI, ["govctl", "created"], ...), "lacks created"),
    (_with(GOOD_WI, ["govctl", "completed"], "2026-01-01"), "created <= started <= completed"),
    (_with(GOOD_WI, ["govctl", "completed"], ...), "done without govctl.completed"),
    (_with(GOOD_WI, ["govctl", "refs"], ["RFC-1"]), "govctl.refs[0]"),
    (_with(GOOD_WI, ["govctl", "start_date"], "2026-01-02"), "unknown field start_date"),
    (_with(GOOD_WI, ["content", "description"], "TODO"), "placeholder"),
    (_with(GOOD_WI, ["content", "acceptance_criteria", 0, "status"], "pending"), "done with pending criteria"),
    (_with(GOOD_WI, ["content", "acceptance_criteria", 0, "category"], "feature"), ".category"),
    (_with(GOOD_WI, ["content", "acceptance_criteria", 0, "text"], ""), ".text"),
    (_with(GOOD_WI, ["content", "notes"], "one string"), "content.notes"),
]


@pytest.mark.parametrize("doc,why", BAD_RFC, ids=[w for _, w in BAD_RFC])
def test_the_rfc_checker_refuses(doc, why):
    problems = check_rfc(doc, "RFC-0007")
    assert any(why in p for p in problems), problems


@pytest.mark.parametrize("doc,why", BAD_CLAUSE, ids=[w for _, w in BAD_CLAUSE])
def test_the_clause_checker_refuses(doc, why):
    problems = check_clause(doc, "C-A", "1.2.0")
    assert any(why in p for p in problems), problems


@pytest.mark.parametrize("doc,why", BAD_WI, ids=[w for _, w in BAD_WI])
def test_the_work_item_checker_refuses(doc, why):
    problems = check_work_item(doc, "2026-01-02-the-work")
    assert any(why in p for p in problems), problems
