# CPU/gloo port of pytorch/examples distributed/minGPT-ddp/mingpt/trainer.py, rewritten for checkpointless.
# Copyright (c) 2017, Pytorch contributors. All rights reserved. BSD 3-Clause License: see
# examples/adopted/mingpt_original/LICENSE_NOTICE.txt for its full text and conditions.
"""A plain training loop: nothing here is specific to GPT.
CPU port: no device moves, no S3 upload (snapshots go where fsspec can write)."""

import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import checkpointless as cl


@dataclass
class TrainerConfig:
    max_epochs: int = None
    batch_size: int = None
    data_loader_workers: int = None
    grad_norm_clip: float = None
    snapshot_path: str | None = None
    save_every: int = None
    use_amp: bool = None
    amp_dtype: str = "float16"  # the upstream script's autocast dtype


@dataclass
class Snapshot:
    model_state: "OrderedDict[str, torch.Tensor]"
    optimizer_state: dict[str, Any]
    finished_epoch: int


class Trainer:
    def __init__(self, trainer_config: TrainerConfig, model, optimizer, train_dataset, test_dataset=None):
        self.config = trainer_config
        self.job = cl.init()
        # torchrun's variables
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device_type = "cpu"
        self.train_dataset = train_dataset
        self.train_loader = self._prepare_dataloader(train_dataset)
        self.test_loader = self._prepare_dataloader(test_dataset) if test_dataset else None
        self.epochs_run = 0
        self.model = model
        self.optimizer = optimizer
        self.save_every = self.config.save_every
        if self.config.use_amp:
            self.scaler = torch.amp.GradScaler(self.device_type)
            self.job.track(scaler=self.scaler)  # its scale travels with the weights
        if self.config.snapshot_path is None:
            self.config.snapshot_path = "snapshot.pt"
        if not self.job.is_replacement:  # a replacement receives the state from a peer
            self._load_snapshot()
        self.model = self.job.data_parallel(self.model, optimizer=self.optimizer)

    def _prepare_dataloader(self, dataset: Dataset):
        return DataLoader(
            dataset,
            batch_size=self.config.batch_size,
            shuffle=False,
            num_workers=self.config.data_loader_workers,
            sampler=DistributedSampler(dataset),
        )

    def _load_snapshot(self):
        try:
            with fsspec.open(self.config.snapshot_path) as f:
                snapshot_data = torch.load(f, map_location="cpu")
        except FileNotFoundError:
            print("Snapshot not found. Training model from scratch")
            return
        snapshot = Snapshot(**snapshot_data)
        self.model.load_state_dict(snapshot.model_state)
        self.optimizer.load_state_dict(snapshot.optimizer_state)
        self.epochs_run = snapshot.finished_epoch
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets, train: bool = True) -> float:
        amp = torch.amp.autocast(
            device_type=self.device_type,
            dtype=getattr(torch, self.config.amp_dtype),
            enabled=self.config.use_amp,
        )
        with torch.set_grad_enabled(train), amp:
            _, loss = self.model(source, targets)
        if train:
            self.optimizer.zero_grad(set_to_none=True)
            if self.config.use_amp:
                self.scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_norm_clip)
                self.optimizer.step()
        return loss.item()

    def _run_epoch(self, epoch: int, dataloader: DataLoader, train: bool = True):
        if train:
            dataloader.sampler.set_epoch(epoch)
        for iter, (source, targets) in enumerate(dataloader):
            step_type = "Train" if train else "Eval"
            batch_loss = self._run_batch(source, targets, train)
            if iter % 100 == 0:
                print(
                    f"[RANK{self.global_rank}] Epoch {epoch} | Iter {iter} | {step_type} Loss {batch_loss:.5f}"
                )

    def _save_snapshot(self, epoch):
        model = self.model
        raw_model = model.module if hasattr(model, "module") else model
        snapshot = Snapshot(
            model_state=raw_model.state_dict(),
            optimizer_state=self.optimizer.state_dict(),
            finished_epoch=epoch,
        )
        with fsspec.open(self.config.snapshot_path, "wb") as f:
            torch.save(asdict(snapshot), f)
        print(f"Snapshot saved at epoch {epoch}")

    def train(self):
        for epoch in self.job.epochs(self.config.max_epochs, self.train_loader, start=self.epochs_run):
            epoch += 1
            for step in self.job.epoch_steps():
                with step:
                    self._run_batch(*step.batch)
            if self.local_rank == 0 and epoch % self.save_every == 0 and not self.job.epoch_abandoned:
                self._save_snapshot(epoch)
            # eval run
            if self.test_loader:
                self._run_epoch(epoch, self.test_loader, train=False)
