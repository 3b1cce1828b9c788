"""FSDP2 engine adapter: one (dp, ring, ulysses) mesh, SP-aligned batches, the exact gradient contract,
atomic DCP checkpoints. See ``FSDPEngine``."""

from .checkpoint import CheckpointError
from .consistency import SPDivergenceError
from .fsdp_engine import FSDPEngine, LoraSettings, OptimSettings

__all__ = ["CheckpointError", "FSDPEngine", "LoraSettings", "OptimSettings", "SPDivergenceError"]
