"""No source module is over 400 lines (issue 35).

A module past that size has almost always grown a second concept beside its first: the reader
has to hold both to change either. The fix is a split along that concept (a helper class that
owns its own state, a group of pure functions, a typed message, a decision rule) into its own
module in the same folder, never a class's methods spread over several modules. There is no
allowlist: a module over the limit is split, not excused.
"""

from __future__ import annotations

import pytest

from tests.helpers.paths import ROOT

pytestmark = pytest.mark.timeout(60)

PACKAGE = ROOT / "src" / "checkpointless"
MAX_LINES = 400


def test_no_source_module_is_over_400_lines() -> None:
    modules = sorted(PACKAGE.rglob("*.py"))
    assert modules, f"no modules found under {PACKAGE}"
    over = {
        str(path.relative_to(ROOT)): n
        for path in modules
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not over, "\n".join(
        f"{path} has {n} lines, over {MAX_LINES}: split it along a concept (a helper class that owns "
        "its own state, a group of pure functions, a typed message, a decision rule) into a "
        "well-named module in the same folder; a class's methods stay in one module"
        for path, n in sorted(over.items())
    )
