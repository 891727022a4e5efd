"""Pool the paired rounds of several ``sharded_overhead.py`` runs into one interval per measure.

Why: on a 2-core machine one round's ratio (a design's run against plain FSDP2's, next to each
other) has an SD of 10-13%, so telling a 2% target takes a few hundred rounds, more than one
run fits between other work. Each file's rounds are paired exactly as that run paired them (the
same round number, both runs finished); the pooled interval is ``_harness.ratio_ci``'s bootstrap
over all of them, at 95% (the benchmark's rule) and at 99% (rounds were added after earlier looks
were undecided, which weakens a 95% interval's guarantee). Every run's final shards are also
checked: a design whose digests differ from plain FSDP2's in any file is reported.

Run: python benchmarks/pool_rounds.py --mesh 2x2 --design checkpointless --out OUT.json A.json B.json ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent / "baseline"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _harness as bl


def paired(doc: dict[str, Any], mesh: str, design: str) -> tuple[list[float], list[float]]:
    """The round ratios (step, CPU) of ``design`` against plain FSDP2 in one result file."""
    ok = [r for r in doc["runs"] if r["error"] is None and r["mesh"] == mesh]
    by_round: dict[tuple[int, str], dict[str, Any]] = {(r["round"], r["design"]): r for r in ok}
    step, cpu = [], []
    for i in sorted({r["round"] for r in ok}):
        x, y = by_round.get((i, design)), by_round.get((i, "fsdp"))
        if x is None or y is None:
            continue
        step.append(x["median_step_s"] / y["median_step_s"])
        if x["cpu_per_step_s"] and y["cpu_per_step_s"]:
            cpu.append(x["cpu_per_step_s"] / y["cpu_per_step_s"])
    return step, cpu


def same_shards(doc: dict[str, Any], mesh: str, design: str) -> bool:
    digests = {
        d: {r["digest"] for r in doc["runs"] if r["mesh"] == mesh and r["design"] == d and r["error"] is None}
        for d in (design, "fsdp")
    }
    return digests[design] == digests["fsdp"] and len(digests["fsdp"]) == 1


def pool(docs: list[tuple[str, dict[str, Any]]], mesh: str, design: str, target_pct: float) -> dict[str, Any]:
    parts, step, cpu = [], [], []
    for name, doc in docs:
        s, c = paired(doc, mesh, design)
        step += s
        cpu += c
        m = doc.get("machine", {})
        parts.append(
            {
                "file": name,
                "command": doc.get("command"),
                "git": m.get("git"),
                "date": m.get("date"),
                "load_note": m.get("load_note"),
                "rounds": len(s),
                "step_ci95": bl.ratio_ci(s),
                "cpu_ci95": bl.ratio_ci(c),
                "same_shards": same_shards(doc, mesh, design),
            }
        )
    out: dict[str, Any] = {"benchmark": "sharded_overhead pooled", "mesh": mesh, "design": design}
    out |= {"target_pct": target_pct, "parts": parts, "rounds": len(step)}
    for key, vals in (("step", step), ("cpu", cpu)):
        ci95, ci99 = bl.ratio_ci(vals, 0.95), bl.ratio_ci(vals, 0.99)
        out[f"{key}_ci95"], out[f"{key}_ci99"] = ci95, ci99
        out[f"{key}_verdict"] = bl.verdict(ci95, target_pct)
        out[f"{key}_ratios"] = [round(v, 4) for v in vals]
    out["same_shards"] = all(p["same_shards"] for p in parts)
    return out


def table(res: dict[str, Any]) -> str:
    def ci(c: dict[str, Any]) -> str:
        if c["lo"] is None:
            return "-"
        return f"{c['geomean']:.3f} ({c['lo']:.3f}-{c['hi']:.3f})"

    rows = [
        f"| {res['mesh']} {res['design']} | rounds | step ratio, 95% CI | CPU ratio, 95% CI | same shards |",
        "|---|---:|---:|---:|---|",
    ]
    for p in res["parts"]:
        rows.append(
            f"| {p['file']} | {p['rounds']} | {ci(p['step_ci95'])} | {ci(p['cpu_ci95'])} | {p['same_shards']} |"
        )
    rows.append(
        f"| **pooled** | {res['rounds']} | {ci(res['step_ci95'])} | {ci(res['cpu_ci95'])} | {res['same_shards']} |"
    )
    s99, c99 = res["step_ci99"], res["cpu_ci99"]
    if s99["lo"] is not None and c99["lo"] is not None:
        rows.append(
            f"| 99% intervals | | ({s99['lo']:.3f}-{s99['hi']:.3f}) | ({c99['lo']:.3f}-{c99['hi']:.3f}) | |"
        )
    rows.append(
        f"\nverdict against <= {res['target_pct']:g}%: step {res['step_verdict']}, CPU {res['cpu_verdict']}"
    )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", help="sharded_overhead.py result files")
    ap.add_argument("--mesh", default="2x2")
    ap.add_argument("--design", default="checkpointless", help="the column compared with plain FSDP2")
    ap.add_argument("--target-pct", type=float, default=2.0)
    ap.add_argument("--out", required=True, help="JSON output")
    a = ap.parse_args(argv)
    docs = [(Path(f).name, json.loads(Path(f).read_text())) for f in a.files]
    res = pool(docs, a.mesh, a.design, a.target_pct)
    res["command"] = "python benchmarks/pool_rounds.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    res["table"] = table(res)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(res["table"])
    return res


if __name__ == "__main__":
    main()
