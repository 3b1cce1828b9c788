"""Qwen-Image-Edit-Plus (2509 / 2511) on rows with different numbers of condition images (1 to 3) in one run.

The Qwen-Image transformer has no mask over image tokens, so rows of different counts cannot share a forward by
padding: a batch carries its condition tokens zero-padded to its largest count with ``condition_counts`` (host ints,
one per row), and ``sampling/denoise.velocity`` runs one forward per count and puts the velocities back in row order
(``condition_groups``: the counts of every rank's batch, so that ranks run the same forwards).

- against the pipeline: each row of a mixed batch gets the velocity ``QwenImageEditPlusPipeline`` computes for that
  row alone (its own transformer inputs); tolerance ``1e-5 max|v|`` absolute: fp32 rounding only (the single rows
  share a group forward with nobody here, but their text is padded to the batch's longest prompt, masked keys in a
  longer softmax sum, and the batch's GEMMs need not sum in the single row's order);
- a batch of one count is the forward it always was, bit for bit; CFG in one forward equals the two forwards;
- the trainer at SP 2 on 2 gloo ranks on rows of 1, 2 and 3 images with CFG: finite rewards and loss, and update
  micro-batches that mix counts;
- no host read in any forward of the mixed batch (the hot-path canary);
- a 4th image is refused with one line naming the row.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from ._dist import run_distributed
from ._engine import OneProcessEngine
from .test_pipeline_io_cond import AREA, PROMPT, _image, _load, _record

ROOT = Path(__file__).resolve().parent.parent
FAMILY = "qwenimage-edit-plus"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    return save_tiny_pipeline(FAMILY, tmp_path_factory.mktemp("edit-plus") / FAMILY, num_layers=1)


def _rows(tmp_path: Path, counts=(1, 2, 3)):
    from sp_diffusers.flowgrpo.io.data import read_prompts

    for i in range(max(counts)):
        _image(64, 128, seed=i).save(tmp_path / f"src{i}.png")
    lines = [
        json.dumps({"prompt": PROMPT, "images": [f"src{i}.png" for i in range(n)]}) for n in counts
    ]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return read_prompts(tmp_path / "rows.jsonl")


def _parts(folder, rows):
    from sp_diffusers.flowgrpo.build import build_text_encoder, run_schedule
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.flowgrpo.models.conditioning import build_conditioning
    from sp_diffusers.flowgrpo.models.pipeline_io import load_transformers, resolve_pipeline

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.image_width = str(folder), 8, 16
    c.model.condition_area, c.text.max_sequence_length, c.flowgrpo.num_steps = AREA, 512, 3
    resolve_pipeline(c)
    model = load_transformers(c)["transformer"].eval()
    text = build_text_encoder(c, torch.device("cpu"))
    adapter, encoder = build_conditioning(c, model, text, build_adapter(model, 8, True, 2, 512, image_width=16), rows)
    return c, model, adapter, encoder, run_schedule(c, adapter)


def _dense(batch, prefixes=("",)):
    from sp_diffusers.parallel.padding import pad_text_batch

    cond = {k: v for k, v in batch.items() if k.startswith("condition_")}
    for p in prefixes:
        cond[f"{p}prompt_embeds"], cond[f"{p}prompt_embeds_mask"] = pad_text_batch(
            batch[f"{p}prompt_embeds"], batch[f"{p}prompt_embeds_mask"], 1, "prompt_embeds"
        )
    return cond


def test_each_row_of_a_mixed_batch_gets_the_pipelines_velocity_for_it_alone(folder, tmp_path, monkeypatch):
    from sp_diffusers.flowgrpo.models.conditioning import with_sources
    from sp_diffusers.flowgrpo.sampling.denoise import velocity

    rows = _rows(tmp_path)
    _, model, adapter, encoder, schedule = _parts(folder, rows)
    assert adapter.images_per_row == 3
    pipe = _load(folder)
    alone = []  # each row's first transformer call in the pipeline, and the velocity of its noisy tokens
    for row in rows:
        images = [_image(64, 128, seed=i) for i in range(len(row.images))]
        pipe_calls, _ = _record(pipe, FAMILY, images, monkeypatch)
        call = pipe_calls[0][1]
        with torch.no_grad():
            v = model(**{**call, "return_dict": False})[0][:, : adapter.tokens]
        alone.append((call, v))

    batch = encoder.encode(rows)
    assert batch["condition_counts"] == [1, 2, 3]
    assert batch["condition_latents"].shape[1] == adapter.condition_tokens(3)  # padded to the most
    assert batch["source_pixels"].shape[:2] == (3, 3)
    sources = with_sources([r.metadata for r in rows], batch["source_pixels"], 3)  # what rewards read: each row's own
    assert [len(m["source_images"]) for m in sources] == [1, 2, 3]
    cond = _dense(batch)
    x = torch.cat([call["hidden_states"][:, : adapter.tokens] for call, _ in alone])
    engine = OneProcessEngine(model)
    with torch.no_grad():
        got = velocity(engine, adapter, x, schedule.timesteps[0], cond)
    assert len(engine.calls) == 3  # one forward per count
    # each group's forward: the pipeline's row, its own sequence (the prompt with its images: a longer text for more)
    for (call, _), ours in zip(alone, engine.calls, strict=True):
        assert ours["img_shapes"] == call["img_shapes"]
        torch.testing.assert_close(ours["hidden_states"], call["hidden_states"], atol=1e-5, rtol=0)
    for i, (_, v) in enumerate(alone):
        torch.testing.assert_close(got[i : i + 1], v, atol=1e-5 * float(v.abs().max()), rtol=0, msg=f"row {i}")


def test_one_count_is_one_forward_bit_for_bit_and_cfg_pairs_the_groups(folder, tmp_path):
    from sp_diffusers.flowgrpo.sampling.denoise import velocity

    rows = _rows(tmp_path, (2, 1, 2, 3))
    _, model, adapter, encoder, _ = _parts(folder, rows)
    batch = encoder.encode(rows, negative=True)
    cond = _dense(batch, ("", "negative_"))
    x = torch.randn(adapter.latent_shape(4), generator=torch.Generator().manual_seed(1))
    t = torch.tensor(700.0)
    with torch.no_grad():
        # rows 0 and 2 (two images each) alone: one forward, exactly as without counts
        pick = torch.tensor([0, 2])
        two = {k: v[pick] if torch.is_tensor(v) else [v[0], v[2]] for k, v in cond.items()}
        engine = OneProcessEngine(model)
        counted = velocity(engine, adapter, x[pick], t, two)
        assert len(engine.calls) == 1
        # ... a run whose rows all have two images: its adapter's grids, no counts
        plain = {k: v for k, v in two.items() if k != "condition_counts"}
        plain["condition_latents"] = plain["condition_latents"][:, : adapter.condition_tokens(2)]
        before = dataclasses.replace(adapter, condition_grids=adapter.condition_grids[:2])
        assert torch.equal(counted, velocity(engine, before, x[pick], t, plain))
        # another rank's counts: a stand-in forward per missing count, the result unchanged
        engine.calls.clear()
        standing = velocity(engine, adapter, x[pick], t, {**two, "condition_groups": (1, 2, 3)})
        assert len(engine.calls) == 3 and torch.equal(standing, counted)
        # the mixed batch's CFG in one forward (both branches of each count together) against the two forwards
        engine.calls.clear()
        one = velocity(engine, adapter, x, t, cond, 4.0, cfg_batch=True)
        assert len(engine.calls) == 3 and [k["hidden_states"].shape[0] for k in engine.calls] == [2, 4, 2]
        split = velocity(engine, adapter, x, t, cond, 4.0, cfg_batch=False)
        torch.testing.assert_close(one, split, atol=1e-5 * float(split.abs().max()), rtol=0)
        for i in range(4):  # and each row alone
            row = {k: v[i : i + 1] for k, v in cond.items()}  # a tensor's row, a host list's item
            alone = velocity(engine, adapter, x[i : i + 1], t, row, 4.0)
            torch.testing.assert_close(one[i : i + 1], alone, atol=1e-5 * float(one.abs().max()), rtol=0)


def test_a_fourth_image_is_refused_naming_the_row(folder, tmp_path):
    from sp_diffusers.flowgrpo.config import ConfigError

    rows = _rows(tmp_path, (1, 4))
    with pytest.raises(ConfigError) as err:
        _parts(folder, rows)
    message = str(err.value)
    assert "\n" not in message and "rows.jsonl:2" in message and "4 images" in message and "at most 3" in message
    # a row past the run's most, met later (not among the rows the adapter was built for): refused when encoded
    encoder = _parts(folder, _rows(tmp_path, (1, 2)))[3]
    with pytest.raises(ConfigError, match=r"rows.jsonl:2: 3 image\(s\).*at most 2"):
        encoder.encode(_rows(tmp_path, (1, 3)))


def _config(folder: Path, data: Path, run: Path, sp: int, prompts: int = 3):
    from sp_diffusers.flowgrpo.config import TrainConfig

    c = TrainConfig()
    c.model.pipeline, c.model.image_size, c.model.condition_area = str(folder), 4, 32 * 32
    c.parallel.ulysses_sequence_parallel_size = sp
    c.data.train, c.data.eval = str(data / "train.jsonl"), str(data / "eval.jsonl")
    c.train.eval_every, c.train.sample_every, c.train.save_every, c.train.progress = 2, 0, 0, False
    c.train.plot, c.train.out_dir, c.train.iterations = False, str(run), 2
    c.flowgrpo.rewards = [{"fn": f"{ROOT / 'examples' / 'rewards' / 'simple_rewards.py'}:source_similarity"}]
    c.flowgrpo.num_steps, c.flowgrpo.window_size, c.flowgrpo.window_range = 3, 1, [0, 2]
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size, c.flowgrpo.micro_batch_size = prompts, 2, min(3, 2 * prompts)
    c.flowgrpo.cfg_scale, c.text.max_sequence_length = 4.0, 512
    c.optim.lr, c.lora.enabled, c.lora.rank, c.lora.alpha, c.lora.init = 1e-3, True, 4, 8.0, False
    return c


def _data(root: Path) -> Path:
    data = root / "data"
    shutil.copytree(ROOT / "examples" / "data" / "images", data / "images", dirs_exist_ok=True)
    names = ["images/blue.png", "images/red.png", "images/green.png"]
    prompts = ("make it red", "swap them", "mix all")
    rows = [{"prompt": p, "images": names[:n]} for p, n in zip(prompts, (1, 2, 3), strict=True)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[1:]))
    return data


def train_counting(rank: int, world: int, folder: str, data: str, run: str, sp: int, prompts: int) -> dict:
    """Two iterations of the trainer at SP ``sp`` on mixed rows; the metrics and how many velocity calls ran one
    forward per count (``_by_count``) with gradients (the update) and without (rollout, eval), and their counts."""
    from sp_diffusers.flowgrpo.sampling import denoise
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer
    from tests.workers.engine_steps import _quiet

    _quiet()
    seen = {"grad": 0, "no_grad": 0, "counts": set()}
    by_count = denoise._by_count

    def counted(forward, groups, *args):
        seen["grad" if torch.is_grad_enabled() else "no_grad"] += 1
        seen["counts"].add(tuple(c for c, r in groups if r))  # this rank's own (not its stand-ins')
        return by_count(forward, groups, *args)

    denoise._by_count = counted
    torch.manual_seed(0)
    trainer = FlowGRPOTrainer(_config(Path(folder), Path(data), Path(run), sp, prompts))
    trainer.run()
    lines = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()] if rank == 0 else []
    return {"metrics": lines, "grad": seen["grad"], "no_grad": seen["no_grad"], "counts": sorted(seen["counts"])}


@pytest.mark.parametrize(
    ("sp", "prompts"),
    [(2, 3), (1, 1)],  # SP 2: one batch on both ranks; DP 2: one row each, another count each (stand-in forwards)
    ids=["sp2", "dp2"],
)
def test_trainer_on_rows_of_1_2_and_3_images(folder, tmp_path, sp, prompts):
    data = _data(tmp_path)
    out = run_distributed(
        "tests.test_mixed_image_counts:train_counting",
        2,
        str(folder),
        str(data),
        str(tmp_path / "run"),
        sp,
        prompts,
        timeout=900,
    )
    lines = out[0]["metrics"]
    assert [m["iteration"] for m in lines] == [1, 2]
    for m in lines:
        assert -1.0 <= m["reward_mean"] < 0.0 and m["grad_norm"] > 0
        losses = [float(v) for k, v in m.items() if "loss" in k]
        assert losses and all(torch.isfinite(torch.tensor(losses))), m
    assert "eval_reward_mean" in lines[1]
    for rank in out:  # both ranks ran the same forwards
        assert rank["grad"] > 0 and rank["no_grad"] > 0 and rank["grad"] == out[0]["grad"]
        assert rank["no_grad"] == out[0]["no_grad"]
    if sp == 2:  # micro-batches of 3 of the pairs of rows with 1, 2 and 3 images: mixed
        assert any(len(c) > 1 for c in out[0]["counts"]) and out[0]["counts"] == out[1]["counts"]
    else:  # each rank's batch one row of one count: the others' counts are stand-ins
        assert all(len(c) == 1 for rank in out for c in rank["counts"])


def test_no_host_read_in_the_mixed_forwards(folder, tmp_path, monkeypatch):
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    from .test_zimage_host_sync import _forwards_recorded, _ours

    c = _config(folder, _data(tmp_path), tmp_path / "run", 1)
    c.rollout.chunks, c.flowgrpo.recompute_old_log_probs = 2, True
    torch.manual_seed(0)
    trainer = FlowGRPOTrainer(c)
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    assert sorted(batch.cond["condition_counts"]) == [1, 1, 2, 2, 3, 3]
    assert batch.cond["condition_groups"] == (1, 2, 3)
    with _forwards_recorded(monkeypatch) as (rec, calls):
        traj, advantages, old_log_probs, _ = trainer.collect(batch)
        assert _ours(rec) == [] and calls, _ours(rec)
        trainer.update(batch, traj, advantages, old_log_probs)
        trainer.evaluator.render(trainer.evaluator.eval_rows, [0, 1])
        assert _ours(rec) == [], _ours(rec)
