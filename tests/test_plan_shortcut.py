"""The block shortcut (runs with 3 and 4 blocks per list, extrapolated) against a full trace of the whole model:
every place's peak by part, the FLOPs and the bytes sent. Small models of real classes (fake tensors; nothing is
allocated) at Ulysses 2 on 4 ranks with uneven shards: Qwen-Image with checkpointing (where FSDP's retained
reduce-scatter buffer makes a block next to the first or the last one differ), Wan with checkpointing and LoRA,
and a two-list Flux with full fine-tuning. ``plan --rl``'s iteration pieces, counted on one and two blocks per list
and grown, against the pieces of a full trace: Wan (LoRA, the KL reference) and the two-list Flux."""

from __future__ import annotations

import pytest
import torch

from sp_diffusers.planner.extrapolate import combine, grown_pieces, ledger_counts, shortcut_counts
from sp_diffusers.planner.iteration import RLKnobs
from sp_diffusers.planner.models import FAMILIES, ModelSpec
from sp_diffusers.planner.shapes import Workload
from sp_diffusers.planner.trace import TraceRequest, block_lists, run_trace

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


@pytest.mark.parametrize(
    "kind, config, checkpointing, lora",
    [
        ("wan", {**WAN, "num_layers": 3}, True, 4),
        ("flux", {**FLUX, "num_layers": 3, "num_single_layers": 2}, False, None),
    ],
    ids=["wan-checkpointing-lora-kl", "flux-two-lists-full"],
)
def test_the_pieces_on_fewer_blocks_equal_a_full_trace(kind, config, checkpointing, lora):
    """The iteration's pieces (every piece, kind, calls and bytes) grown from runs of one and two blocks per list
    equal the pieces of a run of the whole model (three blocks: the first, one between, the last); Wan: a run of
    the phases' measures alone measures what a run with the pieces does."""
    spec = ModelSpec(f"small-{kind}", kind, config, FAMILIES[kind])
    lists = block_lists(spec)
    rl = RLKnobs(num_steps=2, trained_steps=1, group_size=2, update_gather="auto", kl=lora is not None)
    work = Workload(batch=1, grid=(1, 15, 17), text_len=15)  # 255 tokens: uneven shards over 2 ranks

    def trace(counts: dict[str, int], part: str):
        req = TraceRequest(spec, work, 4, ulysses=2, checkpointing=checkpointing, lora_rank=lora, rl=rl)
        return run_trace(TraceRequest(**{**req.__dict__, "blocks": tuple(counts.items()), "part": part}))

    full_train, full_rollout = trace(lists, "all")
    got = grown_pieces(lists, [trace(c, "ledger")[0].pieces for c in ledger_counts(lists)])
    assert set(got) == set(full_train.pieces) and got == full_train.pieces
    assert any(full_train.pieces.values())
    if kind != "wan":
        return
    train, rollout = trace(lists, "memory")
    assert not train.pieces
    for full, mine in (
        (full_train, train),
        (full_rollout, rollout),
        (full_train.held_update, train.held_update),
    ):
        assert (mine.places, mine.flops, mine.comm) == (full.places, full.flops, full.comm)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.linear(h)) + shared


class _Blocks(torch.nn.Module):
    """Blocks that all take one shared input, as a DiT's blocks take its text and timestep embeddings."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shared = self.embed(c)
        for block in self.blocks:
            x = block(x, shared)
        return x


def test_the_tracker_holds_nothing_a_run_without_it_frees():
    """Under the planner's tracker, as without it: a graph whose output is dropped is freed at once, and a block's
    input gradient once the block before it has used it. torch's module tracker hooks every module's inputs and
    outputs with hooks that are reference cycles (a dropped graph, and what it saved, lived until the garbage
    collector ran: off here, so only reference counts free anything) and that buffer the gradients they see until
    every hooked input has one (with an input every block shares, each block's input gradient lived until the end
    of backward)."""
    import gc
    import weakref

    from sp_diffusers.planner.tracker import make_tracker

    mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
    saved = []  # the first layer's output, which only the GELU's backward holds
    mlp[0].register_forward_hook(lambda module, args, out: saved.append(weakref.ref(out)))
    model = _Blocks()
    grads: list[weakref.ref] = []  # the gradients entering blocks 1-3

    def watch(module: torch.nn.Module, args: tuple) -> None:
        args[0].register_hook(lambda g: grads.append(weakref.ref(g)))

    for block in model.blocks[1:]:
        block.register_forward_pre_hook(watch)
    x, c = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8)
    alive: list[int] = []  # of those, how many live when backward reaches the model's input
    x.register_hook(lambda g: alive.append(sum(r() is not None for r in grads)))
    gc.collect()
    gc.disable()
    try:
        for tracked, step in (
            (mlp, lambda: mlp(torch.randn(2, 4))),
            (model, lambda: model(x, c).sum().backward()),
        ):
            tracker = make_tracker(tracked, None, {}, ())
            try:
                with tracker:
                    out = step()
            finally:
                tracker.remove_hooks()
            if tracked is mlp:
                assert saved[0]() is not None
                del out
                assert saved[0]() is None
    finally:
        gc.enable()
    assert len(grads) == 3 and alive == [0], alive
