"""The environment check scripts/setup.sh runs after installing a lock (stdlib only, run by the venv's Python).

    python scripts/check_env.py smoke PROFILE    import what the profile uses, then `pip check`

A failed check prints one line naming the broken package and exits 1.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import re
import subprocess
import sys
import traceback

# What the tests and the trainer import: the diffusers pipelines the tiny pipelines are built from, the
# transformers models of their text and image encoders, and the trainer's own dependencies.
SMOKE: dict[str, list[str]] = {
    "main": [
        "torch",
        "diffusers",
        "transformers.activations",
        "peft",
        "accelerate",
        "yaml",
        "tqdm",
        "matplotlib",
        "imageio",
        "imageio_ffmpeg",
        "ftfy",
        "sp_diffusers",
    ],
    "verl": ["verl"],
    "test": ["pytest", "xdist", "pytest_timeout", "wandb"],
}
ATTRS: dict[str, list[str]] = {  # module -> names imported from it (lazy modules load them on first access)
    "transformers": [
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen2Model",
        "T5EncoderModel",
        "UMT5EncoderModel",
        "CLIPTextModel",
        "CLIPTextModelWithProjection",
        "CLIPVisionModel",
        "CLIPModel",
        "ByT5Tokenizer",
        "PreTrainedTokenizerFast",
    ],
    "diffusers": [
        "QwenImagePipeline",
        "QwenImageEditPipeline",
        "QwenImageEditPlusPipeline",
        "FluxPipeline",
        "FluxKontextPipeline",
        "StableDiffusion3Pipeline",
        "WanPipeline",
        "WanImageToVideoPipeline",
    ],
}
PROFILES = {"main": ["main"], "verl": ["main", "verl"], "test": ["main", "verl", "test"]}


def _root_cause(exc: BaseException) -> BaseException:
    """The first exception of a chain (diffusers' lazy imports wrap the real error in a RuntimeError)."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def _culprit(exc: BaseException) -> str:
    """The installed distribution whose code raised: the deepest traceback frame inside site-packages."""
    owners = md.packages_distributions()
    culprit = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        m = re.search(r"site-packages/([^/]+)/", frame.filename)
        if m and m.group(1) in owners:
            dist = owners[m.group(1)][0]
            culprit = (
                f"{dist} {md.version(dist)} ({frame.filename.split('site-packages/')[1]}:{frame.lineno})"
            )
    return culprit


def smoke(profile: str) -> int:
    for group in PROFILES[profile]:
        for module in SMOKE[group]:
            try:
                mod = importlib.import_module(module)
                for attr in ATTRS.get(module, []):
                    getattr(mod, attr)
            except Exception as exc:  # one line naming the package, whatever the import raised
                root = _root_cause(exc)
                where = _culprit(root) or module
                first = str(root).strip().splitlines()[0] if str(root).strip() else ""
                print(f"broken package: {where}: importing {module} raised {type(root).__name__}: {first}")
                return 1
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    if check.returncode != 0:
        print(f"broken package (pip check): {(check.stdout or check.stderr).strip().splitlines()[0]}")
        return 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "smoke" and argv[1] in PROFILES:
        return smoke(argv[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
