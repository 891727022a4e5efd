"""The benchmarks' harness counts a run's CPU from every process the run started, whatever
forked it, and a run whose CPU was not fully counted is an error, not a data point (issue 35:
one design's CPU per step read 0.0 ms when its processes left the sampled process tree)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import _harness as bl

# The command's child forks a grandchild and exits at once: the grandchild is re-parented out of
# the command's process tree, burns ~0.6 s of CPU, and exits before anyone reaps it here. The
# command lives on until the orphan is done (its pipe's write end closes with it): a fixed sleep
# once ended the command with the orphan at 0.42 s of CPU on a loaded machine.
ORPHAN = textwrap.dedent(
    """
    import os, sys, time
    r, w = os.pipe()
    if os.fork() == 0:
        if os.fork() == 0:
            os.close(r)
            t = time.process_time()
            while time.process_time() - t < 0.6:
                pass
            os._exit(0)
        os._exit(0)
    os.close(w)
    os.wait()
    os.read(r, 1)  # EOF once the orphan has exited
    """
)


@pytest.mark.timeout(60)
def test_the_cpu_of_a_process_that_left_the_tree_is_counted(tmp_path: Path) -> None:
    if bl.cgroup_base() is None:
        pytest.skip("no cgroup this process may create (not root, or no cgroup v2 / cpuacct)")
    fin = bl.run_command([sys.executable, "-c", ORPHAN], timeout=30, sample_cpu=True)
    assert fin.rc == 0 and fin.cpu_error is None, fin
    assert fin.cpu_method.startswith("cgroup")
    assert fin.cpu_samples[-1][1] >= 0.5, fin.cpu_samples  # the orphan's 0.6 s, and no more lost
    # the walk of the command's tree alone misses the orphan: that was the bug
    os.environ["CHECKPOINTLESS_BENCH_CPU"] = "proc"
    try:
        tree = bl.run_command([sys.executable, "-c", ORPHAN], timeout=30, sample_cpu=True)
    finally:
        del os.environ["CHECKPOINTLESS_BENCH_CPU"]
    assert tree.cpu_method == "proc-tree" and tree.cpu_samples[-1][1] < 0.45, tree.cpu_samples
    # and the run's cgroup is gone with every process in it
    base = bl.cgroup_base()
    assert base is not None and not list(base[0].glob(f"cl-bench-{os.getpid()}-*"))


@pytest.mark.timeout(30)
def test_a_run_without_counted_cpu_is_an_error() -> None:
    assert bl.run_error(False, 0, 20, 10, (None, 0.025)) is None
    assert "0.0 ms of CPU per step" in str(bl.run_error(False, 0, 20, 10, (None, 0.0)))
    assert "no CPU samples" in str(bl.run_error(False, 0, 20, 10, (None, None)))
    assert "not readable" in str(bl.run_error(False, 0, 20, 10, ("CPU not readable (cgroup-v2): x", 0.02)))
    assert bl.run_error(True, None, 0, 10, (None, None)) == "timed out"
    # a samples list in which the CPU never moved gives 0.0 per step, which run_error refuses
    samples = [(0.0, 1.0), (10.0, 1.0)]
    cps = bl.cpu_per_step(samples, {5: 2.0, 6: 3.0, 7: 4.0}, 5)
    assert cps == 0.0 and bl.run_error(False, 0, 20, 10, (None, cps))
