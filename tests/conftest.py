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


# A test that fails runs once more (pytest-rerunfailures). Most tests start real processes (jobs,
# ranks, sockets) that race each other on a shared 2-core machine, and a single lost race must not
# stop `make test -x`, which CI runs. A flake is never silent, though: each rerun is listed by name
# with its first failure's cause at the end of the run, since every flake so far was a real race
# worth fixing (docs/testing.md). A broken feature fails both tries.
_reruns: list[tuple[str, str]] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            top = item.path.resolve().relative_to(_TESTS).parts[0]
        except ValueError:  # a test outside tests/ (none today): no kind
            continue
        if top in _KINDS:
            item.add_marker(top)
        if item.get_closest_marker("flaky") is None:
            item.add_marker(pytest.mark.flaky(reruns=1))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # under xdist this runs in the controller too, for every worker's reports
    if report.outcome == "rerun":
        crash = getattr(report.longrepr, "reprcrash", None)
        why = crash.message if crash is not None else str(report.longrepr)
        _reruns.append((report.nodeid, why.splitlines()[0][:300] if why else "?"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _reruns or hasattr(terminalreporter.config, "workerinput"):
        return
    terminalreporter.section("flaky: failed, then ran once more (fix the race each names)")
    for nodeid, why in _reruns:
        terminalreporter.write_line(f"RERUN {nodeid}: {why}")


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
