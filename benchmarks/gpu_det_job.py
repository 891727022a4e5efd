"""An example (examples/train_gpt.py, or ``--example llama_3d``: the 3-D replicate x FSDP x TP
example) with deterministic GPU kernels, for benchmarks/gpu_check.py.

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
args = sys.argv[1:]
name = "train_gpt"
if "--example" in args:  # ours, not the example's: taken out before the example parses the rest
    i = args.index("--example")
    name = args[i + 1]
    del args[i : i + 2]
example = Path(__file__).resolve().parents[1] / "examples" / f"{name}.py"
if not example.is_file():
    raise SystemExit(f"--example {name}: no examples/{name}.py; use train_gpt or llama_3d")
sys.argv = [str(example), *args]
runpy.run_path(str(example), run_name="__main__")
