"""Reload exported weights with diffusers alone: this script never imports sp_diffusers (checked at the end).

    python tests/workers/plain_diffusers.py CASES.json

CASES.json lists {"ref": <torch file of inputs and the trained outputs>, "export": <export folder>} entries; for
each trained transformer it prints the largest difference from the trained output of (a) the exported
``transformer`` folder (LoRA merged), (b) the base transformer with the LoRA file (``load_lora_adapter``), (c) the
base pipeline with ``load_lora_weights``, (d) the exported pipeline folder, and (e) the base model (for scale).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import diffusers
import torch


def _max_diff(model, inputs, want) -> float:
    with torch.no_grad():
        got = model(**inputs, return_dict=False)[0]
    if isinstance(got, (list, tuple)):  # Z-Image: a per-sample list
        got = torch.stack(list(got))
    return float((got.float() - want.float()).abs().max())


def _pipeline(folder) -> diffusers.DiffusionPipeline:
    """The pipeline class the folder names, whole; a Qwen-Image-Edit processor only where transformers can build one
    (it needs torchvision for a video processor an edit never uses: sp_diffusers.families.processors)."""
    from transformers.utils import is_torchvision_available

    index = json.loads((Path(folder) / "model_index.json").read_text())
    extra = {"processor": None} if "processor" in index and not is_torchvision_available() else {}
    return diffusers.DiffusionPipeline.from_pretrained(folder, **extra)


def check(ref_file: str, export: str) -> dict:
    case = torch.load(ref_file, weights_only=False)
    export_dir = Path(export)
    cls = getattr(diffusers, case["class"])
    inputs, out = case["inputs"], {}
    for name, want in case["outputs"].items():
        r = out[name] = {}
        r["merged"] = _max_diff(cls.from_pretrained(export_dir / name), inputs, want)
        r["base"] = _max_diff(cls.from_pretrained(case["pipeline"], subfolder=name), inputs, want)
        r["scale"] = float(want.abs().max())
        if case["lora"]:
            weight = "pytorch_lora_weights.safetensors" if name == "transformer" else f"pytorch_lora_weights_{name}.safetensors"
            model = cls.from_pretrained(case["pipeline"], subfolder=name)
            model.load_lora_adapter(str(export_dir), weight_name=weight, prefix="transformer")
            r["lora_adapter"] = _max_diff(model, inputs, want)
            pipe = _pipeline(case["pipeline"])
            extra = {"load_into_transformer_2": True} if name == "transformer_2" else {}
            if hasattr(pipe, "load_lora_weights"):
                pipe.load_lora_weights(str(export_dir), weight_name=weight, **extra)
            else:  # no LoRA loader in diffusers (HunyuanVideo15Pipeline): the pipeline's transformer loads the file
                getattr(pipe, name).load_lora_adapter(str(export_dir), weight_name=weight, prefix="transformer")
            r["lora_pipeline"] = _max_diff(getattr(pipe, name), inputs, want)
        pipe = _pipeline(export_dir)
        r["pipeline_class"] = type(pipe).__name__
        r["pipeline"] = _max_diff(getattr(pipe, name), inputs, want)
    return out


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    results = {key: check(c["ref"], c["export"]) for key, c in cases.items()}
    results["sp_diffusers_imported"] = any(m == "sp_diffusers" or m.startswith("sp_diffusers.") for m in sys.modules)
    print("RESULTS " + json.dumps(results))
