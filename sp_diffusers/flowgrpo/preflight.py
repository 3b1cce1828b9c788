"""``sp-diffusers train --check``: what a run would read, checked without loading a weight or joining a process group.

The checks the trainer runs before it builds anything, in its order, each raising the error training would raise:
the algorithm keys; the model folder (``model.kind`` against the folder's class, the components the run loads:
``folder_checks.py``, JSON only); the rewards (imported as training imports them: a missing file or callable shows
here); the prompt files and preference pairs; a ``text.pipeline`` or ``flowgrpo.scheduler`` folder. The lines returned say what was found.
"""

from __future__ import annotations

from .config import TrainConfig

__all__ = ["check_config"]


def check_config(config: TrainConfig) -> list[str]:
    """Check ``config`` against the files it names; the report, one line per finding (``ConfigError`` otherwise)."""
    from .build import check_algorithm
    from .io.data import read_prompts
    from .io.preferences import read_pairs
    from .models.folder_checks import check_model_folder, read_index
    from .rewards.loading import reward_specs
    from .sampling.pipeline_schedule import load_scheduler_config

    g = config.flowgrpo
    check_algorithm(config)
    lines = check_model_folder(config)
    specs = reward_specs(g.rewards, g.reward)
    lines.append("rewards: " + ", ".join(f"{s.name} (reads {s.input}, weight {s.weight:g})" for s in specs))
    if config.text.pipeline:
        name = read_index(config.text.pipeline, "text.pipeline").get("_class_name")
        lines.append(f"text.pipeline={config.text.pipeline}: a {name} (encodes the prompts)")
    if g.scheduler:
        scheduler = load_scheduler_config(g.scheduler, "flowgrpo.scheduler").get("_class_name")
        lines.append(f"flowgrpo.scheduler={g.scheduler}: a {scheduler}")
    for key, path in (("data.train", config.data.train), ("data.eval", config.data.eval)):
        if path:
            lines.append(f"{key}={path}: {len(read_prompts(path, key, config.data.max_image_pixels))} prompts")
    for key, path in (("flowgrpo.dpo.pairs", g.dpo.pairs), ("flowgrpo.dpo.eval_pairs", g.dpo.eval_pairs)):
        if path:
            lines.append(f"{key}={path}: {len(read_pairs(path, key, config.data.max_image_pixels))} preference pairs")
    return lines
