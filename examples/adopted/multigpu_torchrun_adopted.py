# Ported to CPU/gloo from pytorch/examples, distributed/ddp-tutorial-series/multigpu_torchrun.py
# (with datautils.py's MyTrainDataset inlined), keeping its structure. Original licence:
#
# BSD 3-Clause License
# Copyright (c) 2017, Pytorch contributors. All rights reserved.
# Redistribution and use in source and binary forms, with or without modification, are permitted
# provided that the following conditions are met: (1) redistributions of source code must retain
# the above copyright notice, this list of conditions and the following disclaimer; (2)
# redistributions in binary form must reproduce the above copyright notice, this list of conditions
# and the following disclaimer in the documentation and/or other materials provided with the
# distribution; (3) neither the name of the copyright holder nor the names of its contributors may
# be used to endorse or promote products derived from this software without specific prior written
# permission. THIS SOFTWARE IS PROVIDED BY THE COPYRIGHT HOLDERS AND CONTRIBUTORS "AS IS" AND ANY
# EXPRESS OR IMPLIED WARRANTIES ARE DISCLAIMED; IN NO EVENT SHALL THE COPYRIGHT HOLDER OR
# CONTRIBUTORS BE LIABLE FOR ANY DAMAGES ARISING IN ANY WAY OUT OF THE USE OF THIS SOFTWARE.
#
# The adopted version of multigpu_torchrun_original.py (the diff is in docs/adoption.md). Run:
# checkpointless run --nproc 2 --spares 1 examples/adopted/multigpu_torchrun_adopted.py 3 1
# CPU port: gloo instead of nccl, no device moves; the dataset is seeded (the original draws it
# unseeded, so every rank trained on different random data); mse_loss, because cross_entropy over
# one output is a constant with zero gradient; --digest-out writes the final weights' hash.
import hashlib
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import checkpointless as cl


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    return cl.init()


class Trainer:
    def __init__(
        self,
        model: torch.nn.Module,
        train_data: DataLoader,
        optimizer: torch.optim.Optimizer,
        save_every: int,
        snapshot_path: str,
    ) -> None:
        self.job = job = cl.init()
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        self.model = model
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path) and not job.is_replacement:
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)

        self.model = job.data_parallel(self.model, optimizer=self.optimizer)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[CPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {
            "MODEL_STATE": self.model.module.state_dict(),
            "EPOCHS_RUN": epoch,
        }
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs: int):
        for epoch in self.job.epochs(max_epochs, self.train_data, start=self.epochs_run):
            for step in self.job.epoch_steps():
                with step:
                    self._run_batch(*step.batch)
            if self.gpu_id == 0 and epoch % self.save_every == 0 and not self.job.epoch_abandoned:
                self._save_snapshot(epoch)


def load_train_objs():
    train_set = MyTrainDataset(2048)  # load your dataset
    torch.manual_seed(0)  # the same initial weights on every rank
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    return train_set, model, optimizer


def prepare_dataloader(dataset: Dataset, batch_size: int):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every: int, total_epochs: int, batch_size: int, snapshot_path: str, digest_out: str):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if digest_out:
        h = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.state_dict().values()))
        with open(digest_out.replace("{rank}", os.environ["RANK"]), "w") as f:
            f.write(h.hexdigest() + "\n")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument(
        "--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)"
    )
    parser.add_argument("--snapshot_path", default="snapshot.pt")
    parser.add_argument("--digest-out", default="", help="write the final weights' SHA-256 here")
    parser.add_argument("--data", help="ignored (the test helper passes it)")
    args = parser.parse_args()

    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.digest_out)
