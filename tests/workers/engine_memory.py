"""FSDPEngine built from a model on ``meta``: the per-rank peak while building it, and the values it loads.

One process group runs every check (engine builds are cheap, spawns are not)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

# Wan with enough width that its blocks hold most of the parameters (as in a real DiT)
WAN = dict(num_layers=4, num_attention_heads=4, attention_head_dim=32, ffn_dim=512, text_dim=64, freq_dim=64)


def _reference(folder: str) -> torch.nn.Module:
    from sp_diffusers.tiny import tiny_model

    model = tiny_model("wan", seed=3, **WAN)
    if dist.get_rank() == 0:
        model.save_pretrained(folder)  # safetensors
    dist.barrier()
    return model


def _meta(folder: str) -> torch.nn.Module:
    from diffusers import WanTransformer3DModel

    from sp_diffusers.engine.weights import meta_model

    return meta_model(WanTransformer3DModel, folder)


def _full(engine) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        for n, p in engine.model.named_parameters()
    }


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return None


def build_checks(rank: int, world: int, folder: str) -> dict[str, Any]:
    from torch.distributed._tools.mem_tracker import MemTracker

    from sp_diffusers import FSDPEngine

    ref = _reference(folder)
    ref_state = {n: p.detach().clone() for n, p in ref.named_parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in ref.parameters())
    buffer_bytes = sum(b.numel() * b.element_size() for b in ref.buffers())
    block_bytes = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in ref.blocks)
    out: dict[str, Any] = {
        "param_bytes": param_bytes,
        "buffer_bytes": buffer_bytes,
        "block_bytes": block_bytes,
    }

    # 1. meta -> sharded -> each rank reads its own rows of the safetensors file, under torch's memory tracker
    model = _meta(folder)
    out["meta_before"] = all(p.is_meta for p in model.parameters())
    tracker = MemTracker()
    with tracker:
        engine = FSDPEngine(model, use_fsdp=True, device="cpu", weights=folder)
    peak = tracker.get_tracker_snapshot("peak")
    out["peak_bytes"] = max(v["Total"] for v in peak.values())
    full = _full(engine)
    out["values_equal"] = all(torch.equal(full[n], ref_state[n]) for n in ref_state)
    out["n_params"] = (len(full), len(ref_state))
    rope = next(b for n, b in engine.model.named_buffers() if "freqs" in n)
    ref_rope = next(b for n, b in ref.named_buffers() if "freqs" in n)
    out["rope_equal"] = torch.equal(rope, ref_rope)

    # 1b. resume in place: the load allocates the host rollback copy of this rank's parameters and the AdamW
    # placeholders it loads into, not a second copy of everything (as loading into copies did)
    root = f"{folder}/checkpoints"
    engine.save_checkpoint(root, step=1)
    with torch.no_grad():
        for p in engine.model.parameters():
            p.zero_()
    tracker = MemTracker()
    # the engine's own tensors are known before the load starts (else views of them would count as new)
    tracker.track_external(engine.model, engine.optimizer)
    with tracker:
        before = max(v["Total"] for v in tracker.get_tracker_snapshot("current").values())
        engine.load_checkpoint(root)
    peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    out["resume_peak_bytes"] = peak - before  # what the load adds to the engine's own memory
    out["resumed_equal"] = all(torch.equal(v, ref_state[n]) for n, v in _full(engine).items())

    # 2. a state dict of full tensors as the source, with LoRA adapters the source lacks (peft initialises them)
    from sp_diffusers.engine import LoraSettings

    lora = FSDPEngine(_meta(folder), device="cpu", weights=ref.state_dict(), lora=LoraSettings(rank=4))
    lora_full = _full(lora)

    def in_lora(name: str) -> str:  # peft moves a wrapped layer's tensors under .base_layer
        owner, _, leaf = name.rpartition(".")
        wrapped = f"{owner}.base_layer.{leaf}"
        return wrapped if wrapped in lora_full else name

    out["lora_base_equal"] = all(torch.equal(lora_full[in_lora(n)], v) for n, v in ref_state.items())
    out["lora_b_zero"] = all(v.abs().sum() == 0 for n, v in lora_full.items() if "lora_B" in n)
    out["lora_a_random"] = all(v.std() > 0 for n, v in lora_full.items() if "lora_A" in n)
    metrics = lora.train_step({}, lambda eng, b: (_loss(eng), {}))
    out["lora_step_finite"] = all(isinstance(v, float) for v in metrics.values())

    # 3. "empty" allocates and leaves values alone; a callable initialises
    empty = FSDPEngine(_meta(folder), device="cpu", weights="empty")
    out["empty_real"] = not any(p.is_meta for p in empty.model.parameters())
    seen: list[str] = []
    FSDPEngine(_meta(folder), device="cpu", weights=lambda m: seen.append(type(m).__name__))
    out["init_called"] = seen

    # 3b. the control flow of an NCCL world, on gloo: the engine's agreements on gloo twins of the world and the
    # SP group (forced here; NCCL needs them), through a step, a batch broadcast and a checkpoint round trip
    from sp_diffusers.engine import model_setup

    real = model_setup.needs_host_groups
    model_setup.needs_host_groups = lambda: True
    try:
        twin = FSDPEngine(_meta(folder), device="cpu", weights=folder, ulysses_sequence_parallel_size=2)
    finally:
        model_setup.needs_host_groups = real
    groups = (twin.control_group, twin.sp_control_group)
    out["twins"] = [
        (dist.get_backend(g), dist.get_process_group_ranks(g), g is not dist.group.WORLD) for g in groups
    ]
    batch = twin.prepare_batch({"hidden_states": torch.randn(1, 16, 1, 4, 4), "note": "same"})
    twin_metrics = twin.train_step({}, lambda eng, b: (_loss(eng), {}))
    twin.save_checkpoint(f"{folder}/twin", step=1)
    twin.load_checkpoint(f"{folder}/twin")
    out["twin_step"] = (
        batch["note"],
        tuple(batch["hidden_states"].shape),
        isinstance(twin_metrics["loss"], float),
    )

    # 4. refusals, on every rank alike
    out["no_source"] = _error(lambda: FSDPEngine(_meta(folder), device="cpu"))
    out["source_for_real_model"] = _error(lambda: FSDPEngine(ref, device="cpu", weights=folder))
    out["wrong_folder"] = _error(lambda: FSDPEngine(_meta(folder), device="cpu", weights=folder + "/nothing"))
    mine = folder if rank == 0 else folder + "/nothing"  # one rank cannot read its source: every rank raises
    out["one_rank_fails"] = _error(lambda: FSDPEngine(_meta(folder), device="cpu", weights=mine))
    return out


def _loss(engine) -> torch.Tensor:
    from sp_diffusers.tiny import tiny_inputs

    inputs = tiny_inputs("wan", engine.model, batch=1, seed=1, image_hw=(4, 4), frames=1)
    return engine.forward(**inputs).square().mean()
