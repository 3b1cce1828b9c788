"""The scheduler configs of the released checkpoints (each repository's ``scheduler/scheduler_config.json``): what a
family's pipeline samples with when no pipeline folder gives its own. One source for the FlowGRPO schedules
(``flowgrpo.pipeline_schedule``) and the tiny pipelines (``tiny.pipelines``)."""

from __future__ import annotations

from typing import Any

__all__ = ["SCHEDULER_DEFAULTS", "scheduler_kwargs"]

_WAN_UNIPC = {
    # Wan2.1-T2V-1.3B-Diffusers scheduler/scheduler_config.json (the pipeline's default, 480p: flow_shift 3)
    "_class_name": "UniPCMultistepScheduler",
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "beta_start": 0.0001,
    "final_sigmas_type": "zero",
    "flow_shift": 3.0,
    "lower_order_final": True,
    "num_train_timesteps": 1000,
    "predict_x0": True,
    "prediction_type": "flow_prediction",
    "solver_order": 2,
    "solver_type": "bh2",
    "timestep_spacing": "linspace",
    "use_flow_sigmas": True,
}
# The scheduler configs of the released checkpoints, used when no pipeline folder gives one.
SCHEDULER_DEFAULTS: dict[str, dict[str, Any]] = {
    # stabilityai/stable-diffusion-3(.5) scheduler_config.json
    "sd3": {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0},
    # Qwen/Qwen-Image scheduler_config.json
    "qwenimage": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 8192,
        "max_shift": 0.9,
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "shift_terminal": 0.02,
        "time_shift_type": "exponential",
        "use_dynamic_shifting": True,
    },
    "wan": _WAN_UNIPC,
    # Tongyi-MAI/Z-Image-Turbo scheduler_config.json: a static shift 3 (ZImagePipeline still computes mu from the
    # image tokens and passes it; without use_dynamic_shifting set_timesteps ignores it)
    "zimage": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": False,
    },
    # FLUX.2: black-forest-labs/FLUX.2-dev's scheduler_config.json, as its diffusers-staff copy
    # (diffusers/FLUX.2-dev-bnb-4bit) and diffusers' scripts/convert_flux2_to_diffusers.py (FLUX.1-dev's scheduler
    # for converted FLUX.2 pipelines) give it. FLUX.2-klein-4B's own file was not at hand: assumed the same.
    # Flux2Pipeline / Flux2KleinPipeline pass linspace(1, 1/N, N) sigmas and their own mu
    # (compute_empirical_mu(image tokens, N)): with use_dynamic_shifting only time_shift_type matters here.
    "flux2": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 4096,
        "max_shift": 1.15,
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "time_shift_type": "exponential",
        "use_dynamic_shifting": True,
    },
    # HunyuanVideo-1.5 (hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v): a static shift, 5 for the 480p
    # checkpoints in Tencent's release notes (720p: 9; the file was not at hand: a real folder's own config is read).
    # HunyuanVideo15Pipeline passes sigmas linspace(1, 0, N + 1)[:-1], shifted by set_timesteps.
    "hunyuanvideo15": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "num_train_timesteps": 1000,
        "shift": 5.0,
        "use_dynamic_shifting": False,
    },
    # Lightricks/LTX-2 scheduler_config.json (LTX-2.0 full model; diffusers' scripts/convert_ltx2_to_diffusers.py
    # writes the same: time_shift_type is the constructor's default). LTX2Pipeline passes linspace(1, 1/N, N) sigmas
    # and mu = calculate_shift(video tokens, 1024, 4096, 0.95, 2.05); the distilled checkpoints turn dynamic shifting
    # and shift_terminal off instead.
    "ltx2": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 1024,
        "base_shift": 0.95,
        "max_image_seq_len": 4096,
        "max_shift": 2.05,
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "shift_terminal": 0.1,
        "time_shift_type": "exponential",
        "use_dynamic_shifting": True,
    },
    # black-forest-labs/FLUX.1-dev scheduler_config.json (FluxPipeline passes linspace(1, 1/N, N) and mu)
    "flux": {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "base_image_seq_len": 256,
        "base_shift": 0.5,
        "max_image_seq_len": 4096,
        "max_shift": 1.15,
        "num_train_timesteps": 1000,
        "shift": 3.0,
        "use_dynamic_shifting": True,
    },
}


def scheduler_kwargs(family: str) -> dict[str, Any]:
    """The family's default config as constructor keywords (without ``_class_name``)."""
    return {k: v for k, v in SCHEDULER_DEFAULTS[family].items() if k != "_class_name"}
