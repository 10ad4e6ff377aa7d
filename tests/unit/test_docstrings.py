"""Every public name's docstring has a one-line summary and documents each of its arguments (Google
style: ``Args:``/``Attributes:``, ``Returns:``, ``Raises:``), as the API reference (mkdocstrings, griffe's
parser) renders them: the same parser reads them here, so a new argument without its line fails."""
from pathlib import Path

import griffe
import pytest

import dpex

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = [name for name in dpex.__all__ if not name.startswith("Dpex") or name == "DpexDataLoader"]
RAY = ["ray.RayConfig", "ray.start", "ray.stop", "ray.status"]


@pytest.fixture(scope="module")
def package():
    return griffe.load("dpex", search_paths=[str(ROOT)], docstring_parser="google", resolve_aliases=True,
                       resolve_external=False)


def documented(obj) -> set[str]:
    names = set()
    for section in obj.docstring.parse("google"):
        if section.kind.value in ("parameters", "other_parameters", "attributes"):
            names |= {p.name.lstrip("*") for p in section.value}
    return names


def undocumented(obj, parameters) -> list[str]:
    assert obj.docstring is not None and obj.docstring.value.strip(), f"{obj.path}: no docstring"
    summary = obj.docstring.value.strip().splitlines()[0]
    assert summary.endswith("."), f"{obj.path}: no one-line summary: {summary!r}"
    have = documented(obj)
    return [p.name for p in parameters if p.name not in ("self", "cls") and p.name not in have]


@pytest.mark.parametrize("name", PUBLIC + RAY)
def test_a_public_names_every_argument_is_documented(package, name):
    obj = package[name]
    if obj.is_class:  # the constructor's arguments in the class's docstring (a dataclass's fields too)
        init = obj.members.get("__init__")
        missing = undocumented(obj, init.parameters if init is not None else [])
        assert not missing, f"{name}: {missing}"
        for member in obj.members.values():
            if member.is_function and not member.name.startswith("_"):
                assert not undocumented(member, member.parameters), f"{name}.{member.name}"
    else:
        assert not undocumented(obj, obj.parameters), name
