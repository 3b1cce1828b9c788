"""diffusers' own ``native`` (SDPA) backend is not exact under Ulysses for training.

Defects of ``TemplatedUlyssesAttention`` with the native forward/backward ops:
- 0.36-0.37: backward is broken: the backward op runs without grad mode and returns 11 gradients for 12
  inputs (shape error; diffusers#12761);
- 0.38+: backward is correct but recomputes the whole attention forward (diffusers#13328);
- 0.36-0.38: a local-length key-padding mask ``[B, S_kv/P]`` is rejected or misapplied (0.39+ gathers it);
- all versions: per-head masks ``[B, H, S_q, S_kv]`` fail (open PR diffusers#14317), and backward fails
  when S_q != S_kv (cross-attention) because every gradient is reshaped with the query's length;
- all versions: GQA (H_kv < H) is refused.
Fix: for users who keep ``set_attention_backend("native")``, the native backend sends Ulysses-only
calls (ulysses_degree > 1, ring_degree == 1, return_lse=False) through sp_diffusers' exact Ulysses path
(``sp_diffusers.parallel.attention.ulysses_sdpa_attention``: SDPA under autograd between two all-to-alls).
Everything else (no parallelism, ring attention, LSE requests) still runs diffusers' own code.
Affected: 0.36-0.42 (each version has at least the per-head / cross-attention defects).
Upstream: diffusers#12761, #13328, #14317.
"""

from __future__ import annotations

import inspect

from ..swaps import AttributeSwaps
from ._base import Probe, logger

NAME = "native_ulysses"
AFFECTED = "0.36-0.42"
UPSTREAM = "diffusers#12761, #13328, #14317"

_swaps = AttributeSwaps()


def _dispatch():
    from diffusers.models import attention_dispatch

    return attention_dispatch


def defects() -> list[str]:
    """The native Ulysses defects visible in the installed code."""
    mod = _dispatch()
    found = []
    backward_op = inspect.getsource(mod._native_attention_backward_op)
    if "enable_grad" not in backward_op:
        found.append("backward runs without grad mode (broken, diffusers#12761)")
    elif "scaled_dot_product_attention" in backward_op:
        found.append("backward recomputes the attention forward (diffusers#13328)")
    ulysses = mod.TemplatedUlyssesAttention
    if "all_gather" not in inspect.getsource(ulysses.forward):
        found.append("local-length masks are not all-gathered")
    if "grad_key_op" in inspect.getsource(ulysses.backward):
        found.append("every gradient is reshaped with the query length: S_q != S_kv backward fails")
    if "attn_mask.shape[1]" not in inspect.getsource(ulysses.forward):
        found.append("per-head masks are not sliced to the local heads")
    return found


def probe() -> Probe:
    found = defects()
    if not found:
        return Probe(False, "native Ulysses backward, masks and cross-attention look exact")
    return Probe(True, "; ".join(found))


def apply() -> None:
    if _swaps.active:
        return
    from ...parallel.attention import ulysses_sdpa_attention
    from ...parallel.cp_groups import cp_degrees

    mod = _dispatch()
    registry = mod._AttentionBackendRegistry
    native = mod.AttentionBackendName.NATIVE
    original = registry._backends[native]

    def native_attention(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        return_lse=False,
        _parallel_config=None,
    ):
        ulysses, ring = cp_degrees(_parallel_config)
        if ring == 1 and ulysses > 1 and not return_lse:
            return ulysses_sdpa_attention(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, False, _parallel_config
            )
        return original(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            return_lse,
            _parallel_config,
        )

    native_attention.__wrapped__ = original  # type: ignore[attr-defined]
    _swaps.set(registry._backends, native, native_attention)
    logger.info("patched diffusers' native backend: Ulysses calls use sp_diffusers' exact path")


def revert() -> None:
    _swaps.restore()


def is_applied() -> bool:
    return _swaps.active
