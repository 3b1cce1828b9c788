"""Z-Image's forwards read nothing back from the device.

``ZImagePipeline`` hands its transformer each caption's valid rows only (a list of ``[L_i, D]``), so the adapter needs
each row's length as a host int. The trainer counts them on the host when a batch is made (``PromptEncoder``, from
the CPU masks) and carries them beside the text (``prompt_embeds_lengths``) through the engine's padding and
broadcast, CFG's stacked branches, rollout chunks and the micro-batches; the adapter cuts each row with them (a view).
Cutting by the mask instead (``e[mask]``) reads the mask on the host: one sync per caption per forward.

Counted with the hot-path canary's recorder (``workers/hot_path.py``: every op that reads tensor data on the host,
boolean indexing included), attributed to sp_diffusers' own code, inside every velocity the trainer computes: the
rollout (CFG batched and as two forwards, in chunks), the recomputed old log-probs, the update and the evaluation.
The numbers are those of the mask path, bit for bit, and the captions those the pipeline hands its transformer.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from .workers.hot_path import Recorder


@contextlib.contextmanager
def _forwards_recorded(monkeypatch):
    """``(recorder, calls)``: host reads inside each velocity (adapter inputs, engine forward, output) recorded."""
    from sp_diffusers.flowgrpo import update
    from sp_diffusers.flowgrpo.sampling import denoise

    rec, calls, main = Recorder(), [], threading.get_ident()

    def counted(fn):
        def velocity(*args, **kwargs):
            outer, rec.tag["pass"] = rec.tag["pass"], "forward"
            calls.append(1)
            try:
                return fn(*args, **kwargs)
            finally:
                rec.tag["pass"] = outer

        return velocity

    for module in (denoise, update):
        monkeypatch.setattr(module, "velocity", counted(module.velocity))

    def host_read(fn, name):
        def read(self, *args, **kwargs):
            # only ever recorded inside a forward, and on this thread (rollout.chunks scores chunks on another)
            if threading.get_ident() == main:
                rec.add("sync", op=f"Tensor.{name}", ours=True)
            return fn(self, *args, **kwargs)

        return read

    for name in ("tolist", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, host_read(getattr(torch.Tensor, name), name))
    with rec:
        yield rec, calls


def _ours(rec: Recorder) -> list[str]:
    return [e["op"] for e in rec.events if e["kind"] == "sync" and e["ours"]]


def _trainer(tmp_path, cfg_batch: bool):
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.kind, c.model.overrides = "zimage", {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1  # one process, no process group
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 3, 1, [0, 1]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = 2, 2, 2
    c.flowgrpo.cfg_scale, c.flowgrpo.recompute_old_log_probs = 2.0, True
    c.rollout.chunks, c.rollout.cfg_batch = 2, cfg_batch
    c.train.progress, c.train.plot, c.train.out_dir = False, False, str(tmp_path / "run")
    data = tmp_path / "train.txt"
    data.write_text("a red cat\na blue teapot on a wooden table\n")  # both in each batch: ragged text
    c.data.train = str(data)
    torch.manual_seed(0)
    return FlowGRPOTrainer(c)


@pytest.mark.parametrize("cfg_batch", [True, False])
def test_a_zimage_iteration_makes_no_host_read_in_any_forward(tmp_path, monkeypatch, cfg_batch):
    from sp_diffusers.flowgrpo.io.data import PromptRow
    from sp_diffusers.flowgrpo.models.zimage import ZImageAdapter

    trainer = _trainer(tmp_path, cfg_batch)
    rows = [PromptRow("a red cat"), PromptRow("a blue teapot on a wooden table")]
    assert isinstance(trainer.adapter, ZImageAdapter) and trainer.prompt_encoder.lengths
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    for prefix in ("", "negative_"):  # on the host beside the dense text: each row's valid tokens, first
        lengths, mask = (
            batch.cond[f"{prefix}prompt_embeds_lengths"],
            batch.cond[f"{prefix}prompt_embeds_mask"],
        )
        assert lengths == mask.sum(dim=1).tolist() and all(mask[i, :n].all() for i, n in enumerate(lengths))
    assert len(set(batch.cond["prompt_embeds_lengths"])) == 2  # ragged: the padding must be cut

    with _forwards_recorded(monkeypatch) as (rec, calls):
        traj, advantages, old_log_probs, _ = trainer.collect(
            batch
        )  # rollout in 2 chunks, recomputed log-probs
        assert _ours(rec) == [] and calls, _ours(rec)
        rollout_calls = len(calls)
        trainer.update(batch, traj, advantages, old_log_probs)
        assert len(calls) > rollout_calls
        final, _ = trainer.evaluator.render(rows, [0, 1])  # eval and sample grids: denoise in micro-batches
        assert _ours(rec) == [], _ours(rec)

    # the same numbers as cutting by the mask (each forward then reads it on the host), bit for bit
    again = _trainer(tmp_path, cfg_batch)
    again.prompt_encoder.lengths = False
    other = again.iteration_batch(0).prepared(again.engine)
    assert "prompt_embeds_lengths" not in other.cond
    with _forwards_recorded(monkeypatch) as (rec, _):
        traj_mask, _, old_mask, _ = again.collect(other)
        assert "aten.index.Tensor" in _ours(rec)  # the canary sees the mask read
    assert torch.equal(traj_mask.final, traj.final) and torch.equal(old_mask, old_log_probs)
    trainer.prompt_encoder.lengths = False  # the same trained weights, cut by the mask
    final_mask, _ = trainer.evaluator.render(rows, [0, 1])
    assert torch.equal(final_mask, final)


def test_zimage_captions_are_the_pipeline_s_with_host_lengths(tmp_path):
    """The trainer's text (``PromptEncoder`` with lengths, padded as the engine pads for SP 4, CFG's branches stacked)
    cut by the adapter with the host lengths: the captions ``ZImagePipeline`` hands its transformer, bit for bit, and
    no host read."""
    from diffusers import ZImagePipeline

    from sp_diffusers.flowgrpo.build import build_text_encoder
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.conditioning import PromptEncoder
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline
    from sp_diffusers.flowgrpo.sampling.guidance import paired
    from sp_diffusers.parallel.padding import pad_text_batch
    from sp_diffusers.tiny import save_tiny_pipeline

    prompts = ["a red cat", "a blue teapot on a table"]
    folder = save_tiny_pipeline("zimage", tmp_path / "zimage", num_layers=1)
    pipe = ZImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    calls = []
    hook = pipe.transformer.register_forward_pre_hook(lambda m, args: calls.append(args[2]))
    pipe(
        prompt=list(prompts),
        num_inference_steps=1,
        height=16,
        width=16,
        guidance_scale=2.0,
        max_sequence_length=128,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    )
    hook.remove()
    want = calls[0]  # [pos..., neg...]: the valid rows of each caption

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.text.max_sequence_length = str(folder), 8, 128
    resolve_pipeline(c)
    adapter = build_adapter(load_transformers(c)["transformer"], 8, True, 1, 128)

    class Row:
        def __init__(self, prompt: str) -> None:
            self.prompt = prompt

    encoder = PromptEncoder(build_text_encoder(c, torch.device("cpu")), None, negative=True, lengths=True)
    cond, _ = encoder.encode([Row(p) for p in prompts])
    for key in ("prompt_embeds", "negative_prompt_embeds"):
        cond[key], cond[f"{key}_mask"] = pad_text_batch(cond[key], cond[f"{key}_mask"], 4, key)
    both = paired(cond)
    rec = Recorder()
    rec.tag["pass"] = "forward"
    with rec:
        got = adapter.inputs(
            torch.zeros(adapter.latent_shape(4)),
            torch.tensor(500.0),
            both["prompt_embeds"],
            both["prompt_embeds_mask"],
            lengths=both["prompt_embeds_lengths"],
        )["cap_feats"]
    assert _ours(rec) == [], _ours(rec)
    assert len(got) == len(want) == 4
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and torch.equal(g, w)


def test_the_lengths_follow_every_slice_of_the_batch():
    from sp_diffusers.flowgrpo.batch import IterationBatch
    from sp_diffusers.flowgrpo.models.conditioning import text_lengths

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    cond = {
        "prompt_embeds": torch.randn(3, 3, 2),
        "prompt_embeds_mask": mask,
        "prompt_embeds_lengths": [2, 1, 3],
    }
    batch = IterationBatch(
        prompts=["a", "b", "c"], cond=cond, group_ids=torch.arange(3), latents=torch.zeros(3)
    )
    part = batch.cond_of(torch.tensor([2, 0]))  # host indices, as the micro-batches are
    assert part["prompt_embeds_lengths"] == [3, 2] and torch.equal(part["prompt_embeds_mask"], mask[[2, 0]])
    assert batch.cond_of(slice(1, 3))["prompt_embeds_lengths"] == [1, 3]  # a rollout chunk
    with pytest.raises(
        ValueError, match=r"host lists \['prompt_embeds_lengths'\].*fix: pass the host indices"
    ):
        batch.cond_of(torch.tensor([0], device="meta"))  # indices on a device would have to be read back
    assert text_lengths(mask) == [2, 1, 3] and text_lengths(list(mask)) == [2, 1, 3]
    with pytest.raises(ValueError, match=r"prompt_embeds_mask row 0 has padding between its valid tokens"):
        text_lengths([torch.tensor([True, False, True])])
