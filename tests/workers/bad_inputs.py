"""Bad inputs that need real ranks. Every case must raise on every rank; a barrier after the last case
proves that no rank was left inside a collective (the harness kills the run if one hangs)."""

from __future__ import annotations

import logging
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .common import ulysses_parallel_config


def _catch(fn) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def bad_inputs(rank: int, world: int) -> dict:
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.parallel.attention import ulysses_sdpa_attention
    from sp_diffusers.tiny import tiny_model

    dlogging.set_verbosity(logging.ERROR)
    sp_diffusers.install()
    out: dict[str, str | None] = {}
    cfg = ulysses_parallel_config(world)
    S, D = 4 * world, 8
    q = torch.randn(2, S // world, 2 * world, D)
    out["attn:kv_heads_not_divisible"] = _catch(
        lambda: ulysses_sdpa_attention(
            torch.randn(2, S // world, 3 * world, D),
            torch.randn(2, S // world, 3, D),
            torch.randn(2, S // world, 3, D),
            _parallel_config=cfg,
        )
    )
    out["attn:mask_fits_neither_length"] = _catch(
        lambda: ulysses_sdpa_attention(
            q, q, q, attn_mask=torch.ones(2, S + 3, dtype=torch.bool), _parallel_config=cfg
        )
    )
    out["attn:dtype_mismatch"] = _catch(
        lambda: ulysses_sdpa_attention(q, q.double(), q, _parallel_config=cfg)
    )
    out["attn:mask_local_on_both_dims"] = _catch(
        lambda: ulysses_sdpa_attention(
            q,
            q,
            q,
            attn_mask=torch.ones(2, 1, S // world, S // world, dtype=torch.bool),
            _parallel_config=cfg,
        )
    )
    out["config:sp_exceeds_world"] = _catch(
        lambda: sp_diffusers.context_parallel_config(ulysses_degree=2 * world)
    )
    out["config:sp_not_dividing_world"] = _catch(
        lambda: sp_diffusers.context_parallel_config(ulysses_degree=3)
    )
    out["config:mesh_without_ulysses"] = _catch(
        lambda: sp_diffusers.context_parallel_config(
            ulysses_degree=world, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("sp",))
        )
    )
    out["config:mesh_size_mismatch"] = _catch(
        lambda: sp_diffusers.context_parallel_config(
            ulysses_degree=world // 2,
            mesh=init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses")),
        )
    )

    engine = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1), ulysses_sequence_parallel_size=2, debug_checks=True
    )
    out["engine:unknown_setting"] = _catch(
        lambda: sp_diffusers.FSDPEngine(
            tiny_model("qwenimage", num_layers=1), ulysses_sequence_paralel_size=2
        )
    )
    out["engine:divergent_sp_batches"] = _catch(
        lambda: engine.prepare_batch({"latents": torch.full((1, 4, 16), float(rank))})
    )
    root = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(root, src=0)
    engine.save_checkpoint(root[0], step=1)
    lora = sp_diffusers.LoraSettings(rank=4, alpha=4.0)
    adapted = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1), ulysses_sequence_parallel_size=4, lora=lora
    )
    adapted.save_checkpoint(root[0], step=2)
    other_alpha = sp_diffusers.FSDPEngine(
        tiny_model("qwenimage", num_layers=1),
        ulysses_sequence_parallel_size=4,
        lora=sp_diffusers.LoraSettings(rank=4, alpha=16.0),
    )
    out["engine:checkpoint_other_lora_alpha"] = _catch(lambda: other_alpha.load_checkpoint(root[0]))
    dist.barrier()
    return out
