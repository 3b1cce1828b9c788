"""``sp-diffusers plan --rl --compile blocks``: the compiled iteration is the eager one with each compute term
divided by its speedup (the forwards without grad by ``--compile-speedup``, default 1.5; training by
``--compile-train-speedup``, default 1) and the communication unchanged, so less of the gathers hides behind the
compute, and the rewards' exposed time follows the compiled rollout. Checked on the time model directly (no trace:
CI time); ``tests/test_plan_cond.py`` runs one ``plan --rl --compile blocks`` through the command line."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from sp_diffusers.planner.hardware import compute_scaled
from sp_diffusers.planner.iteration import (
    COMPILE_SPEEDUP,
    Pieces,
    RLKnobs,
    exposed_reward_seconds,
    iteration_seconds,
)
from sp_diffusers.planner.models import PlanError

# one rollout forward and one training micro-step, eager (hardware.step_seconds' terms)
FORWARD = {"compute": 2.0, "sp_comm": 0.5, "fsdp_comm": 1.8, "total": 2.5}
STEP = {"compute": 1.0, "sp_comm": 0.2, "fsdp_comm": 0.8, "total": 1.2}
GATHER = 1.8  # every parameter gathered once: hidden behind 2 s of eager compute, not behind 2 / 1.5 s


def _rl(**kw) -> RLKnobs:
    return RLKnobs(**{"num_steps": 4, "trained_steps": 2, "group_size": 4, "prompts_per_rank": 2, **kw})


def test_the_default_is_eager_and_unchanged():
    rl = _rl()
    assert rl.compile == "off" and rl.forward_speedup == 1.0 and rl.train_speedup == 1.0
    assert rl.compile_speedup == COMPILE_SPEEDUP == 1.5 and rl.compile_train_speedup == 1.0
    for held in (True, False):
        eager = iteration_seconds(FORWARD, STEP, GATHER, rl, 2, held)
        # speedups given to an eager run change nothing (the command refuses them without --compile)
        assert iteration_seconds(FORWARD, STEP, GATHER, _rl(compile_speedup=3.0, compile_train_speedup=2.0), 2, held) == eager
        assert eager["rollout"] == 4 * (2.0 + 0.5) + (0.0 if held else 4 * 0.0)  # 1.8 s of gathers all hidden
        assert eager["train"] == 8 // 2 * 2 * 1.2


@pytest.mark.parametrize("held", [True, False])
def test_compiled_forwards_divide_compute_and_keep_the_communication(held):
    rl = _rl(compile="blocks")
    seconds = iteration_seconds(FORWARD, STEP, GATHER, rl, 2, held)
    compute = 2.0 / 1.5
    exposed = GATHER - compute  # the gathers compute no longer hides
    assert seconds["rollout"] == pytest.approx(4 * (compute + 0.5) + (exposed if held else 4 * exposed))
    micro_batches = 8 // 2
    old = 2 * (compute + 0.5 + (0.0 if held else micro_batches * exposed))
    assert seconds["old_log_probs"] == pytest.approx(old)
    # training at the default --compile-train-speedup 1: the eager micro-steps
    assert seconds["train"] == iteration_seconds(FORWARD, STEP, GATHER, _rl(), 2, held)["train"] == 8 * 1.2
    assert seconds["total"] == pytest.approx(sum(seconds[k] for k in ("rollout", "old_log_probs", "reward", "train")))
    # train.compile: model is predicted as blocks
    assert iteration_seconds(FORWARD, STEP, GATHER, _rl(compile="model"), 2, held) == seconds


def test_a_compiled_training_step_scales_only_its_compute():
    rl = _rl(compile="blocks", compile_train_speedup=2.0)
    seconds = iteration_seconds(FORWARD, STEP, GATHER, rl, 2, True)
    # 1 s of compute -> 0.5; the 0.2 s of SP exchange stays; 0.8 s of FSDP collectives: 0.3 s no longer hidden
    assert seconds["train"] == pytest.approx(8 * (0.5 + 0.2 + 0.3))
    scaled = compute_scaled(STEP, 2.0)
    assert scaled == pytest.approx({"compute": 0.5, "sp_comm": 0.2, "fsdp_comm": 0.8, "total": 1.0})
    assert compute_scaled(STEP, 1.0) == STEP
    # a step whose exposed terms include other collectives (total > compute + sp + hidden fsdp) keeps them
    other = {"compute": 1.0, "sp_comm": 0.2, "fsdp_comm": 0.0, "total": 1.5}
    assert compute_scaled(other, 4.0)["total"] == pytest.approx(0.25 + 0.5)
    # a factor below 1 is a slower compiled step, predicted as such
    assert compute_scaled(STEP, 0.5)["total"] == pytest.approx(2.0 + 0.2)


def test_the_rewards_exposed_time_follows_the_compiled_rollout():
    """4 s of rewards in 4 chunks: an eager 8 s rollout (and 4 s of old log-probs) hides them all; compiled at 4x, a
    2 s rollout does not: chunk i sampled at 0.5 i s, each scored in 1 s, the last done at 4.5 s, 1.5 s after the
    rollout and the old log-probs."""
    forward = {"compute": 2.0, "sp_comm": 0.0, "fsdp_comm": 0.0}
    rl = _rl(reward_seconds=0.5, chunks=4)
    eager = iteration_seconds(forward, {"total": 0.5}, 0.0, rl, 2, True)
    assert eager["rollout"] == 8.0 and eager["reward"] == 0.0
    compiled_rl = dataclasses.replace(rl, compile="blocks", compile_speedup=4.0)
    compiled = iteration_seconds(forward, {"total": 0.5}, 0.0, compiled_rl, 2, True)
    assert compiled["rollout"] == 2.0 and compiled["old_log_probs"] == 1.0
    assert compiled["reward"] == exposed_reward_seconds(2.0, 1.0, compiled_rl) == 1.5


@pytest.mark.parametrize(
    "field, flag", [("compile_speedup", "--compile-speedup"), ("compile_train_speedup", "--compile-train-speedup")]
)
@pytest.mark.parametrize("value", [0.0, -1.5, math.nan, math.inf, True])
def test_a_bad_factor_is_one_clear_error(field, flag, value):
    with pytest.raises(PlanError) as err:
        _rl(compile="blocks", **{field: value}).check(2, False)
    message = str(err.value)
    assert message.startswith(f"{flag} {value!r} is invalid") and "> 0" in message and "fix:" in message


def test_an_unknown_compile_mode_is_refused():
    with pytest.raises(PlanError, match=r"--compile 'fast': choose off, blocks or model"):
        _rl(compile="fast").check(2, False)


def _cli_error(capsys, *argv: str) -> str:
    from sp_diffusers.cli import USAGE_ERROR, main

    assert main(["plan", *argv]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert err.count("error:") == 1, err
    return err


BASE = ("--model", "qwen-image", "--height", "512", "--width", "512", "--gpus", "4", "--lora-rank", "8")
RL = ("--rl", "--num-steps", "4", "--group-size", "4", "--batch", "2")


def test_the_command_line_refuses_what_it_cannot_predict(capsys):
    err = _cli_error(capsys, *BASE, *RL, "--compile-speedup", "2")
    assert "--compile-speedup 2 applies to a compiled run; fix: add --compile blocks" in err
    err = _cli_error(capsys, *BASE, *RL, "--compile-train-speedup", "1.2")
    assert "--compile-train-speedup 1.2 applies to a compiled run; fix: add --compile blocks" in err
    err = _cli_error(capsys, *BASE, "--compile", "blocks")
    assert "--compile blocks predicts the RL iteration; fix: add --rl" in err
    err = _cli_error(capsys, *BASE, "--compile-speedup", "2")
    assert "--compile-speedup predicts the RL iteration; fix: add --rl" in err
    err = _cli_error(capsys, *BASE, *RL, "--compile", "blocks", "--compile-speedup", "0")
    assert "--compile-speedup 0.0 is invalid: a finite factor > 0" in err
    err = _cli_error(capsys, *BASE, *RL, "--compile", "blocks", "--compile-train-speedup", "nan")
    assert "--compile-train-speedup nan is invalid" in err
    from sp_diffusers.cli import main

    with pytest.raises(SystemExit):  # argparse's choices
        main(["plan", *BASE, *RL, "--compile", "fast"])
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_the_command_line_carries_the_knobs(capsys):
    import argparse

    from sp_diffusers.planner.command import add_arguments, request_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    rl = request_from_args(parser.parse_args([*BASE, *RL])).rl
    assert (rl.compile, rl.forward_speedup, rl.train_speedup) == ("off", 1.0, 1.0)
    rl = request_from_args(parser.parse_args([*BASE, *RL, "--compile", "blocks"])).rl
    assert (rl.compile, rl.forward_speedup, rl.train_speedup) == ("blocks", 1.5, 1.0)
    argv = [*BASE, *RL, "--compile", "model", "--compile-speedup", "1.2", "--compile-train-speedup", "1.1"]
    rl = request_from_args(parser.parse_args(argv)).rl
    assert (rl.compile, rl.forward_speedup, rl.train_speedup) == ("model", 1.2, 1.1)
    assert "torch.compile and Diffusers" in parser.format_help()


def test_the_table_json_notes_and_keys_say_it_is_compiled(capsys):
    """The iteration's JSON, the table, the notes and the trainer's keys, from a layout composed without a trace."""
    from sp_diffusers.planner.command import plan_to_json, print_iterations, selection
    from sp_diffusers.planner.hardware import hardware
    from sp_diffusers.planner.models import resolve_model
    from sp_diffusers.planner.planner import LayoutPlan, Plan, PlanRequest, _iteration, _notes
    from sp_diffusers.planner.shapes import workload_from_tokens
    from sp_diffusers.planner.trace import Measure

    spec = resolve_model("qwen-image")
    work = workload_from_tokens(spec, 1024, 2)
    pieces = {f.name: {} for f in dataclasses.fields(Pieces)}
    rollout = Measure({}, int(4e15), {("fsdp", 4): 2e9, ("sp", 2): 1e8})
    step = {"compute": 1.0, "sp_comm": 0.1, "fsdp_comm": 0.5, "total": 1.1}
    layouts = {}
    for mode in ("off", "blocks"):
        rl = _rl(compile=mode, compile_train_speedup=1.25)
        req = PlanRequest(spec, work, 4, hardware("h100"), lora_rank=8, rl=rl)
        it = _iteration(req, 2, pieces, rollout, step, True, False)
        layouts[mode] = LayoutPlan(2, 1, 2, True, step=step, fits=True, iteration=it)
        plan = Plan(req, [layouts[mode]], layouts[mode], _notes(req))
        data = json.loads(json.dumps(plan_to_json(plan, 1.0)))
        got = data["recommended"]["iteration"]
        speedups = (1.5, 1.25) if mode == "blocks" else (1.0, 1.0)
        assert (got["compile"], got["compile_speedup"], got["compile_train_speedup"]) == (mode, *speedups)
        assert ("train.compile" in data["recommended"]["config_keys"]) == (mode == "blocks")
        compiled_note = [n for n in data["notes"] if n.startswith("compiled (--compile blocks)")]
        assert len(compiled_note) == (mode == "blocks")
        print_iterations(plan, None)
        table = capsys.readouterr().out
        assert ("compiled (train.compile: blocks)" in table) == (mode == "blocks")
    assert selection(layouts["blocks"], req)["config_keys"]["train.compile"] == "blocks"
    off, on = (layouts[m].iteration["seconds"] for m in ("off", "blocks"))
    assert on["rollout"] < off["rollout"] and on["train"] == pytest.approx(off["train"] * (0.8 + 0.1 + 0.0) / 1.1)
    assert "1.5" in compiled_note[0] and "6.7 s -> 4.5 s" in compiled_note[0]
