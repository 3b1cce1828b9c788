"""A tiny-but-realistic video DiT for the scaling and memory benchmarks: a real WanTransformer3DModel with
a few layers (4 heads x 32, FFN 512), latent video sized to a requested token count, fixed seeds."""

from __future__ import annotations

import copy

import torch

HEADS, HEAD_DIM, FFN, LAYERS, TEXT = 4, 32, 512, 2, 32


def frames_for(tokens: int, hw: int = 32) -> int:
    """Frames of a ``hw x hw`` latent (patch 1x2x2: (hw/2)^2 tokens per frame) giving ``tokens`` tokens."""
    per_frame = (hw // 2) ** 2
    if tokens % per_frame:
        raise ValueError(f"tokens={tokens} must be a multiple of {per_frame}")
    return tokens // per_frame


def build(seed: int = 0) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=HEADS,
        attention_head_dim=HEAD_DIM,
        in_channels=4,
        out_channels=4,
        text_dim=64,
        freq_dim=64,
        ffn_dim=FFN,
        num_layers=LAYERS,
        rope_max_seq_len=1024,
    )


def inputs(tokens: int, seed: int = 1, device: torch.device | str = "cpu") -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(1, 4, frames_for(tokens), 32, 32, generator=g).to(device),
        timestep=torch.tensor([500.0]).to(device),
        encoder_hidden_states=torch.randn(1, TEXT, 64, generator=g).to(device),
    )


def fwd_bwd(model: torch.nn.Module, x: dict) -> None:
    model(**x, return_dict=False)[0].float().square().mean().backward()
    model.zero_grad(set_to_none=True)


def sp_copy(model: torch.nn.Module, degree: int) -> torch.nn.Module:
    import sp_diffusers

    sp_diffusers.install()
    sp = copy.deepcopy(model)
    sp.set_attention_backend("ulysses_sdpa")
    sp.enable_parallelism(config=sp_diffusers.context_parallel_config(ulysses_degree=degree))
    return sp
