from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.harness.fixtures import netns_hosts, slurm_cluster
from tests.helpers.reference import ReferenceRuns
from tests.helpers.shared import SharedDir, shared_root

__all__ = ["corpus", "netns_hosts", "reference", "shared", "slurm_cluster"]  # fixtures pytest finds here

# The folder a test sits in is its kind: `pytest -m unit` (or e2e, multihost) selects by it, and
# a test moved between folders changes kind with no marker to edit.
_KINDS = ("unit", "e2e", "multihost")
_TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = item.path.resolve().relative_to(_TESTS).parts[0]
        except ValueError:  # a test outside tests/ (none today): no kind
            continue
        if top in _KINDS:
            item.add_marker(top)


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> SharedDir:
    """Results made once for the whole run, whichever xdist worker needs them first."""
    return SharedDir(shared_root(tmp_path_factory))


@pytest.fixture(scope="session")
def corpus(shared: SharedDir) -> Path:
    from checkpointless.data import make_synthetic_corpus, prepare_main

    def make(d: Path) -> None:
        make_synthetic_corpus(d / "corpus.jsonl", num_docs=400, seed=0)
        assert prepare_main([str(d / "corpus.jsonl"), "-o", str(d / "corpus.tokens"), "--quiet"]) == 0

    # one path for every worker: a reference run is shared only between calls on the same data
    return shared.folder("corpus", make, timeout=120) / "corpus.tokens"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, shared: SharedDir) -> ReferenceRuns:
    """Fault-free runs, each run once per test run: ``reference(nproc, script_args=..., ...)``
    (tests/helpers/reference.py), on the run's corpus unless a call names other data."""
    return ReferenceRuns(lambda: tmp_path_factory.mktemp("ref"), corpus, shared)
