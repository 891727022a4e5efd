"""Time to the first batch after a fault, steady-state throughput, and memory per rank.

Compares, over the same token file and the same sample order (every path's first batch is checked
against the same digest):

* ``cache``      -- checkpointless BatchLoader reading the batch that the shared-memory cache holds;
* ``mmap``       -- checkpointless BatchLoader without a cache, assembling from the memory map;
* ``dataloader`` -- a standard ``torch.utils.data.DataLoader`` (num_workers=2) over the same file,
                    rebuilt from the resumed step as a restarted job would rebuild it.

Scenarios: a fresh worker process (a replacement; timed from the end of its imports, and from its
spawn), an in-process recovery (the training process survives and re-runs the step), steady-state
batches/s, and the resident memory of 4 ranks mapping the file (PSS: the page cache shared between
them) against 4 ranks that each read the data into their own memory.

    .venv/bin/python benchmarks/data_first_batch.py            # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/data_first_batch.py --docs 5000 --repeats 2 --steady-steps 50  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from tqdm import tqdm

from checkpointless.data import (
    BatchLoader,
    GlobalSampler,
    ShmBatchCache,
    TokenDataset,
    batch_digest,
    make_synthetic_corpus,
    prepare_main,
    remove_job_cache,
)

RESULTS = Path(__file__).resolve().parent / "results"


class WindowDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The usual map-style dataset over a token memmap, opened lazily so each worker maps it itself."""

    def __init__(self, path: str, seq_len: int) -> None:
        self.path = path
        self.seq_len = seq_len
        self._tokens: np.ndarray[Any, Any] | None = None
        self._len = TokenDataset.open(path, verify="quick").num_samples(seq_len)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = TokenDataset.open(self.path, verify="quick").tokens
        w = torch.from_numpy(self._tokens[i * self.seq_len : (i + 1) * self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]


class ResumeSampler(Sampler[int]):
    """This rank's sample ids from ``start_step`` on, in the checkpointless order (exact resume)."""

    def __init__(self, sampler: GlobalSampler, rank: int, dp: int, start_step: int, steps: int) -> None:
        self.sampler, self.rank, self.dp, self.start, self.steps = sampler, rank, dp, start_step, steps

    def __iter__(self) -> Iterator[int]:
        for step in range(self.start, self.start + self.steps):
            yield from self.sampler.ids(step, self.rank, self.dp).tolist()

    def __len__(self) -> int:
        return self.steps * (self.sampler.global_batch // self.dp)


def make_dataloader(cfg: dict[str, Any], start_step: int, steps: int, workers: int = 2) -> DataLoader[Any]:
    ds = WindowDataset(cfg["path"], cfg["seq_len"])
    sampler = GlobalSampler(len(ds), cfg["global_batch"], cfg["seed"])
    per_rank = cfg["global_batch"] // cfg["dp"]
    return DataLoader(
        ds,
        batch_size=per_rank,
        sampler=ResumeSampler(sampler, cfg["rank"], cfg["dp"], start_step, steps),
        num_workers=workers,
        persistent_workers=workers > 0,
    )


def make_loader(cfg: dict[str, Any], ds: TokenDataset, cache: ShmBatchCache | None) -> BatchLoader:
    return BatchLoader(
        ds, cfg["seq_len"], cfg["global_batch"], cfg["seed"], cfg["rank"], cfg["dp"], cache=cache
    )


# ---------------------------------------------------------------- child processes


def child_first_batch(cfg: dict[str, Any], mode: str) -> None:
    """A fresh replacement process: open everything, fetch the batch of cfg['step'], report."""
    t0 = time.perf_counter()
    step = cfg["step"]
    if mode == "dataloader":
        it = iter(make_dataloader(cfg, step, 4))
        x, y = next(it)
        source = "dataloader"
    else:
        ds = TokenDataset.open(cfg["path"], verify="quick")
        cache = ShmBatchCache(cfg["job"], cfg["rank"], capacity=8) if mode == "cache" else None
        loader = make_loader(cfg, ds, cache)
        x, y = loader.batch(step)
        source = loader.last_source
    ms = (time.perf_counter() - t0) * 1e3
    print(json.dumps({"ms": ms, "source": source, "digest": batch_digest(x, y)}), flush=True)
    if mode != "dataloader":
        loader.close()


def _smaps() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":")
        out[key] = int(value.split()[0])
    return out


def child_memory(cfg: dict[str, Any], mode: str) -> None:
    """One rank that reads the whole token array, mapped ("mmap") or copied into its memory ("copy")."""
    before = _smaps()
    ds = TokenDataset.open(cfg["path"], verify="quick")
    tokens = ds.tokens if mode == "mmap" else np.array(ds.tokens)
    total = int(tokens.sum(dtype=np.int64))  # touches every page
    print("touched", total, flush=True)
    sys.stdin.readline()  # measure only once every rank has touched the data (shared pages exist)
    after = _smaps()
    print(json.dumps({k: after[k] - before[k] for k in ("Rss", "Pss", "Pss_Anon", "Pss_File")}), flush=True)


# ---------------------------------------------------------------- scenarios


def _spawn(cfg: dict[str, Any], child: str, mode: str, stdin: bool = False) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", child, mode, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        text=True,
    )


def _line(proc: subprocess.Popen[str], timeout: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise RuntimeError(f"child {proc.args!r} printed nothing within {timeout} s")
    return proc.stdout.readline()


def fresh_process(cfg: dict[str, Any], expected: str, repeats: int, bar: tqdm[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("cache", "mmap", "dataloader"):
        after_imports, from_spawn = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proc = _spawn(cfg, "first-batch", mode)
            res = json.loads(_line(proc, 120))
            from_spawn.append((time.perf_counter() - t0) * 1e3)
            proc.wait(60)
            assert res["digest"] == expected, f"{mode}: wrong batch"
            assert mode != "cache" or res["source"] == "cache", res
            after_imports.append(res["ms"])
            bar.update()
        out[mode] = {"after_imports_ms": after_imports, "from_spawn_ms": from_spawn}
    return out


def in_process(
    cfg: dict[str, Any], ds: TokenDataset, expected: str, repeats: int, bar: tqdm[Any]
) -> dict[str, Any]:
    step = cfg["step"]
    res: dict[str, list[float]] = {"cache_same_loader": [], "cache_new_loader": [], "mmap_new_loader": []}
    res["dataloader_rebuild"], res["dataloader_teardown"] = [], []
    for _ in range(repeats):
        cache = ShmBatchCache(cfg["job"], cfg["rank"], capacity=8)
        loader = make_loader(cfg, ds, cache)
        for s in range(step - 3, step + 1):  # training reached `step`; the fault interrupts it
            loader.batch(s)
        # A training step takes far longer than prefetching: the thread is idle when the fault hits.
        deadline = time.monotonic() + 10
        while cache.steps()[-1:] != [step + 8] and time.monotonic() < deadline:
            time.sleep(0.005)
        t0 = time.perf_counter()
        x, y = loader.batch(step)  # the recovery re-runs the step with the surviving loader
        res["cache_same_loader"].append((time.perf_counter() - t0) * 1e3)
        assert loader.last_source == "cache" and batch_digest(x, y) == expected
        loader.close()
        t0 = time.perf_counter()  # or the recovery rebuilds the loader (as a framework would)
        loader = make_loader(cfg, ds, ShmBatchCache(cfg["job"], cfg["rank"], capacity=8))
        x, y = loader.batch(step)
        res["cache_new_loader"].append((time.perf_counter() - t0) * 1e3)
        assert loader.last_source == "cache" and batch_digest(x, y) == expected
        loader.close()
        t0 = time.perf_counter()
        x, y = make_loader(cfg, ds, None).batch(step)
        res["mmap_new_loader"].append((time.perf_counter() - t0) * 1e3)
        assert batch_digest(x, y) == expected
        bar.update()
    it = iter(make_dataloader(cfg, step, 4))
    next(it)
    for _ in range(max(2, repeats // 4)):  # each rebuild costs ~1 s of worker start-up
        t0 = time.perf_counter()
        del it  # the old workers must go: they may hold the failed step's state
        res["dataloader_teardown"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        it = iter(make_dataloader(cfg, step, 4))
        x, y = next(it)
        res["dataloader_rebuild"].append((time.perf_counter() - t0) * 1e3)
        assert batch_digest(x, y) == expected
    del it
    return res


def steady_state(cfg: dict[str, Any], ds: TokenDataset, steps: int) -> dict[str, float]:
    start = cfg["step"] + 1000  # steps never cached before
    out = {}
    job = f"bench-steady-{uuid.uuid4().hex[:8]}"
    for name, cache in (("cache_prefetch", ShmBatchCache(job, cfg["rank"], capacity=8)), ("mmap", None)):
        loader = make_loader(cfg, ds, cache)
        loader.batch(start)
        t0 = time.perf_counter()
        for s in range(start + 1, start + 1 + steps):
            loader.batch(s)
        out[name] = steps / (time.perf_counter() - t0)
        loader.close()
    remove_job_cache(job)
    it = iter(make_dataloader(cfg, start, steps + 1))
    next(it)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    out["dataloader"] = steps / (time.perf_counter() - t0)
    del it
    return out


def memory(cfg: dict[str, Any], ranks: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in ("mmap", "copy"):
        procs = [_spawn(cfg, "memory", mode, stdin=True) for _ in range(ranks)]
        for p in procs:
            assert _line(p, 120).startswith("touched")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
        per_rank = [json.loads(_line(p, 60)) for p in procs]
        for p in procs:
            p.wait(30)
        out[mode] = {
            "per_rank_rss_mb": statistics.mean(r["Rss"] for r in per_rank) / 1024,
            "per_rank_pss_mb": statistics.mean(r["Pss"] for r in per_rank) / 1024,
            "node_pss_mb": sum(r["Pss"] for r in per_rank) / 1024,
        }
    return out


def machine() -> dict[str, Any]:
    model = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if "model name" in ln
        ),
        platform.processor(),
    )
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "kernel": platform.release(),
    }


def _med(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=60000, help="synthetic corpus size (60000 docs ~ 25M tokens)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=32)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--step", type=int, default=100, help="the step at which the fault hits")
    ap.add_argument("--repeats", type=int, default=3, help="fresh processes per mode (x10 in-process)")
    ap.add_argument("--steady-steps", type=int, default=300)
    ap.add_argument("--out", type=Path, default=RESULTS / "data_first_batch.json")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, mode, cfg = args.child
        (child_first_batch if kind == "first-batch" else child_memory)(json.loads(cfg), mode)
        return

    work = Path(tempfile.mkdtemp(prefix="ckpl-bench-"))
    job = f"bench-{uuid.uuid4().hex[:8]}"
    try:
        t0 = time.perf_counter()
        corpus = make_synthetic_corpus(work / "corpus.jsonl", num_docs=args.docs, seed=0)
        t1 = time.perf_counter()
        assert prepare_main([str(corpus), "-o", str(work / "data.tokens"), "--quiet"]) == 0
        t2 = time.perf_counter()
        ds = TokenDataset.open(work / "data.tokens", verify="full")
        t3 = time.perf_counter()
        TokenDataset.open(work / "data.tokens", verify="quick")
        t4 = time.perf_counter()
        cfg = {
            "path": str(work / "data.tokens"),
            "seq_len": args.seq_len,
            "global_batch": args.global_batch,
            "dp": args.dp,
            "rank": 1,
            "seed": 1234,
            "step": args.step,
            "job": job,
        }
        expected = batch_digest(*make_loader(cfg, ds, None).batch(args.step))
        setup = {
            "tokens": ds.num_tokens,
            "dataset_mb": ds.num_tokens * ds.tokens.itemsize / 1e6,
            "corpus_s": t1 - t0,
            "prepare_s": t2 - t1,
            "prepare_mb_per_s": corpus.stat().st_size / 1e6 / (t2 - t1),
            "open_full_verify_ms": (t3 - t2) * 1e3,
            "open_quick_verify_ms": (t4 - t3) * 1e3,
        }
        print(
            f"dataset: {ds.num_tokens:,} tokens ({setup['dataset_mb']:.0f} MB), {json.dumps(cfg)}", flush=True
        )
        # a bar over the measurements, on stderr and only on a terminal: the results are unchanged
        total = args.repeats * 10 + 3 * args.repeats + 2
        with tqdm(total=total, desc="data_first_batch", unit="run", disable=None, leave=False) as bar:
            rec = in_process(cfg, ds, expected, args.repeats * 10, bar)
            fresh = fresh_process(
                cfg, expected, args.repeats, bar
            )  # the cache left by in_process serves `step`
            steady = steady_state(cfg, ds, args.steady_steps)
            bar.update()
            mem = memory(cfg, args.dp)
            bar.update()
    finally:
        remove_job_cache(job)
        shutil.rmtree(work, ignore_errors=True)

    result: dict[str, Any] = {"machine": machine(), "config": {**cfg, "path": None}, "setup": setup}
    result.update({"fresh_process": fresh, "in_process": rec, "steady_batches_per_s": steady, "memory": mem})
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")

    print(f"\nfirst batch (median ms)        {'cache':>10} {'cold mmap':>10} {'DataLoader':>11}")
    f = {m: _med(fresh[m]["after_imports_ms"]) for m in fresh}
    print(f"fresh process, after imports   {f['cache']:10.2f} {f['mmap']:10.2f} {f['dataloader']:11.1f}")
    f = {m: _med(fresh[m]["from_spawn_ms"]) for m in fresh}
    print(f"fresh process, from spawn      {f['cache']:10.0f} {f['mmap']:10.0f} {f['dataloader']:11.0f}")
    print(
        f"in-process recovery            {_med(rec['cache_same_loader']):10.2f} {_med(rec['mmap_new_loader']):10.2f}"
        f" {_med(rec['dataloader_rebuild']):11.1f}   (cache, new loader: {_med(rec['cache_new_loader']):.2f};"
        f" DataLoader teardown {_med(rec['dataloader_teardown']):.1f})"
    )
    ratio = _med(rec["dataloader_rebuild"]) / _med(rec["cache_new_loader"])
    print(f"rebuilt DataLoader / cache (new loader): {ratio:.0f}x")
    print(
        f"steady state batches/s         {steady['cache_prefetch']:10.0f} {steady['mmap']:10.0f}"
        f" {steady['dataloader']:11.0f}"
    )
    for mode, m in mem.items():
        print(
            f"memory, {args.dp} ranks, {mode:5s}: per rank RSS {m['per_rank_rss_mb']:.1f} MB,"
            f" PSS {m['per_rank_pss_mb']:.1f} MB; node PSS {m['node_pss_mb']:.1f} MB"
            f" (data {setup['dataset_mb']:.1f} MB)"
        )
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
