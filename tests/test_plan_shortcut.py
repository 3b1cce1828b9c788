"""The block shortcut (runs with 3 and 4 blocks per list, extrapolated) against a full trace of the whole model:
every place's peak by part, the FLOPs and the bytes sent. Small models of real classes (fake tensors; nothing is
allocated) at Ulysses 2 on 4 ranks with uneven shards: Qwen-Image with checkpointing (where FSDP's retained
reduce-scatter buffer makes a block next to the first or the last one differ), Wan with checkpointing and LoRA,
and a two-list Flux with full fine-tuning."""

from __future__ import annotations

import pytest

from sp_diffusers.plan.extrapolate import combine, shortcut_counts
from sp_diffusers.plan.models import FAMILIES, ModelSpec
from sp_diffusers.plan.shapes import Workload
from sp_diffusers.plan.trace import TraceRequest, block_lists, run_trace

QWEN = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=6,
    attention_head_dim=32,
    num_attention_heads=2,
    joint_attention_dim=32,
    axes_dims_rope=(8, 12, 12),
)
WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=32,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=128,
    num_layers=5,
)
FLUX = dict(
    patch_size=1,
    in_channels=16,
    num_layers=4,
    num_single_layers=4,
    attention_head_dim=16,
    num_attention_heads=2,
    joint_attention_dim=32,
    pooled_projection_dim=16,
    axes_dims_rope=(4, 6, 6),
)


@pytest.mark.parametrize(
    "kind, config, checkpointing, lora",
    [("qwenimage", QWEN, True, None), ("wan", WAN, True, 4), ("flux", FLUX, False, None)],
    ids=["qwen-checkpointing", "wan-checkpointing-lora", "flux-two-lists-full"],
)
def test_the_block_shortcut_equals_a_full_trace(kind, config, checkpointing, lora):
    spec = ModelSpec(f"small-{kind}", kind, config, FAMILIES[kind])
    lists = block_lists(spec)
    work = Workload(batch=1, grid=(1, 15, 17), text_len=15)  # 255 tokens: uneven shards over 2 ranks

    def trace(counts: dict[str, int]):
        req = TraceRequest(spec, work, 4, ulysses=2, checkpointing=checkpointing, lora_rank=lora)
        return run_trace(TraceRequest(**{**req.__dict__, "blocks": tuple(counts.items())}))

    full_train, full_rollout = trace(lists)
    runs = [trace(c) for c in shortcut_counts(lists)]
    assert len(runs) == 1 + len(lists)  # 3 per list, then 4 in each list in turn
    for full, got in (
        (full_train, combine(lists, [r[0] for r in runs])),
        (full_rollout, combine(lists, [r[1] for r in runs])),
    ):
        assert got.places.keys() == full.places.keys()
        for place, parts in full.places.items():
            # equal to the byte: memory at every place is linear in the block count once the tracker's own
            # reference cycles are gone (plan/tracker.py: before, a graph the model drops outlived it until the
            # garbage collector ran, a few KiB here or there that looked quadratic in the block count)
            assert got.places[place] == parts, (place, got.places[place], parts)
        assert got.flops == full.flops
        assert got.comm == pytest.approx(full.comm, rel=1e-12)
    # the places include blocks between the first and the last: the shortcut's hardest case
    assert any(place[-1] == "middle" for place in full_train.places)


def test_the_tracker_keeps_no_dropped_graph_alive():
    """A graph whose output is dropped is freed at once under the planner's tracker, as in a run without it:
    torch's module tracker hooks gradients through reference cycles, which kept such a graph, and what it saved,
    until the garbage collector ran (the collector is off here, so only reference counts free anything)."""
    import gc
    import weakref

    import torch

    from sp_diffusers.plan.tracker import make_tracker

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    saved = []  # the first layer's output, which the GELU's backward saves
    model[0].register_forward_hook(lambda module, args, out: saved.append(weakref.ref(out)))
    x = torch.randn(2, 4, requires_grad=True)
    tracker = make_tracker(model, None, {}, (x,))
    gc.collect()
    gc.disable()
    try:
        with tracker:
            out = model(x)
            assert saved[0]() is not None
            del out
            assert saved[0]() is None
    finally:
        gc.enable()
        tracker.remove_hooks()
