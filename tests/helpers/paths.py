"""Where things are in the repository, for tests wherever their folder sits under tests/."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"  # small training scripts that the tests run as real jobs
EXAMPLE = ROOT / "examples" / "train_gpt.py"
