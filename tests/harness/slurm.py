from pathlib import Path


def slurm_unavailable_reason() -> str | None:
    return "todo"


class SlurmCluster:
    def __init__(self, base: Path, nodes: int) -> None: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
