"""The bad-input matrix: every bad configuration or input raises an error that names the parameter, the
value and the fix — in one process here, and on real gloo ranks (collectives under a timeout, a barrier
after the last case proving that no rank hangs) in ``test_distributed_bad_inputs``.

Each case lists words that must appear in the message: the parameter, the offending value, and a word
of the fix. The cases are counted in the closing note of the reliability issue.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ._dist import run_distributed


def _quiet():
    from diffusers.utils import logging as dlogging

    dlogging.set_verbosity(logging.ERROR)


def _engine(model=None, **kw):
    from sp_diffusers import FSDPEngine
    from sp_diffusers.tiny import tiny_model

    return FSDPEngine(model if model is not None else tiny_model("qwenimage", num_layers=1), **kw)


def _config(**sections):
    from sp_diffusers.flowgrpo.config import load_config

    overrides = [f"{k}={json.dumps(v)}" for k, v in sections.items()]
    return load_config(None, overrides)


def _checked(**sections):
    """A config through load_config and the algorithm's checks (what train --check and the trainer run)."""
    from sp_diffusers.flowgrpo.build import check_algorithm

    check_algorithm(_config(**sections))


def _trainer(**sections):
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    base = {"parallel.ulysses_sequence_parallel_size": 1, "train.progress": False}
    base.update(sections)
    return FlowGRPOTrainer(_config(**base))


def _before_install():
    import sp_diffusers

    sp_diffusers.uninstall()
    return sp_diffusers.context_parallel_config(ulysses_degree=2)


def _written(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def _uninstall_in_use():
    import sp_diffusers
    from sp_diffusers.tiny import tiny_model

    sp_diffusers.install()
    model = tiny_model("qwenimage", num_layers=1)
    model.set_attention_backend("ulysses_sdpa")
    try:
        sp_diffusers.uninstall()
    finally:
        model.reset_attention_backend()  # the other cases run in this process


def _second_run(tmp_path):
    from sp_diffusers.flowgrpo.io.run_lock import lock_run_dir

    held = lock_run_dir(tmp_path / "run", rank=0)  # the first run, still going
    try:
        _trainer(**{"train.out_dir": str(tmp_path / "run"), "train.iterations": 1}).run()
    finally:
        held.close()


def _old_diffusers(monkeypatch):
    import diffusers

    from sp_diffusers.patching import compat

    compat.diffusers_version.cache_clear()
    monkeypatch.setattr(diffusers, "__version__", "0.35.2")
    try:
        compat.check_supported()
    finally:
        compat.diffusers_version.cache_clear()


def _installed(fn):
    def run():
        import sp_diffusers

        sp_diffusers.install()
        return fn()

    return run


def _sana():
    # diffusers ships no context-parallel plan for Sana, and sp_diffusers adds none
    from diffusers import SanaTransformer2DModel

    return SanaTransformer2DModel(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=1,
        num_cross_attention_heads=2,
        cross_attention_head_dim=8,
        cross_attention_dim=16,
        caption_channels=16,
        sample_size=8,
        patch_size=1,
    )


def _save_then_load(tmp_path, save_kw, load_kw, corrupt=None):
    from sp_diffusers.tiny import tiny_model

    saver = _engine(tiny_model("qwenimage", num_layers=save_kw.pop("num_layers", 1)), **save_kw)
    path = saver.save_checkpoint(tmp_path / "ckpt", step=1)
    if corrupt:
        corrupt(path)
    loader = _engine(tiny_model("qwenimage", num_layers=load_kw.pop("num_layers", 1)), **load_kw)
    return loader.load_checkpoint(tmp_path / "ckpt")


def _bump_format(path) -> None:
    meta = json.loads((path / "meta.json").read_text())
    meta["format"] = 99  # written by a newer sp-diffusers
    (path / "meta.json").write_text(json.dumps(meta))


def _lora():
    from sp_diffusers import LoraSettings

    return LoraSettings(rank=2)


# (id, callable taking (monkeypatch, tmp_path), exception type, words that must appear)
CASES = [
    ("config_before_install", lambda mp, tp: _before_install(), RuntimeError, ["install()", "Fix"]),
    (
        "ulysses_degree_zero",
        lambda mp, tp: _installed(lambda: __import__("sp_diffusers").context_parallel_config(0))(),
        ValueError,
        ["ulysses_degree", "got 0", "positive int"],
    ),
    (
        "ulysses_degree_str",
        lambda mp, tp: _installed(lambda: __import__("sp_diffusers").context_parallel_config("2"))(),
        ValueError,
        ["ulysses_degree", "'2'"],
    ),
    (
        "ring_degree_negative",
        lambda mp, tp: _installed(
            lambda: __import__("sp_diffusers").context_parallel_config(2, ring_degree=-1)
        )(),
        ValueError,
        ["ring_degree", "-1", "positive int"],
    ),
    ("unsupported_diffusers", lambda mp, tp: _old_diffusers(mp), RuntimeError, ["0.35.2", "diffusers>=0.36"]),
    (
        "text_mask_disagrees",
        lambda mp, tp: __import__("sp_diffusers").pad_text_batch(torch.randn(2, 6, 4), torch.ones(2, 5)),
        ValueError,
        ["prompt_embeds_mask shape (2, 5)", "(2, 6, 4)", "fix"],
    ),
    (
        "text_list_lengths_disagree",
        lambda mp, tp: __import__("sp_diffusers").pad_text_batch(
            [torch.randn(3, 2)], [torch.ones(4, dtype=torch.bool)]
        ),
        ValueError,
        ["prompt_embeds_mask lengths", "[(4,)]", "[3]"],
    ),
    (
        "config_key_typo",
        lambda mp, tp: _config(**{"flowgrpo.group_szie": 4}),
        ValueError,
        ["unknown config key 'flowgrpo.group_szie'", "did you mean flowgrpo.group_size"],
    ),
    (
        "config_section_typo",
        lambda mp, tp: _config(**{"flowgrp.group_size": 4}),
        ValueError,
        ["unknown config key 'flowgrp'", "flowgrpo"],
    ),
    (
        "config_wrong_type",
        lambda mp, tp: _config(**{"flowgrpo.group_size": "four"}),
        ValueError,
        ["flowgrpo.group_size must be int", "'four'"],
    ),
    (
        "config_override_syntax",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.config", fromlist=["x"]).load_config(
            None, ["flowgrpo.group_size"]
        ),
        ValueError,
        ["'flowgrpo.group_size'", "key=value"],
    ),
    (
        "sp_without_distributed",
        lambda mp, tp: _engine(ulysses_sequence_parallel_size=2),
        ValueError,
        ["ulysses_sequence_parallel_size=2", "torchrun"],
    ),
    (
        "model_without_cp_plan",
        lambda mp, tp: _engine(_sana()),
        ValueError,
        ["SanaTransformer2DModel", "_cp_plan", "fix"],
    ),
    (
        "ring_degree_exceeds_world_in_engine",
        lambda mp, tp: _engine(ring_degree=2),
        ValueError,
        ["ulysses_degree * ring_degree = 1 * 2 = 2", "world size 1", "fix"],
    ),
    (
        "mixed_precision_unknown",
        lambda mp, tp: _engine(mixed_precision="fp8"),
        ValueError,
        ["mixed_precision='fp8'", "bf16"],
    ),
    (
        "kl_without_reference",
        lambda mp, tp: _trainer(**{"flowgrpo.kl_coef": 0.1}),
        ValueError,
        ["flowgrpo.kl_coef", "lora", "kl_coef=0"],
    ),
    (
        "image_size_not_patch_multiple",
        lambda mp, tp: _trainer(**{"model.image_size": 7}),
        ValueError,
        ["model.image_size=7", "patch size 2"],
    ),
    (
        "window_out_of_range",
        lambda mp, tp: _trainer(**{"flowgrpo.window_range": [0, 9]}),
        ValueError,
        ["flowgrpo.window_range=[0, 9]", "num_steps - window_size + 1"],
    ),
    (
        "pretrained_missing",
        lambda mp, tp: _trainer(**{"model.pretrained": str(tp / "nope")}),
        FileNotFoundError,
        ["model.pretrained=", "nope", "save_pretrained"],
    ),
    (
        "checkpoint_missing",
        lambda mp, tp: _engine().load_checkpoint(tp / "none"),
        RuntimeError,
        ["no checkpoint at", "none"],
    ),
    (
        "checkpoint_other_model",
        lambda mp, tp: _save_then_load(tp, {"num_layers": 2}, {"num_layers": 1}),
        RuntimeError,
        ["model_fingerprint", "same model", "any layout"],
    ),
    (
        "checkpoint_lora_mismatch",
        lambda mp, tp: _save_then_load(tp, {}, {"lora": _lora()}),
        RuntimeError,
        ["lora=False", "lora=True"],
    ),
    (
        "checkpoint_corrupt_meta",
        lambda mp, tp: _save_then_load(
            tp, {}, {}, corrupt=lambda p: (p / "meta.json").write_text("{not json")
        ),
        RuntimeError,
        ["meta.json", "corrupt", "earlier step"],
    ),
    (
        "checkpoint_other_format",
        lambda mp, tp: _save_then_load(tp, {}, {}, corrupt=_bump_format),
        RuntimeError,
        ["meta.json has format 99", "reads formats 1 and 2", "fix"],
    ),
    (
        "checkpoint_corrupt_shards",
        lambda mp, tp: _save_then_load(
            tp, {}, {}, corrupt=lambda p: [f.write_bytes(b"garbage") for f in p.glob("*.distcp")]
        ),
        RuntimeError,
        ["corrupt or incomplete"],
    ),
    (
        "checkpoint_dangling_latest",
        lambda mp, tp: _save_then_load(
            tp, {}, {}, corrupt=lambda p: (p.parent / "latest").write_text("step-00000099\n")
        ),
        RuntimeError,
        ["step-00000099", "not a complete checkpoint", "fix"],
    ),
    (
        "reward_prompt_without_colour",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.rewards.builtin", fromlist=["x"]).ColorLatentReward(4)(
            torch.zeros(1, 2, 4), ["a cat"]
        ),
        ValueError,
        ["'a cat'", "colours"],
    ),
    (
        "sde_noise_level_zero",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.sampling.sde", fromlist=["x"]).sde_step_with_logprob(
            torch.zeros(1, 2), torch.zeros(1, 2), 1.0, 0.5, 0.0, sigma_one_substitute=0.9
        ),
        ValueError,
        ["noise_level", "0.0", "ode_step"],
    ),
    (
        "flow_sigmas_too_few_steps",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.sampling.schedule", fromlist=["x"]).flow_sigmas(1),
        ValueError,
        ["num_steps", "1"],
    ),
    (
        "adapter_for_unsupported_model",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.models.adapters", fromlist=["x"]).build_adapter(
            __import__("sp_diffusers.tiny", fromlist=["x"]).tiny_model("cogvideox"), 8
        ),
        ValueError,
        ["CogVideoXTransformer3DModel", "QwenImageTransformer2DModel", "FluxTransformer2DModel"],
    ),
    (
        "tiny_model_unknown_kind",
        lambda mp, tp: __import__("sp_diffusers.tiny", fromlist=["x"]).tiny_model("sd9"),
        ValueError,
        ["kind='sd9'", "qwenimage"],
    ),
    (
        "config_iterations_negative",
        lambda mp, tp: _config(**{"train.iterations": -1}),
        ValueError,
        ["train.iterations=-1", "at least 1"],
    ),
    (
        "config_group_size_one",
        lambda mp, tp: _config(**{"flowgrpo.group_size": 1}),
        ValueError,
        ["flowgrpo.group_size=1", ">= 2"],
    ),
    (
        "config_micro_batch_zero",
        lambda mp, tp: _config(**{"flowgrpo.micro_batch_size": 0}),
        ValueError,
        ["flowgrpo.micro_batch_size=0", ">= 1"],
    ),
    (
        "config_mini_batches_zero",
        lambda mp, tp: _config(**{"flowgrpo.mini_batches": 0}),
        ValueError,
        ["flowgrpo.mini_batches=0", ">= 1"],
    ),
    (
        "config_max_grad_norm_nan",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.config", fromlist=["x"]).load_config(
            None, ["optim.max_grad_norm=.nan"]
        ),
        ValueError,
        ["optim.max_grad_norm=nan", "finite"],
    ),
    (
        "config_empty_yaml",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.config", fromlist=["x"]).load_config(
            _written(tp / "empty.yaml", ""), []
        ),
        ValueError,
        ["empty.yaml is empty", "fix"],
    ),
    (
        "config_missing_yaml",
        lambda mp, tp: __import__("sp_diffusers.flowgrpo.config", fromlist=["x"]).load_config(
            str(tp / "nope.yaml"), []
        ),
        (ValueError, FileNotFoundError),
        ["nope.yaml"],
    ),
    (
        "engine_optim_lr_nan",
        lambda mp, tp: __import__("sp_diffusers").OptimSettings(lr=float("nan")),
        ValueError,
        ["OptimSettings.lr=nan", "finite number >= 0"],
    ),
    (
        "uninstall_while_a_model_uses_the_backend",
        lambda mp, tp: _uninstall_in_use(),
        RuntimeError,
        ["uninstall()", "still use 'ulysses_sdpa'", "reset_attention_backend()"],
    ),
    (
        "run_dir_unwritable",
        lambda mp, tp: _trainer(
            **{"train.out_dir": _written(tp / "a-file", "") + "/run", "train.iterations": 1}
        ).run(),
        ValueError,
        ["train.out_dir=", "cannot be written", "Not a directory", "writable --out-dir"],
    ),
    (
        "run_dir_in_use",
        lambda mp, tp: _second_run(tp),
        ValueError,
        ["train.out_dir=", "in use by a run that is still going", "pid ", "--out-dir"],
    ),
    # every key is read or refused: another algorithm's section, the EMA's keys without an EMA, CFG's batching
    # without CFG; one rule per key for every algorithm (issue 42)
    (
        "key_of_another_algorithm",
        lambda mp, tp: _checked(**{"flowgrpo.mix.window_size": 2}),
        ValueError,
        ["flowgrpo.mix.window_size=2", "read by mix_grpo only", "flowgrpo.algorithm=flow_grpo does nothing", "fix"],
    ),
    (
        "nft_key_with_grpo_guard",
        lambda mp, tp: _checked(**{"flowgrpo.algorithm": "grpo_guard", "flowgrpo.nft.beta": 0.1}),
        ValueError,
        ["flowgrpo.nft.beta=0.1", "read by diffusion_nft only", "flowgrpo.algorithm=grpo_guard", "fix: drop it"],
    ),
    (
        "ema_decay_without_ema",
        lambda mp, tp: _config(**{"flowgrpo.ema_decay": 0.99}),
        ValueError,
        ["flowgrpo.ema_decay=0.99", "flowgrpo.ema=false keeps none", "fix: flowgrpo.ema=true"],
    ),
    (
        "cfg_batch_without_cfg",
        lambda mp, tp: _config(**{"rollout.cfg_batch": False}),
        ValueError,
        ["rollout.cfg_batch=False", "flowgrpo.cfg_scale=1 runs none", "fix"],
    ),
    (
        "timestep_fraction_over_one_for_flow_grpo",
        lambda mp, tp: _config(**{"flowgrpo.timestep_fraction": 1.5}),
        ValueError,
        ["flowgrpo.timestep_fraction=1.5", "(0, 1] for every algorithm"],
    ),
    (
        "mix_window_past_the_steps_for_every_strategy",
        lambda mp, tp: _checked(
            **{"flowgrpo.algorithm": "mix_grpo", "flowgrpo.mix.window_size": 20, "flowgrpo.num_steps": 8}
        ),
        ValueError,
        ["flowgrpo.mix.window_size=20", "at most num_steps - 2 = 6"],
    ),
    (
        "return_lse",
        lambda mp, tp: __import__("sp_diffusers.parallel.attention", fromlist=["x"]).ulysses_sdpa_attention(
            torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), return_lse=True
        ),
        ValueError,
        ["return_lse=True", "Fix"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(case, monkeypatch, tmp_path):
    _quiet()
    _, fn, exc, words = case
    with pytest.raises(exc) as info:
        fn(monkeypatch, tmp_path)
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


DISTRIBUTED_WORDS = {
    # attention (4 ranks): per rank, before any collective
    "attn:kv_heads_not_divisible": ["H_kv=3", "ulysses_degree=4", "fix"],
    "attn:mask_fits_neither_length": ["attn_mask shape", "local", "global"],
    "attn:dtype_mismatch": ["dtypes differ", "torch.float64"],
    "attn:mask_local_on_both_dims": ["local length", "key-padding"],
    # configuration (4 ranks)
    "config:sp_exceeds_world": ["8", "world size 4", "fix"],
    "config:sp_not_dividing_world": ["3", "world size 4", "1, 2, 4"],
    "config:mesh_without_ulysses": ["('sp',)", "'ulysses'", "build_device_mesh"],
    "config:mesh_size_mismatch": ["'ulysses' has size 4", "ulysses_degree=2"],
    # engine (4 ranks, SP = 2)
    "engine:unknown_setting": ["ulysses_sequence_paralel_size", "closest", "ulysses_sequence_parallel_size"],
    "engine:divergent_sp_batches": ["SP peers disagree", "latents", "fix"],
    "engine:checkpoint_other_lora_alpha": ["other LoRA settings", "alpha=16.0", "fix"],
}


def test_distributed_bad_inputs():
    results = run_distributed("tests.workers.bad_inputs:bad_inputs", 4, timeout=300)
    for rank, messages in enumerate(results):
        assert set(messages) == set(DISTRIBUTED_WORDS), sorted(set(messages) ^ set(DISTRIBUTED_WORDS))
        for name, words in DISTRIBUTED_WORDS.items():
            assert messages[name] is not None, f"rank {rank} {name}: no error"
            for word in words:
                assert word in messages[name], f"rank {rank} {name}: {word!r} not in {messages[name]!r}"


def test_matrix_size():
    assert len(CASES) + len(DISTRIBUTED_WORDS) >= 25
