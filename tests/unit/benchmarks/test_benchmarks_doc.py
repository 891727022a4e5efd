"""BENCHMARKS.md is a reference, not a notebook: every table in it is rendered from a result file
in benchmarks/results/ (benchmarks/render.py), every result file is cited, and every cited file
exists. Fast: reads files only."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

REPO = ROOT
sys.path.insert(0, str(REPO / "benchmarks"))
import render  # noqa: E402

DOC = (REPO / "BENCHMARKS.md").read_text()


@pytest.mark.timeout(30)
def test_every_table_comes_from_its_result_file_and_every_file_is_cited() -> None:
    assert render.problems(DOC) == []


@pytest.mark.timeout(30)
def test_a_figure_changed_by_hand_is_caught() -> None:
    block = render.render_block(render.BLOCKS[0])
    row = next(
        line for line in block.splitlines() if line.startswith("| ") and any(c.isdigit() for c in line)
    )
    edited = row.replace(next(c for c in row if c.isdigit()), "9" if "9" not in row[:3] else "8", 1)
    assert edited != row
    found = render.problems(DOC.replace(row, edited, 1))
    assert any("differ from the result files" in p for p in found), found


@pytest.mark.timeout(30)
def test_a_table_outside_the_blocks_is_caught() -> None:
    found = render.problems(DOC + "\n| a table | typed by hand |\n|---|---|\n| 1 | 2 |\n")
    assert any("outside the rendered blocks" in p for p in found), found


@pytest.mark.timeout(30)
def test_an_uncited_result_file_and_a_missing_one_are_caught(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(render.RESULTS, results)
    (results / "sharded_overhead-s21.json").write_text("{}\n")  # a dated variant nobody cites
    (results / "wait_cost.json").unlink()
    found = render.problems(DOC, results)
    assert "benchmarks/results/sharded_overhead-s21.json is cited nowhere" in found, found
    assert "benchmarks/results/wait_cost.json is cited but does not exist" in found, found


@pytest.mark.timeout(30)
def test_one_result_file_per_benchmark() -> None:
    files = sorted(p.relative_to(render.RESULTS).as_posix() for p in render.RESULTS.rglob("*") if p.is_file())
    assert all(f.endswith(".json") for f in files), files
    assert len({b.file for b in render.BLOCKS}) == len(render.BLOCKS)
    assert sorted({b.file for b in render.BLOCKS} | set(render.SIDE_FILES)) == files
