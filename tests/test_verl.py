"""The verl integration against the real verl 0.9.1: registry, mesh layout, ``train_batch`` parity, plugin
discovery, the trainer through verl's registry, the verl-override mapping and the vllm-omni settings.

Parity tolerances (derived in ``tests/_parity.py``), against the same ``train_batch`` (same configs, same
global batch) in one process: every gradient within ``1e-5 + 1e-4 |ref|`` (only the order of fp32 sums
differs: per-rank partial gradients, FSDP's reduce-scatter); every parameter after the AdamW step within the
bound that gradient tolerance implies through the step (AdamW eps = lr = 1e-3, no clipping: well-conditioned,
and a wrong gradient contract moves parameters by ~|g| / 2: caught); grad norm within 1e-4 relative and the
mean loss within 1e-5 relative. Multi-rank runs spawn real gloo processes with ``VERL_PLATFORM=cpu``
(sp-diffusers' CPU platform for verl).
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ._dist import run_distributed
from ._parity import PARITY_EPS, PARITY_LR, worst_grad, worst_step

# the mapping and the vllm-omni settings need no verl; everything else runs the real verl 0.9.1
needs_verl = pytest.mark.skipif(
    importlib.util.find_spec("verl") is None,
    reason="verl is installed by scripts/setup.sh (pip install 'sp-diffusers[verl]')",
)

ROOT = Path(__file__).resolve().parent.parent
ENV = {"VERL_PLATFORM": "cpu", "VERL_USE_EXTERNAL_PLUGINS": "none"}
ATOL, RTOL = 1e-5, 1e-4
LAYOUTS = {"sp2": (2, 2), "dp2_sp2": (4, 2)}  # name: (world, ulysses)


@functools.cache
def _train(world: int, sp: int, extras: bool, ring: int = 1) -> list[dict]:
    return run_distributed("tests.workers.verl_engine:train_step", world, sp, extras, ring, env=ENV)


@functools.cache
def _registry() -> dict:
    return run_distributed("tests.workers.verl_engine:registry", 1, env=ENV)[0]


def _ref() -> dict:
    return _train(1, 1, True)[0]


def _excess(a, b) -> tuple[float, float]:
    """(max of |a - b| - RTOL |b|, max |a - b|): the first must stay <= ATOL."""
    diff = (a - b).abs()
    return (diff - RTOL * b.abs()).max().item(), diff.max().item()


def _assert_step(kind: str, results: list[dict], ref: dict, label: str) -> None:
    src = [r for r in results if r["layout"]["src"]]
    losses = [loss for r in src for loss in r[kind]["losses"]]  # every micro-batch of every dp rank, once
    ref_loss = sum(ref[kind]["losses"]) / len(ref[kind]["losses"])
    assert abs(sum(losses) / len(losses) - ref_loss) <= 1e-5 * abs(ref_loss), label
    for r in results:  # SP peers computed the same micro-batch losses
        peer = next(s for s in src if s["layout"]["dp_rank"] == r["layout"]["dp_rank"])
        assert r[kind]["losses"] == pytest.approx(peer[kind]["losses"], rel=1e-6), label
        # verl's train_batch reports the grad norm on the rank that returns outputs only
        assert (r[kind]["grad_norm"] is not None) == r["layout"]["src"], label
    for r in src:
        assert r[kind]["grad_norm"] == pytest.approx(ref[kind]["grad_norm"], rel=1e-4), label
        assert r[kind]["lr"] == ref[kind]["lr"]
    params, ref_params = results[0][kind]["params"], ref[kind]["params"]
    assert set(params) == set(ref_params) and ref_params
    # a parameter outside the loss's graph has no gradient in one process and a zero one under FSDP's
    # reduce-scatter: the same step (none)
    zero = {n: torch.zeros_like(p) for n, p in ref_params.items()}
    grads, ref_grads = zero | results[0][kind]["grads"], zero | ref[kind]["grads"]
    assert len(ref[kind]["grads"]) >= 0.8 * len(ref_params)
    for name, g_ref in ref_grads.items():
        ok, err = worst_grad(grads[name], g_ref)
        assert ok, f"{label}: grad {name} off by {err:.3e}"
    for name, p_ref in ref_params.items():
        ok, err, ratio = worst_step(params[name], p_ref, ref_grads[name], PARITY_LR, PARITY_EPS)
        assert ok, f"{label}: parameter {name} after the step off by {err:.3e} ({ratio:.2f} x its bound)"


@needs_verl
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_mesh_layout_from_verl_flag(layout):
    """``FSDPEngineConfig(ulysses_sequence_parallel_size=2, strategy="fsdp2")`` alone sets the layout."""
    world, sp = LAYOUTS[layout]
    dp = world // sp
    for r in _train(world, sp, layout == "sp2"):
        lay = r["layout"]
        rank = lay["rank"]
        assert lay["mesh"] == {"dp": dp, "ring": 1, "ulysses": sp}
        assert lay["dp_size"] == dp and lay["dp_rank"] == rank // sp
        assert lay["sp_rank"] == rank % sp
        assert lay["sp_group_ranks"] == list(range(rank - rank % sp, rank - rank % sp + sp))  # adjacent
        assert lay["dp_group_ranks"] == list(range(rank % sp, world, sp))  # dp only, not the whole world
        assert lay["src"] == (rank % sp == 0)


@needs_verl
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_train_batch_matches_one_process(layout):
    world, sp = LAYOUTS[layout]
    _assert_step("full", _train(world, sp, layout == "sp2"), _ref(), f"{layout} full")


@needs_verl
def test_train_batch_ulysses_x_ring_matches_one_process():
    """verl's Ulysses flag = 2 plus ``model_config.ring_degree=2`` on 4 ranks: one sample over all four
    (dp 1), outputs from rank 0 only, and the step equals one process."""
    results = _train(4, 2, False, 2)
    for r in results:
        lay = r["layout"]
        assert lay["mesh"] == {"dp": 1, "ring": 2, "ulysses": 2}
        assert lay["dp_size"] == 1 and lay["dp_rank"] == 0 and lay["dp_group_ranks"] == [lay["rank"]]
        assert lay["sp_group_ranks"] == [0, 1, 2, 3] and lay["src"] == (lay["rank"] == 0)
    _assert_step("full", results, _train(1, 1, False)[0], "ring2_ulysses2 full")


@needs_verl
def test_train_batch_lora_matches_one_process():
    _assert_step("lora", _train(2, 2, True), _ref(), "sp2 lora")


@needs_verl
def test_infer_batch_and_both_loss_forms():
    """forward_only returns the gathered prediction [B, L, C] (same as one process on the same rows); verl's
    keyword loss and an ``engine_loss`` (sp-diffusers' form) give the same numbers."""
    ref = _ref()["infer"]
    for r in _train(2, 2, True):
        got = r["infer"]
        assert got["model_pred"].shape == ref["model_pred"].shape
        excess, err = _excess(got["model_pred"], ref["model_pred"])
        assert excess <= ATOL, f"model_pred off by {err:.3e}"
        assert got["losses"] == got["own_losses"]
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)


@needs_verl
def test_disable_adapter_gives_the_base_model():
    for r in [_ref(), *_train(2, 2, True)]:
        assert r["adapters_off_diff"] <= 1e-5  # same base weights, same layout
        assert r["adapters_on_diff"] > 1e-3  # the trained adapters do change the prediction


@needs_verl
def test_checkpoint_resume_through_verl_surface():
    for r in [_ref(), *_train(2, 2, True)]:
        ckpt = r["ckpt"]
        assert ckpt["resume_diff"] == 0.0, "load_checkpoint + the same step must reproduce the parameters"
        assert ckpt["second_exists"] and not ckpt["first_exists_after_prune"]  # max_ckpt_to_keep=1


@needs_verl
def test_lora_aware_weight_export():
    """base (base_sync_done=False), adapters only (True), merged (lora.merge): names, values, merge math."""
    import torch

    ref = _ref()["export"]
    got = _train(2, 2, True)[0]["export"]
    base, adapters, merged = got["base"], got["adapters"], got["merged"]
    assert base and all("lora_" not in k and "base_layer" not in k for k in base)
    assert adapters and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in adapters)
    assert not any(".default." in k for k in adapters)  # peft names, adapter name dropped
    assert set(merged) == set(base)
    assert got["peft_config"]["r"] == 4 and got["adapter_peft_config"] == got["peft_config"]
    assert got["merged_peft_config"] is None
    scaling = 8.0 / 4  # lora_alpha / r
    n_merged = 0
    for key, w in merged.items():
        a_key = key.removesuffix(".weight") + ".lora_A.weight"
        expected = base[key]
        if a_key in adapters:
            b = adapters[key.removesuffix(".weight") + ".lora_B.weight"]
            expected = base[key] + scaling * (b @ adapters[a_key])
            n_merged += 1
        torch.testing.assert_close(w, expected, atol=1e-6, rtol=1e-6)
    assert n_merged == len(adapters) // 2 > 0
    # The export is data movement only: the frozen base weights come out bitwise as in one process, the
    # adapters bitwise as this layout's own parameters (whose parity with one process after the AdamW step
    # test_train_batch_lora_matches_one_process checks at its derived bound).
    assert set(base) == set(ref["base"]) and set(adapters) == set(ref["adapters"])
    for key, value in ref["base"].items():
        assert torch.equal(base[key], value), key
    params = _train(2, 2, True)[0]["lora"]["params"]
    for key, value in adapters.items():
        name = key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(value, params[name]), key


@needs_verl
def test_registry_lookup_and_idempotent_registration():
    r = _registry()
    ours = "sp_diffusers.integrations.verl.engine.SPDiffusersEngine"
    expected_keys = {
        f"{t}/{b}/{d}"
        for t in ("sp_diffusers_diffusion", "diffusion_model")
        for b in ("fsdp", "fsdp2")
        for d in ("cuda", "npu", "cpu")
    }
    assert set(r["found"]) == expected_keys and set(r["found"].values()) == {ours}
    for report in (r["again"], r["reloaded"]):  # register() twice and a module reload: no AssertionError
        assert len(report["sp_diffusers_diffusion"]) == 6 and len(report["diffusion_model"]) == 6
    assert "already registed" in r["raw_duplicate"]  # what verl does on a plain duplicate
    assert (r["device"], r["backend"], r["dist_backend"]) == ("cpu", "gloo", "gloo")


@needs_verl
def test_a_model_with_several_outputs_needs_the_engine_loss_form():
    """LTX-2's transformer returns (video, audio): verl's keyword loss form, which hands the loss one model_pred
    tensor, refuses it naming the fix; an engine_loss reads both outputs and the step runs (a finite loss)."""
    r = _registry()["multi_output"]
    assert r["refused"] is not None and "LTX2VideoTransformer3DModel returns 2 outputs (tuple)" in r["refused"]
    assert "fix: a loss fn(engine, batch)" in r["refused"] and "engine_loss" in r["refused"]
    assert len(r["loss"]) == 1 and math.isfinite(r["loss"][0]) and r["loss"][0] > 0
    assert r["metrics"]["video_numel"][0] > 0 and r["metrics"]["audio_numel"][0] > 0


@needs_verl
def test_engine_config_errors_name_the_fix():
    errors = _registry()["config_errors"]
    assert "ulysses_sequence_parallel_size" in errors["sp3"] and "fix" in errors["sp3"]
    assert (
        "lr_scheduler_type='cosine'" in errors["cosine"]
        and "fix: lr_scheduler_type=constant" in errors["cosine"]
    )
    assert "fsdp_size=2" in errors["fsdp_size"] and "fix: fsdp_size=-1" in errors["fsdp_size"]
    ring = errors["ring3"]  # one process cannot hold a ring of 3
    assert "actor_rollout_ref.model.ring_degree" in ring and "= 3" in ring and "fix:" in ring


@needs_verl
def test_flowgrpo_trainer_through_verl_registry_is_identical():
    """The trainer with its engine built by ``EngineRegistry.new`` (what ``sp-diffusers train`` does when given
    verl keys) produces bit-identical metrics and parameters to the directly built FSDPEngine (LoRA, SP = 2)."""
    for r in run_distributed("tests.workers.verl_engine:trainer_identity", 2, env=ENV):
        native, verl = r["native"], r["verl"]
        assert verl["has_verl_engine"] and not native["has_verl_engine"]
        assert native["history"] == verl["history"] and len(native["history"]) == 2
        assert native["params"].keys() == verl["params"].keys()
        for name, p in native["params"].items():
            assert (p - verl["params"][name]).abs().max().item() == 0.0, name


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_")}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=300
    )


@needs_verl
def test_entry_point_discovery_in_a_fresh_interpreter():
    """``import verl`` alone finds the engine through the verl.plugins entry point, leaves diffusers with
    ``ulysses_sdpa`` registered and the patches applied (what verl-omni's engine needs), and logs the install
    report once (a module reload installs nothing again); with VERL_PLATFORM=cpu the plugin also brings
    verl's CPU platform. VERL_USE_EXTERNAL_PLUGINS=none turns all of it off."""
    code = (
        "import importlib, logging\n"
        "logging.basicConfig(level=logging.INFO)\n"
        "import verl\n"
        "from verl.utils.device import get_device_name, get_nccl_backend\n"
        "from verl.workers.engine.base import EngineRegistry\n"
        "cls = EngineRegistry.get_engine_cls('sp_diffusers_diffusion', 'fsdp2')\n"
        "print('FOUND', cls.__module__ + '.' + cls.__qualname__, get_device_name(), get_nccl_backend())\n"
        "from diffusers.models.attention_dispatch import AttentionBackendName\n"
        "import sp_diffusers, sp_diffusers.integrations.verl.plugin as plugin\n"
        "importlib.reload(plugin)\n"
        "print('BACKEND', 'ulysses_sdpa' in {m.value for m in AttentionBackendName}, sp_diffusers.is_installed())\n"
        "print('APPLIED', ','.join(sp_diffusers.install().applied))\n"
    )
    proc = _python(code, {"VERL_PLATFORM": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FOUND sp_diffusers.integrations.verl.engine.SPDiffusersEngine cpu gloo" in proc.stdout
    assert "BACKEND True True" in proc.stdout
    applied = next(line for line in proc.stdout.splitlines() if line.startswith("APPLIED")).split()[1]
    assert "native_ulysses" in applied.split(",")  # the patches this diffusers needs, by the plugin
    assert proc.stderr.count("sp-diffusers install: diffusers") == 1, proc.stderr[-3000:]
    off = _python(
        "import verl\nfrom verl.workers.engine.base import EngineRegistry\n"
        "print('TYPES', sorted(EngineRegistry._engines))\n"
        "from diffusers.models.attention_dispatch import AttentionBackendName\n"
        "print('BACKEND', 'ulysses_sdpa' in {m.value for m in AttentionBackendName})\n",
        {"VERL_USE_EXTERNAL_PLUGINS": "none"},
    )
    assert off.returncode == 0 and "sp_diffusers_diffusion" not in off.stdout  # discovery really did it
    assert "BACKEND False" in off.stdout


def test_missing_verl_names_the_extra():
    proc = _python("import sys\nsys.modules['verl'] = None\nimport sp_diffusers.integrations.verl.plugin")
    assert proc.returncode != 0
    assert "pip install 'sp-diffusers[verl]'" in proc.stderr


# ------------------------------------------------------------------------------------ override mapping


def test_verl_overrides_map_onto_train_config():
    from sp_diffusers.flowgrpo.config import load_config
    from sp_diffusers.integrations.verl.overrides import translate_overrides

    plan = translate_overrides(
        [
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.actor.strategy=fsdp2",
            "actor_rollout_ref.model.path=/ckpt/transformer",
            "+actor_rollout_ref.model.ring_degree=2",
            "actor_rollout_ref.actor.optim.lr=1e-4",
            "+actor_rollout_ref.model.lora_rank=16",
            "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
            "actor_rollout_ref.rollout.n=8",
            "trainer.n_gpus_per_node=4",
            "trainer.nnodes=2",
            "flowgrpo.num_steps=10",  # our own keys pass through
        ]
    )
    config = load_config(None, plan.overrides)
    assert config.parallel.ulysses_sequence_parallel_size == 2 and config.parallel.ring_degree == 2
    assert config.parallel.use_fsdp is True
    assert config.model.pretrained == "/ckpt/transformer"
    assert config.optim.lr == 1e-4 and isinstance(config.optim.lr, float)  # "1e-4": a YAML 1.1 string
    assert config.lora.enabled is True and config.lora.rank == 16
    assert config.parallel.mixed_precision == "bf16"
    assert config.flowgrpo.group_size == 8 and config.flowgrpo.num_steps == 10
    assert (plan.n_gpus_per_node, plan.nnodes, plan.world_size) == (4, 2, 8)
    plan.check_launch(8)
    with pytest.raises(ValueError, match=r"4 x 2 = 8 but 2 processes were launched; fix: launch 8"):
        plan.check_launch(2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor_rollout_ref.actor.strategy=megatron"],
            r"strategy='megatron' is not supported.*fix: .*=fsdp2",
        ),
        (
            [
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=3",
                "trainer.n_gpus_per_node=4",
            ],
            r"=3 does not divide .* = 4; fix: pick one of \[1, 2, 4\]",
        ),
        (
            [
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
                "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size=4",
            ],
            r"ref\.fsdp_config\.ulysses_sequence_parallel_size=4 differs .*fix: give both the same degree",
        ),
        (
            ["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_paralel_size=2"],
            r"did you mean actor_rollout_ref\.actor\.fsdp_config\.ulysses_sequence_parallel_size",
        ),
        (["actor_rollout_ref.model.lora_rank=-1"], r"lora_rank=-1 must be an int >= 0.*fix:"),
        (["trainer.nnodes=0"], r"trainer\.nnodes=0 must be a positive int; fix: trainer\.nnodes=1"),
        (["flowgrpo.group_szie=4"], None),  # ours: refused later by load_config with the closest key
        (["~trainer.nnodes"], r"not key=value"),
        (["~trainer.nnodes=1"], r"deletes a key"),
    ],
)
def test_verl_override_errors(overrides, message):
    from sp_diffusers.flowgrpo.config import ConfigError, load_config
    from sp_diffusers.integrations.verl.overrides import translate_overrides

    if message is None:
        with pytest.raises(ConfigError, match=r"did you mean flowgrpo\.group_size"):
            load_config(None, translate_overrides(overrides).overrides)
        return
    with pytest.raises(ConfigError, match=message):
        translate_overrides(overrides)


def test_cli_builds_through_verl_only_for_verl_driven_runs(capsys):
    """Without verl keys (the README main job) the CLI keeps the native engine and skips verl's import; a
    positional that is not key=value is a usage error (one block on stderr, exit 2)."""
    from sp_diffusers.cli import USAGE_ERROR, _engine_factory, main

    assert _engine_factory("auto", False) == (None, "sp_diffusers.FSDPEngine")
    assert _engine_factory("native", True) == (None, "sp_diffusers.FSDPEngine")
    assert main(["train", "--iterations", "1", "not-an-override"]) == USAGE_ERROR
    err = capsys.readouterr().err
    assert re.search(r"'not-an-override' is not key=value \(e\.g\. actor_rollout_ref", err), err


@needs_verl
def test_example_script_uses_exactly_the_verl_keys(tmp_path):
    """examples/verl/run_flowgrpo_sp2.sh, shortened: the engine comes from verl's registry, SP = 2 from verl's
    flag, and the run writes its metrics and checkpoints."""
    import json

    script = (ROOT / "examples/verl/run_flowgrpo_sp2.sh").read_text()
    for key in (
        "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.strategy=fsdp2",
        "actor_rollout_ref.actor.optim.lr=",
        "trainer.n_gpus_per_node=",
        "trainer.nnodes=",
    ):
        assert key in script
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            "bash",
            "examples/verl/run_flowgrpo_sp2.sh",
            "--iterations",
            "2",
            "--out-dir",
            str(out),
            "actor_rollout_ref.model.lora_rank=4",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert (
        "via verl EngineRegistry (model_type=sp_diffusers_diffusion), ulysses_sequence_parallel_size=2"
        in (proc.stdout)
    )
    config = json.loads((out / "config.json").read_text())
    assert config["parallel"]["ulysses_sequence_parallel_size"] == 2
    assert config["optim"]["lr"] == 5e-4 and config["lora"]["rank"] == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [1, 2]
    assert (out / "checkpoints" / "step-00000002" / "meta.json").exists()
    # verl's "<name> engine is not available" notices (our import triggers them, once per rank) are not shown
    assert "engine is not available" not in proc.stderr + proc.stdout


# ------------------------------------------------------------------------------------- vllm-omni side


def test_vllm_omni_settings_mirror_the_trainer():
    from sp_diffusers.integrations.vllm_omni import ENGINE_KWARGS_PREFIX, rollout_settings

    s = rollout_settings(2, num_attention_heads=24, image_tokens=4096)
    assert s.parallel_config_kwargs() == {
        "ulysses_degree": 2,
        "ring_degree": 1,
        "sequence_parallel_size": 2,
        "ulysses_mode": "strict",
        "cfg_parallel_size": 1,
        "tensor_parallel_size": 1,
    }
    assert f"{ENGINE_KWARGS_PREFIX}.ulysses_degree=2" in s.overrides()
    assert s.world_size == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"ulysses_degree": 2, "ring_degree": 2, "sequence_parallel_size": 2},
            r"vllm_omni\.sequence_parallel_size=2: must equal ulysses_degree x ring_degree = 2 x 2 = 4; "
            r"fix: set sequence_parallel_size=4",
        ),
        ({"ulysses_degree": 0}, r"vllm_omni\.ulysses_degree=0: must be a positive int; fix:"),
        (
            {"cfg_parallel_size": 0},
            r"cfg_parallel_size=0: must be a positive int; fix: set cfg_parallel_size to 1 or more",
        ),
        ({"ulysses_mode": "loose"}, r"ulysses_mode='loose': must be one of .*fix: ulysses_mode=strict"),
        ({"ulyses_degree": 2}, r"did you mean ulysses_degree\?"),
    ],
)
def test_vllm_omni_settings_errors(kwargs, message):
    from sp_diffusers.integrations.vllm_omni import RolloutConfigError, settings_from_engine_kwargs

    with pytest.raises(RolloutConfigError, match=message):
        settings_from_engine_kwargs(kwargs)


def test_vllm_omni_model_checks_and_consistency_warnings():
    from sp_diffusers.integrations.vllm_omni import (
        RolloutConfigError,
        RolloutMismatchWarning,
        RolloutParallelSettings,
        check_consistency,
        rollout_settings,
        validate,
    )

    with pytest.raises(
        RolloutConfigError,
        match=r"ulysses_degree=4: the model's num_attention_heads=6 .*"
        r"fix: pick ulysses_degree among \[1, 2, 3, 6\], or ulysses_mode=advanced_uaa",
    ):
        rollout_settings(4, num_attention_heads=6)
    with pytest.raises(RolloutConfigError, match=r"token count 30 is not divisible.*fix:"):
        rollout_settings(4, image_tokens=30)
    with pytest.raises(
        RolloutConfigError, match=r"rollout_world_size .*=6: not a multiple of tp x sp x cfg = 4"
    ):
        validate(RolloutParallelSettings(ulysses_degree=2, cfg_parallel_size=2), rollout_world_size=6)
    assert rollout_settings(4, num_attention_heads=6, ulysses_mode="advanced_uaa").ulysses_degree == 4

    same = rollout_settings(2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_consistency(same, trainer_dtype="bf16", rollout_dtype="bfloat16") == []
    ring = RolloutParallelSettings(ulysses_degree=1, ring_degree=2)
    with pytest.warns(RolloutMismatchWarning) as record:
        reasons = check_consistency(ring, rollout_attention_backend="SAGE_ATTN", trainer_dtype="fp32")
    assert len(reasons) == 3 == len(record)
    assert "ignores attention masks" in reasons[0] and "fix: ring_degree=1 and ulysses_degree=2" in reasons[0]
    assert "'SAGE_ATTN' is not exact" in reasons[1] and "rollout dtype bf16 != trainer" in reasons[2]


def test_verl_overrides_carry_the_rollout_settings():
    from sp_diffusers.flowgrpo.config import ConfigError, load_config
    from sp_diffusers.integrations.verl.overrides import translate_overrides
    from sp_diffusers.integrations.vllm_omni import RolloutMismatchWarning

    plan = translate_overrides(
        [
            "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2",
            "actor_rollout_ref.rollout.engine_kwargs.vllm_omni.ulysses_degree=1",
            "actor_rollout_ref.rollout.engine_kwargs.vllm_omni.ring_degree=2",
            "actor_rollout_ref.rollout.dtype=fp32",  # as the trainer: only the ring reason remains
        ]
    )
    assert plan.rollout.sp_size == 2
    with pytest.warns(RolloutMismatchWarning, match="ring attention ignores attention masks") as record:
        reasons = plan.check_rollout(load_config(None, plan.overrides))
    assert len(reasons) == 1 == len(record)
    with pytest.raises(ConfigError, match=r"sequence_parallel_size=3: must equal"):
        translate_overrides(
            [
                "actor_rollout_ref.rollout.engine_kwargs.vllm_omni.ulysses_degree=2",
                "actor_rollout_ref.rollout.engine_kwargs.vllm_omni.sequence_parallel_size=3",
            ]
        )


def test_vllm_omni_module_imports_without_vllm_omni():
    proc = _python(
        "import sys\nsys.modules['vllm_omni'] = None\nsys.modules['vllm'] = None\n"
        "import sp_diffusers.integrations.vllm_omni as m\nprint('OK', m.rollout_settings(2).sp_size)"
    )
    assert proc.returncode == 0 and "OK 2" in proc.stdout, proc.stderr[-2000:]
