"""docs/configuration.md, the CLI and the settings classes agree (issue 35): every flag of
`checkpointless run` is in the table once and every row is a flag that exists, with the default the
parser really has; the table's flag and default columns are exactly what
`python -m checkpointless.settings.docs` generates from JobSettings, and the agent's entry is
AgentSettings' synopsis. A flag added, renamed or re-defaulted without the docs fails here."""

from __future__ import annotations

import argparse
import re

import pytest

from checkpointless.cli import build_parser
from checkpointless.settings.docs import agent_synopsis, render, table_rows
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

DOC = ROOT / "docs" / "configuration.md"
_ROW = re.compile(r"^\| `(--[a-z0-9-]+)[^`]*` \| ([^|]*) \|")


def _subparser(name: str) -> argparse.ArgumentParser:
    for action in build_parser()._actions:  # argparse keeps its subparsers here, and nowhere public
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise AssertionError("no subcommands")


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        max(a.option_strings, key=len): a
        for a in p._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    }


def _documented_rows(section: str) -> dict[str, str]:
    text = DOC.read_text(encoding="utf-8")
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    body = body.split("\n### ", 1)[0]  # the flags' table, not the error table below it
    rows: dict[str, str] = {}
    for line in body.splitlines():
        m = _ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} documented twice"
            rows[m.group(1)] = m.group(2).strip()
    return rows


def _literal(doc_default: str) -> object:
    """The value a documented default names, or None where it is prose (an environment variable,
    a path pattern, another flag)."""
    d = doc_default.strip("`")
    first = d.split(" ")[0].strip("`")
    if first in ("off", "none"):
        return "off"
    try:
        return float(first)
    except ValueError:
        return None


def test_every_run_flag_is_documented_once_and_every_row_exists() -> None:
    flags = set(_options(_subparser("run")))
    rows = set(_documented_rows("`checkpointless run`"))
    assert flags - rows == set(), "flags missing from docs/configuration.md's table"
    assert rows - flags == set(), "rows in docs/configuration.md for flags the CLI does not have"


def test_the_documented_defaults_are_the_parsers() -> None:
    opts = _options(_subparser("run"))
    checked = 0
    for flag, doc in _documented_rows("`checkpointless run`").items():
        want = _literal(doc)
        if want is None:
            continue
        got = opts[flag].default
        if want == "off":
            assert got in (None, False, 0, []), (flag, doc, got)
        elif (isinstance(got, (int, float)) and not isinstance(got, bool)) or isinstance(got, str):
            assert float(got) == want, (flag, doc, got)
        else:
            raise AssertionError(f"{flag}: documented default {doc!r}, parser default {got!r}")
        checked += 1
    assert checked >= 30, checked  # the check would pass vacuously if the table's form changed


def test_the_coordinator_takes_the_same_flags_as_run() -> None:
    assert set(_options(_subparser("coordinator"))) == set(_options(_subparser("run")))


def test_every_agent_flag_is_named_in_the_docs() -> None:
    text = DOC.read_text(encoding="utf-8")
    entry = text.split("- `checkpointless agent", 1)[1].split("\n- ", 1)[0]
    assert [f for f in _options(_subparser("agent")) if f not in entry] == []


def test_the_table_is_generated_from_the_settings() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert render(text) == text, "run `python -m checkpointless.settings.docs` and review the diff"
    rows = _documented_rows("`checkpointless run`")
    assert [(name, cells) for name, _, cells in table_rows()] == list(rows.items())


def test_the_agent_entry_is_the_settings_synopsis() -> None:
    entry = DOC.read_text(encoding="utf-8").split("- `checkpointless agent", 1)[1].split("\n- ", 1)[0]
    assert agent_synopsis() in "`checkpointless agent" + entry.replace("\n  ", " ")
