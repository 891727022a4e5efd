# CPU/gloo port of pytorch/examples distributed/minGPT-ddp/mingpt/model.py, rewritten for checkpointless.
# Copyright (c) 2017, Pytorch contributors. All rights reserved. BSD 3-Clause License: see
# examples/adopted/mingpt_original/LICENSE_NOTICE.txt for its full text and conditions.
"""The GPT language model (after karpathy/minGPT), all in one file."""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    model_type: str = "gpt2"
    n_layer: int = None
    n_head: int = None
    n_embd: int = None
    vocab_size: int = 50257
    block_size: int = 1024
    embd_pdrop: float = 0.1
    resid_pdrop: float = 0.1
    attn_pdrop: float = 0.1


@dataclass
class OptimizerConfig:
    learning_rate: float = 3e-4
    weight_decay: float = 0.1


# layer counts, heads and widths of the named model types, used when the config leaves them out
MODEL_TYPES = {
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),
    "gpt-mini": dict(n_layer=6, n_head=6, n_embd=192),
    "gpt-micro": dict(n_layer=4, n_head=4, n_embd=128),
    "gpt-nano": dict(n_layer=3, n_head=3, n_embd=48),
}


class MultiheadAttentionLayer(nn.Module):
    """Causal multi-head self-attention followed by an output projection."""

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        n = config.block_size
        self.register_buffer("mask", torch.tril(torch.ones(n, n)).view(1, 1, n, n))
        self.attn = nn.MultiheadAttention(
            config.n_embd, config.n_head, dropout=config.attn_pdrop, batch_first=True
        )
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = nn.Dropout(config.resid_pdrop)

    def forward(self, x):
        t = x.size(1)
        y, _ = self.attn(x, x, x, attn_mask=self.mask[0, 0, :t, :t])
        return self.resid_drop(self.c_proj(y))


class Block(nn.Module):
    """One pre-norm transformer block: attention, then an MLP, each with a residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.n_embd)
        self.attn = MultiheadAttentionLayer(config)
        self.ln2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd),
            nn.GELU(),
            nn.Linear(4 * config.n_embd, config.n_embd),
            nn.Dropout(config.resid_pdrop),
        )

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class EmbeddingStem(nn.Module):
    """Token plus learned position embeddings."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Parameter(torch.zeros(1, config.block_size, config.n_embd))
        self.drop = nn.Dropout(config.embd_pdrop)
        self.block_size = config.block_size

    def forward(self, idx):
        t = idx.size(1)
        assert t <= self.block_size, f"sequence of length {t} is longer than block_size {self.block_size}"
        return self.drop(self.tok_emb(idx) + self.pos_emb[:, :t, :])


class GPT(nn.Module):
    """GPT language model: embeddings, a stack of blocks, a final norm and the vocabulary head."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        if None in (config.n_layer, config.n_head, config.n_embd):
            config.__dict__.update(MODEL_TYPES[config.model_type])
        self.block_size = config.block_size
        self.emb_stem = EmbeddingStem(config)
        self.blocks = nn.Sequential(*[Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections that write into the residual stream
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
        print(f"number of parameters: {sum(p.numel() for p in self.blocks.parameters()) / 1e6:.2f}M")

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.zeros_(module.bias)
            nn.init.ones_(module.weight)

    def forward(self, idx, targets=None):
        x = self.ln_f(self.blocks(self.emb_stem(idx)))
        logits = self.head(x)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def create_optimizer(model: nn.Module, opt_config: OptimizerConfig):
    """AdamW with weight decay on the weights of linear layers and attention input projections
    only; biases, norms, embeddings and the position embedding are not decayed."""
    decay, no_decay = set(), set()
    for mn, m in model.named_modules():
        for pn, _ in m.named_parameters(recurse=False):
            full = f"{mn}.{pn}" if mn else pn
            if (pn.endswith("weight") and isinstance(m, nn.Linear)) or pn == "in_proj_weight":
                decay.add(full)
            else:
                no_decay.add(full)
    params = dict(model.named_parameters())
    assert not decay & no_decay and set(params) == decay | no_decay, (
        "a parameter is in neither or both groups"
    )
    groups = [
        {"params": [params[n] for n in sorted(decay)], "weight_decay": opt_config.weight_decay},
        {"params": [params[n] for n in sorted(no_decay)], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=opt_config.learning_rate, betas=(0.9, 0.95))
