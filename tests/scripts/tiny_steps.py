"""A small adopted job of fast steps (issue 38's frictions): ``--steps N`` steps of ``--sleep``
seconds each; ``--config-error-at S`` raises a ConfigError in step S on ``--rank`` (every rank
when -1), a deterministic error no replacement can fix; with ``--in-section``, in a section that
runs before step S instead."""

from __future__ import annotations

import argparse
import time

import torch

import checkpointless as cl
from checkpointless.errors import ConfigError

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--config-error-at", type=int, default=-1)
parser.add_argument("--rank", type=int, default=-1)
parser.add_argument("--in-section", action="store_true")
args = parser.parse_args()

job = cl.init()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
dp = job.data_parallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
job.track(model=model, optimizer=opt)


def refuse() -> None:
    if job.committed_step == args.config_error_at and args.rank in (-1, job.rank):
        raise ConfigError("tiny_steps.py: --bad-setting is refused; drop it")


if args.in_section:
    job.section("check", refuse, every=1)
for step in job.steps(args.steps):
    with step:
        if not args.in_section and step.index == args.config_error_at and args.rank in (-1, job.rank):
            raise ConfigError("tiny_steps.py: --bad-setting is refused; drop it")
        loss = dp(torch.ones(2, 4)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.sleep)
