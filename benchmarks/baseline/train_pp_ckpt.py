"""tests/scripts/pp_mlp.py's pipeline job under plain torchrun with DCP checkpoints: the PP baseline.

The same MLP, stages, schedule, batches and optimizer as ``tests/scripts/pp_mlp.py`` (its stage
builder, batch function and state digest are imported from it): ``init_device_mesh("cpu", (dp,
pp))`` on a plain gloo process group, rank (dp=i, pp=j) keeps stage j in a ``PipelineStage`` on
the "pp" group, ``Schedule1F1B`` over 4 microbatches, the gradients averaged over "dp"; no
launcher of ours, no resilient groups. Every ``--ckpt-every`` K steps each rank's stage (module
and AdamW state, under a key naming the stage), the step and each rank's RNG state are saved
with ``torch.distributed.checkpoint.save``; a (re)started process loads the newest complete
checkpoint and redoes the steps after it (ckptloop.py's loop and logs, shared with the other
baselines).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc-per-node 4 \\
        --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:29914 \\
        benchmarks/baseline/train_pp_ckpt.py --steps 40 --ckpt-every 10 --hidden 1024 \\
        --log-dir /tmp/f --inject kill:rank=3:step=35
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
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.pipelining import PipelineStage, Schedule1F1B  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ckptloop as cl  # noqa: E402  (imports torch.distributed.checkpoint: part of the import phase)

_T_IMPORTED = time.time()
PP_MLP = Path(__file__).resolve().parents[2] / "tests" / "scripts" / "pp_mlp.py"
PP = 2  # pipeline stages: rank r is (dp r // 2, pp r % 2), as in pp_mlp.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=32, help="the MLP's hidden width (pp_mlp.py --hidden)")
    cl.add_job_args(
        ap,
        hang_help="gloo timeout of the default group once the first step is done",
        digest_help="write each rank's stage state's SHA-256 here; {rank}: one file per rank",
    )
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % PP or world < 2 * PP:
        raise SystemExit(f"torchrun started {world} ranks: use a multiple of {PP}, at least {2 * PP}")
    job = cl.start_job(args, _T_START, _T_IMPORTED)
    pp_mlp = cl.load_example(PP_MLP)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.start_timeout))
    mesh = init_device_mesh("cpu", (world // PP, PP), mesh_dim_names=("dp", "pp"))
    job.log.phase("pg_ready")

    dp, pp = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    model = pp_mlp.stage_module(pp, args.hidden)
    stage = PipelineStage(model, pp, PP, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(stage, n_microbatches=pp_mlp.MICROBATCHES, loss_fn=F.mse_loss)
    job.log.phase("model_ready")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # pp_mlp.py's optimizer, no scheduler
    job.log.phase("optimizer_ready")
    dp_group, dp_size = mesh["dp"].get_group(), mesh["dp"].size()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = pp_mlp.batch(step, dp)
        return x, y

    def one_step(x: torch.Tensor, y: torch.Tensor) -> float:
        # pp_mlp.py's step, op for op, so both designs compute the same bits
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        for p in model.parameters():  # the replicas' average, as DDP would
            assert p.grad is not None
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(dp_size)
        opt.step()
        return float(torch.stack(losses).mean()) if losses else 0.0

    cl.train(job, model, opt, None, batch=batch, step_fn=one_step, state_key=f"stage{pp}")
    final = pp_mlp.state_digest(model, opt)
    job.log.emit("done", digest=final)
    if args.digest_out:
        Path(args.digest_out.replace("{rank}", str(job.rank))).write_text(final)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
