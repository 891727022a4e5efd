"""The CUDA / NCCL path on a real GPU, as far as one GPU allows.

NCCL refuses two ranks on one device ("Duplicate GPU detected"), so a multi-rank NCCL job needs
a machine with several GPUs. On one GPU this checks what can be checked:

1. ``Communicator`` over NCCL (world of one): the group forms through our store, an all-reduce
   goes through the future-callback ``Handle``, the waiting thread's stream is ordered after the
   collective (a large reduction followed at once by a kernel that reads its buffer), an abort
   fails the next collective at once, and a rebuilt generation works again.
2. State transfer of CUDA tensors (model + AdamW state on the GPU) over the direct stream, between
   two ranks of a gloo pair (threads): bytes staged through host memory, verified, and loaded
   back into a model on the GPU, bitwise.
   Then the state staged for a buddy copy or snapshot as a step begins (1.6 GB: weights and
   AdamW moments on the GPU): the training thread's staging time against the old synchronous
   ``.cpu()`` of every tensor, and the copy thread's landing on its own stream (a pinned undo
   copy, a snapshot file) while the training stream computes and changes a buffer in place,
   checked bitwise against the state as staged.
3. A real job under ``checkpointless run`` on the GPU with NCCL (one rank, one spare): fault-free
   twice (is the GPU run deterministic at all?), then with an exception in the backward pass and
   one in the forward pass, each recovered in process. The final weights must be bitwise equal to
   the fault-free run's. Deterministic kernels are asked for (``benchmarks/gpu_det_job.py``).
4. FSDP2 over our process groups on a 2-D mesh of one (with one member per group FSDP2 sends no
   all-gather or reduce-scatter; HSDP's all-reduce over the replicate group is what reaches our
   NCCL groups): CUDA tensors through each generation's NCCL group, an abort and a re-formed
   generation in the middle of training, bitwise; then the example with ``--fsdp 1,1`` under the
   launcher through an exception in the backward pass (at its first gradient), one in the forward
   and one in the optimizer step (restored from the snapshot and replayed), bitwise.
   Then FSDP2's step time over torch's own NCCL group against ours, on a compute-bound and a
   launch-bound model, in fresh processes alternating (``benchmarks/gpu_fsdp_step.py``), final
   weights bitwise equal across every run.
   What one GPU leaves untested: shards over several ranks, so no all-gather or reduce-scatter
   that moves bytes between GPUs, no replica peer or buddy copy between GPUs, and no NCCL abort of
   a collective that a dead peer left hanging.
5. The 3-D example (``examples/llama_3d.py``: tensor parallel by ``parallelize_module``, then
   FSDP2) on a mesh of one under the launcher, through the same three exceptions, bitwise: its
   DTensors on CUDA, its groups the job's NCCL groups. Several GPUs are needed for TP collectives
   that move bytes.

    python3 benchmarks/gpu_check.py --out DIR      # writes DIR/gpu-check.json
    python3 benchmarks/gpu_check.py --out DIR --skip fsdp_step_time_nccl   # leave a check out

On a machine without CUDA it says so and exits 0 (nothing to check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def check_communicator() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from checkpointless.comm.communicator import Communicator
    from checkpointless.errors import CommAborted

    torch.cuda.set_device(0)
    store = dist.HashStore()
    comm = Communicator(0, 1, datetime.timedelta(seconds=60), backend="nccl")
    t0 = time.monotonic()
    comm.rebuild(0, dist.PrefixStore("g0/", store), 0, 1, time.monotonic() + 60)
    out: dict[str, Any] = {"form_s": time.monotonic() - t0}
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    got = comm.wait(comm.allreduce(x), 30)
    out["allreduce_ok"] = bool(torch.equal(got, torch.arange(1 << 20, dtype=torch.float32, device="cuda")))
    # stream ordering: 256 MB reduced in place, then read at once by a kernel on this stream
    big = torch.full((64 << 20,), 3.0, device="cuda")
    comm.wait(comm.allreduce(big), 30)
    big.mul_(2.0)
    out["stream_order_ok"] = bool((big == 6.0).all().item())
    out["abort_pending"] = comm.abort("gpu check")
    try:
        comm.allreduce(x)
        out["abort_refuses_next"] = False
    except CommAborted:
        out["abort_refuses_next"] = True
    t0 = time.monotonic()
    comm.rebuild(1, dist.PrefixStore("g1/", store), 0, 1, time.monotonic() + 60)
    out["rebuild_s"] = time.monotonic() - t0
    y = torch.ones(1000, device="cuda")
    out["after_rebuild_ok"] = bool(
        torch.equal(comm.wait(comm.allreduce(y), 30), torch.ones(1000, device="cuda"))
    )
    comm.barrier(30)
    out["ok"] = all(
        out[k] for k in ("allreduce_ok", "stream_order_ok", "abort_refuses_next", "after_rebuild_ok")
    )
    return out


def check_cuda_state_transfer() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from checkpointless.comm.communicator import Communicator
    from checkpointless.rendezvous import KeyServer
    from checkpointless.state.stream import StreamRoute
    from checkpointless.state.transfer import receive_state, send_state

    def model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(5)
        m = torch.nn.Sequential(
            torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
        ).cuda()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        return m, opt

    src_model, src_opt = model()
    for _ in range(3):  # optimizer state on the GPU, weights moved off their initial values
        src_model(torch.randn(8, 1024, device="cuda")).square().mean().backward()
        src_opt.step()
        src_opt.zero_grad()
    tree = {"model": src_model.state_dict(), "optimizer": src_opt.state_dict(), "step": 3}
    dst_model, dst_opt = model()
    store = dist.HashStore()
    servers = [KeyServer("127.0.0.1", 0, b"g" * 32) for _ in range(2)]
    for s in servers:
        s.start()
    peers = [s.address for s in servers]
    result: list[Any] = [None, None]

    def run(rank: int) -> None:
        comm = Communicator(rank, 2, datetime.timedelta(seconds=60), backend="gloo")
        comm.rebuild(0, dist.PrefixStore("g0/", store), rank, 2, time.monotonic() + 60)
        route = StreamRoute(servers[rank], peers, b"g" * 32, "state/gen1")
        try:
            if rank == 0:
                result[0] = send_state(comm, tree, [1], 60, route)
            else:
                into = {"model": dst_model.state_dict(), "optimizer": dst_opt.state_dict()}
                result[1] = receive_state(comm, 0, 60, into, route)
        except Exception as e:
            result[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    t0 = time.monotonic()
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    for s in servers:
        s.stop()
    if not isinstance(result[1], tuple):
        return {"ok": False, "error": repr(result[1]), "sender": repr(result[0])}
    got, stats = result[1]
    dst_model.load_state_dict(got["model"])
    dst_opt.load_state_dict(got["optimizer"])
    same_w = all(
        torch.equal(a, b)
        for a, b in zip(src_model.state_dict().values(), dst_model.state_dict().values(), strict=True)
    )
    s0, s1 = src_opt.state_dict()["state"], dst_opt.state_dict()["state"]
    same_opt = all(
        torch.equal(s0[k][n].cpu(), s1[k][n].cpu())
        for k in s0
        for n in s0[k]
        if isinstance(s0[k][n], torch.Tensor)
    )
    on_gpu = all(p.is_cuda for p in dst_model.parameters()) and all(
        v.is_cuda for st in s1.values() for n, v in st.items() if n != "step"
    )
    return {
        "ok": same_w and same_opt and on_gpu,
        "weights_equal": same_w,
        "optimizer_equal": same_opt,
        "state_on_gpu_after_load": on_gpu,
        "bytes": stats["bytes"],
        "seconds": time.monotonic() - t0,
    }


def check_staging_cuda(device: str = "cuda", width: int = 4096) -> dict[str, Any]:
    """The step's state staged for a buddy copy or snapshot without leaving the GPU on the training
    thread (state/device_copy.py): the staging's host time against the old synchronous ``.cpu()``
    of every tensor, then the copy thread's landing (pinned undo copy, and a snapshot file) while
    the training stream keeps computing and changes a buffer in place; the landed bytes must be the
    state as it was staged, bitwise, tensor by tensor."""
    import torch

    from checkpointless.state.buddy import BuddyCopies
    from checkpointless.state.codec import as_byte_view, unpack
    from checkpointless.state.snapshot_file import load_snapshot, write_snapshot
    from checkpointless.state.staging import guarded_pointers, staged_layout

    torch.manual_seed(6)
    # 8 layers of 4096 x 4096: 537 MB of weights, 1.6 GB with AdamW's moments
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(device)
    model.register_buffer("running", torch.zeros(1 << 20, device=device))  # changed by "forward"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(64, width, device=device)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    expected = {k: as_byte_view(v).clone() for k, v in _tensors(state).items()}  # the old way
    old_s = time.perf_counter() - t0
    guarded = guarded_pointers([opt])
    staged_layout(state, guarded)  # the first layout builds the memo; time the steady one
    t0 = time.perf_counter()
    lay = staged_layout(state, guarded)
    staging_s = time.perf_counter() - t0
    on_gpu = sum(1 for m in lay.messages if m.device.type == device)
    # the training stream goes on at once: a long matmul chain, and the buffer changed in place
    x = torch.randn(width, width, device=device)
    for _ in range(50):
        x = torch.tanh(x @ x)
    model.running.add_(1.0)
    t0 = time.perf_counter()
    undo = BuddyCopies(0, None, [], 60)._undo_copy(1, lay)
    copy_s = time.perf_counter() - t0
    pinned = bool(undo.messages[0].is_pinned()) or device == "cpu"
    got = _tensors(unpack(undo.manifest, undo.messages))
    undo_equal = set(got) == set(expected) and all(
        torch.equal(as_byte_view(got[k]), expected[k]) for k in expected
    )
    lay2 = staged_layout(state, guarded)  # the buffer now holds ones: a snapshot of this state
    expected2 = {k: as_byte_view(v).clone() for k, v in _tensors(state).items()}
    for _ in range(20):
        x = torch.tanh(x @ x)
    model.running.add_(1.0)
    with tempfile.TemporaryDirectory(prefix="cl-gpu-snap-") as d:
        write_snapshot(Path(d) / "snap", 2, lay2)  # (a private directory inside a private one)
        snap = _tensors(load_snapshot(Path(d) / "snap", 2)[0])
    snap_equal = set(snap) == set(expected2) and all(
        torch.equal(as_byte_view(snap[k]), expected2[k]) for k in expected2
    )
    sync()
    return {
        "ok": undo_equal and snap_equal and pinned and on_gpu > 0,
        "state_mb": round(sum(int(v.numel()) for v in expected.values()) / 1e6, 1),
        "messages_on_gpu": on_gpu,
        "staging_host_ms": round(staging_s * 1e3, 2),
        "old_sync_cpu_ms": round(old_s * 1e3, 2),
        "copy_thread_ms": round(copy_s * 1e3, 2),
        "undo_copy_pinned": pinned,
        "undo_copy_bitwise": undo_equal,
        "snapshot_bitwise": snap_equal,
    }


def _tensors(tree: Any) -> dict[str, Any]:
    from checkpointless.state.codec import tensor_paths

    return tensor_paths(tree)


def check_job(
    work: Path,
    script_args: tuple[str, ...] = (),
    launcher_args: tuple[str, ...] = (),
    faults: tuple[str, ...] = ("raise:rank=0:step=7:site=backward", "raise:rank=0:step=15:site=forward"),
) -> dict[str, Any]:
    """checkpointless run on the GPU with NCCL; final weights compared with a fault-free run."""
    script = REPO / "benchmarks" / "gpu_det_job.py"
    args = ["--steps", "24", "--dim", "128", "--layers", "2", "--heads", "4", "--seq-len", "64", *script_args]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    env.pop("CHECKPOINTLESS_BACKEND", None)  # CUDA present: NCCL is the default

    def run(name: str, faults: list[str]) -> dict[str, Any]:
        run_dir = work / name
        digest = work / f"{name}.digest"
        cmd = [sys.executable, "-m", "checkpointless", "run", "--nproc", "1", "--spares", "1"]
        cmd += ["--run-dir", str(run_dir), "--hang-timeout", "20", *launcher_args]
        for f in faults:
            cmd += ["--inject", f]
        cmd += [str(script), *args, "--digest-out", str(digest)]
        t0 = time.monotonic()
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
        events = []
        ev = run_dir / "events.jsonl"
        if ev.exists():
            events = [json.loads(line) for line in ev.read_text().splitlines() if line.strip()]
        rec = [e for e in events if e.get("event") == "recovery"]
        return {
            "rc": p.returncode,
            "wall_s": time.monotonic() - t0,
            "digest": digest.read_text().strip() if digest.exists() else None,
            "recoveries": [
                {k: e.get(k) for k in ("downtime_s", "resume_step", "transport", "first_batch_s") if k in e}
                for e in rec
            ],
            "backend": sorted(
                {ln.split(":")[-1].strip() for ln in p.stdout.splitlines() if "job backend:" in ln}
            ),
            "tail": (p.stdout + p.stderr)[-1500:] if p.returncode else "",
        }

    out: dict[str, Any] = {"clean_1": run("clean1", []), "clean_2": run("clean2", [])}
    out["faulted"] = run("faulted", list(faults))
    ref = out["clean_1"]["digest"]
    out["deterministic"] = ref is not None and ref == out["clean_2"]["digest"]
    out["bitwise_after_faults"] = ref is not None and out["faulted"]["digest"] == ref
    out["recovered"] = len(out["faulted"]["recoveries"]) == len(faults)
    out["nccl"] = all(out[k]["backend"] == ["nccl"] for k in ("clean_1", "faulted"))
    out["ok"] = out["deterministic"] and out["bitwise_after_faults"] and out["recovered"] and out["nccl"]
    return out


def check_fsdp_groups() -> dict[str, Any]:
    """FSDP2 over our process groups on the GPU (a 2-D mesh of one): CUDA tensors go to each
    generation's NCCL group, an abort refuses the next collective, and a model trained across
    an abort and a re-formed generation ends bitwise equal to one trained straight through.
    With one member per group FSDP2 skips its all-gathers and reduce-scatters (local copies), so
    the mesh is ``("replicate", "shard")`` of ``(1, 1)``: HSDP's all-reduce of each block's
    gradients goes through the groups, and the collectives are counted (at least one per step)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from checkpointless.comm.mesh import make_device_mesh
    from checkpointless.errors import CommAborted

    torch.cuda.set_device(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    names = ("replicate", "shard")
    mesh = make_device_mesh(names, (1, 1), 0, 1, dist.HashStore(), device_type="cuda")
    store = dist.HashStore()
    mesh.configure(0, store, time.monotonic() + 60)
    pg = mesh.dim_groups[0]
    issued: list[str] = []
    for g in mesh.dim_groups:
        g.before_collective = issued.append
    out: dict[str, Any] = {
        "device_group": type(pg._dev_pg).__name__,
        "mesh_device": mesh.device_mesh.device_type,
    }
    x = torch.arange(4096.0, device="cuda")
    o = torch.empty_like(x)
    dist.all_gather_into_tensor(o, x, group=pg)
    out["all_gather_ok"] = bool(torch.equal(o, x))
    dist.reduce_scatter_tensor(o, x * 2, group=pg)
    out["reduce_scatter_ok"] = bool(torch.equal(o, x * 2))

    def train(abort_at: int | None) -> list[torch.Tensor]:
        issued.clear()
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh.device_mesh)
        fully_shard(model, mesh=mesh.device_mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator(device="cuda").manual_seed(4)
        for step in range(8):
            if step == abort_at:
                out["abort_pending"] = mesh.abort("gpu check")
                try:
                    dist.all_reduce(torch.ones(1, device="cuda"), group=pg)
                    out["abort_refuses_next"] = False
                except CommAborted:
                    out["abort_refuses_next"] = True
                mesh.configure(mesh.generation + 1, store, time.monotonic() + 60)
            model(torch.randn(16, 256, device="cuda", generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out["params_on_gpu"] = all(p.is_cuda for p in model.parameters())
        out["collectives_in_training"] = len(issued)
        return [p.to_local().detach().cpu() for p in model.parameters()]  # type: ignore[operator]

    straight, across = train(None), train(4)
    out["bitwise_across_generations"] = all(torch.equal(a, b) for a, b in zip(straight, across, strict=True))
    out["ok"] = (
        out["device_group"] == "ProcessGroupNCCL"
        and out["mesh_device"] == "cuda"
        and out["all_gather_ok"]
        and out["reduce_scatter_ok"]
        and out.get("abort_refuses_next", False)
        and out["params_on_gpu"]
        and out["collectives_in_training"] >= 8 * 2  # 8 steps, an all-reduce per Linear block
        and out["bitwise_across_generations"]
    )
    return out


def check_fsdp_step_time(
    sizes: tuple[tuple[str, int, int, int], ...] = (("small", 256, 4, 256), ("large", 1024, 8, 4096)),
    rounds: int = 3,
    steps: int = 60,
    device: str = "cuda",
) -> dict[str, Any]:
    """FSDP2 step time on the GPU over torch's own NCCL group against ours (a world of one), runs
    alternating (plain ours, ours plain, ...) in fresh processes (``benchmarks/gpu_fsdp_step.py``);
    every run's final weights must be bitwise the same. The ratio is a figure, not a pass mark:
    the "small" model is launch-bound, so it shows the per-collective cost of our groups at its
    largest; the "large" one is a compute-bound step."""
    script = REPO / "benchmarks" / "gpu_fsdp_step.py"
    out: dict[str, Any] = {}
    digests: set[str] = set()
    for name, dim, layers, rows in sizes:
        runs: dict[str, list[dict[str, Any]]] = {"plain": [], "ours": []}
        for r in range(rounds):
            for groups in ("plain", "ours") if r % 2 == 0 else ("ours", "plain"):
                with tempfile.NamedTemporaryFile(suffix=".json") as f:
                    cmd = [sys.executable, str(script), "--groups", groups, "--device", device]
                    cmd += ["--dim", str(dim)]
                    cmd += ["--layers", str(layers), "--rows", str(rows), "--steps", str(steps)]
                    subprocess.run([*cmd, "--out", f.name], cwd=REPO, check=True, timeout=180)
                    runs[groups].append(json.loads(Path(f.name).read_text()))
        med = {g: statistics.median(x["step_ms_median"] for x in v) for g, v in runs.items()}
        cpu = {g: statistics.median(x["cpu_ms_median"] for x in v) for g, v in runs.items()}
        digests |= {x["digest"] + name for v in runs.values() for x in v}
        out[name] = {
            "model": f"{layers} blocks of Linear({dim}, {4 * dim}) GELU Linear, {rows} rows, AdamW",
            "step_ms_plain": round(med["plain"], 3),
            "step_ms_ours": round(med["ours"], 3),
            "ratio": round(med["ours"] / med["plain"], 4),
            "cpu_ms_plain": round(cpu["plain"], 3),
            "cpu_ms_ours": round(cpu["ours"], 3),
            "per_run_step_ms": {g: [round(x["step_ms_median"], 3) for x in v] for g, v in runs.items()},
            "group_types": sorted({x["group_type"] for v in runs.values() for x in v}),
            "collectives_per_step_ours": min(x["collectives_per_step"] for x in runs["ours"]),
        }
    out["bitwise_plain_equals_ours"] = len(digests) == len(sizes)
    # the ratio means something only if the collectives went through our groups
    out["ok"] = out["bitwise_plain_equals_ours"] and all(
        out[n]["collectives_per_step_ours"] > 0 for n, *_ in sizes
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="where gpu-check.json/.md go")
    ap.add_argument("--skip", default="", help="checks to leave out, comma-separated names")
    ap.add_argument("--step-rounds", type=int, default=3, help="rounds of the FSDP2 step-time check")
    a = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: fixed GEMMs
    import torch

    if not torch.cuda.is_available():
        print("gpu check: no CUDA device here; nothing to check")
        return 0
    info = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(info), flush=True)
    results: dict[str, Any] = {"machine": info}
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("communicator_nccl", check_communicator),
        ("cuda_state_transfer", check_cuda_state_transfer),
        ("staging_cuda", check_staging_cuda),
    ]
    with tempfile.TemporaryDirectory(prefix="cl-gpu-check-") as tmp:
        checks.append(("job_nccl", lambda: check_job(Path(tmp) / "ddp")))
        checks.append(("fsdp_groups_nccl", check_fsdp_groups))
        checks.append(("fsdp_step_time_nccl", lambda: check_fsdp_step_time(rounds=a.step_rounds)))
        # FSDP2 on a 2-D mesh of one under the launcher: an exception in the backward pass and
        # one in the forward recovered in process; one in the optimizer (the only rank's state
        # half-updated) restored from the shared-memory snapshot of step 15 and replayed
        fsdp_faults = (
            "raise:rank=0:step=7:site=backward",
            "raise:rank=0:step=13:site=forward",
            "raise:rank=0:step=19:site=optimizer",
        )
        # the 3-D example (replicate x FSDP x TP) on a mesh of one: its TP plan's DTensor
        # collectives and FSDP2's on each generation's NCCL groups, through the same faults
        checks.append(
            (
                "tp_job_nccl",
                lambda: check_job(
                    Path(tmp) / "tp",
                    ("--example", "llama_3d", "--dp", "1", "--fsdp", "1", "--tp", "1"),
                    ("--snapshot-every", "5"),
                    fsdp_faults,
                ),
            )
        )
        checks.append(
            (
                "fsdp_job_nccl",
                lambda: check_job(
                    Path(tmp) / "fsdp", ("--fsdp", "1,1"), ("--snapshot-every", "5"), fsdp_faults
                ),
            )
        )
        skip = {n for n in a.skip.split(",") if n}
        unknown = skip - {n for n, _ in checks}
        if unknown:
            ap.error(
                f"--skip {','.join(sorted(unknown))}: no such check; the checks: {', '.join(n for n, _ in checks)}"
            )
        checks = [(n, fn) for n, fn in checks if n not in skip]
        results["skipped"] = sorted(skip)
        for name, fn in checks:
            t0 = time.monotonic()
            try:
                results[name] = fn()
            except Exception:
                results[name] = {"ok": False, "error": traceback.format_exc()[-3000:]}
            results[name]["check_s"] = round(time.monotonic() - t0, 2)
            print(f"{name}: {json.dumps(results[name], default=str)}", flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(results, indent=1, default=str))
    ok = all(results[n].get("ok") for n, _ in checks)
    left_out = f" ({', '.join(results['skipped'])} left out)" if results.get("skipped") else ""
    print(f"gpu check: {'all passed' if ok else 'FAILED'}{left_out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
