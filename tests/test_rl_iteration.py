"""The RL iteration at SP 2 on real gloo ranks: weights gathered once per rollout, classifier-free guidance in one
forward, and the communication ledger that shows both.

Tolerances. Gathering once changes no arithmetic (the same weights, the same kernels): equal bit for bit. The
batched CFG forward pads the shorter (empty) text with masked keys; a masked key adds exact zeros to the softmax,
but its sums then run over more terms, so each branch's velocity may differ by a few ulp: within ``1e-5`` of the
velocity's magnitude (a relative fp32 tolerance; ~2e-7 relative was measured). Guidance forms ``v_u + s (v_c - v_u)``,
which amplifies a branch's difference by up to ``2s - 1``, and the Euler steps integrate the velocity over
``sum |dt| = 1``: so the final latents stay within ``(2s - 1) 1e-5 max|v|``; log-probs are evaluated at stored
latents and differ by the rounding of one guided step (``1e-5`` absolute covers it, 2.4e-7 measured).
"""

from __future__ import annotations

import functools

import pytest
import torch

from ._dist import run_distributed

CFG = 4.0
KINDS = ["qwenimage", "sd3", "flux", "wan"]  # masked text (Qwen-Image, SD3), fixed-length text (FLUX.1, Wan)


@functools.cache
def _modes():
    return run_distributed("tests.workers.iteration_checks:rollout_modes", 2, 2, KINDS)


RUNS = {
    "n8": {"num_steps": 8},
    "n16": {"num_steps": 16},
    "n8_cfg": {"num_steps": 8, "cfg_scale": CFG},
    # today's iteration before this change: a gather per step, CFG as two forwards
    "n8_cfg_per_step": {"num_steps": 8, "cfg_scale": CFG, "rollout": {"gather_params": "never", "cfg_batch": False}},
}


@functools.cache
def _ledgers():
    return run_distributed("tests.workers.iteration_checks:iteration_ledgers", 2, 2, "qwenimage", RUNS)


def _total(ledger: dict, kind: str, what: int, phase: str = "") -> int:
    return sum(v[what] for k, v in ledger.items() if k.endswith("/" + kind) and k.startswith(phase))


@pytest.mark.parametrize("kind", KINDS)
def test_gathered_once_and_batched_cfg_roll_out_what_per_step_two_forwards_do(kind):
    for rank in _modes():
        r = rank[kind]
        assert r["text_lengths"][0] != r["text_lengths"][1] or kind in ("wan", "flux"), "the two texts must differ"
        branches = r["branches"]
        tol_v = 1e-5 * max(1.0, branches["scale"])
        assert branches["cond"] <= tol_v and branches["uncond"] <= tol_v, branches
        for mode, diffs in r["diffs"].items():
            if "cfg_batch=False" in mode:  # gathered once or per step: bit for bit
                assert all(d == 0.0 for d in diffs.values()), (mode, diffs)
                continue
            assert diffs["final"] <= (2 * CFG - 1) * tol_v, (mode, diffs)
            assert diffs["log_probs"] <= 1e-5 and diffs["old"] <= 1e-5, (mode, diffs)


def test_parameter_gathers_do_not_grow_with_steps_or_cfg():
    ledgers = {name: r["ledger"] for name, r in _ledgers()[0].items()}
    gathers = {name: _total(ledger, "param_gather", 1) for name, ledger in ledgers.items()}
    # gathered once per rollout: the rollout's gathers are the same at 8 and 16 steps, with CFG or without
    rollout = {name: _total(ledger, "param_gather", 1, "rollout/") for name, ledger in ledgers.items()}
    assert rollout["n8"] == rollout["n16"] == rollout["n8_cfg"] > 0, rollout
    assert "old_log_probs/param_gather" not in ledgers["n8"]  # the recompute reads the held weights
    assert gathers["n16"] <= 1.05 * gathers["n8"] and gathers["n8_cfg"] <= 1.05 * gathers["n8"], gathers
    # one forward per step with CFG: as many exchanges (of twice the tokens) as without
    calls = {name: _total(ledger, "activation", 0) for name, ledger in ledgers.items()}
    assert calls["n8_cfg"] <= 1.1 * calls["n8"], calls
    # and the iteration before: every step gathers every block, twice with CFG
    before = ledgers["n8_cfg_per_step"]
    assert _total(before, "param_gather", 0, "rollout/") >= 2 * 8 * 2  # 8 steps x 2 forwards x 2 blocks
    assert _total(before, "param_gather", 1) > 2 * gathers["n8_cfg"]


def test_the_ranks_ledgers_agree_and_auto_gathers_on_this_host():
    results = _ledgers()
    for name in RUNS:
        mine, peer = results[0][name]["ledger"], results[1][name]["ledger"]
        assert {k: v[0] for k, v in mine.items()} == {k: v[0] for k, v in peer.items()}, name  # the same calls
        for key, (_, nbytes) in mine.items():  # the same bytes, but where a ragged text shards unevenly
            assert nbytes == peer[key][1] or key.endswith("/activation"), (name, key)
        expected = RUNS[name].get("rollout", {}).get("gather_params", "auto") != "never"
        assert results[0][name]["gathered_once"] is expected, name  # auto: the tiny model fits the host
    assert results[0]["n8_cfg"]["reward_mean"] == pytest.approx(results[0]["n8_cfg_per_step"]["reward_mean"], abs=1e-5)


@pytest.fixture(scope="module")
def wan22_folder(tmp_path_factory):
    from sp_diffusers.tiny import save_tiny_pipeline

    return str(save_tiny_pipeline("wan2.2", tmp_path_factory.mktemp("wan22"), num_layers=2))


def test_a_frozen_expert_is_sharded_and_rolls_out_as_one_process(wan22_folder):
    """Wan2.2's expert that is not trained is FSDP-sharded like the trained one (no gradients, no optimizer): a
    rank holds its own rows of every parameter (torch.chunk of dim 0, FSDP2's rule), where it held a whole copy -
    1/2 of the expert at SP 2 but for the tiny model's few parameters of 1 or 3 rows; Wan2.2-A14B's every matrix
    divides by 8, so 1/8 on 8 GPUs. Its steps of the rollout equal one process's (the 1e-4 of
    tests/test_engine.py's rollout check: 6 steps compound the forward's rounding)."""
    ref = run_distributed("tests.workers.iteration_checks:frozen_expert", 1, wan22_folder)[0]
    for r in run_distributed("tests.workers.iteration_checks:frozen_expert", 2, wan22_folder):
        assert r["frozen"] and not r["optimizer"] and not r["grads"]
        assert "transformer" in r["route"] and "transformer_2" in r["route"]  # both experts ran
        assert r["rank_bytes"] == r["chunk_bytes"] < 0.7 * r["full_bytes"], (r["rank_bytes"], r["full_bytes"])
        assert (r["final"] - ref["final"]).abs().max().item() <= 1e-4
    assert ref["rank_bytes"] == ref["full_bytes"]  # one process: the whole expert


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_an_update_on_held_weights_is_the_update_and_gathers_once(lora):
    """update.gather_params: always holds the gathered weights over an optimizer step's micro-steps (and their
    backwards): the same arithmetic on the same weights, so the parameters after the step are equal bit for bit,
    and the update's parameter gathers drop to one per module (the first forward), none in backward."""
    for r in run_distributed("tests.workers.iteration_checks:update_modes", 2, 2, lora):
        per_block, held = r[False], r[True]
        assert held["held"] is True and per_block["held"] is False
        assert held["loss"] == per_block["loss"]
        for name, value in per_block["params"].items():
            assert torch.equal(held["params"][name], value), name
        gathers = {k: v for k, v in held["ledger"].items() if k.endswith("/param_gather")}
        # each module gathered once at most (2 blocks and the root, which the old log-probs' forward left gathered)
        assert list(gathers) == ["train_forward/param_gather"] and gathers["train_forward/param_gather"][0] <= 3
        before = per_block["ledger"]
        assert before["train_backward/param_gather"][0] > 0 and before["train_forward/param_gather"][0] > 3
        assert held["ledger"]["train_backward/grad_reduce"] == before["train_backward/grad_reduce"]


def test_the_ema_follows_flow_grpo_s_decay_schedule():
    """flow_grpo's EMAModuleWrapper, re-implemented in fp64: decay min((1 + s) / (10 + s), 0.9), applied when
    (s + 1) % interval == 0, ema += (1 - decay) (p - ema); the first and last steps of two intervals."""
    from sp_diffusers.engine.ema import ParameterEMA

    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))
    ema = ParameterEMA({"w": p}, decay=0.9, interval=8)
    ref = torch.zeros(3, dtype=torch.float64)
    for s in range(20):
        with torch.no_grad():
            p.add_(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
        ema.step(s)
        if (s + 1) % 8 == 0:
            ref = ref + (1 - min((1 + s) / (10 + s), 0.9)) * (p.detach() - ref)
        assert torch.equal(ema.averages["w"], ref), s
    assert not torch.equal(ema.averages["w"], p.detach())
    with ema.swapped():
        assert torch.equal(p.detach(), ref)
    assert not torch.equal(p.detach(), ref)  # put back


def test_the_ema_is_checkpointed_resumed_and_exported(tmp_path):
    """flowgrpo.ema at SP 2: the moving average is saved with the checkpoint and resumed exactly, and
    `sp-diffusers export` writes the average (what the run evaluated), not the last parameters."""
    from sp_diffusers.flowgrpo.io.export import export_run

    results = run_distributed("tests.workers.iteration_checks:ema_run", 2, str(tmp_path / "run"))
    for r in results:
        first, resumed = r["first"], r["resumed"]
        assert first["step"] == resumed["step"] == 2
        for name, average in first["averages"].items():
            assert torch.equal(resumed["averages"][name], average), name
            assert torch.equal(resumed["params"][name], first["params"][name]), name
        moved = max((first["averages"][n] - first["params"][n]).abs().max().item() for n in first["params"])
        assert moved > 1e-4  # the average lags the parameters
    exported = export_run(tmp_path / "run", tmp_path / "export")
    from safetensors.torch import load_file

    weights = {}
    for f in exported.transformers["transformer"].glob("*.safetensors"):
        weights.update(load_file(str(f)))
    first = results[0]["first"]
    for name, average in first["averages"].items():
        assert torch.equal(weights[name].float(), average.float()), name
