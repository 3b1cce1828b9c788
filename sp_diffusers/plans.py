"""Context-parallel plans for models diffusers ships without one (SD3 / SD3.5, ...), in diffusers' own
declarative form, plus the processor each needs to route attention through the dispatcher.

A plan is diffusers' ``_cp_plan`` dict (which module inputs/outputs to split or gather along which dim)
and, where the model's attention processor calls SDPA directly (so no backend or parallel config can
reach it), a ``prepare(model)`` that swaps in a processor that computes the same function through
``dispatch_attention_fn``. ``sp_diffusers.install()`` attaches a plan only to classes whose installed
diffusers has none, and runs ``prepare`` before ``set_attention_backend`` / ``enable_parallelism``.
Users register plans for their own models with :func:`register_plan`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .patches._base import AttributeSwaps

logger = logging.getLogger(__name__)

__all__ = [
    "ModelPlan",
    "PlanStatus",
    "SD3JointAttnProcessor",
    "attach",
    "detach",
    "register_plan",
    "registered_plans",
]


@dataclass(frozen=True)
class ModelPlan:
    model_class: str  # the diffusers class name, e.g. "SD3Transformer2DModel"
    cp_plan: Callable[[], dict]  # built lazily: ContextParallelInput/Output live in diffusers
    prepare: Callable[[torch.nn.Module], None] | None = None
    module: str = "diffusers"  # where the class is importable from


@dataclass(frozen=True)
class PlanStatus:
    model_class: str
    attached: bool
    reason: str


_PLANS: dict[str, ModelPlan] = {}
_swaps = AttributeSwaps()
_attached: list[type] = []


def register_plan(
    model_class: str | type,
    cp_plan: dict | Callable[[], dict],
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> None:
    """Register a context-parallel plan for ``model_class`` (a class or its name in ``diffusers``).

    Takes effect at the next ``sp_diffusers.install()`` (call ``uninstall()`` first if already installed).
    """
    name = model_class if isinstance(model_class, str) else model_class.__name__
    module = "diffusers" if isinstance(model_class, str) else model_class.__module__
    builder = cp_plan if callable(cp_plan) else (lambda plan=cp_plan: plan)
    _PLANS[name] = ModelPlan(name, builder, prepare, module)


def registered_plans() -> dict[str, ModelPlan]:
    return dict(_PLANS)


def _resolve(plan: ModelPlan) -> type | None:
    import importlib

    module = importlib.import_module(plan.module)
    return getattr(module, plan.model_class, None)


def prepare_model(model: torch.nn.Module) -> None:
    """Run the ``prepare`` of ``model``'s plan (idempotent); a no-op for other models."""
    for cls in type(model).__mro__:
        plan = _PLANS.get(cls.__name__)
        if plan is not None and plan.prepare is not None and cls in _attached:
            plan.prepare(model)
            return


def attach() -> list[PlanStatus]:
    """Attach every registered plan whose class has no ``_cp_plan`` in the installed diffusers."""
    from diffusers.models.modeling_utils import ModelMixin

    statuses = []
    for plan in _PLANS.values():
        cls = _resolve(plan)
        if cls is None:
            statuses.append(PlanStatus(plan.model_class, False, "class not in this diffusers version"))
            continue
        if getattr(cls, "_cp_plan", None) is not None:
            statuses.append(PlanStatus(plan.model_class, False, "diffusers ships its own _cp_plan"))
            continue
        _swaps.set(cls, "_cp_plan", plan.cp_plan())
        _attached.append(cls)
        statuses.append(
            PlanStatus(plan.model_class, True, "diffusers has no _cp_plan: sp_diffusers plan attached")
        )
    if _attached:
        # a processor swapped in after set_attention_backend would miss the backend: prepare first
        for name in ("set_attention_backend", "enable_parallelism"):
            _swaps.set(ModelMixin, name, _preparing(getattr(ModelMixin, name)))
    return statuses


def _preparing(original: Callable) -> Callable:
    def method(self, *args, **kwargs):
        prepare_model(self)
        return original(self, *args, **kwargs)

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method.__doc__ = original.__doc__
    method.__name__ = original.__name__
    return method


def detach() -> None:
    _swaps.restore()
    _attached.clear()


# ------------------------------------------------------------------------------------------------ SD3


class SD3JointAttnProcessor:
    """``JointAttnProcessor2_0`` (SD3 / SD3.5 MMDiT, incl. qk-norm and dual attention) through the dispatcher.

    Same function as diffusers' processor, but attention goes through ``dispatch_attention_fn`` with this
    processor's backend and parallel config, so ``ulysses_sdpa`` (or any backend) and context parallelism
    apply. Under a plan the image tokens ``[B, N/P, D]`` and the text tokens ``[B, T/P, D]`` are both
    sequence-sharded; each rank attends over ``cat([image_r, text_r])`` and the all-to-all gathers the keys
    as ``[image_0, text_0, image_1, text_1, ...]``.

    ``encoder_hidden_states_mask`` (``[B, T]`` bool over the global text length, passed through
    ``joint_attention_kwargs``) masks padded text keys, so text padded to a multiple of the SP degree gives
    exactly the unpadded result; the joint key mask is built in the all-to-all's key order.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        if attention_mask is not None:
            raise ValueError(
                "SD3JointAttnProcessor takes no attention_mask; pass encoder_hidden_states_mask [B, T] (text keys) "
                "through joint_attention_kwargs instead"
            )
        image_tokens = hidden_states.shape[1]
        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, N, H, D]
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        mask = None
        if encoder_hidden_states is not None:
            text_q = attn.add_q_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            text_k = attn.add_k_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            text_v = attn.add_v_proj(encoder_hidden_states).unflatten(-1, (attn.heads, -1))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)
            if encoder_hidden_states_mask is not None:
                mask = self._joint_key_mask(
                    encoder_hidden_states_mask, image_tokens, encoder_hidden_states.shape[1]
                )
        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return attn.to_out[1](attn.to_out[0](out))
        image_out, text_out = out[:, :image_tokens], out[:, image_tokens:]
        if not attn.context_pre_only:
            text_out = attn.to_add_out(text_out)
        return attn.to_out[1](attn.to_out[0](image_out)), text_out

    def _joint_key_mask(self, text_mask: torch.Tensor, image_local: int, text_local: int) -> torch.Tensor:
        """``[B, T]`` text mask -> the ``[B, 1, 1, keys]`` mask of the joint keys, in the order attention sees them."""
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        world = cp.ulysses_degree * cp.ring_degree if cp is not None else 1
        batch = text_mask.shape[0]
        if text_mask.dim() != 2 or text_mask.shape[1] != world * text_local:
            raise ValueError(
                f"encoder_hidden_states_mask must be [B, T] over the global text length {world * text_local}, got "
                f"shape {tuple(text_mask.shape)}; fix: pass the mask of the (padded) encoder_hidden_states"
            )
        text = text_mask.to(torch.bool).unflatten(1, (world, text_local))
        image = torch.ones((batch, world, image_local), dtype=torch.bool, device=text_mask.device)
        # [B, 1, 1, keys]: every backend (diffusers 0.36's native too) broadcasts a 4-D mask over heads/queries
        return torch.cat([image, text], dim=2).flatten(1)[:, None, None, :]


def _sd3_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    return {
        # the patch embedding adds absolute positions before the split, so each shard keeps its own
        "pos_embed": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "context_embedder": {0: ContextParallelInput(split_dim=1, expected_dims=3, split_output=True)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_sd3(model: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import Attention, JointAttnProcessor2_0

    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is JointAttnProcessor2_0:
            module.set_processor(SD3JointAttnProcessor())


register_plan("SD3Transformer2DModel", _sd3_plan, _prepare_sd3)


# ---------------------------------------------------------------------------------- shared by the plans below


def _cp_world(parallel_config: Any) -> int:
    """Number of sequence shards under ``parallel_config`` (1 without context parallelism)."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    return cp.ulysses_degree * cp.ring_degree if cp is not None else 1


def _to_all_to_all_order(
    x: torch.Tensor, dim: int, first_local: int, second_local: int, world: int
) -> torch.Tensor:
    """Reorder ``dim`` of ``x`` from stream order to the key order the all-to-all produces.

    ``x.shape[dim] == world * (first_local + second_local)``, laid out ``[first (world * first_local), second
    (world * second_local)]`` (the order of one process); returns it as ``[first_0, second_0, first_1, second_1,
    ...]``, the order in which Ulysses concatenates each rank's ``cat([first_r, second_r])`` chunk.
    """
    dim = dim % x.dim()
    first, second = x.split([world * first_local, world * second_local], dim=dim)
    first = first.unflatten(dim, (world, first_local))  # [..., P, first_local, ...]
    second = second.unflatten(dim, (world, second_local))  # [..., P, second_local, ...]
    return torch.cat([first, second], dim=dim + 1).flatten(dim, dim + 1)


def _text_key_mask(
    text_mask: torch.Tensor, text_local: int, other_local: int, world: int, text_first: bool, processor: str
) -> torch.Tensor:
    """``[B, T]`` text mask (global, padded length) -> ``[B, 1, 1, keys]`` mask of the joint keys, in the
    order attention sees them: rank chunks ``cat([text_r, other_r])`` (or ``[other_r, text_r]``) concatenated.

    4-D on purpose: diffusers 0.36's native backend hands a 2-D mask to SDPA unchanged (no key-padding reading).
    """
    if text_mask.dim() != 2 or text_mask.shape[1] != world * text_local:
        raise ValueError(
            f"{processor}: encoder_hidden_states_mask must be [B, T] over the global (padded) text length "
            f"{world * text_local}, got shape {tuple(text_mask.shape)}; fix: pass the [B, T] mask of the "
            "encoder_hidden_states given to the model (e.g. from sp_diffusers.padding.pad_text_batch)"
        )
    batch = text_mask.shape[0]
    text = text_mask.to(torch.bool).unflatten(1, (world, text_local))  # [B, P, T/P]
    other = torch.ones((batch, world, other_local), dtype=torch.bool, device=text_mask.device)
    parts = [text, other] if text_first else [other, text]
    return torch.cat(parts, dim=2).flatten(1)[:, None, None, :]  # [B, 1, 1, P * (T/P + N/P)]


def _block_cp(block: torch.nn.Module) -> Any:
    """The context-parallel config of ``block``'s attention (set by ``enable_parallelism``), or None."""
    for module in block.modules():
        config = getattr(getattr(module, "processor", None), "_parallel_config", None)
        if config is not None:
            return getattr(config, "context_parallel_config", None)
    return None


def _bound_args(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[list[str], dict[str, Any]]:
    """``module.forward``'s parameter names (without self) and the call's arguments by name."""
    import inspect

    names = list(inspect.signature(type(module).forward).parameters)[1:]
    return names, dict(zip(names, args, strict=False)) | kwargs


class _StreamsDivide:
    """Forward pre-hook of the block where a plan splits the video and text streams: under context parallelism
    both lengths must divide the degree. diffusers' sharder would only assert; this names the fix. It runs
    before diffusers' split hook (torch pre-hooks precede the hook-wrapped ``forward``)."""

    def __init__(self, model: str, text_fix: str) -> None:
        self.model, self.text_fix = model, text_fix

    def __call__(self, block: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        cp = _block_cp(block)
        world = cp.ulysses_degree * cp.ring_degree if cp is not None else 1
        if world == 1:
            return
        _, bound = _bound_args(block, args, kwargs)
        video, text = bound.get("hidden_states"), bound.get("encoder_hidden_states")
        if torch.is_tensor(text) and text.shape[1] % world:
            raise ValueError(
                f"{self.model}: encoder_hidden_states has {text.shape[1]} tokens, not divisible by the context-"
                f"parallel degree {world}; fix: pad the text to a multiple of {world} with "
                f"sp_diffusers.padding.pad_text_batch and {self.text_fix}"
            )
        if torch.is_tensor(video) and video.shape[1] % world:
            raise ValueError(
                f"{self.model}: the video has {video.shape[1]} tokens (frames x height x width after patching), "
                f"not divisible by the context-parallel degree {world}; fix: choose a frame count or size whose "
                f"token count is a multiple of {world}, or a degree that divides {video.shape[1]}"
            )


def _check_streams_divide(block: torch.nn.Module, model: str, text_fix: str) -> None:
    if not getattr(block, "_sp_diffusers_divisibility_hook", False):
        block.register_forward_pre_hook(_StreamsDivide(model, text_fix), with_kwargs=True)
        block._sp_diffusers_divisibility_hook = True


# -------------------------------------------------------------------------------------------- HunyuanVideo


class HunyuanVideoJointAttnProcessor:
    """diffusers' ``HunyuanVideoAttnProcessor2_0`` with the joint mask in the order context parallelism needs.

    diffusers' processor already routes attention through ``dispatch_attention_fn``; what breaks under a
    sequence split is the mask. ``HunyuanVideoTransformer3DModel.forward`` builds a key mask
    ``[B, 1, 1, N + T]`` over *global* lengths in stream order ``[video (N), text (T)]`` (our plan splits the
    streams at the first block, after the mask is built). Each rank attends over ``cat([video_r, text_r])``
    (``[B, N/P + T/P, H, D]``: dual-stream blocks concatenate the projected streams, single-stream blocks the
    hidden states), so the all-to-all orders the keys ``[video_0, text_0, video_1, text_1, ...]``; this
    processor reorders the mask's key (and, for a ``[.., S, S]`` mask, query) dim to that order and then runs
    diffusers' processor unchanged. With no parallelism it is diffusers' processor, bit for bit.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

        world = _cp_world(self._parallel_config)
        if attention_mask is not None and encoder_hidden_states is not None and world > 1:
            attention_mask = self._in_all_to_all_order(
                attention_mask, hidden_states.shape[1], encoder_hidden_states.shape[1], world
            )
        # diffusers' processor reads only _attention_backend / _parallel_config from self: run it as ours
        return HunyuanVideoAttnProcessor2_0.__call__(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
        )

    @staticmethod
    def _in_all_to_all_order(
        mask: torch.Tensor, video_local: int, text_local: int, world: int
    ) -> torch.Tensor:
        """Global stream-order mask (key dim ``P * (N/P + T/P)``) -> all-to-all key order; a local-length mask
        (``N/P + T/P``, this rank's keys) is left for the backend to all-gather, which yields that order."""
        local, full = video_local + text_local, world * (video_local + text_local)
        if mask.shape[-1] == local:
            return mask
        if mask.shape[-1] != full:
            raise ValueError(
                f"HunyuanVideoJointAttnProcessor: attention_mask has {mask.shape[-1]} keys, expected {full} "
                f"(global: {world} ranks x ({video_local} video + {text_local} text)) or {local} (this rank's); "
                "fix: pass HunyuanVideoTransformer3DModel an encoder_attention_mask [B, T] of the (padded) text, "
                "and split the streams with sp_diffusers' HunyuanVideo plan"
            )
        mask = _to_all_to_all_order(mask, -1, video_local, text_local, world)
        if mask.dim() >= 2 and mask.shape[-2] == full:  # a [.., S_q, S_kv] mask: queries are ordered likewise
            mask = _to_all_to_all_order(mask, -2, video_local, text_local, world)
        return mask


def _local_first_frame_tokens(block: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Forward pre-hook of HunyuanVideo's token-replace blocks (I2V, ``image_condition_type="token_replace"``).

    Those blocks modulate the first ``num_tokens`` video tokens (the first latent frame) differently from the
    rest. Under a sequence split this rank holds global video tokens ``[r * N/P, (r + 1) * N/P)``, so its
    first-frame count is ``clamp(num_tokens - r * N/P, 0, N/P)``. ``N/P`` is read from the RoPE tables, which
    the plan splits before any block runs (the block's own ``hidden_states`` is still global at block 0).
    """
    cp = _block_cp(block)
    if cp is None or cp.ulysses_degree * cp.ring_degree == 1:
        return None
    import torch.distributed as dist

    names, bound = _bound_args(block, args, kwargs)
    rope = bound.get("freqs_cis", bound.get("image_rotary_emb"))
    num_tokens = bound.get("num_tokens")
    if rope is None or num_tokens is None:
        return None
    video_local = rope[0].shape[0]  # [N/P, D] after the plan's split of the RoPE module's output
    rank = dist.get_rank(cp._flattened_mesh.get_group())
    local = min(max(int(num_tokens) - rank * video_local, 0), video_local)
    index = names.index("num_tokens")
    if index < len(args):
        args = (*args[:index], local, *args[index + 1 :])
    else:
        kwargs = {**kwargs, "num_tokens": local}
    return args, kwargs


def _hunyuan_video_plan(first_block: str = "transformer_blocks.0") -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    # Split at the first block, not at the embedders: the model builds its joint key mask from the video and
    # text lengths after embedding, which must still be the global ones. The token refiner (context_embedder)
    # thus runs on the whole text on every rank: its self-attention is masked per text token and its pooled
    # projection averages all valid tokens, both of which need the whole text; it is small. Single-stream
    # blocks receive the sharded streams from the dual-stream blocks and re-concatenate them per rank, which
    # keeps the same [video_r, text_r] key order.
    return {
        first_block: {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        # (cos, sin) tables [N, D], one row per video token in the same order: split like the video tokens
        "rope": {
            0: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
            1: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True),
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_hunyuan_video(model: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import Attention
    from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0

    blocks = (*model.transformer_blocks, *model.single_transformer_blocks)
    if not len(model.transformer_blocks) and type(model)._cp_plan is not None:
        # no dual-stream block: this model's streams first meet in a single-stream block (same inputs)
        model._cp_plan = _hunyuan_video_plan("single_transformer_blocks.0")
    if blocks:
        _check_streams_divide(blocks[0], type(model).__name__, "pass its mask as encoder_attention_mask")
    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is HunyuanVideoAttnProcessor2_0:
            module.set_processor(HunyuanVideoJointAttnProcessor())
    if model.config.image_condition_type == "token_replace":
        for block in blocks:
            if not getattr(block, "_sp_diffusers_first_frame_hook", False):
                block.register_forward_pre_hook(_local_first_frame_tokens, with_kwargs=True)
                block._sp_diffusers_first_frame_hook = True


register_plan("HunyuanVideoTransformer3DModel", _hunyuan_video_plan, _prepare_hunyuan_video)


# ---------------------------------------------------------------------------------------------- CogVideoX


class CogVideoXJointAttnProcessor:
    """``CogVideoXAttnProcessor2_0`` (CogVideoX 1.0 / 1.5 joint text-video attention) through the dispatcher.

    Same function as diffusers' processor (which calls SDPA directly, out of reach of backends and context
    parallelism): per rank the joint sequence is ``cat([text_r, video_r])`` (``[B, T/P + N/P, H, D]``), q/k get
    LayerNorm over the head dim, RoPE rotates the video part only (tables ``[N/P, D]``, split by the plan like
    the video tokens), and the all-to-all orders the keys ``[text_0, video_0, text_1, video_1, ...]``.

    CogVideoX has no text mask. Text that does not divide the SP degree is padded (zeros) and the padded keys
    masked: pass ``attention_kwargs={"encoder_hidden_states_mask": mask}`` (``[B, T]`` bool over the padded
    length) to the model, which hands it to every block's attention; the result equals the unpadded model's.
    """

    _attention_backend = None
    _parallel_config = None

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from diffusers.models.attention_dispatch import dispatch_attention_fn
        from diffusers.models.embeddings import apply_rotary_emb

        world = _cp_world(self._parallel_config)
        text_local, video_local = encoder_hidden_states.shape[1], hidden_states.shape[1]
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # [B, T/P + N/P, C]
        batch, length, _ = hidden_states.shape

        mask = None
        if attention_mask is not None:
            if encoder_hidden_states_mask is not None or world > 1:
                raise ValueError(
                    "CogVideoXJointAttnProcessor: attention_mask is only honoured without context parallelism "
                    "and without encoder_hidden_states_mask (got "
                    f"{world} sequence shards, encoder_hidden_states_mask "
                    f"{'set' if encoder_hidden_states_mask is not None else 'None'}); fix: mask padded text "
                    "with encoder_hidden_states_mask [B, T] in attention_kwargs"
                )
            # what diffusers' processor does with it: a per-head [B, H, S_q, S_kv] mask
            mask = attn.prepare_attention_mask(attention_mask, length, batch)
            mask = mask.view(batch, attn.heads, -1, mask.shape[-1])
        elif encoder_hidden_states_mask is not None:
            mask = _text_key_mask(
                encoder_hidden_states_mask, text_local, video_local, world, True, type(self).__name__
            )

        query = attn.to_q(hidden_states).unflatten(-1, (attn.heads, -1))  # [B, S, H, D]
        key = attn.to_k(hidden_states).unflatten(-1, (attn.heads, -1))
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        if attn.norm_q is not None:
            query = attn.norm_q(query)  # LayerNorm over D: per token and head, layout-independent
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            # RoPE on the video tokens only (text keeps no position), as diffusers' in-place slice assignment
            query = torch.cat(
                [
                    query[:, :text_local],
                    apply_rotary_emb(query[:, text_local:], image_rotary_emb, sequence_dim=1),
                ],
                dim=1,
            )
            if not attn.is_cross_attention:
                key = torch.cat(
                    [
                        key[:, :text_local],
                        apply_rotary_emb(key[:, text_local:], image_rotary_emb, sequence_dim=1),
                    ],
                    dim=1,
                )

        out = dispatch_attention_fn(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=0.0,
            is_causal=False,
            backend=self._attention_backend,
            parallel_config=self._parallel_config,
        )
        out = out.flatten(2, 3).to(query.dtype)  # [B, S, H * D]
        out = attn.to_out[1](attn.to_out[0](out))
        text_out, video_out = out.split([text_local, length - text_local], dim=1)
        return video_out, text_out


def _cogvideox_plan() -> dict:
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

    # CogVideoXPatchEmbed embeds text and video together into one [B, T + N, C] sequence (adding sincos positions
    # on CogVideoX-2b), and the model then slices it into the two streams with the global text length. So the
    # streams are split where they enter the first block, each along its own sequence dim (a split of the joint
    # sequence would cut it at the wrong place for every rank but the first).
    return {
        "transformer_blocks.0": {
            "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
            "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
        },
        # RoPE (CogVideoX-5b, 1.5) arrives as a model input, (cos, sin) [N, D] in video-token order, and is
        # handed unchanged to every block: split it at each block like the video tokens (None on CogVideoX-2b).
        "transformer_blocks.*": {
            "image_rotary_emb": [
                ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),
                ContextParallelInput(split_dim=0, expected_dims=2, split_output=False),
            ],
        },
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


def _prepare_cogvideox(model: torch.nn.Module) -> None:
    from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0

    for module in model.modules():
        if isinstance(module, Attention) and type(module.processor) is CogVideoXAttnProcessor2_0:
            module.set_processor(CogVideoXJointAttnProcessor())
    if not len(model.transformer_blocks):
        return
    _check_streams_divide(
        model.transformer_blocks[0],
        type(model).__name__,
        "pass the mask as attention_kwargs={'encoder_hidden_states_mask': mask} (CogVideoX-2b's sincos "
        "positions fix the text length at max_text_seq_length: there, choose a degree that divides it)",
    )


register_plan("CogVideoXTransformer3DModel", _cogvideox_plan, _prepare_cogvideox)

__all__ += ["CogVideoXJointAttnProcessor", "HunyuanVideoJointAttnProcessor"]
