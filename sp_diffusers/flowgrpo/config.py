"""The training configuration: one dataclass per YAML section (their defaults are the keys' defaults), loaded
from YAML with errors that name the key, and the values that cannot train refused (``validate``).

A key that does not exist is refused with the closest valid keys suggested (a typo never silently falls back to
a default); values are type-checked against the dataclass fields.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FLAT_KEYS",
    "GATHER_MODES",
    "LOGGERS",
    "TEXT_OFFLOAD",
    "TINY_KIND",
    "ConfigError",
    "DPOConfig",
    "DPPOConfig",
    "DanceConfig",
    "DataConfig",
    "FlowGRPOConfig",
    "GardoConfig",
    "GuardConfig",
    "LoraConfig",
    "MixConfig",
    "ModelConfig",
    "NFTConfig",
    "OptimConfig",
    "ParallelConfig",
    "RolloutConfig",
    "TextConfig",
    "TrainConfig",
    "TrainLoopConfig",
    "UpdateConfig",
    "apply_overrides",
    "load_config",
    "require",
    "validate",
]

GATHER_MODES = ("auto", "always", "never")
LOGGERS = ("jsonl", "tensorboard", "wandb")
TEXT_OFFLOAD = ("never", "after_cache")


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message names it and the fix."""


TINY_KIND = "qwenimage"  # model.kind left out, and no folder to take it from: the tiny model of this family


@dataclass
class ModelConfig:
    # model family (sp_diffusers.families.kinds): "" (left out) takes it from model.pipeline's or model.pretrained's
    # folder, else TINY_KIND; given, it must agree with the folder (folder_checks.py)
    kind: str = ""
    pretrained: str = ""  # a transformer folder written by save_pretrained (its config.json names its class)
    # a diffusers pipeline folder (save_pretrained / a model repository): its transformer(s), text encoder(s),
    # scheduler and VAE; its pipeline class gives model.kind (pipeline_io.py)
    pipeline: str = ""
    # a two-expert Wan2.2 pipeline: which to train, of transformer (high noise) and transformer_2 (low noise); []: all
    experts: list = field(default_factory=list)
    overrides: dict = field(default_factory=dict)  # tiny-config overrides, e.g. {num_layers: 2}
    image_size: int = 8  # latent height before patching (pixels / the VAE's factor; tokens = (size / patch)^2)
    image_width: int = 0  # latent width (0: image_size, square)
    frames: int = 4  # latent frames of a video family (wan); image families ignore it
    # LTX-2: latent audio frames (0: as LTX2Pipeline gives a video of `frames` at `frame_rate`, from model.pipeline)
    audio_frames: int = 0
    frame_rate: float = 24.0  # LTX-2: the video's frame rate (its positions are conditioned on it; the MP4's)
    # editing families (Qwen-Image-Edit, FLUX.1 Kontext): the condition image's area in pixels; 0: the pipeline's
    # own (about 1 MP), at the output's aspect ratio (models/conditioning.py)
    condition_area: int = 0
    seed: int = 0


@dataclass
class TextConfig:
    # the built-in encoder when `pipeline` is empty: "byte" (a tiny Qwen2 over UTF-8 bytes, ragged), "umt5" (a
    # tiny UMT5 over ByT5 bytes, zero-padded to max_sequence_length as WanPipeline does); "": umt5 for wan, else byte
    encoder: str = ""
    hidden_size: int = 32
    num_layers: int = 1
    seed: int = 1234
    # a diffusers pipeline folder whose own text encoders encode the prompts (Qwen-Image, FLUX.1, SD3, Wan,
    # Z-Image, FLUX.2 [klein], HunyuanVideo-1.5); "": model.pipeline's
    pipeline: str = ""
    max_sequence_length: int = 256  # text tokens: T5 of a pipeline encoder, UMT5 (Wan pads prompts to it)
    cache_mb: float = 4096.0  # each unique prompt encoded once per run, its encodings kept up to this; 0: off
    # "after_cache": encode the run's whole prompt set first, then move the text encoders off the GPU; "never"
    offload: str = "never"


@dataclass
class ParallelConfig:
    ulysses_sequence_parallel_size: int = 2
    ring_degree: int = 1
    # HSDP: shard within each of dp_replicate groups of world / dp_replicate ranks (a node), replicate across
    dp_replicate: int = 1
    use_fsdp: bool = True
    mixed_precision: str = ""  # "" (fp32) or "bf16"
    activation_checkpointing: bool = False
    debug_checks: bool = False
    pad_text_to_degree: bool = False  # pad prompts to a multiple of the SP degree (any length shards exactly)


@dataclass
class LoraConfig:
    enabled: bool = False
    rank: int = 8
    alpha: float = 8.0
    target_modules: list = field(default_factory=lambda: ["to_q", "to_k", "to_v", "to_out.0"])
    init: str | bool = (
        "gaussian"  # peft init_lora_weights: "gaussian", True (B = 0) or False (random A and B)
    )


@dataclass
class OptimConfig:
    lr: float = 3e-4
    eps: float = 1e-8  # AdamW's epsilon
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    warmup_steps: int = 0


@dataclass
class DanceConfig:
    """``flowgrpo.dance``: DanceGRPO's keys (arXiv 2505.07818; algorithms/dance_grpo.py)."""

    # the KL scale: "verl_omni" divides by the step's noise variance eta^2 (sigma - sigma') (the Gaussian KL of the
    # two steps, as verl-omni's dance_sde); "flow_grpo" by eta^2 (no dt factor, as flow_grpo's SDE KL)
    kl: str = "verl_omni"


@dataclass
class NFTConfig:
    """``flowgrpo.nft``: DiffusionNFT's keys (arXiv 2509.16117; algorithms/diffusion_nft.py), the defaults of its
    reference (NVlabs/DiffusionNFT config/nft.py)."""

    beta: float = 1.0  # the implicit policies' mix (0.1 in its OCR and multi-reward configs)
    # the old policy's decay schedule: copy | linear_to_0_5 | delayed_linear_to_0_999 (its decay_type 0 | 1 | 2)
    decay: str = "linear_to_0_5"
    timestep_fraction: float = 0.99  # the fraction of the N timesteps each sample trains
    solver: str = "dpm2"  # the rollout's deterministic solver: dpm2 | euler


@dataclass
class GuardConfig:
    """``flowgrpo.guard``: GRPO-Guard's keys (arXiv 2510.22319; algorithms/grpo_guard.py)."""

    ratio_norm: bool = True  # RatioNorm and the 1 / mean(sqrt(-dt))^2 reweighting (false: the plain ratio)
    # the ratio's mean-drift bias per sample ("sample", verl-omni) or its micro-batch mean ("batch", as flow_grpo's
    # script computes it)
    bias: str = "sample"


@dataclass
class DPPOConfig:
    """``flowgrpo.dppo``: Flow-DPPO's keys (algorithms/flow_dppo.py), verl-omni's defaults."""

    kl_mask_threshold: float = 1e-5  # the trust region: a step's divergence from the old policy past this is masked
    kl_coefficient: bool = True  # the divergence divides by the step's variance (false: by 2 alone)


@dataclass
class DPOConfig:
    """``flowgrpo.dpo``: Diffusion-DPO's keys (arXiv 2311.12908; algorithms/diffusion_dpo.py), verl-omni's defaults."""

    beta: float = 2000.0  # the inverse temperature of the pairwise loss (verl-omni's online Qwen-Image recipe: 100)
    # offline: a .jsonl of {"prompt", "chosen", "rejected"} rows (images; videos for Wan) trained instead of rollouts
    # ("": online)
    pairs: str = ""
    # held-out pairs (the same format): their implicit reward margin and accuracy every train.eval_every iterations
    eval_pairs: str = ""


@dataclass
class GardoConfig:
    """``flowgrpo.gardo``: GARDO's keys (algorithms/gardo.py; flow_grpo's ``scripts/train_sd3_gardo.py``), its
    defaults (``config/grpo_gardo.py``, the SD3 OCR recipe)."""

    # a vision model folder (transformers: DINOv2, DINOv3, any AutoModel with pooled image features) whose features
    # weigh each above-mean sample's advantage by its distance to its group's nearest other sample; "none": no weight
    features: str = ""
    main_reward: str = ""  # the flowgrpo.rewards name the advantages read ("": the weighted total)
    # the rewards whose ranks the main reward's rank is held against: the KL applies to the samples ranked higher by
    # the main reward than by these (the reference: aesthetic and imagereward beside ocr); []: the KL applies to none
    aux_rewards: list = field(default_factory=list)
    kl_coef: float = 0.04  # the gated KL's coefficient (train.beta: OCR 0.04, GenEval 0.07, FLUX 0.01)
    kl_fraction: float = 0.1  # the fraction of samples the KL starts on; moved by kl_fraction_rate, within the range
    kl_fraction_range: list = field(default_factory=lambda: [0.02, 0.2])
    kl_fraction_rate: float = 0.1  # up (down) by this factor when the uncertainty passes the window's max (min)
    kl_window: int = 20  # the iterations whose mean uncertainty the current one is compared with
    reset_kl: float = 3e-4  # the reference is reset to the policy after an iteration whose mean KL passes this
    reset_every: int = 15  # ... and once more than this many iterations passed since the last reset
    std_weighting: bool = True  # each sample's policy loss x its step's noise std / the micro-batch's mean std


@dataclass
class MixConfig:
    """``flowgrpo.mix``: MixGRPO's keys (arXiv 2507.21802; Tencent-Hunyuan/MixGRPO, algorithms/mix_grpo.py): a window
    of ``window_size`` SDE steps whose start moves with training (``strategy``), Euler ODE before it, Euler or
    DPM-Solver++ after it."""

    window_size: int = 4  # SDE (and trained) steps per rollout; the window ends before step num_steps - 2
    strategy: str = "progressive"  # progressive, random, decay, exp_decay: how the window's start moves
    iters_per_group: int = 25  # iterations between two moves (progressive; exp_decay before its threshold)
    prog_overlap: bool = False  # move by prog_overlap_step instead of by window_size
    prog_overlap_step: int = 1  # (the released FLUX script: 1; MixGRPO-Flash*: 0, a window that stays at 0)
    roll_back: bool = False  # past step num_steps - 2: back to step 0 (true) or stay at the end (false)
    max_iters_per_group: int = 10  # decay: iterations per move at step 0, falling linearly ...
    min_iters_per_group: int = 1  # ... to this at step num_steps - 2
    exp_decay_threshold: int = 13  # exp_decay: iterations per move fall as exp(-k (start - threshold)) past it
    exp_decay_k: float = 0.1
    tail_solver: str = "euler"  # after the window: "euler", or "dpmsolver++" (multistep, order 2), fewer steps
    tail_compress_ratio: float = 0.4  # dpmsolver++: int((num_steps - last window step) * ratio) tail points
    dpm_solver_type: str = "midpoint"  # dpmsolver++'s second-order form: midpoint or heun
    kl_coef: float = 0.01  # 0.5 mean((log_prob - old_log_prob)^2) per trained step (the reference's kl_loss)
    same_noise: bool = False  # the samples of a prompt start from one noise (the reference's init_same_noise)


# the flat keys of earlier releases -> (section, key); they still load, with a warning naming the new key
FLAT_KEYS = {
    "dance_kl": ("dance", "kl"),
    **{f"nft_{k}": ("nft", k) for k in ("beta", "decay", "timestep_fraction", "solver")},
    "ratio_norm": ("guard", "ratio_norm"),
    "guard_bias": ("guard", "bias"),
    **{f"mix_{f.name}": ("mix", f.name) for f in dataclasses.fields(MixConfig)},
}


def _warn_flat(path: str) -> None:
    section, key = FLAT_KEYS[path.rsplit(".", 1)[-1]]
    warnings.warn(
        f"{path} is now flowgrpo.{section}.{key}; the old key is read for one more release",
        FutureWarning,
        stacklevel=3,
    )


@dataclass
class FlowGRPOConfig:
    # flow_grpo (arXiv 2505.05470: an SDE window, the rest ODE) or dance_grpo (arXiv 2505.07818: every step SDE,
    # each sample trains on a random timestep_fraction of steps 0..N-2)
    algorithm: str = "flow_grpo"
    sde_type: str = "sde"  # flow_grpo's step: "sde" (its default) or "cps" (coefficients-preserving sampling)
    num_steps: int = 8  # denoising steps per rollout
    # "pipeline": the family's scheduler as its diffusers pipeline sets it; "linspace": DanceGRPO's
    # shift(linspace(1, 0, N + 1)); "auto": linspace for dance_grpo, else pipeline
    schedule: str = "auto"
    scheduler: str = (
        ""  # a pipeline or scheduler folder whose scheduler config to use ("": text.pipeline's, else default)
    )
    shift: float = 0.0  # time shift: pipeline schedule: replaces the scheduler's static shift (0: keep it); linspace: required
    window_size: int = 2  # flow_grpo: SDE steps per rollout (the rest is ODE)
    window_range: list = field(default_factory=lambda: [0, 4])  # flow_grpo: window start drawn from [lo, hi)
    # the trained fraction of the steps; 0: the algorithm's (dance_grpo 0.6: int((N - 1) * fraction) random steps per
    # sample; flow_grpo / grpo_guard with sde_steps "all" 0.99: the first int(N * fraction) steps, in order)
    timestep_fraction: float = 0.0
    noise_level: float = 0.8  # sde: a; cps: a in (0, 1); dance_grpo: eta (DanceGRPO uses 0.3)
    group_size: int = 4  # samples per prompt
    prompts_per_rank: int = 2  # prompts per data-parallel rank per iteration
    micro_batch_size: int = 4
    mini_batches: int = 1  # optimizer steps per iteration
    inner_epochs: int = 1
    clip_range: float = 1e-3
    adv_clip_max: float = 5.0
    kl_coef: float = 0.0
    # flow_grpo's sample.kl_reward: each trained step's KL to the reference folded into its reward, R_t = R -
    # kl_reward * KL_t, and advantages per step (flow_grpo, grpo_guard, flow_dppo; needs lora.enabled)
    kl_reward: float = 0.0
    recompute_old_log_probs: bool = True
    # an exponential moving average of the trained weights (flow_grpo's train.ema), used for evaluation, sample
    # grids and export: decay min((1 + s) / (10 + s), ema_decay) at optimizer step s, every ema_interval steps
    ema: bool = False
    ema_decay: float = 0.9
    ema_interval: int = 8
    drop_zero_advantage: bool = True  # train only samples with a non-zero advantage, as flow_grpo does
    cfg_scale: float = 1.0  # > 1: classifier-free guidance with the empty prompt
    # FLUX.1-dev's and FLUX.2 [dev]'s embedded guidance; 0: the pipeline's default (FluxPipeline 3.5, Flux2Pipeline 4);
    # models without a guidance embedding ignore it
    guidance_scale: float = 0.0
    reward: str = "color"  # the built-in reward when `rewards` is empty: color, video_color, mean_latent
    # rewards you bring: [{fn: "pkg.module:callable" | "path/file.py:callable", weight, input: pixels | latents,
    # kwargs, name}]; the total is the weighted sum (reward_loading.py)
    rewards: list = field(default_factory=list)
    # flow_grpo / grpo_guard (Flow-GRPO arXiv 2505.05470, its Fast variant; GRPO-Guard arXiv 2510.22319):
    # which rollout steps are SDE: "window" (window_size of them, ODE elsewhere; every window step trained), "all"
    # (every step; the first int(N * timestep_fraction) trained), "auto" (window for flow_grpo, all for grpo_guard)
    sde_steps: str = "auto"
    per_sample_windows: bool = False  # "window": each sample its own start in window_range (verl-omni's)
    # each algorithm's own keys (flowgrpo.<section>.<key>): read only by that algorithm
    dance: DanceConfig = field(default_factory=DanceConfig)
    nft: NFTConfig = field(default_factory=NFTConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    mix: MixConfig = field(default_factory=MixConfig)
    dppo: DPPOConfig = field(default_factory=DPPOConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    gardo: GardoConfig = field(default_factory=GardoConfig)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in FLAT_KEYS:  # an old flat key: the new one, with a warning (for one release)
            section, key = FLAT_KEYS[name]
            _warn_flat(f"flowgrpo.{name}")
            setattr(getattr(self, section), key, value)
            return
        super().__setattr__(name, value)

@dataclass
class RolloutConfig:
    # the parameters of a rollout: "always" all-gathered once and held over its denoising steps and the recomputed
    # old log-probs (one gather per rollout, not one per step), "never" gathered per forward as FSDP does, "auto"
    # once where the whole model fits the device's free memory with a quarter of it to spare (engine/held_params.py)
    gather_params: str = "auto"
    cfg_batch: bool = True  # classifier-free guidance's two branches as one forward of 2B samples (false: two)
    # the rollout in N consecutive chunks of its samples; each chunk's rewards are decoded and scored in a background
    # thread while the next chunk samples (rewards/overlap.py); 1: scored after the rollout
    chunks: int = 1


@dataclass
class UpdateConfig:
    # the policy update's parameters: "always" gathered at an optimizer step's first micro-step and held through
    # its forwards and backwards (gradients still reduce-scattered after each backward), resharded before the step:
    # one gather per optimizer step instead of two per micro-step; "never" per block, as FSDP does; "auto" held
    # where the whole model in the compute dtype fits with a quarter of the device to spare (training's
    # activations must fit in that quarter: plan --rl says whether they do)
    gather_params: str = "never"
    # 0: each iteration updates on its own rollout (on-policy). 1: each iteration updates on the previous one's
    # rollout, whose rewards were scored in the background meanwhile (a reward server or model off these devices
    # then costs the iteration nothing); one optimizer step behind its samples, the clipped ratio to the rollout
    # policy's log-probs corrects for it (flowgrpo.clip_range). docs/training.md, "What an iteration costs"
    lag: int = 0


@dataclass
class DataConfig:
    # a .txt (one prompt a line) or .jsonl ({"prompt": ..., other fields go to the rewards as metadata}) file,
    # shuffled per epoch from train.seed; "": the `prompts` list, drawn at random
    train: str = ""
    eval: str = ""  # held-out prompts (same formats) that train.eval_every evaluates
    # the most pixels a row's image may have (width x height; a guard against decompression bombs); 0: no limit
    max_image_pixels: int = 178_956_970


@dataclass
class TrainLoopConfig:
    iterations: int = 60
    out_dir: str = "runs/flowgrpo-tiny"
    save_every: int = 20
    eval_every: int = 0  # evaluate data.eval every N iterations (ODE, fixed noise); 0: never
    sample_every: int = 0  # write a grid of samples to <out_dir>/samples every N iterations; 0: never
    sample_count: int = 4  # prompts in a sample grid
    resume: bool = True
    # resume the newest checkpoint's weights (and EMA) with a fresh optimizer state and LR schedule: the one way to
    # continue a folder under another flowgrpo.algorithm, or without the EMA its checkpoint keeps (io/run_record.py)
    reset_optimizer: bool = False
    seed: int = 0
    progress: bool = True
    plot: bool = True
    # where rank 0 writes the metrics: jsonl (always), tensorboard (when installed), wandb (Weights & Biases;
    # WANDB_MODE=offline keeps the run on disk, `wandb sync` uploads it later)
    loggers: list = field(default_factory=lambda: ["jsonl", "tensorboard"])
    wandb_project: str = "sp-diffusers"
    # torch.compile of the trained transformer (and frozen experts) for rollout, recompute, update and eval:
    # "off", "blocks" (each block's forward, fullgraph) or "model" (the whole forward); engine/compiling.py
    compile: str = "off"


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    text: TextConfig = field(default_factory=TextConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    flowgrpo: FlowGRPOConfig = field(default_factory=FlowGRPOConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainLoopConfig = field(default_factory=TrainLoopConfig)
    prompts: list = field(default_factory=list)  # empty: sp_diffusers.flowgrpo.models.text.DEFAULT_PROMPTS

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ values that cannot train


def _wandb_key_or_offline() -> bool:
    """Whether W&B can start without asking for a key: offline / disabled, or a key in the environment or netrc."""
    import netrc
    import urllib.parse

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def require(ok: bool, key: str, value: Any, rule: str) -> None:
    """Refuse a value that cannot train: ``ConfigError`` naming the key, the value and the rule."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {rule}")


def validate(config: TrainConfig) -> None:
    """Values that type-check but cannot train (each error names the key, the value and the rule)."""
    from ..families.kinds import KINDS

    g, o, t = config.flowgrpo, config.optim, config.train
    finite = math.isfinite
    m = config.model
    require(
        m.kind in KINDS or m.kind == "",
        "model.kind",
        m.kind,
        f"one of {', '.join(KINDS)}, or leave it out to take it from model.pipeline / model.pretrained",
    )
    if not (m.kind or m.pipeline or m.pretrained):
        m.kind = TINY_KIND  # no folder to take the family from: the tiny default (a folder's is read at start)
    require(t.iterations >= 1, "train.iterations", t.iterations, "train at least 1 iteration")
    require(m.audio_frames >= 0, "model.audio_frames", m.audio_frames, "latent audio frames >= 1, or 0 (the pipeline's)")
    require(finite(m.frame_rate) and m.frame_rate > 0, "model.frame_rate", m.frame_rate, "frames a second, > 0")
    require(
        t.save_every >= 0, "train.save_every", t.save_every, "0 (only at the end) or a positive interval"
    )
    for key, value in (
        ("parallel.dp_replicate", config.parallel.dp_replicate),
        ("flowgrpo.micro_batch_size", g.micro_batch_size),
        ("flowgrpo.mini_batches", g.mini_batches),
        ("flowgrpo.inner_epochs", g.inner_epochs),
        ("flowgrpo.prompts_per_rank", g.prompts_per_rank),
        ("flowgrpo.window_size", g.window_size),
    ):
        require(value >= 1, key, value, "must be >= 1")
    require(
        g.group_size >= 2,
        "flowgrpo.group_size",
        g.group_size,
        "must be >= 2: a group of one sample has no relative advantage (every advantage is 0)",
    )
    require(g.num_steps >= 2, "flowgrpo.num_steps", g.num_steps, "must be >= 2 denoising steps")
    require(
        g.window_size <= g.num_steps,
        "flowgrpo.window_size",
        g.window_size,
        f"must be <= flowgrpo.num_steps={g.num_steps}",
    )
    # lr = 0 is allowed: a benchmark or a probe may run the update without moving the model
    require(finite(o.lr) and o.lr >= 0, "optim.lr", o.lr, "must be a finite number >= 0")
    for key, value in (
        ("optim.eps", o.eps),
        ("flowgrpo.noise_level", g.noise_level),
        ("flowgrpo.clip_range", g.clip_range),
    ):
        require(finite(value) and value > 0, key, value, "must be a finite number > 0")
    for key, value in (
        ("optim.weight_decay", o.weight_decay),
        ("flowgrpo.kl_coef", g.kl_coef),
        ("flowgrpo.adv_clip_max", g.adv_clip_max),
    ):
        require(finite(value) and value >= 0, key, value, "must be a finite number >= 0")
    # NaN compares false with everything: a NaN max norm would silently turn clipping off
    require(
        finite(o.max_grad_norm), "optim.max_grad_norm", o.max_grad_norm, "a finite number (<= 0: no clipping)"
    )
    require(
        finite(g.cfg_scale) and g.cfg_scale >= 1.0,
        "flowgrpo.cfg_scale",
        g.cfg_scale,
        "must be >= 1 (1: no CFG)",
    )
    require(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "must be >= 0")
    require(
        0 <= g.timestep_fraction <= 1,
        "flowgrpo.timestep_fraction",
        g.timestep_fraction,
        "must be in (0, 1] for every algorithm (0: the algorithm's own; flow_grpo's configs use 0.99)",
    )
    require(0 <= g.ema_decay < 1, "flowgrpo.ema_decay", g.ema_decay, "must be in [0, 1); flow_grpo uses 0.9")
    fresh = FlowGRPOConfig()
    for key in ("ema_decay", "ema_interval"):
        require(
            g.ema or getattr(g, key) == getattr(fresh, key),
            f"flowgrpo.{key}",
            getattr(g, key),
            "sets the EMA, and flowgrpo.ema=false keeps none; fix: flowgrpo.ema=true, or drop it",
        )
    require(
        g.cfg_scale > 1.0 or config.rollout.cfg_batch == RolloutConfig().cfg_batch,
        "rollout.cfg_batch",
        config.rollout.cfg_batch,
        "says how classifier-free guidance runs, and flowgrpo.cfg_scale=1 runs none; fix: drop it, or "
        "flowgrpo.cfg_scale > 1",
    )
    require(g.ema_interval >= 1, "flowgrpo.ema_interval", g.ema_interval, "must be >= 1; flow_grpo uses 8")
    for key, value in (
        ("rollout.gather_params", config.rollout.gather_params),
        ("update.gather_params", config.update.gather_params),
    ):
        require(value in GATHER_MODES, key, value, f"one of {', '.join(GATHER_MODES)}")
    samples = g.prompts_per_rank * g.group_size
    require(
        1 <= config.rollout.chunks <= samples,
        "rollout.chunks",
        config.rollout.chunks,
        f"an int in [1, {samples}] (each rank rolls out flowgrpo.prompts_per_rank x group_size = {samples} samples)",
    )
    require(config.update.lag in (0, 1), "update.lag", config.update.lag, "0 (on-policy) or 1 (one step behind)")
    require(
        config.update.lag == 0 or config.rollout.chunks == 1,
        "rollout.chunks",
        config.rollout.chunks,
        "with update.lag=1 it must be 1 (the whole rollout is scored while the next iteration runs: chunks would "
        "only add forwards); fix: rollout.chunks=1, or update.lag=0",
    )
    for key, value in (("train.eval_every", t.eval_every), ("train.sample_every", t.sample_every)):
        require(value >= 0, key, value, "0 (never) or a positive interval in iterations")
    require(t.sample_count >= 1, "train.sample_count", t.sample_count, "must be >= 1")
    from ..engine.compiling import COMPILE_MODES

    require(t.compile in COMPILE_MODES, "train.compile", t.compile, f"one of {', '.join(COMPILE_MODES)}")
    require(
        config.data.max_image_pixels >= 0,
        "data.max_image_pixels",
        config.data.max_image_pixels,
        "pixels >= 0 (0: no limit)",
    )
    text = config.text
    require(text.cache_mb >= 0, "text.cache_mb", text.cache_mb, "MiB >= 0 (0: every batch encodes its prompts)")
    require(text.offload in TEXT_OFFLOAD, "text.offload", text.offload, f"one of {', '.join(TEXT_OFFLOAD)}")
    require(
        text.offload == "never" or text.cache_mb > 0,
        "text.offload",
        text.offload,
        "keeps the encodings in the cache; fix: text.cache_mb > 0, or text.offload=never",
    )
    unknown = [x for x in t.loggers if x not in LOGGERS]
    require(not unknown, "train.loggers", t.loggers, f"each one of {', '.join(LOGGERS)} (unknown: {unknown})")
    if "wandb" in t.loggers:
        import importlib.util

        require(
            importlib.util.find_spec("wandb") is not None,
            "train.loggers",
            t.loggers,
            "wandb is not installed; fix: pip install 'sp-diffusers[wandb]' (or drop wandb from train.loggers)",
        )
        require(
            _wandb_key_or_offline(),
            "train.loggers",
            t.loggers,
            "W&B has no API key here (no WANDB_API_KEY, no `wandb login` in ~/.netrc) and WANDB_MODE is not offline; "
            "fix: wandb login, or WANDB_MODE=offline (the run kept on disk; `wandb sync` uploads it later), or drop "
            "wandb from train.loggers",
        )
    require(
        not t.eval_every or bool(config.data.eval or config.flowgrpo.dpo.eval_pairs),
        "train.eval_every",
        t.eval_every,
        "evaluates the held-out prompts of data.eval (or Diffusion-DPO's flowgrpo.dpo.eval_pairs); fix: "
        "data.eval=<a .txt or .jsonl file>, or train.eval_every=0",
    )
    require(
        not config.flowgrpo.dpo.eval_pairs or bool(t.eval_every),
        "flowgrpo.dpo.eval_pairs",
        config.flowgrpo.dpo.eval_pairs,
        "is evaluated every train.eval_every iterations, which is 0; fix: train.eval_every=N",
    )


# ---------------------------------------------------------------------------------------- loading


def _check_type(path: str, value: Any, annotation: Any) -> Any:
    expected = annotation if isinstance(annotation, type) else typing.get_origin(annotation) or annotation
    if isinstance(expected, str):
        expected = {"int": int, "float": float, "bool": bool, "str": str, "list": list, "dict": dict}.get(
            expected
        )
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str):
        # YAML 1.1 reads "5e-4" (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if expected is str and isinstance(value, bool):  # YAML 1.1 reads off / on (no / yes) as booleans
        return "on" if value else "off"
    if expected in (int, float, str, bool, list, dict) and not isinstance(value, expected):
        raise ConfigError(f"{path} must be {expected.__name__}, got {value!r} ({type(value).__name__})")
    if expected is int and isinstance(value, bool):
        raise ConfigError(f"{path} must be int, got {value!r}")
    return value


def _merge(obj: Any, data: dict[str, Any], prefix: str) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if prefix == "flowgrpo." and key in FLAT_KEYS:  # an old flat key: its section's, with a warning
            section, name = FLAT_KEYS[key]
            _warn_flat(path)
            _merge(getattr(obj, section), {name: value}, f"{prefix}{section}.")
            continue
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f"; did you mean {', '.join(prefix + c for c in close)}?" if close else ""
            raise ConfigError(f"unknown config key '{path}'{hint} (valid: {', '.join(sorted(fields))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} is a section; give it a mapping, got {value!r}")
            _merge(current, value, f"{path}.")
        else:
            setattr(obj, key, _check_type(path, value, hints[key]))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults <- YAML file <- ``key.sub=value`` overrides (values parsed as YAML)."""
    import yaml

    config = TrainConfig()
    if path is not None:
        if not Path(path).is_file():
            raise ConfigError(
                f"--config {path}: no such file; fix: pass a YAML file (examples/configs/*.yaml)"
            )
        data = yaml.safe_load(Path(path).read_text())
        if data is None:
            # an empty file silently meaning "all defaults" is how a wrong path or a truncated file hides
            raise ConfigError(
                f"{path} is empty; fix: give it at least one section, or omit --config to run the defaults"
            )
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections")
        _merge(config, data, "")
    apply_overrides(config, overrides or [])
    validate(config)
    return config


def apply_overrides(config: TrainConfig, overrides: list[str]) -> None:
    import yaml

    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. flowgrpo.group_size=8)")
        key, raw = item.split("=", 1)
        value: Any = yaml.safe_load(raw)
        nested: dict[str, Any] = value
        for part in reversed(key.strip().split(".")):
            nested = {part: nested}
        _merge(config, nested, "")
