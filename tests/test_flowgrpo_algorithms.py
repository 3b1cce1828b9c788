"""DanceGRPO, flow_grpo's CPS step, the pipelines' schedules and the zero-advantage filter; single process, CPU.

Tolerances: the steps run in float64 against the papers' / reference trainers' formulas evaluated independently
(python-float coefficients, ``torch.distributions.Normal``, the x0/x1 forms), on O(1) values: they agree to
float64 rounding (~1e-15 relative) and 1e-10 still catches any formula error (>= 1e-3). Schedules are compared
*exactly* (``torch.equal``) with what the diffusers pipelines compute, since they run the same scheduler code on
the same inputs; DanceGRPO's float32 schedule against python floats at 1e-6 (a few float32 ulps).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sp_diffusers.flowgrpo import flowgrpo_loss, group_advantages, sde_step_with_logprob
from sp_diffusers.flowgrpo.algorithms.selection import kept_samples
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import (
    SCHEDULER_DEFAULTS,
    linspace_schedule,
    load_scheduler_config,
    pipeline_schedule,
)
from sp_diffusers.flowgrpo.sampling.sde import StepRule, cps_step_with_logprob, dance_step_with_logprob

F64 = 1e-10


def _close(actual, expected, tol=F64):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


def _inputs(batch=3, shape=(6, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, *shape, generator=g, dtype=torch.float64) for _ in range(3))


# ------------------------------------------------------------------------------------------------- CPS


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.3, 0.1)])
def test_cps_step_matches_flow_grpo_formulas(sigma, sigma_next):
    x, v, noise = _inputs()
    a = 0.8
    s = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v  # predicted data and noise
    mean = (1 - sigma_next) * x0 + sigma_next * math.cos(a * math.pi / 2) * x1  # sqrt(s'^2 - s^2) = s' cos
    x_prev = mean + s * noise
    step = cps_step_with_logprob(x, v, sigma, sigma_next, a, prev_sample=x_prev)
    _close(step.prev_sample_mean, mean)
    _close(step.std_dev_t, torch.full((3,), s, dtype=torch.float64))
    # flow_grpo keeps only -(x' - mean)^2 ("remove all constants"), averaged over the non-batch elements
    _close(step.log_prob, -(s * noise).pow(2).mean(dim=(1, 2)))
    # ... which is 2 s^2 x (the Gaussian log-density - its constant): a ratio tempered by 2 s^2
    gauss = torch.distributions.Normal(mean, s).log_prob(x_prev).mean(dim=(1, 2))
    _close(step.log_prob / (2 * s * s), gauss + math.log(s) + 0.5 * math.log(2 * math.pi))


def test_cps_sampling_and_last_step():
    x, v, _ = _inputs(batch=2, shape=(4000, 4))
    g = torch.Generator().manual_seed(5)
    step = cps_step_with_logprob(x, v, 0.5, 0.3, 0.8, generator=g)
    z = (step.prev_sample - step.prev_sample_mean) / (0.3 * math.sin(0.4 * math.pi))
    # 16000 draws per sample: std errors 0.008 (mean) and 0.006 (std); a wrong scale misses by > 0.1
    assert abs(z.mean().item()) < 0.04 and abs(z.std().item() - 1.0) < 0.04
    again = cps_step_with_logprob(x, v, 0.5, 0.3, 0.8, prev_sample=step.prev_sample)
    torch.testing.assert_close(again.log_prob, step.log_prob, atol=0, rtol=0)
    last = cps_step_with_logprob(x, v, 0.2, 0.0, 0.8, generator=g)  # sigma' = 0: deterministic, x' = x0
    _close(last.prev_sample, x - 0.2 * v, 1e-15)
    assert last.log_prob.abs().max().item() == 0.0
    with pytest.raises(ValueError, match=r"noise_level must be in \(0, 1\)"):
        cps_step_with_logprob(x, v, 0.5, 0.3, 1.0)


# ------------------------------------------------------------------------------------------------- DanceGRPO


def _dance_ref(x, v, sigma, sigma_next, eta):
    """DanceGRPO's flux_step with python floats: the score from the predicted data x0 (its lines 105-119)."""
    dsigma = sigma_next - sigma
    x0 = x - sigma * v
    score = -(x - (1 - sigma) * x0) / sigma**2
    mean = x + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    return mean, eta * math.sqrt(sigma - sigma_next)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.95), (0.6, 0.45), (0.3, 0.0)])
def test_dance_step_matches_the_paper(sigma, sigma_next):
    x, v, noise = _inputs()
    eta = 0.3
    mean, std = _dance_ref(x, v, sigma, sigma_next, eta)
    x_prev = mean + std * noise
    step = dance_step_with_logprob(x, v, sigma, sigma_next, eta, prev_sample=x_prev)
    _close(step.prev_sample_mean, mean)
    # the full Gaussian log-density (normaliser included), averaged over C, F, H, W
    _close(step.log_prob, torch.distributions.Normal(mean, std).log_prob(x_prev).mean(dim=(1, 2)))
    _close(step.std_dev_t, torch.full((3,), eta, dtype=torch.float64))
    # closed form: flow_grpo's SDE mean with its std_t replaced by eta, and the same noise eta sqrt(-dt)
    if sigma < 1.0:
        sub = sigma  # min(sigma, sub) = sigma: a = eta sqrt((1 - sigma) / sigma) makes std_t = eta
        a = eta * math.sqrt((1 - sigma) / sigma)
        sde = sde_step_with_logprob(x, v, sigma, sigma_next, a, sigma_one_substitute=sub, prev_sample=x_prev)
        _close(sde.prev_sample_mean, mean)
        _close(sde.log_prob, step.log_prob)


def test_dance_per_sample_sigmas_sampling_and_rule():
    x, v, _ = _inputs(batch=3, shape=(3000, 4))
    sched = linspace_schedule(8, 3.0)
    sigmas = sched.sigmas.double()
    idx = torch.tensor([0, 3, 7])  # sigma 1 (no special case needed), a middle step, the last (sigma' = 0)
    rule = StepRule("dance", 0.3)
    g = torch.Generator().manual_seed(2)
    step = rule.step(x, v, sigmas, idx, generator=g)
    for b, i in enumerate(idx.tolist()):
        mean, std = _dance_ref(x[b], v[b], sigmas[i].item(), sigmas[i + 1].item(), 0.3)
        _close(step.prev_sample_mean[b], mean)
        z = (step.prev_sample[b] - mean) / std
        assert abs(z.mean().item()) < 0.05 and abs(z.std().item() - 1.0) < 0.05
    again = rule.step(x, v, sigmas, idx, prev_sample=step.prev_sample)
    torch.testing.assert_close(again.log_prob, step.log_prob, atol=0, rtol=0)
    assert torch.isfinite(step.log_prob).all()


def test_dance_loss_and_advantages_match_the_reference():
    # DanceGRPO, per trained step: mean_b max(-A r, -A clamp(r, 1 - eps, 1 + eps)) / (grad_acc * T) with
    # A = clamp((r - mean_g) / (std_g (n - 1) + 1e-8), +-adv_clip_max)
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.5, 0.0, 0.0, 0.0, 9.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    expected = []
    for grp in (rewards[:4].tolist(), rewards[4:].tolist()):
        m = sum(grp) / 4
        sd = math.sqrt(sum((r - m) ** 2 for r in grp) / 3)  # unbiased
        expected += [max(-5.0, min(5.0, (r - m) / (sd + 1e-8))) for r in grp]
    adv = group_advantages(rewards, ids, std="group", eps=1e-8, correction=1)
    _close(adv, expected)
    lp_old = torch.linspace(-1, 1, 8, dtype=torch.float64)
    lp = lp_old + torch.tensor([5e-5, -5e-5, 3e-4, -3e-4, 0.0, 1e-3, -1e-3, 2e-5], dtype=torch.float64)
    eps, grad_acc, t = 1e-4, 2, 11
    r = torch.exp(lp - lp_old)
    ref = torch.maximum(-adv * r, -adv * r.clamp(1 - eps, 1 + eps)).mean() / (grad_acc * t)
    loss, _ = flowgrpo_loss(lp, lp_old, adv, clip_range=eps, normalizer=grad_acc * t)
    _close(loss, ref)


def test_advantage_std_conventions():
    r = torch.tensor([1.0, 3.0, 2.0, 6.0], dtype=torch.float64)
    ids = torch.tensor([0, 0, 1, 1])
    # batch, unbiased: var = 14 / 3 (flow_grpo uses the population 14 / 4, tests/test_flowgrpo_math.py)
    d = math.sqrt(14 / 3) + 1e-4
    _close(group_advantages(r, ids, correction=1), [-1 / d, 1 / d, -2 / d, 2 / d])
    # a constant group is exactly 0 even where its float mean is not the value (0.1 * 3 / 3 != 0.1)
    const = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.2], dtype=torch.float64)
    adv = group_advantages(const, torch.tensor([0, 0, 0, 1, 1]))
    assert adv[:3].abs().max().item() == 0.0 and adv[3:].abs().min().item() > 0.5
    with pytest.raises(ValueError, match="correction must be 0"):
        group_advantages(r, ids, correction=2)


# ------------------------------------------------------------------------------------------------- schedules


def test_sd3_schedule_is_the_pipelines(tmp_path):
    """The tiny StableDiffusion3Pipeline's own __call__ (its retrieve_timesteps path) against ours."""
    from diffusers import StableDiffusion3Pipeline

    from sp_diffusers.tiny import save_tiny_sd3_pipeline

    folder = save_tiny_sd3_pipeline(tmp_path / "sd3", num_layers=1)
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, vae=None)
    seen = []

    def grab(p, i, t, kwargs):
        seen.append(t.item())
        return kwargs

    pipe(
        "a red cat",
        num_inference_steps=10,
        height=8 * pipe.vae_scale_factor,
        width=8 * pipe.vae_scale_factor,
        output_type="latent",
        guidance_scale=1.0,
        max_sequence_length=16,
        callback_on_step_end=grab,
    )
    ours = pipeline_schedule("sd3", 10, scheduler_config=load_scheduler_config(folder), image_seq_len=16)
    assert torch.equal(ours.sigmas, pipe.scheduler.sigmas.float())
    assert torch.equal(ours.timesteps, torch.tensor(seen, dtype=torch.float32))
    assert torch.equal(pipeline_schedule("sd3", 10).sigmas, ours.sigmas)  # the default is SD3's own config
    # the numbers: the last non-zero sigma is shift(shift(1/1000)) = 0.0089 (the scheduler shifts its
    # training grid's sigma_min once more), not the 0.25 of shift(linspace(1, 1/N, N))
    s_min = 3e-3 / (1 + 2e-3)
    assert ours.sigmas[-2].item() == pytest.approx(3 * s_min / (1 + 2 * s_min), abs=1e-6)


@pytest.mark.parametrize("image_seq_len", [16, 1024, 4096])
def test_qwenimage_schedule_is_the_pipelines(image_seq_len):
    """QwenImagePipeline's step 5 (its own calculate_shift and retrieve_timesteps) on Qwen-Image's config."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    n = 10
    config = SCHEDULER_DEFAULTS["qwenimage"]
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    mu = calculate_shift(
        image_seq_len,
        config["base_image_seq_len"],
        config["max_image_seq_len"],
        config["base_shift"],
        config["max_shift"],
    )
    timesteps, _ = retrieve_timesteps(scheduler, n, "cpu", sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    ours = pipeline_schedule("qwenimage", n, image_seq_len=image_seq_len)
    assert torch.equal(ours.sigmas, scheduler.sigmas.float())
    assert torch.equal(ours.timesteps, timesteps.float())
    assert ours.sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)  # shift_terminal
    if image_seq_len == 4096:  # 1024 px: the report's values (mu 0.6935)
        assert ours.sigmas[1].item() == pytest.approx(0.936978, abs=1e-6)


def test_wan_schedule_is_the_pipelines(tmp_path):
    """The tiny WanPipeline's own __call__ (UniPC, set_timesteps(N)) against ours, and the folder's config."""
    from diffusers import WanPipeline

    from sp_diffusers.tiny import save_tiny_wan_pipeline

    folder = save_tiny_wan_pipeline(tmp_path / "wan", num_layers=1)
    pipe = WanPipeline.from_pretrained(folder)
    seen = []

    def grab(p, i, t, kwargs):
        seen.append(t.item())
        return kwargs

    pipe(
        "a red cat",
        num_inference_steps=10,
        height=16,
        width=16,
        num_frames=5,
        output_type="latent",
        guidance_scale=1.0,
        max_sequence_length=16,
        callback_on_step_end=grab,
    )
    ours = pipeline_schedule("wan", 10, scheduler_config=load_scheduler_config(folder))
    assert torch.equal(ours.sigmas, pipe.scheduler.sigmas.float())
    assert torch.equal(ours.timesteps, torch.tensor(seen, dtype=torch.float32))
    assert torch.equal(pipeline_schedule("wan", 10).sigmas, ours.sigmas)  # the default is Wan2.1's config
    assert ours.sigmas[0].item() == pytest.approx(1 - 1e-6, abs=1e-7)  # UniPC's sigma_0
    assert ours.timesteps[3].item() == 875.0  # integer timesteps
    shifted = pipeline_schedule("wan", 10, shift=5.0)  # flowgrpo.shift replaces flow_shift
    assert shifted.sigmas[-2] > ours.sigmas[-2]


def test_linspace_schedule_is_dance_grpos():
    s = linspace_schedule(10, 3.0)
    t = [1 - i / 10 for i in range(11)]
    _close(s.sigmas, [3 * x / (1 + 2 * x) for x in t], 1e-6)
    # int(1000 sigma) of the float32 sigmas: 0.875 rounds to 0.87499994 in float32, so 874 (as DanceGRPO)
    assert s.timesteps.tolist() == [1000, 964, 923, 874, 818, 750, 666, 562, 428, 250]
    with pytest.raises(ValueError, match=r"flowgrpo\.shift must be > 0"):
        linspace_schedule(10, 0.0)


def test_schedule_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"model\.kind='hunyuanvideo'.*flowgrpo\.schedule=linspace"):
        pipeline_schedule("hunyuanvideo", 8)
    with pytest.raises(ValueError, match=r"flowgrpo\.shift=2.0 has no effect"):
        pipeline_schedule("qwenimage", 8, image_seq_len=16, shift=2.0)
    with pytest.raises(ValueError, match="DDIMScheduler"):
        pipeline_schedule("sd3", 8, scheduler_config={"_class_name": "DDIMScheduler"})
    with pytest.raises(FileNotFoundError, match=r"flowgrpo\.scheduler="):
        load_scheduler_config(tmp_path)


def test_sde_first_step_on_unipc_uses_sigmas_1():
    # Wan's UniPC schedule starts at 1 - 1e-6: the plain std_t would be sqrt(1e6) a ~ 700; min(sigma, sigmas[1])
    # gives flow_grpo's sigma = 1 rule, a sqrt(sigma / (1 - sigmas[1]))
    x, v, _ = _inputs()
    sigmas = pipeline_schedule("wan", 10).sigmas.double()
    step = StepRule("sde", 0.7).step(x, v, sigmas, 0, prev_sample=x)
    s0, s1 = sigmas[0].item(), sigmas[1].item()
    _close(step.std_dev_t, torch.full((3,), 0.7 * math.sqrt(s0 / (1 - s1)), dtype=torch.float64))
    assert step.std_dev_t.max().item() < 5


# ------------------------------------------------------------------------------------------------- filter


def test_kept_samples_same_count_on_every_dp_rank():
    # dp 3 x 4 samples: non-zero counts 3, 1, 0 -> K = 3, or 4 with mini_batches 2 (a multiple of it)
    adv = torch.tensor([0.5, -1.0, 0.0, 2.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0])
    for mini, k in ((1, 3), (2, 4)):
        kept = [kept_samples(adv, r, 3, mini, seed=11) for r in range(3)]
        assert [len(x) for x in kept] == [k] * 3
        for r, idx in enumerate(kept):
            local = adv[4 * r : 4 * r + 4]
            nonzero = set(torch.nonzero(local).flatten().tolist())
            assert nonzero <= set(idx.tolist())  # no non-zero sample is ever dropped
            assert len(set(idx.tolist())) == len(idx) and idx.tolist() == sorted(idx.tolist())
    assert kept_samples(adv, 2, 3, 1, seed=11).tolist() == kept_samples(adv, 2, 3, 1, seed=11).tolist()
    assert kept_samples(torch.zeros(8), 1, 2, 1, seed=0).numel() == 0  # nothing to learn: no update anywhere
    with pytest.raises(ValueError, match="dp_size"):
        kept_samples(torch.zeros(7), 0, 2, 1, seed=0)


# ------------------------------------------------------------------------------------------------- Wan parts


def test_wan_adapter_text_does_not_depend_on_padding():
    from sp_diffusers.flowgrpo.models.adapters import WanAdapter

    adapter = WanAdapter(frames=2, height=4, width=4, channels=4, patch=(1, 2, 2), text_len=6)
    assert adapter.tokens == 8 and adapter.latent_shape(3) == (3, 4, 2, 4, 4)
    embeds = torch.randn(2, 4, 8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    latents, t = torch.randn(2, 4, 2, 4, 4), torch.tensor(500.0)
    short = adapter.inputs(latents, t, embeds, mask)["encoder_hidden_states"]
    # the same prompts padded further (the engine's SP padding: zeros, mask False) give the same text
    padded = torch.cat([embeds, torch.randn(2, 4, 8)], dim=1)
    pmask = torch.cat([mask, torch.zeros(2, 4, dtype=torch.bool)], dim=1)
    assert torch.equal(adapter.inputs(latents, t, padded, pmask)["encoder_hidden_states"], short)
    assert short.shape == (2, 6, 8) and short[0, 3:].abs().max() == 0 and short[1, :4].abs().min() > 0
    assert adapter.reward_view(latents).shape == (2, 2, 4, 4, 4)  # [B, F, H, W, C]


def test_umt5_encoder_is_what_wan_pipeline_computes(tmp_path):
    from diffusers import WanPipeline

    from sp_diffusers.flowgrpo.models.text import PipelineTextEncoder, UMT5TextEncoder
    from sp_diffusers.tiny import save_tiny_wan_pipeline

    folder = save_tiny_wan_pipeline(tmp_path / "wan", num_layers=1)
    prompts = ["a red cat", "a yellow lighthouse at dusk"]
    pipe = WanPipeline.from_pretrained(folder, vae=None, transformer=None)
    with torch.no_grad():  # as the pipeline's __call__ (with transformers 5.24 the encoders differ in the last bit with autograd)
        embeds, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, max_sequence_length=16)
    got = PipelineTextEncoder(str(folder), max_sequence_length=16).encode_batch(prompts, prefix="negative_")
    assert torch.equal(torch.stack(got["negative_prompt_embeds"]), embeds.float())
    assert all(m.all() and m.shape == (16,) for m in got["negative_prompt_embeds_mask"])
    # the built-in encoder: the same computation (same class, same seed), zero past each prompt's tokens
    builtin = UMT5TextEncoder(hidden_size=32, num_layers=2, seed=1, max_sequence_length=16)
    builtin.model.load_state_dict(pipe.text_encoder.state_dict())
    mine = torch.stack(builtin.encode_batch(prompts)["prompt_embeds"])
    torch.testing.assert_close(mine, embeds.float(), atol=1e-6, rtol=0)
    lengths = [len(p) + 1 for p in prompts]  # bytes + </s>
    assert (mine[0, lengths[0] :] == 0).all() and (mine[0, : lengths[0]].abs().sum(-1) > 0).all()


def test_video_reward_separates_the_cases():
    from sp_diffusers.flowgrpo.rewards.builtin import VideoColorReward

    reward = VideoColorReward(4)
    g = torch.Generator().manual_seed(0)
    target = reward.targets[reward.color_index("a red cat")]
    good = target.expand(2, 3, 4, 4, 4).clone()  # [B, F, H, W, C]: every frame on target
    flipped = good.clone()
    flipped[:, -1] = -target  # the last frame changes colour
    noise = torch.randn(2, 3, 4, 4, 4, generator=g)
    r = {k: reward(v, ["a red cat"] * 2) for k, v in (("good", good), ("flip", flipped), ("noise", noise))}
    assert r["good"].min().item() == pytest.approx(1.0, abs=1e-6)
    assert r["flip"].max() < r["noise"].min() < r["good"].min()
    other = reward(good, ["a blue cat"] * 2)  # the right colour for another prompt is wrong here
    assert other.max() < 0.5


# ------------------------------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("algorithm", "grpo", r"flowgrpo\.algorithm='grpo'.*flow_grpo, dance_grpo"),
        ("sde_type", "ode", r"flowgrpo\.sde_type='ode'.*'cps'"),
        ("schedule", "karras", r"flowgrpo\.schedule='karras'.*auto, pipeline, linspace"),
        ("noise_level", 1.2, r"flowgrpo\.noise_level=1\.2 must be < 1 with sde_type=cps"),
        ("timestep_fraction", 1.5, r"flowgrpo\.timestep_fraction=1\.5 must be in \(0, 1\]"),
    ],
)
def test_bad_algorithm_keys_are_named(key, value, words):
    from sp_diffusers.flowgrpo.build import check_algorithm
    from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig

    c = TrainConfig()
    if key == "noise_level":
        c.flowgrpo.sde_type = "cps"
    if key == "timestep_fraction":
        c.flowgrpo.algorithm = "dance_grpo"
    setattr(c.flowgrpo, key, value)
    with pytest.raises(ConfigError, match=words):
        check_algorithm(c)
    c = TrainConfig()
    c.flowgrpo.algorithm, c.flowgrpo.sde_type = "dance_grpo", "cps"
    with pytest.raises(ConfigError, match=r"sde_type='cps' is a flow_grpo step"):
        check_algorithm(c)


def test_dance_grpo_rollout_and_timestep_selection(tmp_path):
    """One process: every step is stored, each sample trains on its own steps (a random subset of 0..N-2 without
    replacement, int((N - 1) * fraction) of them), and the recomputed old log-probs are the rollout's."""
    from sp_diffusers.flowgrpo.config import TrainConfig
    from sp_diffusers.flowgrpo.trainer import FlowGRPOTrainer

    c = TrainConfig()
    c.model.overrides = {"num_layers": 1}
    c.parallel.ulysses_sequence_parallel_size = 1
    c.flowgrpo.algorithm, c.flowgrpo.noise_level, c.flowgrpo.shift = "dance_grpo", 0.3, 3.0
    c.flowgrpo.num_steps, c.flowgrpo.timestep_fraction = 8, 0.6
    c.flowgrpo.prompts_per_rank, c.flowgrpo.group_size = 2, 4
    c.train.out_dir, c.train.progress, c.train.plot = str(tmp_path), False, False
    trainer = FlowGRPOTrainer(c)
    assert "DanceGRPO" in trainer.schedule.source  # schedule auto -> linspace for dance_grpo
    batch = trainer.iteration_batch(0).prepared(trainer.engine)
    steps = batch.plan.train_steps
    assert steps.shape == (8, 4)  # int(7 * 0.6) = 4
    assert steps.max() <= 6 and steps.min() >= 0  # the last step (index 7) is never trained
    assert all(len(set(row.tolist())) == 4 for row in steps)  # without replacement
    assert len({tuple(row.tolist()) for row in steps}) > 1  # each sample its own
    traj, adv, old, _ = trainer.collect(batch)
    assert traj.latents.shape[1] == 9 and traj.log_probs.shape == (8, 8)  # every step is an SDE step
    assert torch.equal(traj.steps(), steps)
    torch.testing.assert_close(old, traj.rollout_log_probs(), atol=1e-6, rtol=0)
    metrics = trainer.update(batch, traj, adv, old)
    assert abs(metrics["ratio_mean"] - 1.0) <= 1e-6 and metrics["trained_samples"] == 8


def test_bad_wan_and_text_keys_are_named():
    from sp_diffusers.flowgrpo.build import build_text_encoder
    from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
    from sp_diffusers.flowgrpo.models.adapters import build_adapter
    from sp_diffusers.tiny import tiny_model

    wan = tiny_model("wan", num_layers=1)
    with pytest.raises(ValueError, match=r"model\.image_size=7 must be a multiple of the patch size"):
        build_adapter(wan, 7, frames=2)
    with pytest.raises(ValueError, match=r"model\.frames=0 must be a positive multiple"):
        build_adapter(wan, 8, frames=0)
    c = TrainConfig()
    c.text.encoder = "t5"
    with pytest.raises(ConfigError, match=r"text\.encoder='t5'.*'byte', 'umt5'"):
        build_text_encoder(c, torch.device("cpu"))


def test_prompts_past_the_encoders_limit_are_warned_about():
    """Two prompts that differ only past the limit get one embedding: the encoder says so (once per prompt)."""
    import warnings

    from sp_diffusers.flowgrpo.models.text import ByteTextEncoder, UMT5TextEncoder

    byte = ByteTextEncoder(max_length=8)
    long_a, long_b = "a red cat on a mat", "a red cat on a hat"
    with pytest.warns(
        UserWarning, match=r"ByteTextEncoder: the prompt 'a red cat on a mat' has 18 tokens, more"
    ):
        embeds, _ = byte.encode([long_a, long_b])
    assert torch.equal(embeds[0], embeds[1])  # what the warning is about
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        byte.encode(["a red"])  # within the limit: silent
    umt5 = UMT5TextEncoder(max_sequence_length=8)
    with pytest.warns(UserWarning, match=r"more than text\.max_sequence_length \(8\)"):
        umt5.encode([long_a])
