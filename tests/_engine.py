"""The transformer as the trainer's engine calls it, in one process (no SP): what the sampler's ``velocity`` needs."""

from __future__ import annotations

from typing import Any

import torch


class OneProcessEngine:
    """``engine.forward(**kwargs)``: the model's output (every output of a multi-output model, as ``FSDPEngine``
    returns them: LTX-2's video and audio), each call's kwargs kept in ``calls``; ``for_step``: itself (one expert)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[dict[str, Any]] = []

    def for_step(self, step: int) -> OneProcessEngine:
        return self

    def forward(self, **inputs: Any) -> Any:
        self.calls.append(inputs)
        out = self.model(**inputs, return_dict=False)
        return out[0] if len(out) == 1 else tuple(out)
