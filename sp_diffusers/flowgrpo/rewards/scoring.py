"""Scoring a rollout with a set of rewards: split over the SP group, decoded once, checked, agreed on by every rank.

The ranks of an SP group hold the same B samples. Scoring each of them on every rank would run every reward model
P times; instead SP rank r scores its own slice ``tensor_split(range(B), P)[r]`` (decoding only those latents, once,
and only when some reward reads pixels), then one all-gather in the SP group gives every rank all B scores. A
rollout in chunks (``rollout.chunks``) scores each chunk's share as the chunk is done, in a background thread
(``overlap.py``: no collective there), and gathers the shares once after the rollout (``RewardSet.combine``).

A reward that raises, returns the wrong shape or a non-finite value on any rank: after scoring, every rank of the
world learns it (one small all-gather of a flag; the messages only on failure) and raises the same ``RewardError``
naming the reward's function, the rank, what went wrong and the fix, so no rank waits in the next collective (and
``sp-diffusers train`` prints it once, as it prints a configuration error).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ...parallel.devices import to_device
from ...parallel.ledger import comm_kind
from .features import Features
from .loading import RewardSpec
from .remote import RewardServerError

__all__ = ["RewardError", "RewardSet", "Scorer", "Scores", "Share"]


class RewardError(RuntimeError):
    """A reward failed on some rank; every rank raises it with the same message."""


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


_SHAPE_FIX = "return one float per sample it is given (a [b] tensor, array or list)"
_FINITE_FIX = "return finite scores (guard its divisions and logs, or clamp what it returns)"


def _raised_fix(err: BaseException, where: str) -> str:
    """The fix for a reward that raised: the function at ``where``; a missing key may be a field the data lacks."""
    fix = f"the function{where} (called as fn(pixels or latents, prompts, metadata, **kwargs))"
    if isinstance(err, KeyError):
        fix += (
            "; a key your prompt rows lack? metadata is each data.train / data.eval row's fields other than the "
            "prompt (a .jsonl line's; {} for a .txt file)"
        )
    return fix


def _as_scores(out: Any, count: int, spec: RewardSpec) -> tuple[torch.Tensor | None, str | None]:
    """``out`` as a float64 CPU ``[count]`` tensor, or why it is not one (with the fix)."""
    try:
        t = torch.as_tensor(out.detach() if torch.is_tensor(out) else out).to("cpu", torch.float64)
    except Exception as err:
        return None, (
            f"returned {type(out).__name__}, not one float per sample ({type(err).__name__}: {err}); fix: {_SHAPE_FIX}"
        )
    if t.shape != (count,):
        return None, f"returned shape {tuple(t.shape)}; it must return one float per sample: shape [{count}]; fix: {_SHAPE_FIX}"
    bad = (~torch.isfinite(t)).nonzero().flatten().tolist()
    if bad:
        return None, (
            f"returned non-finite values ({t[bad].tolist()}) for sample(s) {bad} of this rank's {count}; fix: {_FINITE_FIX}"
        )
    return t, None


@dataclass(frozen=True)
class Scores:
    """A batch scored: the weighted total ``[B]`` (float32), each reward's ``[B]`` by name and, where the run reads
    them (``RewardSet.features``), each sample's features ``[B, D]`` (float64); identical on SP peers."""

    total: torch.Tensor
    each: dict[str, torch.Tensor]
    features: torch.Tensor | None = None


class RewardSet:
    """``specs`` scored together: ``__call__(latents, prompts, metadata) -> Scores`` on CPU.

    Args:
        specs: the loaded rewards (``reward_loading.reward_specs``).
        reward_view: the final latents -> what ``input: latents`` rewards read (``adapter.reward_view``).
        decode: the final latents ``[b, ...]`` -> pixels in [0, 1] (``decode.PixelDecoder``); None without a VAE.
        engine: gives the SP group, this rank's place in it and the device collectives use (None: one process).
        features: each sample's features, computed beside the rewards from the same pixels (``features.py``).
        audio: the final latents -> waveforms ``[b, channels, samples]`` (LTX-2's ``ltx2.AudioDecoder``, whose
            ``sample_rate`` is read): a pixel reward's metadata rows then carry ``"audio"`` (``[channels, samples]``
            float32 in [-1, 1]) and ``"audio_sample_rate"``.
    """

    def __init__(
        self,
        specs: Sequence[RewardSpec],
        reward_view: Callable[[torch.Tensor], torch.Tensor],
        decode: Callable[[torch.Tensor], torch.Tensor] | None = None,
        engine: Any = None,
        features: Features | None = None,
        audio: Any = None,
    ) -> None:
        self.specs = list(specs)
        self.reward_view, self.decode, self.engine, self.features = reward_view, decode, engine, features
        self.audio = audio
        self.wants_pixels = any(s.input == "pixels" for s in self.specs)
        from ..config import ConfigError

        if self.wants_pixels and decode is None:
            names = ", ".join(s.label for s in self.specs if s.input == "pixels")
            raise ConfigError(
                f"flowgrpo.rewards: {names} read(s) pixels, but this run has no VAE to decode them; fix: "
                "model.pipeline=<a diffusers pipeline folder with a vae>, or input: latents"
            )
        if features is not None and features.input == "pixels" and decode is None:
            raise ConfigError(
                "flowgrpo.gardo.features: an image model reads pixels, but this run has no VAE to decode them; fix: "
                "model.pipeline=<a diffusers pipeline folder with a vae>, or flowgrpo.gardo.features=latents"
            )

    @classmethod
    def from_config(
        cls,
        config: Any,
        adapter: Any,
        engine: Any = None,
        decode: Any = None,
        features: Features | None = None,
        audio: Any = None,
    ) -> RewardSet:
        """``flowgrpo.rewards`` (else the built-in ``flowgrpo.reward``); pixels from ``decode`` (a ``PixelDecoder``),
        waveforms from ``audio`` (LTX-2's ``AudioDecoder``)."""
        from .loading import reward_specs

        g = config.flowgrpo
        return cls(reward_specs(g.rewards, g.reward), adapter.reward_view, decode, engine, features, audio)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def _layout(self) -> tuple[int, int, Any]:
        e = self.engine
        if e is None or getattr(e, "sp_group", None) is None:
            return 0, 1, None
        return e.sp_rank, e.sp_size, e.sp_group

    def _collective_device(self) -> torch.device:
        if dist.is_initialized() and dist.get_backend() == "nccl":
            return self.engine.device
        return torch.device("cpu")

    def score_local(
        self, latents: torch.Tensor, prompts: list[str], metadata: list[dict], features: bool = True
    ) -> tuple[torch.Tensor, str | None]:
        """This rank's slice scored by every reward: ``[b, R]`` float64 (then the ``[b, D]`` features, where
        ``features`` and the set computes them), or the first failure's message."""
        count = latents.shape[0]
        embed = self.features if features else None
        width = embed.width(latents) if embed is not None else 0
        out = torch.zeros(count, len(self.specs) + width, dtype=torch.float64)
        if count == 0:
            return out, None
        pixels = None
        if self.wants_pixels or (embed is not None and embed.input == "pixels"):
            try:
                with torch.no_grad():
                    pixels = self.decode(latents)
            except Exception as err:
                return out, (
                    f"decoding the latents with the pipeline's VAE raised {type(err).__name__}: {err}{_where(err)}; fix: "
                    "a VAE of the model's family (model.pipeline's own); out of memory: a smaller "
                    "flowgrpo.micro_batch_size (the batch it decodes at once)"
                )
        rows = list(metadata)
        if self.audio is not None and self.wants_pixels:
            try:
                with torch.no_grad():
                    waves = self.audio(latents).cpu()
            except Exception as err:
                return out, (
                    f"decoding the audio with the pipeline's audio VAE and vocoder raised {type(err).__name__}: {err}"
                    f"{_where(err)}; fix: model.pipeline's own audio_vae and vocoder; out of memory: a smaller "
                    "flowgrpo.micro_batch_size"
                )
            rate = int(self.audio.sample_rate)
            rows = [{**row, "audio": wave, "audio_sample_rate": rate} for row, wave in zip(rows, waves, strict=True)]
        view = self.reward_view(latents) if any(s.input == "latents" for s in self.specs) else None
        for j, spec in enumerate(self.specs):
            data = pixels if spec.input == "pixels" else view
            try:
                with torch.no_grad():
                    result = spec.fn(data, list(prompts), list(rows), **spec.kwargs)
            except RewardServerError as err:  # its message names the server and the fix
                return out, f"reward {spec.label}: {err}"
            except Exception as err:
                where = _where(err)
                return out, f"reward {spec.label} raised {type(err).__name__}: {err}{where}; fix: {_raised_fix(err, where)}"
            scores, problem = _as_scores(result, count, spec)
            if problem:
                return out, f"reward {spec.label} {problem}"
            out[:, j] = scores
        if embed is not None:
            try:
                feats = embed(pixels if embed.input == "pixels" else self.reward_view(latents))
            except Exception as err:
                return out, (
                    f"the image features (flowgrpo.gardo.features) raised {type(err).__name__}: {err}{_where(err)}; "
                    "fix: a vision model folder transformers' AutoModel loads (DINOv2, DINOv3)"
                )
            if feats.shape != (count, width) or not torch.isfinite(feats).all():
                return out, (
                    f"the image features (flowgrpo.gardo.features) came out {tuple(feats.shape)} (finite: "
                    f"{bool(torch.isfinite(feats).all())}), not [{count}, {width}] and finite; fix: a vision model whose "
                    "output has pooler_output or last_hidden_state"
                )
            out[:, len(self.specs) :] = feats
        return out, None

    def _agree(self, problem: str | None) -> None:
        """Every rank raises the same ``RewardError`` when any rank's scoring failed (one flag all-gather)."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            if problem:
                raise RewardError(f"flowgrpo.rewards: {problem}")
            return
        from ...parallel.gathers import gather_ints

        flags = gather_ints([int(problem is not None)], dist.group.WORLD, self._collective_device())
        failed = [rank for rank, (flag,) in enumerate(flags) if flag]
        if not failed:
            return
        messages: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(messages, problem)
        first = failed[0]
        more = f" (failing ranks: {failed})" if len(failed) > 1 else ""
        what, _, fix = str(messages[first]).partition("; fix: ")
        raise RewardError(f"flowgrpo.rewards: on rank {first}{more}, {what}; every rank stops; fix: {fix}")

    def score_share(
        self, latents: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None, features: bool = True
    ) -> Share:
        """This SP rank's share of the samples given (a batch, or a chunk of one) scored, with no collective: what a
        background thread may run while the next chunk samples (``combine`` then gathers the shares). ``features``:
        the samples' features too, where the set computes them."""
        batch = latents.shape[0]
        if len(prompts) != batch:
            raise ValueError(f"RewardSet: {batch} samples but {len(prompts)} prompts")
        metadata = list(metadata) if metadata is not None else [{} for _ in range(batch)]
        sp_rank, sp_size, _ = self._layout()
        mine = _shares(batch, sp_size)[sp_rank]
        try:
            local, problem = self.score_local(latents[mine], prompts[mine], metadata[mine], features)
        except Exception as err:  # reward_view, a cast: every rank must still reach combine's agreement
            width = self.features.width(latents) if features and self.features is not None else 0
            local = torch.zeros(mine.stop - mine.start, len(self.specs) + width, dtype=torch.float64)
            problem = f"scoring raised {type(err).__name__}: {err}{_where(err)}; fix: see the error"
        return Share(batch, local, problem)

    def combine(self, shares: Sequence[Share]) -> Scores:
        """The consecutive pieces' shares as the batch's :class:`Scores` (CPU), identical on SP peers: one agreement
        on failure, one all-gather in the SP group (the features ride in the scores' rows)."""
        problem = next((s.problem for s in shares if s.problem), None)
        self._agree(problem)
        _, sp_size, group = self._layout()
        scores = torch.cat([s.local for s in shares])
        if sp_size > 1:
            # every SP rank's rows of the batch, piece by piece (the same table on every rank)
            rows: list[list[int]] = [[] for _ in range(sp_size)]
            offset = 0
            for share in shares:
                for q, part in enumerate(_shares(share.count, sp_size)):
                    rows[q] += range(offset + part.start, offset + part.stop)
                offset += share.count
            longest = max(len(r) for r in rows)
            device = self._collective_device()
            send = torch.zeros(longest, scores.shape[1], dtype=torch.float64, device=device)
            send[: scores.shape[0]] = scores.to(device)
            parts = [torch.empty_like(send) for _ in range(sp_size)]
            with comm_kind("data"):
                dist.all_gather(parts, send, group=group)
            scores = torch.empty(offset, send.shape[1], dtype=torch.float64)
            for q, part in enumerate(parts):
                scores[rows[q]] = part[: len(rows[q])].cpu()
        r = len(self.specs)
        weights = torch.tensor([s.weight for s in self.specs], dtype=torch.float64)
        total = (scores[:, :r] * weights).sum(dim=1).float()
        features = scores[:, r:] if scores.shape[1] > r else None
        return Scores(total, {s.name: scores[:, j].float() for j, s in enumerate(self.specs)}, features)

    def __call__(
        self, latents: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None, features: bool = True
    ) -> Scores:
        """The batch's :class:`Scores` (CPU), identical on SP peers."""
        return self.combine([self.score_share(latents, prompts, metadata, features)])


@dataclass(frozen=True)
class Share:
    """One SP rank's scores ``local [b, R (+ D)]`` (float64, CPU: the rewards, then the features where they are
    computed) of its share of ``count`` samples, or the first failure's message."""

    count: int
    local: torch.Tensor
    problem: str | None


def _shares(count: int, sp_size: int) -> list[slice]:
    """Each SP rank's consecutive share of ``count`` samples (``tensor_split``'s sizes)."""
    base, extra = divmod(count, sp_size)
    bounds = [0]
    for q in range(sp_size):
        bounds.append(bounds[-1] + base + (q < extra))
    return [slice(bounds[q], bounds[q + 1]) for q in range(sp_size)]


class Scorer:
    """The iteration's rewards of the final latents: :class:`Scores` on the latents' device, split over the SP group
    and identical on its ranks. ``override`` (``reward(latents, prompts) -> [B]``, given to
    the trainer) replaces the configured ``rewards``; an image-conditioned family's rewards read each sample's source
    images in its metadata (``conditioning.with_sources``)."""

    def __init__(self, rewards: RewardSet, reward_view: Callable[[torch.Tensor], torch.Tensor], override: Any = None):
        self.rewards, self.reward_view, self.override = rewards, reward_view, override

    def share(
        self,
        final: torch.Tensor,
        prompts: list[str],
        metadata: list[dict] | None = None,
        source_pixels: torch.Tensor | None = None,
        features: bool = True,
    ) -> Share:
        """This rank's share of ``final``'s samples scored by the configured rewards (no collective)."""
        from ..models.conditioning import with_sources

        metadata = with_sources(metadata, source_pixels, final.shape[0])
        return self.rewards.score_share(final, prompts, metadata, features)

    def combine(self, shares: Sequence[Share], device: torch.device) -> Scores:
        s = self.rewards.combine(shares)
        return Scores(to_device(s.total, device), to_device(s.each, device), to_device(s.features, device))

    def __call__(
        self,
        final: torch.Tensor,
        prompts: list[str],
        metadata: list[dict] | None = None,
        source_pixels: torch.Tensor | None = None,
        features: bool = True,
    ) -> Scores:
        """``features``: the samples' features too, where the run reads them (not for evaluation)."""
        if self.override is not None:
            return Scores(self.override(self.reward_view(final), prompts).float(), {})
        return self.combine([self.share(final, prompts, metadata, source_pixels, features)], final.device)
