"""FSDP2 engine adapter: one (dp, ring, ulysses) mesh (HSDP: dp split into replica groups), SP-aligned
batches, the exact gradient contract, atomic DCP checkpoints. See ``FSDPEngine``.

    fsdp_engine.py   build (mesh, LoRA, backend, FSDP2, AdamW), forward/backward, optimizer step
    sharding.py      FSDP2 on the mesh: plain (every rank) or HSDP (replicate x shard), the exact reduction
    settings.py      EngineSettings / OptimSettings / LoraSettings: what an engine is built from
    batch.py         SP-aligned batches: ragged text padded to the degree, broadcast in the SP group
    checkpoint.py    atomic, resumable DCP checkpoints: save, load (any layout), the model checks
    checkpoint_files.py  the on-disk format: folders, meta.json, latest, RNG files
    consistency.py   SP peers must see the same data: checksums compared across the group
    step_agreement.py  before backward: did every rank's loss_fn work, how many samples each rank holds
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
