"""The registry every extension point uses: names in the order added, each
once, an unknown name refused with the choices, a bad ``add`` refused with
nothing added."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cpkv.contract.registry import Registry

NAMES = st.from_regex(r"[a-z0-9][a-z0-9.\-]{0,8}", fullmatch=True)


@given(st.lists(NAMES, unique=True, min_size=1, max_size=8))
def test_names_in_order_each_reaching_its_entry(names):
    reg = Registry("thing")
    entries = [object() for _ in names]
    for n, e in zip(names, entries):
        assert reg.add(n, e, f"the {n}") is e
    assert reg.names() == tuple(names) == tuple(reg) and len(reg) == len(names)
    for n, e in zip(names, entries):
        assert reg.get(n) is e and reg.check(n) == n and reg.summary(n) == f"the {n}" and n in reg
    assert reg.describe() == "; ".join(f"{n}: the {n}" for n in names)


@given(st.lists(NAMES, unique=True, min_size=1, max_size=5), st.data())
def test_a_second_add_of_a_name_is_refused_and_changes_nothing(names, data):
    reg = Registry("thing")
    for n in names:
        reg.add(n, n, "x")
    again = data.draw(st.sampled_from(names))
    with pytest.raises(ValueError, match=f"thing {again!r} is registered already"):
        reg.add(again, "other", "y")
    assert reg.get(again) == again and reg.names() == tuple(names)


@pytest.mark.parametrize("name", ["", "Upper", "a b", "a,b", "-x", 3, None])
def test_malformed_names_and_summaries_refused(name):
    reg = Registry("thing")
    with pytest.raises(ValueError, match="a thing name is lower case"):
        reg.add(name, 1, "x")
    for summary in ("", "  ", "two\nlines", 7):
        with pytest.raises(ValueError, match="one non-empty line"):
            reg.add("ok", 1, summary)
    assert len(reg) == 0


def test_unknown_name_names_the_choices():
    reg = Registry("kernel backend")
    reg.register("torch", "the reference")(int)
    reg.add("triton", float, "kernels")
    for bad in ("cuda", None, ["torch"]):
        with pytest.raises(ValueError, match=r"unknown kernel backend .*; choose from torch, triton"):
            reg.get(bad)
        assert bad not in reg
    with pytest.raises(ValueError, match="unknown kernel backend"):
        reg.check("auto")
