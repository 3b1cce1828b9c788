"""The prompt cache: each unique prompt through the text encoder once, the same encodings as encoding directly."""

from __future__ import annotations

import pytest
import torch

from sp_diffusers.flowgrpo.models.conditioning import PromptEncoder
from sp_diffusers.flowgrpo.models.prompt_cache import PromptCache
from sp_diffusers.flowgrpo.models.text import ByteTextEncoder


class _Counting:
    """A text encoder that counts what it encodes; SD3-like: dense embeddings and a pooled vector per prompt."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def encode_batch(self, prompts: list[str], prefix: str = "") -> dict:
        self.seen += prompts
        embeds = torch.stack([torch.full((3, 2), float(len(p))) for p in prompts])
        return {
            f"{prefix}prompt_embeds": list(embeds),
            f"{prefix}prompt_embeds_mask": [torch.ones(3, dtype=torch.bool)] * len(prompts),
            f"{prefix}pooled_prompt_embeds": embeds[:, 0] * 2,
        }


def test_each_prompt_is_encoded_once_and_read_back_unchanged():
    encoder = ByteTextEncoder()
    cache = PromptCache(encoder, limit_mb=16)
    prompts = ["a red cube", "a blue sphere", "a red cube", "a red cube"]
    first = cache.encode_batch(prompts)
    again = cache.encode_batch(list(reversed(prompts)), prefix="negative_")
    assert cache.encoded == 2  # two unique prompts, encoded in the first call only
    direct = encoder.encode_batch(["a red cube", "a blue sphere"])
    for i, j in enumerate([0, 1, 0, 0]):
        assert torch.equal(first["prompt_embeds"][i], direct["prompt_embeds"][j])
        assert torch.equal(first["prompt_embeds_mask"][i], direct["prompt_embeds_mask"][j])
    assert torch.equal(again["negative_prompt_embeds"][2], direct["prompt_embeds"][1])  # reversed: cube, cube, sphere


def test_pooled_embeddings_are_kept_per_prompt_and_the_limit_evicts_oldest_first():
    encoder = _Counting()
    entry_bytes = 3 * 2 * 4 + 3 + 2 * 4  # embeds, mask, pooled
    cache = PromptCache(encoder, limit_mb=2.5 * entry_bytes / 2**20)  # room for two prompts
    out = cache.encode_batch(["x", "yy", "x"])
    assert torch.equal(out["pooled_prompt_embeds"], torch.tensor([[2.0, 2.0], [4.0, 4.0], [2.0, 2.0]]))
    cache.encode_batch(["zzz"])  # pushes out "x", the least recently used
    cache.encode_batch(["yy", "x"])
    assert encoder.seen == ["x", "yy", "zzz", "x"]
    with pytest.raises(ValueError, match=r"text\.cache_mb=.* holds 2 of the run's 3 prompts; fix: text\.cache_mb="):
        cache.encode_all(["x", "yy", "zzz"])


def test_no_cache_encodes_every_batch():
    encoder = _Counting()
    cache = PromptCache(encoder, limit_mb=0)
    cache.encode_batch(["x", "x"])
    cache.encode_batch(["x"])
    assert encoder.seen == ["x", "x", "x"]


def test_a_prepared_encoder_pads_every_prompt_to_the_run_s_length():
    encoder = PromptEncoder(ByteTextEncoder(), None, negative=True, cache_mb=16)
    rows = ["ab", "a longer prompt"]
    encoder.prepare(rows, lambda n: 32)
    assert encoder.cache.encoded == 3  # both prompts and CFG's empty prompt, before any batch

    class Row:
        def __init__(self, prompt: str) -> None:
            self.prompt = prompt

    cond, sources = encoder.encode([Row("ab")], repeat=2)
    assert sources is None and encoder.cache.encoded == 3
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        assert [tuple(e.shape) for e in cond[key]] == [(32, 32)] * 2
        mask = cond[f"{key}_mask"][0]
        assert mask.shape == (32,) and mask.sum() < 32 and not mask[-1]
    unpadded = ByteTextEncoder().encode_batch(["ab"])["prompt_embeds"][0]
    # encoded beside longer prompts (another GEMM shape): equal to a few fp32 ulps of these O(1) values
    torch.testing.assert_close(cond["prompt_embeds"][0][: unpadded.shape[0]], unpadded, atol=1e-5, rtol=1e-5)
    assert not cond["prompt_embeds"][0][unpadded.shape[0] :].any()


def test_an_image_conditioned_row_is_encoded_once_and_read_back_in_order():
    """ConditionCache: each row (prompt and images) through the encoders once; a batch of kept and new rows comes
    back in its own order, every per-row entry (tensors and lists) intact; the limit evicts oldest first."""
    from sp_diffusers.flowgrpo.io.data import PromptRow
    from sp_diffusers.flowgrpo.models.prompt_cache import ConditionCache

    calls: list[list[str]] = []

    def encode_rows(rows):
        calls.append([r.prompt for r in rows])
        n = len(rows)
        code = torch.tensor([float(len(r.prompt) + len(r.images[0])) for r in rows])
        return {
            "prompt_embeds": [torch.full((len(r.prompt), 2), float(len(r.prompt))) for r in rows],
            "condition_latents": code.view(n, 1, 1).expand(n, 3, 4).contiguous(),
            "source_pixels": code.to(torch.uint8).view(n, 1).expand(n, 5).contiguous(),
        }

    a, b, c = PromptRow("a cat", images=("x.png",)), PromptRow("a dog", images=("y.png",)), PromptRow("a cat", images=("z.png",))
    cache = ConditionCache(limit_mb=1.0)
    first = cache.encode([a, b, a], encode_rows)
    second = cache.encode([c, b, a], encode_rows)  # c: the same prompt with another image is another row
    assert calls == [["a cat", "a dog"], ["a cat"]] and cache.encoded == 3
    uncached = ConditionCache(limit_mb=0.0).encode([c, b, a], encode_rows)
    for key, value in uncached.items():
        if torch.is_tensor(value):
            assert torch.equal(second[key], value), key
        else:
            assert all(torch.equal(x, y) for x, y in zip(second[key], value, strict=True)), key
    assert torch.equal(first["condition_latents"][0], first["condition_latents"][2])  # one row, twice
    tiny = ConditionCache(limit_mb=1e-4)  # ~100 bytes: one row at a time
    calls.clear()
    tiny.encode([a], encode_rows), tiny.encode([b], encode_rows), tiny.encode([a], encode_rows)
    assert calls == [["a cat"], ["a dog"], ["a cat"]]  # a was pushed out by b
