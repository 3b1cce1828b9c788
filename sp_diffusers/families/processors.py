"""Qwen-Image-Edit's ``processor`` (a ``Qwen2VLProcessor``: Qwen2.5-VL's tokenizer and image processor), built where
transformers cannot build it.

transformers >= 5 constructs a ``Qwen2VLProcessor`` only with a video processor, and Qwen2-VL's video processor
imports torchvision. An edit prompt never holds a video, so without torchvision (a CPU-only torch has no matching
torchvision wheel) the processor is assembled from its folder's tokenizer and image processor, with no video
processor: ``__call__(text=..., images=...)`` is unchanged (``tests/test_pipeline_io.py`` holds the edit pipelines'
prompt embeddings equal). With torchvision installed, transformers' own ``from_pretrained`` is used.

FLUX.2 [dev]'s ``tokenizer`` is Mistral's ``PixtralProcessor``, which transformers builds only with torchvision too.
A text prompt needs only its tokenizer and chat template: without torchvision, :func:`processor_tokenizer` loads
those from the same folder and the pipeline is handed them in the processor's place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["load_qwen_vl_processor", "processor_tokenizer", "qwen_vl_processor", "save_qwen_vl_processor"]


def qwen_vl_processor(image_processor: Any, tokenizer: Any) -> Any:
    """A ``Qwen2VLProcessor`` of these parts; without torchvision, one that holds no video processor."""
    from transformers import Qwen2VLProcessor
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor(
            patch_size=image_processor.patch_size,
            merge_size=image_processor.merge_size,
            temporal_patch_size=image_processor.temporal_patch_size,
        )
        return Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video)
    processor = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    processor.chat_template = None
    processor.image_processor, processor.tokenizer, processor.video_processor = (
        image_processor,
        tokenizer,
        None,
    )
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tokenizer.convert_tokens_to_ids(processor.image_token)
    processor.video_token_id = tokenizer.convert_tokens_to_ids(processor.video_token)
    return processor


def save_qwen_vl_processor(processor: Any, folder: str | Path) -> Path:
    """Write the processor's parts as ``Qwen2VLProcessor.save_pretrained`` lays them out (tokenizer files,
    ``preprocessor_config.json``, ``processor_config.json``), without a video processor."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    processor.tokenizer.save_pretrained(folder)
    processor.image_processor.save_pretrained(folder)
    (folder / "processor_config.json").write_text(
        json.dumps({"processor_class": "Qwen2VLProcessor"}, indent=2)
    )
    return folder


def load_qwen_vl_processor(folder: str | Path) -> Any:
    """``Qwen2VLProcessor.from_pretrained(folder)`` where transformers can (torchvision installed), else the
    processor assembled from the folder's tokenizer and image processor (:func:`qwen_vl_processor`)."""
    from transformers import AutoTokenizer
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        from transformers import Qwen2VLProcessor

        return Qwen2VLProcessor.from_pretrained(folder)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return qwen_vl_processor(
        Qwen2VLImageProcessorPil.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    )


def processor_tokenizer(pipeline: str | Path, component: str = "tokenizer") -> Any | None:
    """The tokenizer to put in the processor's place where ``model_index.json`` lists a processor as ``component``
    (FLUX.2 [dev]: ``PixtralProcessor``) and transformers cannot build it (no torchvision): the folder's tokenizer
    with the processor's chat template. None where the folder loads as it is. diffusers checks a passed component
    against the class the index lists, which it cannot import here, so load the pipeline with ``component=None`` and
    set this tokenizer on it afterwards."""
    from transformers import AutoTokenizer
    from transformers.utils import is_torchvision_available

    entry = json.loads((Path(pipeline) / "model_index.json").read_text()).get(component)
    if is_torchvision_available() or not (isinstance(entry, list) and str(entry[1]).endswith("Processor")):
        return None
    folder = Path(pipeline) / component
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:  # a processor may keep its template beside the tokenizer's files
        for name in ("chat_template.jinja", "chat_template.json"):
            path = folder / name
            if path.is_file():
                text = path.read_text()
                tokenizer.chat_template = json.loads(text)["chat_template"] if name.endswith(".json") else text
                break
    if tokenizer.chat_template is None:
        raise ValueError(
            f"{folder}: the {entry[1]} needs torchvision, and its tokenizer alone has no chat template; fix: pip "
            "install torchvision (the build matching torch: torch's own index for a CPU torch)"
        )
    return tokenizer
