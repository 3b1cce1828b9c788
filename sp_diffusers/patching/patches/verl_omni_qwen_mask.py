"""verl-omni's Qwen-Image Ulysses mask fix runs on diffusers where it is wrong.

Defect: ``verl_omni.models.diffusers.qwen_image.apply_qwen_image_ulysses_mask_fix`` (called by verl-omni
for every Qwen-Image pipeline, from ``DiffusionModelBase.get_class``) replaces
``QwenImageTransformer2DModel.forward`` on every diffusers >= 0.38 (its only gate is ``< 0.38``: return).
Its forward builds the joint text/image mask in all-to-all key order and passes it as an external
``attention_mask``. That is right on 0.38 alone, but:
- 0.39+ build the mask per block from the split text mask (diffusers#13756) and the processor refuses an
  external one: ``ValueError: QwenDoubleStreamAttnProcessor2_0 does not accept an external
  attention_mask`` in the first forward under SP (Qwen-Image SP in verl-omni is broken there);
- 0.38 with sp-diffusers installed: ``qwenimage_joint_mask`` reorders the joint mask in the processor, so
  verl-omni's already reordered mask is reordered twice: silently wrong (gradients off by ~13%).
Affected: verl-omni at ``verl-project/verl-omni`` a1139ba, on diffusers 0.38-0.42.
Upstream: none filed (the version gate in ``verl_omni/models/diffusers/qwen_image.py``).
Fix: exactly one reorder runs. verl-omni's function is replaced by a gated one that calls it only where
diffusers still builds the global joint mask and sp-diffusers' ``qwenimage_joint_mask`` is not applied;
elsewhere it leaves diffusers' forward in place, and takes verl-omni's forward back off if it was put on
before this patch (or ``import verl``) ran. Applied only where verl-omni is installed.
"""

from __future__ import annotations

import inspect
import sys
from types import ModuleType

from ..swaps import AttributeSwaps
from . import _verl_omni, qwenimage_joint_mask
from ._base import Probe, logger

NAME = "verl_omni_qwen_mask"
AFFECTED = "verl-omni a1139ba, diffusers 0.38-0.42"
UPSTREAM = "verl-omni: none filed (apply_qwen_image_ulysses_mask_fix gated < 0.38 only)"

MODULE = "verl_omni.models.diffusers.qwen_image"
SOURCE = "models/diffusers/qwen_image.py"
FUNCTION = "apply_qwen_image_ulysses_mask_fix"
MARKER = "_verl_omni_ulysses_mask_patched"  # verl-omni's own mark on the forward it installs
REFUSAL = "does not accept an external attention_mask"
GATED = "_sp_diffusers_gated"  # our mark on the gated function

_swaps = AttributeSwaps()


def _model_cls():
    from diffusers.models.transformers import transformer_qwenimage

    return transformer_qwenimage.QwenImageTransformer2DModel, transformer_qwenimage


def _refuses_external_mask() -> bool:
    _, mod = _model_cls()
    return REFUSAL in inspect.getsource(mod.QwenDoubleStreamAttnProcessor2_0.__call__)


def probe() -> Probe:
    if not _verl_omni.installed():
        return _verl_omni.NOT_INSTALLED
    if f"def {FUNCTION}" not in (_verl_omni.source(SOURCE) or ""):
        return Probe(False, f"verl-omni has no {FUNCTION} in {SOURCE}")
    from packaging.version import Version

    from ..compat import diffusers_version

    if diffusers_version() < Version("0.38"):
        return Probe(False, "verl-omni's Qwen-Image mask fix returns early below diffusers 0.38")
    if _refuses_external_mask():
        return Probe(
            True, "verl-omni's Qwen-Image mask fix passes an external mask diffusers refuses (>= 0.39)"
        )
    if qwenimage_joint_mask.probe().needed:
        return Probe(True, "verl-omni's Qwen-Image mask fix and qwenimage_joint_mask would reorder twice")
    return Probe(False, "diffusers' Qwen-Image mask order needs no fix")


def _verl_omni_fix_wanted() -> bool:
    """Only where diffusers builds one global joint mask and nothing of ours reorders it."""
    return qwenimage_joint_mask.probe().needed and not qwenimage_joint_mask.is_applied()


def _diffusers_forward(forward):
    """diffusers' own forward, found in the closure of verl-omni's replacement (it calls it)."""
    cls, mod = _model_cls()
    for cell in forward.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if (
            getattr(value, "__qualname__", "") == f"{cls.__name__}.forward"
            and value.__module__ == mod.__name__
        ):
            return value
    return getattr(forward, "__wrapped__", None)


def _take_off_verl_omni_forward() -> None:
    cls, _ = _model_cls()
    forward = vars(cls).get("forward")
    if forward is None or not getattr(forward, MARKER, False):
        return
    original = _diffusers_forward(forward)
    if original is None:
        raise RuntimeError(
            f"verl-omni's {FUNCTION} replaced {cls.__name__}.forward before sp-diffusers could gate it, and "
            "diffusers' own forward cannot be found in it; under SP its mask would be wrong or refused. "
            "Fix: import verl (which loads sp-diffusers' plugin) before verl-omni applies its Qwen-Image fix"
        )
    _swaps.set(cls, "forward", original)
    logger.info(
        "took verl-omni's Qwen-Image mask forward off %s: diffusers' own forward is used", cls.__name__
    )


def _fix(module: ModuleType) -> None:
    original = getattr(module, FUNCTION, None)
    if original is None or getattr(original, GATED, False):
        return

    def apply_qwen_image_ulysses_mask_fix(*args, **kwargs):
        if _verl_omni_fix_wanted():
            return original(*args, **kwargs)
        _take_off_verl_omni_forward()
        return None

    apply_qwen_image_ulysses_mask_fix.__wrapped__ = original  # type: ignore[attr-defined]
    apply_qwen_image_ulysses_mask_fix.__doc__ = original.__doc__
    setattr(apply_qwen_image_ulysses_mask_fix, GATED, True)
    # verl-omni re-exports the function (verl_omni.models, verl_omni.models.diffusers): every binding
    # already made points at the original; later ones are made from this module, after this fix
    for name, mod in list(sys.modules.items()):
        if (name == _verl_omni.PACKAGE or name.startswith(_verl_omni.PACKAGE + ".")) and getattr(
            mod, FUNCTION, None
        ) is original:
            _swaps.set(mod, FUNCTION, apply_qwen_image_ulysses_mask_fix)
    if not _verl_omni_fix_wanted():
        _take_off_verl_omni_forward()
    logger.info("gated verl-omni %s: one Qwen-Image mask reorder, never an external mask on 0.39+", FUNCTION)


_lifecycle = _verl_omni.ImportFix((MODULE,), _fix, _swaps)
apply, revert, is_applied = _lifecycle.apply, _lifecycle.revert, _lifecycle.is_applied
