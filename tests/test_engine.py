"""FSDPEngine + FlowGRPO under SP on real gloo ranks vs one process (same data).

Tolerances (derived in ``tests/_parity.py``): every parameter gradient within ``1e-5 + 1e-4 |ref|`` (fp32: only
the order of sums differs); every parameter after the AdamW step within the bound that gradient tolerance
implies through the step (``lr * tol_g / (max(|g_ref| - tol_g, 0) + eps)`` plus the update's rounding, AdamW
eps = lr = 1e-3 so the step is well-conditioned); the loss within 1e-6 absolute. A wrong gradient contract (a
MEAN over the SP group halves the gradients, a missing dp average doubles them) fails both checks.
"""

from __future__ import annotations

import functools

import pytest
import torch

from ._dist import run_distributed
from ._parity import PARITY_EPS, PARITY_LR, worst_grad, worst_step

LAYOUTS = {
    "sp2": (2, 2, 1),
    "dp2_sp2": (4, 2, 1),
    "ring2_ulysses2": (4, 2, 2),
}  # name: (world, ulysses, ring)
# a pure ring of 2 under data parallelism 2 (full fine-tuning only); Ulysses 3 (Z-Image, FLUX.2: a degree that
# divides neither their tokens nor their text)
EXTRA_LAYOUTS = {"dp2_ring2": (4, 1, 2), "sp3": (3, 3, 1)}
# HSDP: 2 replica groups of 2 ranks, each one SP group of 2 (dp 2 = 2 replicas x 1) or, at SP 1, two dp ranks
# (dp 4 = 2 replicas x 2 shards); name: (world, ulysses, ring, dp_replicate)
HSDP_LAYOUTS = {"hsdp2_sp2": (4, 2, 1, 2), "hsdp2_dp2": (4, 1, 1, 2)}


@functools.cache
def _step(
    world: int,
    sp: int,
    lora: bool,
    kind: str = "qwenimage",
    ring: int = 1,
    pipeline: str = "",
    replicate: int = 1,
):
    return run_distributed(
        "tests.workers.engine_steps:flowgrpo_step", world, sp, lora, kind, ring, pipeline, replicate
    )


@pytest.fixture(scope="module")
def pipeline_folder(tmp_path_factory):
    """``kind -> folder`` of the ``*_pipeline`` cases ("" for the others), written here once, before any rank
    starts: from transformers 5.15, ``save_pretrained`` writes a model's weights only on rank 0 of an initialised
    process group, so a folder written by each rank would lack its text encoders' weights on the other ranks."""
    written: dict[str, str] = {}

    def folder(kind: str) -> str:
        if kind.endswith("_pipeline") and kind not in written:
            from sp_diffusers.tiny import save_tiny_pipeline

            family = kind.removesuffix("_pipeline").replace("flux2_", "flux2-")
            # Z-Image, FLUX.2 [klein] and [dev]: 6 heads of 16 (the axes' dims), so that Ulysses 3 divides them
            wide = {
                "zimage": {"dim": 96, "n_heads": 6, "n_kv_heads": 6},
                "flux2-klein": {"num_attention_heads": 6},
                "flux2-dev": {"num_attention_heads": 6},
                "hunyuanvideo15": {"num_attention_heads": 6},
                "ltx2": {
                    "num_attention_heads": 6,
                    "cross_attention_dim": 96,
                    "audio_num_attention_heads": 6,
                    "audio_cross_attention_dim": 48,
                },
            }.get(family, {})
            written[kind] = str(save_tiny_pipeline(family, tmp_path_factory.mktemp(kind), num_layers=2, **wide))
        return written.get(kind, "")

    return folder


@pytest.mark.parametrize(
    ("layout", "lora", "kind"),
    [(layout, lora, "qwenimage") for layout in sorted(LAYOUTS) for lora in (False, True)]
    + [("sp2", False, "sd3_pipeline"), ("dp2_ring2", False, "qwenimage")]
    + [("sp2", False, "wan_pipeline"), ("dp2_sp2", False, "wan_pipeline")]
    + [(layout, False, "zimage_pipeline") for layout in ("sp2", "sp3", "ring2_ulysses2")]
    + [(layout, False, "flux2_klein_pipeline") for layout in ("sp2", "sp3", "ring2_ulysses2")]
    + [(layout, False, "flux2_dev_pipeline") for layout in ("sp2", "sp3", "ring2_ulysses2")]
    + [(layout, False, "hunyuanvideo15_pipeline") for layout in ("sp2", "sp3", "ring2_ulysses2")]
    + [(layout, False, "ltx2_pipeline") for layout in ("sp2", "sp3", "ring2_ulysses2")]
    + [
        ("hsdp2_sp2", False, "qwenimage"),
        ("hsdp2_sp2", True, "qwenimage"),
        ("hsdp2_dp2", False, "qwenimage"),
    ],
    ids=lambda v: {False: "full", True: "lora"}.get(v, v) if isinstance(v, bool) else v,
)
def test_flowgrpo_step_matches_one_process(layout, lora, kind, pipeline_folder):
    """SD3 runs through sp_diffusers' plan, from a real StableDiffusion3Pipeline folder whose own CLIP/T5
    encoders give the text and pooled inputs (text padded to the degree with a masked key); Wan (video latents
    [B, C, F, H, W]) from a real WanPipeline folder: its UMT5 text, its UniPC schedule, diffusers' own Wan plan;
    Z-Image from a real ZImagePipeline folder (per-sample lists in and out, its chat-templated Qwen3 text, our plan)
    at Ulysses 2, 3 and 2 x Ring 2; FLUX.2 [klein] from a real Flux2KleinPipeline folder (packed tokens, batched
    4-axis ids, its stacked Qwen3 layers, diffusers' own plan) at the same three, and FLUX.2 [dev] from a real
    Flux2Pipeline folder (its Mistral3 text and the guidance embedding's input) too; HunyuanVideo-1.5 from a real
    HunyuanVideo15Pipeline folder (two text streams, zero condition channels and image tokens, our plan) too; LTX-2
    from a real LTX2Pipeline folder (video and audio tokens in one latent tensor, the connectors' two text streams,
    our two-stream plan) too;
    ring2_ulysses2 is Ulysses x Ring (USP) on 4 ranks: dp 1 x ring 2 x ulysses 2; dp2_ring2 is dp 2 x ring 2;
    hsdp2_* shard within 2 replica groups of 2 ranks and all-reduce gradients across them (HSDP)."""
    world, sp, ring, *replicate = {**LAYOUTS, **EXTRA_LAYOUTS, **HSDP_LAYOUTS}[layout]
    if kind in ("flux2_klein_pipeline", "flux2_dev_pipeline"):
        import diffusers

        name = {"flux2_klein_pipeline": "Flux2KleinPipeline", "flux2_dev_pipeline": "Flux2Pipeline"}[kind]
        if not hasattr(diffusers, name):  # the compatibility matrix's older releases (-k sp2)
            pytest.skip(f"diffusers {diffusers.__version__} has no {name}")
    pipeline = pipeline_folder(kind)
    ref = _step(1, 1, lora, kind, 1, pipeline)[0]
    results = _step(world, sp, lora, kind, ring, pipeline, *replicate)
    assert results[0]["replicate"] == (replicate or [1])[0]
    # the loss each data-parallel group reports, averaged over dp, is the single-process loss
    dp_losses = {r["dp_rank"]: r["loss"] for r in results if r["sp_rank"] == 0}
    assert abs(sum(dp_losses.values()) / len(dp_losses) - ref["loss"]) <= 1e-6
    for r in results:  # SP peers report the same, unscaled loss
        assert r["loss"] == dp_losses[r["dp_rank"]]
    got = results[0]
    assert got["n_trainable"] == ref["n_trainable"] > 0
    assert 0 < ref["clipfrac"] < 1, "the data must exercise both clipped and unclipped samples"
    # HunyuanVideo-1.5 text to video: the image stream is multiplied by 0 and the glyph stream (no quoted text in
    # these prompts) is all masked, so their embedders get no gradient
    idle = ("image_embedder.", "context_embedder_2.") if kind == "hunyuanvideo15_pipeline" else ()
    nonzero = 0
    for name, g_ref in ref["grads"].items():
        g = got["grads"][name]
        assert (g is None) == (g_ref is None), name
        if g_ref is None:
            continue
        ok, err = worst_grad(g, g_ref)
        assert ok, f"{layout} {'lora' if lora else 'full'}: grad {name} off by {err:.3e}"
        nonzero += int(g_ref.abs().max() > 0)
        assert not (name.startswith(idle) and g_ref.abs().max() > 0), name  # ("".startswith(()) is False)
    assert nonzero >= 0.8 * sum(1 for name in ref["grads"] if not name.startswith(idle))
    assert ref["step_moved"] > 0.1 * PARITY_LR and got["step_moved"] > 0.1 * PARITY_LR  # the step ran
    for name, p_ref in ref["params"].items():
        g_ref = ref["grads"][name]
        if g_ref is None:  # no gradient, no step: untouched on both sides
            assert torch.equal(got["params"][name], p_ref), name
            continue
        ok, err, ratio = worst_step(got["params"][name], p_ref, g_ref, PARITY_LR, PARITY_EPS)
        assert ok, f"{layout}: parameter {name} after the step off by {err:.3e} ({ratio:.2f} x its bound)"


@functools.cache
def _on_policy(world: int, sp: int):
    return run_distributed("tests.workers.engine_steps:on_policy_and_rollout", world, sp)


def test_on_policy_ratio_is_one_under_sp_with_ragged_prompts():
    """The micro-batch equals the rollout batch here, so the training forward repeats the rollout's arithmetic
    exactly (ratio 1, ppo_kl 0); a mis-sharded or mis-padded mask would change one of the two forwards."""
    for r in _on_policy(2, 2):
        assert len(set(r["text_lengths"])) > 1, "prompts must be ragged"
        # padded to the batch maximum only: an odd length shards unevenly over the SP group, exactly
        assert r["padded_len"] == max(r["text_lengths"]) and r["padded_len"] % 2 == 1, r["text_lengths"]
        assert r["ratio_mean"] == 1.0 and r["ratio_std"] == 0.0, r  # bit for bit (docs/training.md)
        assert r["ppo_kl"] == 0.0, r
        assert r["clipfrac"] == 0.0


def test_sp_rollout_matches_one_process():
    ref = _on_policy(1, 1)[0]
    for r in _on_policy(2, 2):
        assert (r["final"] - ref["final"]).abs().max().item() <= 1e-4
        assert (r["log_probs"] - ref["log_probs"]).abs().max().item() <= 1e-4
        assert abs(r["reward_mean"] - ref["reward_mean"]) <= 1e-5


def test_a_rollout_in_chunks_is_the_rollout_in_one_piece():
    """rollout.chunks: 3 (4 samples as 2 + 1 + 1, each chunk's rewards scored in the background, the shares of the
    SP ranks gathered once) gives the one-piece rollout's latents, log-probs and advantages. The tolerance is the
    SP comparison's above (1e-4 on the final latents, 6 steps of a 2-layer model in float32): a smaller batch's
    matmuls round differently; the noise is the batch's own (tests/test_rollout_chunks.py)."""
    for r in [*_on_policy(1, 1), *_on_policy(2, 2)]:
        c = r["chunked"]
        assert c["timed"]  # the background scoring reported its time; the one-piece rollout has none
        assert (c["final"] - r["final"]).abs().max().item() <= 1e-4
        assert (c["log_probs"] - r["log_probs"]).abs().max().item() <= 1e-4
        # the advantages pass through a group's std normalisation (2 samples a group): 1e-3 of a unit advantage
        assert (c["advantages"] - r["advantages"]).abs().max().item() <= 1e-3
        assert abs(c["reward_mean"] - r["reward_mean"]) <= 1e-5


def test_checkpoint_resume_gives_the_same_parameters():
    results = run_distributed("tests.workers.engine_steps:checkpoint_resume", 2, 2)
    assert results[0]["history_len"] == 4  # rank 0 keeps the metrics of the iterations before the restart
    for r in results:
        assert r["start_iteration"] == 2
        assert r["global_step"] == 4
        assert r["steps_between"] > 0, "the 2 extra iterations must change the parameters"
        assert r["max_param_diff"] == 0.0


def test_divergent_sp_peers_are_detected():
    for r in run_distributed("tests.workers.engine_steps:divergent_batches", 2):
        assert r["raised"] is not None
        assert "latents" in r["raised"] and "SP peers disagree" in r["raised"]
        # a key on one peer only: named, on every rank (not a collective abort)
        assert r["extra_key"] is not None and "reference_latents" in r["extra_key"], r["extra_key"]


def test_activation_checkpointing_lora_kl_cfg_and_bf16():
    import math

    for r in run_distributed("tests.workers.engine_steps:features", 2):
        # recomputing activations in backward (all-to-alls included) reproduces the gradients exactly
        assert r["ckpt_n_grads"] > 0 and r["ckpt_max_grad_diff"] == 0.0
        for m in r["lora_kl_cfg"]:
            assert all(math.isfinite(v) for v in m.values()), m
        assert r["lora_kl_cfg"][0]["kl"] > 0  # random adapters: the policy differs from the base model
        for m in r["bf16"]:
            assert all(math.isfinite(v) for v in m.values()), m
        assert r["bf16_param_dtype"] == "torch.float32"  # FSDP keeps fp32 masters, computes in bf16
