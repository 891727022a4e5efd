# CPU/gloo port of pytorch/examples distributed/minGPT-ddp/mingpt/main.py, rewritten for checkpointless.
# Copyright (c) 2017, Pytorch contributors. All rights reserved. BSD 3-Clause License: see
# examples/adopted/mingpt_original/LICENSE_NOTICE.txt for its full text and conditions.
"""Train a small GPT on a character dataset with DDP. CPU port: gloo instead of the accelerator's
backend, and a small YAML loader with ``key.sub=value`` overrides in place of Hydra's.
Run: torchrun --nproc-per-node 2 main.py data_config.path=input.txt [--digest-out FILE]"""

import argparse
import hashlib
import os
import sys

import torch
import yaml
from char_dataset import CharDataset, DataConfig
from model import GPT, GPTConfig, OptimizerConfig, create_optimizer
from torch.distributed import destroy_process_group, init_process_group
from torch.utils.data import random_split
from trainer import Trainer, TrainerConfig


def ddp_setup():
    init_process_group(backend="gloo")


def get_train_objs(gpt_cfg: GPTConfig, opt_cfg: OptimizerConfig, data_cfg: DataConfig):
    dataset = CharDataset(data_cfg)
    train_len = int(len(dataset) * data_cfg.train_split)
    # seeded: every rank must split the same way (the original relies on its global seed)
    split = torch.Generator().manual_seed(42)
    train_set, test_set = random_split(dataset, [train_len, len(dataset) - train_len], generator=split)
    gpt_cfg.vocab_size = dataset.vocab_size
    gpt_cfg.block_size = dataset.block_size
    torch.manual_seed(0)  # the same initial weights on every rank
    model = GPT(gpt_cfg)
    optimizer = create_optimizer(model, opt_cfg)
    return model, optimizer, train_set, test_set


def load_cfg(overrides):
    """The YAML next to this file, with ``section.key=value`` overrides (values parsed as YAML)."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpt2_train_cfg.yaml")) as f:
        cfg = yaml.safe_load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in cfg or name not in cfg[section]:
            sys.exit(f"bad override {item!r}: write section.key=value with a key of gpt2_train_cfg.yaml")
        cfg[section][name] = yaml.safe_load(value)
    return cfg


def main(cfg, digest_out: str):
    ddp_setup()

    gpt_cfg = GPTConfig(**cfg["gpt_config"])
    opt_cfg = OptimizerConfig(**cfg["optimizer_config"])
    data_cfg = DataConfig(**cfg["data_config"])
    trainer_cfg = TrainerConfig(**cfg["trainer_config"])

    model, optimizer, train_data, test_data = get_train_objs(gpt_cfg, opt_cfg, data_cfg)
    trainer = Trainer(trainer_cfg, model, optimizer, train_data, test_data)
    trainer.train()
    if digest_out:  # the final weights' SHA-256, one file per rank ({rank} in the name)
        h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))
        with open(digest_out.replace("{rank}", os.environ["RANK"]), "w") as f:
            f.write(h.hexdigest() + "\n")

    destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="minGPT with DDP (CPU port)")
    ap.add_argument("--digest-out", default="", help="write the final weights' SHA-256 here")
    ap.add_argument("--data", help="ignored (the test helper passes it)")
    args, rest = ap.parse_known_args()
    main(load_cfg(rest), args.digest_out)
