"""Time to the first batch after a fault, steady-state throughput, and memory per rank.

Compares, over the same token file and the same sample order (every path's first batch is checked
against the same digest):

* ``cache``      -- checkpointless BatchLoader reading the batch that the shared-memory cache holds;
* ``mmap``       -- checkpointless BatchLoader without a cache, assembling from the memory map;
* ``dataloader`` -- a standard ``torch.utils.data.DataLoader`` (num_workers=2) over the same file,
                    rebuilt from the resumed step as a restarted job would rebuild it.

``--job-loader`` instead times ``job.loader(DataLoader(..., num_workers=2))`` (a plain DataLoader
over the same file with a ``DistributedSampler``, made step-addressable by
``checkpointless.recovery.loader.StepLoader``) against BatchLoader: the first batch of a
replacement that seeks to the step, and a survivor's replay.

Scenarios: a fresh worker process (a replacement; timed from the end of its imports, and from its
spawn), an in-process recovery (the training process survives and re-runs the step), steady-state
batches/s, and the resident memory of 4 ranks mapping the file (PSS: the page cache shared between
them) against 4 ranks that each read the data into their own memory.

    .venv/bin/python benchmarks/data_first_batch.py            # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/data_first_batch.py --docs 5000 --repeats 2 --steady-steps 50  # smoke
    .venv/bin/python benchmarks/data_first_batch.py --job-loader  # job.loader() vs BatchLoader, ~1 min
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
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler
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
from checkpointless.recovery.loader import StepLoader

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


def make_job_loader(cfg: dict[str, Any], workers: int = 2) -> StepLoader:
    """What ``job.loader(dl)`` builds for a script's own DataLoader + DistributedSampler."""
    ds = WindowDataset(cfg["path"], cfg["seq_len"])
    sampler = DistributedSampler(ds, num_replicas=cfg["dp"], rank=cfg["rank"], shuffle=True, seed=cfg["seed"])
    per_rank = cfg["global_batch"] // cfg["dp"]
    dl = DataLoader(ds, batch_size=per_rank, sampler=sampler, num_workers=workers, drop_last=True)
    return StepLoader(dl, dp_rank=cfg["rank"], dp_size=cfg["dp"])


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
    elif mode == "job-loader":  # a replacement's job.loader(): seeks to the step, starts 2 workers
        job_loader = make_job_loader(cfg)
        x, y = job_loader.batch(step)
        source = "job.loader"
    else:
        ds = TokenDataset.open(cfg["path"], verify="quick")
        cache = ShmBatchCache(cfg["job"], cfg["rank"], capacity=8) if mode == "cache" else None
        loader = make_loader(cfg, ds, cache)
        x, y = loader.batch(step)
        source = loader.last_source
    ms = (time.perf_counter() - t0) * 1e3
    print(json.dumps({"ms": ms, "source": source, "digest": batch_digest(x, y)}), flush=True)
    if mode == "job-loader":
        job_loader.close()
    elif mode != "dataloader":
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


def fresh_process(
    cfg: dict[str, Any],
    expected: str,
    repeats: int,
    bar: tqdm[Any],
    modes: tuple[str, ...] = ("cache", "mmap", "dataloader"),
    expected_for: dict[str, str] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in modes:
        after_imports, from_spawn = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proc = _spawn(cfg, "first-batch", mode)
            res = json.loads(_line(proc, 120))
            from_spawn.append((time.perf_counter() - t0) * 1e3)
            proc.wait(60)
            assert res["digest"] == (expected_for or {}).get(mode, expected), f"{mode}: wrong batch"
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


def job_loader_bench(
    cfg: dict[str, Any], ds: TokenDataset, expected: str, repeats: int, bar: tqdm[Any]
) -> dict[str, Any]:
    """job.loader(DataLoader(num_workers=2)) against BatchLoader: a replacement's first batch (a
    fresh process that seeks) and a survivor's (the replay of the held batch, or a new loader)."""
    step = cfg["step"]
    # the reference batch of the DistributedSampler order, read without workers (another path)
    want = batch_digest(*make_job_loader(cfg, workers=0).batch(step))
    # fill the shared-memory cache around `step`, as training up to the fault would have
    cache = ShmBatchCache(cfg["job"], cfg["rank"], capacity=8)
    loader = make_loader(cfg, ds, cache)
    for s in range(step - 3, step + 1):
        loader.batch(s)
    deadline = time.monotonic() + 10
    while cache.steps()[-1:] != [step + 8] and time.monotonic() < deadline:
        time.sleep(0.005)
    loader.close()
    fresh = fresh_process(
        cfg, expected, repeats, bar, modes=("cache", "mmap", "job-loader"), expected_for={"job-loader": want}
    )
    res: dict[str, list[float]] = {"new_job_loader": [], "replay_job_loader": [], "next_job_loader": []}
    res["new_batch_loader_cache"] = []
    for _ in range(repeats):
        t0 = time.perf_counter()  # the recovery rebuilds the loader in the surviving process
        jl = make_job_loader(cfg)
        x, y = jl.batch(step)
        res["new_job_loader"].append((time.perf_counter() - t0) * 1e3)
        assert batch_digest(x, y) == want
        t0 = time.perf_counter()  # the usual case: the survivor replays the batch it holds
        x, y = jl.batch(step)
        res["replay_job_loader"].append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()  # and goes on to the next step from the running iterator
        jl.batch(step + 1)
        res["next_job_loader"].append((time.perf_counter() - t0) * 1e3)
        jl.close()
        t0 = time.perf_counter()
        bl = make_loader(cfg, ds, ShmBatchCache(cfg["job"], cfg["rank"], capacity=8))
        x, y = bl.batch(step)
        res["new_batch_loader_cache"].append((time.perf_counter() - t0) * 1e3)
        assert bl.last_source == "cache" and batch_digest(x, y) == expected
        bl.close()
        bar.update()
    return {"fresh_process": fresh, "in_process": res}


def print_job_loader(res: dict[str, Any]) -> None:
    f = {m: v["after_imports_ms"] for m, v in res["fresh_process"].items()}
    print(f"\nfirst batch (median ms, min-max)      {'cache':>18} {'cold mmap':>18} {'job.loader':>18}")
    row = " ".join(f"{_med(f[m]):8.2f} ({min(f[m]):.1f}-{max(f[m]):.1f})".rjust(18) for m in f)
    print(f"replacement process, after imports    {row}")
    r = res["in_process"]
    print(
        f"survivor: new loader                  {_med(r['new_batch_loader_cache']):18.2f} {'':>18}"
        f" {_med(r['new_job_loader']):18.2f}"
    )
    print(f"survivor: replay of the held batch    {'':>18} {'':>18} {_med(r['replay_job_loader']):18.4f}")
    print(f"next step from the running iterator   {'':>18} {'':>18} {_med(r['next_job_loader']):18.2f}")


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
    ap.add_argument("--job-loader", action="store_true", help="only job.loader(DataLoader) vs BatchLoader")
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
        if args.job_loader:
            with tqdm(
                total=args.repeats * 4, desc="job.loader", unit="run", disable=None, leave=False
            ) as bar:
                jl = job_loader_bench(cfg, ds, expected, args.repeats, bar)
            out = (
                args.out
                if args.out != RESULTS / "data_first_batch.json"
                else RESULTS / "data_job_loader.json"
            )
            jl.update({"machine": machine(), "config": {**cfg, "path": None}})
            jl["command"] = " ".join([Path(sys.executable).name, *sys.argv])
            out.write_text(json.dumps(jl, indent=2) + "\n")
            print_job_loader(jl)
            print(f"\nwrote {out}")
            return
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
