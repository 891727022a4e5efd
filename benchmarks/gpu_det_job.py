"""examples/train_gpt.py with deterministic GPU kernels, for benchmarks/gpu_check.py.

Bitwise equality after a fault needs the fault-free run itself to be reproducible: cuBLAS with a
fixed workspace (CUBLAS_WORKSPACE_CONFIG, set by the caller), deterministic algorithms where torch
has them, and attention through the plain math kernels (the fused flash / memory-efficient
backward passes accumulate with atomics)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

from checkpointless.comm.handle import default_backend

torch.use_deterministic_algorithms(True, warn_only=True)
torch.backends.cuda.enable_flash_sdp(False)
torch.backends.cuda.enable_mem_efficient_sdp(False)
print(f"job backend: {default_backend()}", flush=True)
example = Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
