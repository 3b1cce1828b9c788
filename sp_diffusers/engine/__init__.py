"""FSDP2 engine adapter: one (dp, ring, ulysses) mesh (HSDP: dp split into replica groups), SP-aligned
batches, the exact gradient contract, atomic DCP checkpoints. See ``FSDPEngine``.
"""

from .checkpoint_files import CheckpointError
from .consistency import SPDivergenceError
from .fsdp_engine import FSDPEngine
from .settings import EngineSettings, LoraSettings, OptimSettings
from .step_agreement import StepError

__all__ = [
    "CheckpointError",
    "EngineSettings",
    "FSDPEngine",
    "LoraSettings",
    "OptimSettings",
    "SPDivergenceError",
    "StepError",
]
