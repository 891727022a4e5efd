"""The benchmarks' shared harness: start the jobs of each design and interleave them, count each
run's CPU from every process it started (``cpu``), read the jobs' logs (``logs``), compute ratios,
confidence intervals and verdicts (``stats``), and write one result file (``report``).

Every script in ``benchmarks/`` answers one question with it; ``benchmarks/render.py`` turns the
result files into BENCHMARKS.md's tables. Scripts import it as ``import _harness as bl`` with the
``benchmarks/`` folder on ``sys.path``.
"""

from __future__ import annotations

from .cpu import CpuAccount, cgroup_base, cpu_at, process_tree
from .logs import cpu_error, cpu_per_step, read_jsonl, run_error, steady_start, step_times
from .procs import (
    BASELINE,
    BENCH,
    EXAMPLE,
    PYTHON,
    REPO,
    RESULTS,
    TORCHRUN,
    Finished,
    bench_env,
    cleanup_on_exit,
    example_batch_args,
    free_port,
    kill_all_started,
    kill_tree,
    run_bar,
    run_command,
    run_job,
    say,
)
from .report import add_model_args, add_run_args, load_note, machine_info, save_result, write_json
from .stats import fmt, fmt_spread, interleaved, ratio_ci, summary, table, verdict

__all__ = [
    "BASELINE",
    "BENCH",
    "EXAMPLE",
    "PYTHON",
    "REPO",
    "RESULTS",
    "TORCHRUN",
    "CpuAccount",
    "Finished",
    "add_model_args",
    "add_run_args",
    "bench_env",
    "cgroup_base",
    "cleanup_on_exit",
    "cpu_at",
    "cpu_error",
    "cpu_per_step",
    "example_batch_args",
    "fmt",
    "fmt_spread",
    "free_port",
    "interleaved",
    "kill_all_started",
    "kill_tree",
    "load_note",
    "machine_info",
    "process_tree",
    "ratio_ci",
    "read_jsonl",
    "run_bar",
    "run_command",
    "run_error",
    "run_job",
    "save_result",
    "say",
    "steady_start",
    "step_times",
    "summary",
    "table",
    "verdict",
    "write_json",
]
