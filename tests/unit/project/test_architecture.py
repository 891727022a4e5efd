"""The shape of the source: which folder may import which, and no import circles (issue 35).

That no module reads another object's private fields is tests/unit/project/test_private_reads.py,
over the whole source, with the one allowlist of other libraries' internals.

Static checks over the source's syntax trees (imports inside functions and under
``TYPE_CHECKING`` count too); nothing is imported or run. Each rule is a table: a folder is added
to the house's rules by adding it to the table.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

SRC = ROOT / "src"

# Packages in which no modules import each other in a circle (their subpackages included).
CIRCLE_FREE = [
    "checkpointless.agent",
    "checkpointless.comm",
    "checkpointless.coordinator",
    "checkpointless.data",
    "checkpointless.faults",
    "checkpointless.integrations",
    "checkpointless.launcher",
    "checkpointless.observe",
    "checkpointless.protocol",
    "checkpointless.recovery",
    "checkpointless.rendezvous",
    "checkpointless.settings",
    "checkpointless.simulate",
    "checkpointless.state",
]

# what supervises the training processes, and the training process's own recovery layer
_SUPERVISOR = ["checkpointless.coordinator", "checkpointless.launcher", "checkpointless.agent"]
_ABOVE_LOWER_LAYERS = [*_SUPERVISOR, "checkpointless.recovery", "checkpointless.integrations"]
_TOOLS = ["checkpointless.observe", "checkpointless.simulate", "checkpointless.audit", "checkpointless.cli"]

# package -> the packages it must not import (a package's own subpackages are named in full).
FORBIDDEN: dict[str, list[str]] = {
    # the coordinator's rules are pure: nothing of the coordinator above them, no process code
    "checkpointless.coordinator.rules": [
        "checkpointless.coordinator",
        "checkpointless.launcher",
        "checkpointless.agent",
        "checkpointless.recovery",
    ],
    # the supervisors run every job and import no optional tool: the command line (cli.py) hands
    # the launcher its observers (metrics, progress) to start
    "checkpointless.launcher": _TOOLS,
    "checkpointless.agent": _TOOLS,
    "checkpointless.coordinator": _TOOLS,
    # the training process never imports what supervises it: the heartbeat record, the peer-table
    # file and the control channel's client are the protocol's (the shared layer below both); nor
    # an optional tool
    "checkpointless.recovery": [*_SUPERVISOR, *_TOOLS],
    "checkpointless.integrations": _TOOLS,
    # the shared lower layers (frames, messages, settings, events) know nothing above them
    "checkpointless.protocol": [*_ABOVE_LOWER_LAYERS, *_TOOLS, "checkpointless.comm", "checkpointless.state"],
    "checkpointless.wire": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    "checkpointless.config": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    # the settings sit below the protocol, which carries them in the agents' welcome
    "checkpointless.settings": [*_ABOVE_LOWER_LAYERS, *_TOOLS, "checkpointless.protocol"],
    "checkpointless.events": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    # the worker's building blocks: no supervisor, no recovery driver, no optional tool
    "checkpointless.comm": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    "checkpointless.state": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    "checkpointless.data": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    "checkpointless.rendezvous": [*_ABOVE_LOWER_LAYERS, *_TOOLS],
    # the optional tools read run files and models; they never reach into a running job's code
    "checkpointless.observe": [*_ABOVE_LOWER_LAYERS, "checkpointless.comm", "checkpointless.state"],
    "checkpointless.simulate": [*_ABOVE_LOWER_LAYERS, "checkpointless.comm", "checkpointless.state"],
    # the audit runs jobs through the command line and reads the fingerprint files they write
    "checkpointless.audit": [*_ABOVE_LOWER_LAYERS, "checkpointless.comm", "checkpointless.state"],
}


def _within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@cache
def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(SRC.rglob("*.py")):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    return mods


@cache
def _tree(name: str) -> ast.Module:
    return ast.parse(_modules()[name].read_text(encoding="utf-8"))


@cache
def _imports(name: str) -> frozenset[str]:
    """The project modules (and packages) ``name`` imports."""
    mods = _modules()
    pkg = name if mods[name].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(t for t in targets if t in mods and t != name)
    return frozenset(out)


def _circles(names: list[str]) -> list[list[str]]:
    """The import circles among ``names`` (an import of a package's ``__init__`` is not followed:
    it re-exports, and is imported by its own modules)."""
    mods, inside = _modules(), set(names)
    return _strong_components(
        {n: [t for t in _imports(n) if t in inside and mods[t].name != "__init__.py"] for n in names}
    )


def _strong_components(edges: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", CIRCLE_FREE)
def test_no_import_circle(package: str) -> None:
    names = [n for n in _modules() if _within(n, package)]
    assert names, f"no modules under {package}"
    assert _circles(names) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_run_one_way(package: str) -> None:
    bad = []
    for n in _modules():
        if not _within(n, package):
            continue
        for t in sorted(_imports(n)):
            if _within(t, package):
                continue
            bad += [f"{n} imports {t}" for f in FORBIDDEN[package] if _within(t, f)]
    assert bad == []


def test_the_checks_see_what_they_look_for() -> None:
    """The checks are not vacuous: the package's modules and a known import are found, and a
    circle among made-up edges is found."""
    assert "checkpointless.coordinator.coordinator" in _modules()
    assert "checkpointless.coordinator.rounds" in _imports("checkpointless.coordinator.coordinator")
    assert _strong_components({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _strong_components({"a": ["b"], "b": [], "c": ["a"]}) == []
