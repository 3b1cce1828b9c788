"""A run's model folder read before anything is built: which family it is and whether it holds what the run needs.

Only JSON is read (``model_index.json``, a transformer's ``config.json``, the scheduler config's presence), never a
weight, so the trainer checks this before it loads anything and ``sp-diffusers train --check`` reports it:

- **The family.** ``model.kind`` and the folder must name the same family: a ``model.pipeline``'s pipeline class
  (``QwenImagePipeline`` -> ``qwenimage``, ...) and the transformer class it lists, or a ``model.pretrained``
  transformer folder's ``_class_name``. ``model.kind`` left out (``""``) is taken from the folder; without a folder it
  is the tiny model's default, ``qwenimage``. A disagreement is refused naming both sides: training the folder's
  family under another family's reward, schedule and text encoder runs without a word and learns nothing.
- **The components the run loads.** The transformer, and ``transformer_2`` where ``model.experts`` names it; the
  VAE when a reward reads pixels; the text encoders and tokenizers when they encode the prompts (``text.pipeline``
  empty); the scheduler config when the rollout schedule is the pipeline's. Each must be listed in
  ``model_index.json`` and present as a subfolder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...families.kinds import KINDS
from ..config import TINY_KIND, ConfigError, TrainConfig

__all__ = [
    "PIPELINE_CONDITIONS",
    "PIPELINE_FAMILIES",
    "TINY_KIND",
    "check_model_folder",
    "condition_of",
    "missing_folder",
    "present",
    "read_index",
]

# pipeline class -> model.kind (the families with a trainer adapter): the transformer's family
PIPELINE_FAMILIES = {
    "QwenImagePipeline": "qwenimage",
    "FluxPipeline": "flux",
    "StableDiffusion3Pipeline": "sd3",
    "WanPipeline": "wan",
    "ZImagePipeline": "zimage",
    "Flux2KleinPipeline": "flux2",
    "Flux2Pipeline": "flux2",
    "HunyuanVideo15Pipeline": "hunyuanvideo15",
    "LTX2Pipeline": "ltx2",
    "QwenImageEditPipeline": "qwenimage",
    "QwenImageEditPlusPipeline": "qwenimage",
    "FluxKontextPipeline": "flux",
    "WanImageToVideoPipeline": "wan",
}
# the image-conditioned pipelines -> how their condition reaches the transformer (conditioning.py; Wan's I2V
# pipeline with expand_timesteps is Wan2.2 TI2V: "wan-ti2v")
PIPELINE_CONDITIONS = {
    "QwenImageEditPipeline": "qwen-edit",
    "QwenImageEditPlusPipeline": "qwen-edit-plus",
    "FluxKontextPipeline": "kontext",
    "WanImageToVideoPipeline": "wan-i2v",
}
_CLASS_KINDS = {cls: kind for kind, cls in KINDS.items()}


def read_index(path: str | Path, key: str = "model.pipeline") -> dict[str, Any]:
    """``model_index.json`` of a pipeline folder; errors name ``key`` and the fix."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise ConfigError(
            f"{key}={str(path)!r} has no model_index.json; fix: a diffusers pipeline folder (written by "
            "save_pretrained, or a downloaded model repository such as Qwen/Qwen-Image)"
        )
    return json.loads(index.read_text())


def present(index: dict[str, Any], name: str) -> bool:
    """Whether ``model_index.json`` lists component ``name`` (a ``[library, class]`` pair, not null)."""
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None


def missing_folder(key: str, path: str | Path) -> FileNotFoundError:
    """The error for a ``model.pipeline`` / ``model.pretrained`` folder that does not exist."""
    return FileNotFoundError(f"{key}={str(path)!r} does not exist: point {key} at a save_pretrained folder")


def _mismatch(kind: str, key: str, path: str, what: str, family: str, fix_folder: str) -> ConfigError:
    return ConfigError(
        f"model.kind={kind!r} but {key}={path!r} is {what} (model.kind {family!r}); one run trains one family, and "
        f"the family's reward, schedule and text encoder must be the folder's; fix: model.kind={family}, or leave "
        f"model.kind out (it is taken from the folder), or {key}=<{fix_folder}>"
    )


def _pipeline_family(config: TrainConfig) -> tuple[str, dict[str, Any]]:
    """``model.pipeline``'s family, checked against ``model.kind``, and its index."""
    c = config.model
    if not Path(c.pipeline).exists():
        raise missing_folder("model.pipeline", c.pipeline)
    index = read_index(c.pipeline)
    name = index.get("_class_name")
    if name not in PIPELINE_FAMILIES:
        raise ConfigError(
            f"model.pipeline={c.pipeline!r} is a {name}; the trainer reads {', '.join(PIPELINE_FAMILIES)}; fix: one "
            "of those, or model.pretrained=<its transformer folder> with model.kind"
        )
    family = PIPELINE_FAMILIES[name]
    _check_distilled(config, name, index)
    _check_guider(config, name)
    if c.kind and c.kind != family:
        # the text-to-image/video pipelines of model.kind's family (FLUX.2: [klein]'s and [dev]'s)
        plain = [p for p, k in PIPELINE_FAMILIES.items() if k == c.kind and p not in PIPELINE_CONDITIONS]
        wanted = " or ".join(plain) or f"{KINDS.get(c.kind, c.kind)} pipeline"
        raise _mismatch(c.kind, "model.pipeline", c.pipeline, f"a {name} folder", family, f"a {wanted} folder")
    if not present(index, "transformer"):
        raise ConfigError(f"model.pipeline={c.pipeline!r} has no transformer (model_index.json: transformer is null)")
    listed = index["transformer"][1]
    if listed != KINDS[family]:
        raise ConfigError(
            f"model.pipeline={c.pipeline!r}: a {name} lists a {listed} as its transformer, not the {KINDS[family]} "
            f"model.kind {family!r} trains; fix: a {name} folder with its own transformer class"
        )
    return family, index


def _check_distilled(config: TrainConfig, name: str, index: dict[str, Any]) -> None:
    """A step-distilled FLUX.2 [klein] (``is_distilled`` in its pipeline config) samples without classifier-free
    guidance at any ``guidance_scale``, and FLUX.2 [dev] (guidance-distilled) embeds it: a run that guides its
    rollouts would train a policy the pipeline never samples."""
    g = config.flowgrpo.cfg_scale
    if name == "Flux2Pipeline" and g > 1.0:
        raise ConfigError(
            f"flowgrpo.cfg_scale={g:g} but model.pipeline={config.model.pipeline!r} is a Flux2Pipeline (FLUX.2 [dev], "
            "guidance-distilled): its pipeline runs no classifier-free guidance and hands guidance_scale to the "
            "transformer's guidance embedding instead; fix: flowgrpo.cfg_scale=1 and flowgrpo.guidance_scale=<g> "
            "(the pipeline's guidance_scale: 4 by default)"
        )
    if index.get("is_distilled") and g > 1.0:
        raise ConfigError(
            f"flowgrpo.cfg_scale={g:g} but model.pipeline={config.model.pipeline!r} is a step-distilled {name} "
            "(model_index.json: is_distilled true), which samples without classifier-free guidance at any "
            "guidance_scale; the rollouts would guide a policy the pipeline never runs; fix: flowgrpo.cfg_scale=1, "
            "or a [klein] Base folder (is_distilled false; its pipeline guides at guidance_scale g > 1: cfg_scale g)"
        )


def _check_guider(config: TrainConfig, name: str) -> None:
    """A pipeline that guides through its ``guider`` folder (HunyuanVideo-1.5's ``ClassifierFreeGuidance``): the
    trainer's ``neg + s (pos - neg)`` at every step is that guider only without a rescale, without the original
    formulation and over the whole schedule; another setting would guide rollouts the pipeline never samples."""
    path = Path(config.model.pipeline) / "guider" / "guider_config.json"
    if config.flowgrpo.cfg_scale <= 1.0 or not path.is_file():
        return
    guider = json.loads(path.read_text())
    differs = {
        key: guider[key]
        for key, plain in (("guidance_rescale", 0.0), ("use_original_formulation", False), ("start", 0.0), ("stop", 1.0))
        if key in guider and guider[key] != plain
    }
    if guider.get("_class_name") != "ClassifierFreeGuidance" or differs:
        raise ConfigError(
            f"flowgrpo.cfg_scale={config.flowgrpo.cfg_scale:g} but model.pipeline={config.model.pipeline!r} (a {name}) "
            f"guides with a {guider.get('_class_name')} {differs or ''}, which is not the trainer's neg + s (pos - neg) "
            "at every step; fix: flowgrpo.cfg_scale=1, or a folder whose guider/guider_config.json is a plain "
            "ClassifierFreeGuidance (guidance_rescale 0, use_original_formulation false, start 0, stop 1)"
        )


def _pretrained_family(config: TrainConfig) -> str:
    """``model.pretrained``'s family from its ``config.json``, checked against ``model.kind``."""
    c = config.model
    folder = Path(c.pretrained)
    if not folder.exists():
        raise missing_folder("model.pretrained", c.pretrained)
    path = folder / "config.json"
    cls = json.loads(path.read_text()).get("_class_name") if path.is_file() else None
    if cls is None:
        raise ConfigError(
            f"model.pretrained={c.pretrained!r} has no config.json naming its class; fix: a transformer folder written "
            "by save_pretrained (a pipeline's transformer/ subfolder), or model.pipeline=<the pipeline folder>"
        )
    family = _CLASS_KINDS.get(cls)
    if c.kind and KINDS.get(c.kind) != cls:
        known = f"model.kind {family!r}" if family else "no model.kind names it"
        raise ConfigError(
            f"model.kind={c.kind!r} builds a {KINDS.get(c.kind)}, but model.pretrained={c.pretrained!r} holds a "
            f"{cls} ({known}); fix: model.kind={family or '<its family>'}, or leave model.kind out (it is taken from "
            "the folder), or model.pretrained=<a folder of that class>"
        )
    if family is None:
        raise ConfigError(
            f"model.pretrained={c.pretrained!r} holds a {cls}, which no model.kind names; fix: a transformer of one of "
            f"{', '.join(KINDS.values())}"
        )
    return family


def _pixel_rewards(config: TrainConfig) -> list[str]:
    """The rewards that read decoded pixels (the same default as ``reward_loading``: built-ins read latents)."""
    from ..rewards.loading import entry_input, entry_name

    return [entry_name(e) for e in config.flowgrpo.rewards if entry_input(e) == "pixels"]


def _needs(config: TrainConfig, index: dict[str, Any]) -> dict[str, str]:
    """The components this run loads from ``model.pipeline``: name -> why."""
    c, g = config, config.flowgrpo
    needs = {"transformer": "trained" if "transformer" in (c.model.experts or ["transformer"]) else "frozen expert"}
    if present(index, "transformer_2") or "transformer_2" in c.model.experts:
        needs["transformer_2"] = "trained" if "transformer_2" in (c.model.experts or ["transformer_2"]) else "frozen expert"
    pixels = _pixel_rewards(c)
    if pixels:
        needs["vae"] = f"decodes pixels for the reward(s) {', '.join(pixels)}"
        if index.get("_class_name") == "LTX2Pipeline":  # the soundtrack the pixel rewards read beside the frames
            needs["audio_vae"] = needs["vocoder"] = f"decodes the audio for the reward(s) {', '.join(pixels)}"
    if index.get("_class_name") == "LTX2Pipeline" and not c.text.pipeline:
        needs["connectors"] = "encodes the prompts (the text streams of video and audio)"
    if condition_of(index):
        needs["vae"] = "encodes the condition images"
        for name in ("processor", "image_encoder", "image_processor"):  # Qwen-Image-Edit; Wan2.1 I2V's CLIP
            if present(index, name):
                needs[name] = "reads the condition images"
    if not c.text.pipeline:
        names = [n for n in index if n.startswith(("text_encoder", "tokenizer")) and present(index, n)]
        for name in sorted(set(names) | {"text_encoder", "tokenizer"}):
            needs[name] = "encodes the prompts"
    schedule = g.schedule if g.schedule != "auto" else _schedule_kind(config)
    if schedule == "pipeline" and not g.scheduler:
        needs["scheduler"] = "the rollout schedule"
    return needs


def _schedule_kind(config: TrainConfig) -> str:
    """``flowgrpo.schedule: auto``'s choice: the algorithm's; ``pipeline`` for a name that is not one (its own
    error comes from the algorithm's check)."""
    from ..algorithms.registry import ALGORITHMS

    cls = ALGORITHMS.get(config.flowgrpo.algorithm)
    return cls.schedule_kind if cls is not None else "pipeline"


def condition_of(index: dict[str, Any]) -> str:
    """How a pipeline folder's condition reaches its transformer (``PIPELINE_CONDITIONS``; ``"wan-ti2v"`` for Wan's
    I2V pipeline with ``expand_timesteps``), ``""`` for a text-to-image / text-to-video pipeline."""
    kind = PIPELINE_CONDITIONS.get(index.get("_class_name", ""), "")
    return "wan-ti2v" if kind == "wan-i2v" and index.get("expand_timesteps") else kind


def _check_components(config: TrainConfig, index: dict[str, Any]) -> list[str]:
    """Refuse a component the run needs that the folder lacks; the report lines of the ones it has."""
    folder = Path(config.model.pipeline)
    lines = []
    for name, why in _needs(config, index).items():
        on_disk = (folder / name / "scheduler_config.json").is_file() if name == "scheduler" else (folder / name).is_dir()
        if not (present(index, name) and on_disk):
            where = "its model_index.json lists none" if not present(index, name) else f"no {name}/ subfolder"
            raise ConfigError(
                f"model.pipeline={config.model.pipeline!r} has no {name} ({where}), and this run needs it ({why}); "
                f"fix: {_fix(name)}"
            )
        lines.append(f"  {name}: {index[name][1]} ({why})")
    return lines


def _fix(name: str) -> str:
    if name == "vae":
        return "a pipeline folder with its vae, or input: latents for those rewards"
    if name == "transformer_2":
        return "a two-expert pipeline folder (Wan2.2-A14B), or model.experts=[transformer] (or leave it out)"
    if name.startswith(("text_encoder", "tokenizer")):
        return f"a pipeline folder with its {name}, or text.pipeline=<a folder whose text encoders to use>"
    if name == "scheduler":
        return "a pipeline folder with scheduler/scheduler_config.json, or flowgrpo.scheduler=<a scheduler folder>"
    return f"a complete pipeline folder (its {name} is what the run trains)"


def check_model_folder(config: TrainConfig) -> list[str]:
    """Set ``model.kind`` from the folder (or check that it agrees), check the folder's components; the report lines.

    Raises ``ConfigError`` (``FileNotFoundError`` for a folder that does not exist) naming the key, both sides and
    the fix. Reads JSON only."""
    c = config.model
    if c.pipeline and c.pretrained:
        raise ConfigError(
            f"model.pipeline={c.pipeline!r} and model.pretrained={c.pretrained!r} both name the weights; fix: keep "
            "one (a pipeline folder gives its transformer, text encoders, scheduler and VAE)"
        )
    given = bool(c.kind)
    source = "given" if given else "taken from the folder"
    if c.pipeline:
        c.kind, index = _pipeline_family(config)
        lines = [f"model.pipeline={c.pipeline}: a {index['_class_name']}; model.kind={c.kind} ({source})"]
        return lines + _check_components(config, index)
    pixels = _pixel_rewards(config)
    if pixels:  # the trainer would refuse it too, but only after loading the model
        raise ConfigError(
            f"flowgrpo.rewards: {', '.join(pixels)} read(s) pixels, but this run has no VAE to decode them; fix: "
            "model.pipeline=<a diffusers pipeline folder with a vae>, or input: latents"
        )
    if c.pretrained:
        c.kind = _pretrained_family(config)
        return [f"model.pretrained={c.pretrained}: a {KINDS[c.kind]}; model.kind={c.kind} ({source})"]
    c.kind = c.kind or TINY_KIND
    return [f"model: the tiny {c.kind} model (no model.pipeline or model.pretrained), random weights"]
