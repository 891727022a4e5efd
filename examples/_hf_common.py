"""What the two Hugging Face examples share: a tiny GPT-2, data made in memory, and a digest.

examples/hf_trainer.py (``transformers.Trainer``) and examples/hf_accelerate.py (an Accelerate
loop) train the same model on the same data, so that the only thing each example shows is its
own loop and the lines that adopt it. Nothing here is fetched from the hub.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 64


class Snippets(Dataset[dict[str, torch.Tensor]]):
    """Sample i: ``seq_len`` tokens of a repeating pattern with noise, a function of (seed, i)."""

    def __init__(self, size: int, seq_len: int, seed: int, vocab: int = VOCAB) -> None:
        self.size, self.seq_len, self.vocab, self.seed = size, seq_len, vocab, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        start = int(torch.randint(0, self.vocab, (), generator=g))
        ids = (start + torch.arange(self.seq_len) * 3) % self.vocab
        noise = torch.rand(self.seq_len, generator=g) < 0.1
        ids = torch.where(noise, torch.randint(0, self.vocab, (self.seq_len,), generator=g), ids)
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_gpt2(seq_len: int, dim: int = 32, layers: int = 2, seed: int = 1234) -> GPT2LMHeadModel:
    """A GPT-2 built from a config, the same on every rank (seeded before it is made)."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=seq_len, n_embd=dim, n_layer=layers, n_head=2)
    return GPT2LMHeadModel(config)


def state_digest(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, logs: Iterable[Mapping[str, Any]] = ()
) -> str:
    """SHA-256 of the weights, the optimizer's state and a log history (timings left out: they
    differ from run to run)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(_bytes(t))
    for pid, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            h.update(f"{pid}/{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(_bytes(value))
    h.update(json.dumps(without_timings(logs), sort_keys=True).encode())
    return h.hexdigest()


def without_timings(logs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Log entries without their run times and rates (``train_runtime``, ``eval_samples_per_second``,
    ``eval_model_preparation_time``, ...)."""
    timing = ("runtime", "per_second", "_time")
    return [{k: v for k, v in e.items() if not any(t in k for t in timing)} for e in logs]


def write_digest(template: str | None, rank: int, digest: str) -> None:
    """Print rank 0's digest; write each rank's to ``template`` ({rank} filled in), whole or not
    at all: a reader must never see half a digest."""
    if rank == 0:
        print(f"final state sha256 {digest}", flush=True)
    if template:
        path = Path(template.replace("{rank}", str(rank)))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(digest + "\n")
        os.replace(tmp, path)


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
