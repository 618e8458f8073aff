"""docs/methods.md describes the registered methods as they are: every method is on the page with its default sink and
window, and with every parameter its class takes and that parameter's default; every parameter is described in its
class's (or module's) docstring; the arXiv id the page gives for a method is the one its module cites, and is in
docs/design.md's table of papers; the README's opening paragraph and that table name every method."""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

from kvcompress.methods import Method, get_method_class, method_names

REPO = Path(__file__).resolve().parents[1]
PAGE = (REPO / "docs" / "methods.md").read_text(encoding="utf-8")
DESIGN = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
README = (REPO / "README.md").read_text(encoding="utf-8")
NAMES = method_names()
ARXIV = re.compile(r"arXiv:(\d{4}\.\d{4,5})")


def summary_rows() -> dict[str, list[str]]:
    """{registered name: the cells of its row} of the page's table of methods (name, paper, keeps, sink, window)."""
    rows = {}
    for line in PAGE.splitlines():
        match = re.match(r"\| `(\w+)` \|(.*)\|$", line)
        if match and line.count("|") == 6:
            rows[match.group(1)] = [cell.strip() for cell in match.group(2).split("|")]
    return rows


def parameter_sections() -> dict[str, str]:
    """{registered name: the text of its "### `name`" section} under the page's "## Parameters"."""
    text = PAGE.split("\n## Parameters\n", 1)[1]
    parts = re.split(r"^### `(\w+)`$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def documented(name: str) -> dict[str, str]:
    """{parameter: its default as the page writes it} of method `name`'s parameter table."""
    return dict(re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", parameter_sections()[name], flags=re.M))


def rendered(f: dataclasses.Field) -> str:
    """A field's default as the page writes it: a Python value's repr; a default method instance as its class called
    with no arguments (AdaKV's scorer, `SnapKV()`)."""
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if isinstance(value, Method):
        assert value == type(value)(), f"{f.name}'s default is not {type(value).__name__}() with its defaults"
        return f"{type(value).__name__}()"
    return repr(value)


def docstrings(cls: type) -> str:
    return (cls.__doc__ or "") + "\n" + (sys.modules[cls.__module__].__doc__ or "")


def test_the_page_lists_every_registered_method_and_no_other():
    assert NAMES
    assert sorted(summary_rows()) == NAMES
    assert sorted(parameter_sections()) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_default_sink_and_window_are_the_class_attributes(name):
    cls = get_method_class(name)
    *_, sink, window = summary_rows()[name]
    assert (sink, window) == (str(cls.default_sink), str(cls.default_window)), name


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_is_listed_with_its_default(name):
    cls = get_method_class(name)
    page = documented(name)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        assert f.name in page, f"docs/methods.md does not list {name}'s parameter {f.name}"
        assert page[f.name] == rendered(f), f"docs/methods.md gives {name}'s {f.name} the default {page[f.name]}, the class {rendered(f)}"
    if not any(f.init for f in dataclasses.fields(cls)):
        assert "No parameters." in parameter_sections()[name]


@pytest.mark.parametrize("name", NAMES)
def test_a_listed_name_that_is_no_field_is_one_the_method_takes_by_name(name):
    """A parameter the page lists beside the fields (AdaKV's scorer_params) is one `from_params` takes, with the
    default the page gives."""
    cls = get_method_class(name)
    fields = {f.name for f in dataclasses.fields(cls)}
    for extra, default in documented(name).items():
        if extra not in fields:
            cls.from_params({extra: ast.literal_eval(default)})


def test_from_params_refuses_a_name_it_does_not_take():
    """What makes the check above mean something: a name that is neither a field nor taken by `from_params` fails."""
    with pytest.raises(ValueError, match="no parameter"):
        get_method_class("snapkv").from_params({"scorer_params": None})


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_is_described_in_the_docstrings(name):
    cls = get_method_class(name)
    text = docstrings(cls)
    missing = [f.name for f in dataclasses.fields(cls) if f.init and not re.search(rf"(?<![\w.]){re.escape(f.name)}(?!\w)", text)]
    assert not missing, f"{cls.__name__}'s docstrings do not describe {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_the_arxiv_id_is_the_one_the_module_cites_and_is_in_the_table_of_papers(name):
    cls = get_method_class(name)
    papers = DESIGN.split("## The papers", 1)[1].split("\n## ", 1)[0]
    for arxiv in ARXIV.findall(summary_rows()[name][0]):
        assert arxiv in docstrings(cls), f"docs/methods.md cites arXiv:{arxiv} for {name}; its module does not"
        assert arxiv in papers, f"docs/design.md's table of papers lacks arXiv {arxiv} ({name})"


def test_the_readme_and_the_table_of_papers_name_every_method():
    opening = README.split("\n## ", 1)[0].replace("\n", " ").lower()
    papers = DESIGN.split("## The papers", 1)[1].split("\n## ", 1)[0].lower()
    for name in NAMES:
        cls = get_method_class(name).__name__.lower()
        assert cls in opening, f"README.md's opening paragraph does not name {cls}"
        assert cls in papers, f"docs/design.md's table of papers does not name {cls}"
