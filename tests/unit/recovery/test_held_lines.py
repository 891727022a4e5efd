"""A section's held lines kept outside the process (recovery/held_lines.py): read back only for
the section and boundary they were kept for, never torn or foreign, gone once shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpointless.recovery.held_lines import HeldLinesFile

pytestmark = pytest.mark.timeout(30)


def test_kept_lines_are_read_back_for_their_section_and_boundary_only(tmp_path: Path) -> None:
    kept = HeldLinesFile(tmp_path, 3)
    kept.keep(10, "eval", b'[{"eval_loss": 1.5}]')
    successor = HeldLinesFile(tmp_path, 3)  # the replacement, on the same host
    assert successor.load(10, "eval") == b'[{"eval_loss": 1.5}]'
    assert successor.load(9, "eval") is None and successor.load(10, "save") is None
    assert HeldLinesFile(tmp_path, 2).load(10, "eval") is None  # another rank's
    kept.keep(10, "eval", None)  # a redone attempt that held nothing: the older one goes
    assert successor.load(10, "eval") is None
    kept.keep(20, "eval", b"x")
    kept.drop()  # shown
    assert successor.load(20, "eval") is None and not list(tmp_path.iterdir())
    kept.drop()  # nothing to drop: no error


def test_a_torn_or_altered_file_is_refused(tmp_path: Path) -> None:
    kept = HeldLinesFile(tmp_path, 0)
    kept.keep(5, "eval", b"lines held")
    path = tmp_path / "rank0.held"
    whole = path.read_bytes()
    path.write_bytes(whole[:-3])  # cut short by a SIGKILL
    assert kept.load(5, "eval") is None
    path.write_bytes(whole.replace(b"lines", b"LINES"))
    assert kept.load(5, "eval") is None
    path.write_bytes(b"")
    assert kept.load(5, "eval") is None


def test_without_a_directory_nothing_is_kept() -> None:
    kept = HeldLinesFile(None, 0)
    kept.keep(1, "eval", b"x")
    assert kept.load(1, "eval") is None
    kept.drop()
