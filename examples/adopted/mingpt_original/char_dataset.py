# CPU/gloo port of pytorch/examples distributed/minGPT-ddp/mingpt/char_dataset.py, rewritten for checkpointless.
# Copyright (c) 2017, Pytorch contributors. All rights reserved. BSD 3-Clause License: see
# examples/adopted/mingpt_original/LICENSE_NOTICE.txt for its full text and conditions.
"""A character-level dataset (after karpathy/minGPT's chargpt): every window of block_size + 1
characters is one sample, its first block_size as input and its last block_size as target."""

from dataclasses import dataclass

import fsspec
import torch
from torch.utils.data import Dataset


@dataclass
class DataConfig:
    path: str = None
    block_size: int = None
    train_split: float = None
    truncate: float = 1.0


class CharDataset(Dataset):
    def __init__(self, data_cfg: DataConfig):
        with fsspec.open(data_cfg.path) as f:
            data = f.read().decode("utf-8")
        data = data[: int(len(data) * data_cfg.truncate)]
        chars = sorted(set(data))
        print(f"Data has {len(data)} characters, {len(chars)} unique.")
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.itos = dict(enumerate(chars))
        self.block_size = data_cfg.block_size
        self.vocab_size = len(chars)
        self.data = data

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        ids = [self.stoi[c] for c in self.data[idx : idx + self.block_size + 1]]
        return torch.tensor(ids[:-1], dtype=torch.long), torch.tensor(ids[1:], dtype=torch.long)
