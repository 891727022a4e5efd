"""examples/llama_3d.py's job under plain torchrun with DCP checkpoints: the 3-D baseline.

The same Llama-style model, mesh, batches and optimizer as ``examples/llama_3d.py`` (model class,
TP plan, batch function and shard digest are imported from it): ``init_device_mesh("cpu", (dp,
shard, tp))`` on a plain gloo process group, ``parallelize_module`` over "tp", then FSDP2's HSDP
over ("dp", "shard"); no launcher of ours, no resilient groups. Every ``--ckpt-every`` K steps the
sharded state dict (each rank's own shards of the model and of AdamW's state, DTensors over both
TP and FSDP), the step and each rank's RNG state are saved with
``torch.distributed.checkpoint.save``; a (re)started process loads the newest complete checkpoint
and redoes the steps after it (ckptloop.py's loop and logs, shared with the other baselines).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 8 \\
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29913 \\
        benchmarks/baseline/train_3d_ckpt.py --mesh 2,2,2 --steps 40 --ckpt-every 10 \\
        --log-dir /tmp/f --inject kill:rank=5:step=25
"""

from __future__ import annotations

import time

_T_START = time.time()  # before the heavy imports: the restart cost includes them

import argparse  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptloop as cl  # noqa: E402  (imports torch.distributed.checkpoint: part of the import phase)

_T_IMPORTED = time.time()
LLAMA = Path(__file__).resolve().parents[2] / "examples" / "llama_3d.py"


def parse_mesh(text: str, world: int) -> tuple[int, int, int]:
    """``DP,SHARD,TP`` whose product is the world size, or exit naming the bad value."""
    try:
        dp, shard, tp = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"bad --mesh {text!r}: use DP,SHARD,TP, e.g. 2,2,2") from None
    if min(dp, shard, tp) < 1 or dp * shard * tp != world:
        raise SystemExit(
            f"--mesh {text}: DP x SHARD x TP = {dp * shard * tp}, but torchrun started {world} ranks"
        )
    return dp, shard, tp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mesh", required=True, metavar="DP,SHARD,TP", help="the (dp, shard, tp) mesh shape")
    ap.add_argument("--vocab", type=int, default=64)
    cl.add_job_args(
        ap,
        hang_help="gloo timeout once the first step is done",
        digest_help="write each rank's shards' SHA-256 here; {rank}: one file per rank",
    )
    args = ap.parse_args()
    dp, shard, tp = parse_mesh(args.mesh, int(os.environ.get("WORLD_SIZE", "1")))
    job = cl.start_job(args, _T_START, _T_IMPORTED)
    llama = cl.load_example(LLAMA)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.start_timeout))
    mesh = init_device_mesh("cpu", (dp, shard, tp), mesh_dim_names=("dp", "shard", "tp"))
    job.log.phase("pg_ready")

    torch.manual_seed(0)  # as the example: one full model on every rank, each keeps its shards
    model = llama.Llama(args.vocab, args.dim, args.heads, args.layers, args.seq_len)
    for block in model.layers:
        parallelize_module(block, mesh["tp"], llama.TP_PLAN)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp", "shard"])
    fully_shard(model, mesh=mesh["dp", "shard"])
    job.log.phase("model_ready")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # the example's optimizer, no scheduler
    job.log.phase("optimizer_ready")
    replica = mesh.get_local_rank("dp") * shard + mesh.get_local_rank("shard")

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = llama.batch(step, replica, args.vocab, args.seq_len)
        return x, y

    cl.train(job, model, opt, None, batch=batch, vocab=args.vocab)
    final = llama.state_digest(model, opt)  # this rank's shards, as the example digests them
    job.log.emit("done", digest=final)
    if args.digest_out and ("{rank}" in args.digest_out or job.rank == 0):
        Path(args.digest_out.replace("{rank}", str(job.rank))).write_text(final + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
