"""docs/configuration.md's flag table, generated from the settings classes.

The table of ``checkpointless run`` has four columns: the flag, its default, what it does and when
to change it. The first two come from :class:`~.job.JobSettings` (its field order, flag names,
metavars and defaults); the prose of the other two is the docs' own, kept row by row. A flag
added to the settings gets a row with its help text to be written up; a row for a flag that is gone
is dropped. The agent's synopsis (``checkpointless agent ...``) comes from
:class:`~.agent.AgentSettings`.

    python -m checkpointless.settings.docs            # rewrite docs/configuration.md
    python -m checkpointless.settings.docs --check    # exit 1 if it is not what this would write
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from pathlib import Path

from checkpointless.settings.agent import AgentSettings
from checkpointless.settings.argv import cell
from checkpointless.settings.job import JobSettings
from checkpointless.settings.spec import base_type, default_of, doc_default, flag_fields, hints, option

__all__ = ["DOC", "agent_synopsis", "main", "render", "table_rows"]

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
_HEADING = "## `checkpointless run`\n"
_ROW = re.compile(r"^\| `(--[a-z0-9-]+)[^`]*` \| (?:[^|\\]|\\\|)*? \| (.*) \|$")


def table_rows() -> list[tuple[str, str, str]]:
    """(option, flag cell, default cell) of every option of ``checkpointless run``, in order."""
    types_of = hints(JobSettings)
    rows = []
    for f, fl in flag_fields(JobSettings):
        if fl.positional:
            continue
        flag_cell = cell(f, fl, base_type(types_of[f.name])).replace("|", "\\|")
        rows.append((option(f, fl), f"`{flag_cell}`", doc_default(f, fl)))
    return rows


def agent_synopsis() -> str:
    """``checkpointless agent --coordinator HOST:PORT ... [--no-rejoin]``: required flags bare,
    the others in brackets."""
    types_of = hints(AgentSettings)
    parts = ["checkpointless agent"]
    for f, fl in flag_fields(AgentSettings):
        text = cell(f, fl, base_type(types_of[f.name]))
        parts.append(text if default_of(f) is dataclasses.MISSING else f"[{text}]")
    return " ".join(parts)


def render(text: str) -> str:
    """``text`` (docs/configuration.md) with the run table's flag and default columns generated."""
    head, rest = text.split(_HEADING, 1)
    lines = rest.split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith("| `--"))
    end = next(i for i in range(first, len(lines)) if not lines[i].startswith("|"))
    prose: dict[str, str] = {}
    for line in lines[first:end]:
        m = _ROW.match(line)
        if m is None:
            raise ValueError(f"docs/configuration.md: a row of the flag table does not parse: {line[:80]}")
        prose[m.group(1)] = m.group(2)
    help_of = {option(f, fl): fl.help for f, fl in flag_fields(JobSettings)}
    table = [
        f"| {flag_cell} | {default} | {prose.get(name, help_of[name] + ' | ')} |"
        for name, flag_cell, default in table_rows()
    ]
    return head + _HEADING + "\n".join(lines[:first] + table + lines[end:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m checkpointless.settings.docs", description=__doc__)
    ap.add_argument("--check", action="store_true", help="only say whether the file is up to date")
    ap.add_argument("path", nargs="?", type=Path, default=DOC)
    args = ap.parse_args(argv)
    old = args.path.read_text(encoding="utf-8")
    new = render(old)
    if agent_synopsis() not in new.replace("\n  ", " "):
        print(f"{args.path}: the agent's entry does not read `{agent_synopsis()}`", file=sys.stderr)
        return 1
    if args.check:
        diff = list(
            difflib.unified_diff(old.splitlines(), new.splitlines(), str(args.path), "generated", lineterm="")
        )
        print("\n".join(diff) or f"{args.path} is up to date")
        return 1 if diff else 0
    if new != old:
        args.path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
