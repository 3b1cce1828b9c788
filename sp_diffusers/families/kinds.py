"""Model families by short name (``kind``): the diffusers class each names, and the class of a built model.

``kind`` is what configs and the CLI say (``model.kind: qwenimage``); the tiny models (``sp_diffusers.tiny``),
the trainer's ``--pretrained`` loading and the benchmarks all resolve it here.
"""

from __future__ import annotations

import torch

__all__ = ["KINDS", "class_name", "kind_available", "model_class"]

# kind -> diffusers class name
KINDS: dict[str, str] = {
    "qwenimage": "QwenImageTransformer2DModel",
    "flux": "FluxTransformer2DModel",
    "wan": "WanTransformer3DModel",
    "sd3": "SD3Transformer2DModel",
    "hunyuanvideo": "HunyuanVideoTransformer3DModel",
    "cogvideox": "CogVideoXTransformer3DModel",
    # the other transformers diffusers ships a context-parallel plan for (LTX-2, Helios: 0.37+; MiniMax-H3: 0.40+)
    "flux2": "Flux2Transformer2DModel",
    "chronoedit": "ChronoEditTransformer3DModel",
    "ltx": "LTXVideoTransformer3DModel",
    "ltx2": "LTX2VideoTransformer3DModel",
    "helios": "HeliosTransformer3DModel",
    "minimax_h3": "MiniMaxH3Transformer3DModel",
    # models diffusers ships without a plan, planned by sp_diffusers.patching.plans
    "zimage": "ZImageTransformer2DModel",
    "hunyuanvideo15": "HunyuanVideo15Transformer3DModel",
    "wanvace": "WanVACETransformer3DModel",
}


def model_class(kind: str) -> type:
    """The diffusers class of ``kind`` in the installed diffusers."""
    import diffusers

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a known model kind; choose one of {tuple(KINDS)}")
    cls = getattr(diffusers, KINDS[kind], None)
    if cls is None:
        raise ValueError(
            f"model kind {kind!r} needs diffusers.{KINDS[kind]}, which diffusers {diffusers.__version__} "
            "does not have; fix: upgrade diffusers"
        )
    return cls


def kind_available(kind: str) -> bool:
    """Whether the installed diffusers has ``kind``'s class (LTX-2 and Helios arrived in 0.37, MiniMax-H3 in 0.40)."""
    import diffusers

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a known model kind; choose one of {tuple(KINDS)}")
    return getattr(diffusers, KINDS[kind], None) is not None


def class_name(model: torch.nn.Module) -> str:
    """The model's own class name (FSDP2 wraps a sharded module's class as ``FSDP<name>``)."""
    return type(model).__name__.removeprefix("FSDP")
