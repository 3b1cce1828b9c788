"""The planner predicts the RL iteration's communication ledger that the trainer counts, to the byte.

The trainer runs a real iteration on gloo ranks (tiny Qwen-Image with ragged prompts, so its text shards unevenly;
tiny Wan, a video with fixed-length text) and counts every collective (``sp_diffusers.parallel.ledger``); the planner runs
the same class at the same layout on fake tensors (``plan/iteration.py``) and composes the iteration from its
pieces. Compared: the model's phases (rollout, old log-probs, train forward and backward, optimizer), every kind,
calls and bytes, exactly; rank 0's view (ranks of an uneven text send different bytes, and the planner is rank 0).
The trainer's second iteration on the same batch is compared: a text length's uneven layouts are learned once per
process (a handful of small gathers in the first forward that meets it), and the planner predicts the steady state.
The trainer's own exchanges outside the model (batch broadcast, reward gathers) are not predicted.
"""

from __future__ import annotations

import functools

import pytest

from ._dist import run_distributed

MODEL_PHASES = ("rollout", "old_log_probs", "train_forward", "train_backward", "optimizer", "reference")
STEPS, GROUP, PROMPTS, MICRO, WINDOW = 8, 4, 2, 2, 2  # tests/workers/engine_steps._config: micro 2, window 2

CASES = {
    # name: (kind, world, cfg scale, rollout.gather_params, parallel.dp_replicate[, update.gather_params])
    "qwenimage-sp2-cfg-held": ("qwenimage", 2, 4.0, "always", 1),
    "qwenimage-sp2-update-held": ("qwenimage", 2, 1.0, "always", 1, "always"),
    "qwenimage-sp2-per-step": ("qwenimage", 2, 1.0, "never", 1),
    "wan-sp2": ("wan", 2, 1.0, "auto", 1),
    "qwenimage-dp2-sp2-cfg": ("qwenimage", 4, 4.0, "always", 1),
    "qwenimage-hsdp2-sp2": ("qwenimage", 4, 1.0, "always", 2),  # HSDP: the SP group shards, two replicas
    "wan-dp2-sp2-cfg": ("wan", 4, 4.0, "always", 1),
}


@functools.cache
def _counted(kind: str, world: int) -> dict:
    runs = {
        name: {
            "num_steps": STEPS,
            "cfg_scale": cfg,
            "window_range": [1, 2],
            "rollout": {"gather_params": gather},
            "parallel": {"dp_replicate": replicate},
            "update": {"gather_params": update[0] if update else "never"},
        }
        for name, (k, w, cfg, gather, replicate, *update) in CASES.items()
        if (k, w) == (kind, world)
    }
    return run_distributed("tests.workers.iteration_checks:iteration_ledgers", world, 2, kind, runs)[0]


def _predicted(
    kind: str, world: int, cfg: float, gather: str, replicate: int, update: str, text_len: int
) -> dict[str, tuple[int, int]]:
    from sp_diffusers.planner.iteration import RLKnobs
    from sp_diffusers.planner.ledger_prediction import predict_iteration_ledger
    from sp_diffusers.planner.models import FAMILIES, ModelSpec
    from sp_diffusers.planner.shapes import Workload
    from sp_diffusers.tiny.specs import tiny_model_config

    spec = ModelSpec(f"tiny-{kind}", kind, tiny_model_config(kind, num_layers=2), FAMILIES[kind])
    grid = (2, 4, 4) if kind == "wan" else (1, 4, 4)  # latent 8 x 8 (2 frames for Wan), patch 2
    rl = RLKnobs(STEPS, cfg > 1, WINDOW, GROUP, PROMPTS, gather, update)
    work = Workload(MICRO, grid, text_len)
    ledger = predict_iteration_ledger(
        spec, work, world, 2, rl, held=gather != "never", replicate=replicate, update_held=update == "always"
    )
    return {f"{phase}/{k}": v for (phase, k), v in ledger.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_the_planner_predicts_the_counted_ledger_to_the_byte(case):
    kind, world, cfg, gather, replicate, *update = CASES[case]
    counted = _counted(kind, world)[case]
    assert counted["gathered_once"] is (gather != "never")
    mine = {k: tuple(v) for k, v in counted["steady"].items() if k.split("/")[0] in MODEL_PHASES}
    predicted = _predicted(kind, world, cfg, gather, replicate, (update or ["never"])[0], counted["text_len"])
    assert predicted == mine
    kinds = {k.split("/")[1] for k in mine}
    assert {"param_gather", "grad_reduce", "activation", "agreement"} <= kinds  # every kind is held, not a few


@pytest.fixture(scope="module")
def edit_folder(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    # written once, before the ranks start (a save_pretrained on rank 1 writes no weights: tests/test_engine.py)
    return str(save_tiny_pipeline("qwenimage-edit", tmp_path_factory.mktemp("edit"), num_layers=2))


def test_the_planner_predicts_a_conditioned_iteration_to_the_byte(edit_folder):
    """An edit family: a real QwenImageEditPipeline folder, its prompts read with their image (ragged text), the
    condition image's tokens after the noisy ones at the output's size, CFG in one forward. The planner's
    conditioned workload (``ModelSpec.condition = "edit"``, ``Workload.condition_tokens``) predicts the counted
    model phases exactly, as for the text-to-image families."""
    import json
    from pathlib import Path

    from sp_diffusers.planner.iteration import RLKnobs
    from sp_diffusers.planner.ledger_prediction import predict_iteration_ledger
    from sp_diffusers.planner.models import FAMILIES, ModelSpec
    from sp_diffusers.planner.shapes import Workload

    rows = str(Path(__file__).resolve().parent.parent / "examples" / "data" / "edit_train.jsonl")
    runs = {"edit-sp2-cfg": {"num_steps": STEPS, "cfg_scale": 4.0, "window_range": [1, 2]}}
    counted = run_distributed("tests.workers.iteration_checks:conditioned_ledgers", 2, 2, edit_folder, rows, runs)[0]
    counted = counted["edit-sp2-cfg"]
    assert counted["condition_tokens"] == counted["noisy_tokens"] == 16  # 64 x 64 px, 8x VAE, 2 x 2 patches
    config = {k: v for k, v in json.loads(Path(edit_folder, "transformer", "config.json").read_text()).items()
              if not k.startswith("_")}
    spec = ModelSpec("tiny-qwen-image-edit", "qwenimage", config, FAMILIES["qwenimage"], condition="edit")
    rl = RLKnobs(STEPS, True, WINDOW, GROUP, PROMPTS, "always", "never")
    work = Workload(MICRO, (1, 4, 4), counted["text_len"], condition_tokens=counted["condition_tokens"])
    ledger = predict_iteration_ledger(spec, work, 2, 2, rl, held=True)
    predicted = {f"{phase}/{k}": v for (phase, k), v in ledger.items()}
    mine = {k: tuple(v) for k, v in counted["steady"].items() if k.split("/")[0] in MODEL_PHASES}
    assert predicted == mine
    assert {"param_gather", "grad_reduce", "activation"} <= {k.split("/")[1] for k in mine}


def test_an_uneven_text_length_is_learned_once():
    """The first iteration learns the uneven layouts (small agreement gathers in the rollout); the second has none,
    and otherwise both iterations move the same."""
    first, steady = (_counted("qwenimage", 2)["qwenimage-sp2-per-step"][k] for k in ("ledger", "steady"))
    assert "rollout/agreement" in first and "rollout/agreement" not in steady
    assert first["rollout/param_gather"] == steady["rollout/param_gather"]


def test_the_rewards_exposed_time_follows_the_chunk_pipeline():
    """plan --rl's reward phase: all of the rewards' time after the rollout with one chunk; with C chunks what a
    pipeline of C equal pieces leaves after the rollout and the old log-probs."""
    from sp_diffusers.planner.iteration import RLKnobs, exposed_reward_seconds, iteration_seconds
    from sp_diffusers.planner.models import PlanError

    rl = RLKnobs(group_size=4, prompts_per_rank=2, reward_seconds=0.5)  # 8 samples: 4 s of rewards
    assert exposed_reward_seconds(8.0, 1.0, rl) == 4.0
    # 4 chunks of a 8 s rollout: chunk i sampled at 2i s, scored in 1 s; the last done at 9 s = rollout + old
    assert exposed_reward_seconds(8.0, 1.0, RLKnobs(**{**rl.__dict__, "chunks": 4})) == 0.0
    # rewards slower than the rollout: the scoring queues (2 chunks of a 4 s rollout, 4 s each to score)
    slow = RLKnobs(**{**rl.__dict__, "chunks": 2, "reward_seconds": 1.0})  # 8 s of rewards
    assert exposed_reward_seconds(4.0, 0.5, slow) == (2.0 + 4.0 + 4.0) - 4.5
    forward = {"compute": 1.0, "sp_comm": 0.0, "fsdp_comm": 0.0}
    seconds = iteration_seconds(forward, {"total": 0.5}, 0.0, RLKnobs(**{**rl.__dict__, "num_steps": 8}), 4, True)
    assert seconds["reward"] == 4.0 and seconds["total"] == pytest.approx(8 + 2 + 4 + 2 * 2 * 0.5)
    with pytest.raises(PlanError, match=r"--chunks 9 is invalid: an int in \[1, 8\]"):
        RLKnobs(**{**rl.__dict__, "chunks": 9}).check(4, False)


def test_the_lagged_update_hides_the_rewards_behind_the_next_iteration():
    """plan --rl --lag 1 (update.lag): a rollout's scoring runs from its end through its old log-probs, the
    previous rollout's update and the next rollout with its old log-probs; only what outlasts them is exposed."""
    from sp_diffusers.planner.iteration import RLKnobs, exposed_reward_seconds, iteration_seconds
    from sp_diffusers.planner.models import PlanError

    rl = RLKnobs(group_size=4, prompts_per_rank=2, reward_seconds=0.5, lag=1)  # 8 samples: 4 s of rewards
    assert exposed_reward_seconds(2.0, 0.25, rl, train=1.0) == 4.0 - (2.0 + 0.5 + 1.0)
    assert exposed_reward_seconds(8.0, 1.0, rl, train=2.0) == 0.0
    forward = {"compute": 1.0, "sp_comm": 0.0, "fsdp_comm": 0.0}
    seconds = iteration_seconds(forward, {"total": 0.5}, 0.0, RLKnobs(**{**rl.__dict__, "num_steps": 2}), 4, True)
    # rollout 2 s, old log-probs 2 s, train 2 micro-batches x 2 steps x 0.5 s: 2 + 2 x 2 + 2 = 8 s hide 4 s
    assert seconds["reward"] == 0.0 and seconds["total"] == pytest.approx(2 + 2 + 2)
    with pytest.raises(PlanError, match=r"--chunks 2 with --lag 1"):
        RLKnobs(**{**rl.__dict__, "chunks": 2}).check(4, False)
    with pytest.raises(PlanError, match=r"--lag 2 is invalid"):
        RLKnobs(**{**rl.__dict__, "lag": 2}).check(4, False)
