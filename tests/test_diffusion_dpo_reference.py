"""Online Diffusion-DPO equals its reference in float64: verl-omni (fetched 2026-12-06, commit a1139baf)
``verl_omni/trainer/diffusion/diffusion_algos.py`` ``DPOLoss.compute_loss`` (the loss, its gradient and metrics) and
``DPOLoss.build_online_dpo_pair_indices`` (the pairs), and ``verl_omni/pipelines/utils.py``
``sample_noise_and_timesteps`` / ``prepare_noisy_latents`` (one logit-normal timestep and one noise per pair, on the
scheduler's training grid), whose lines ``_reference_*`` below restate; the timesteps are compared with diffusers'
own ``compute_density_for_timestep_sampling`` and ``FlowMatchEulerDiscreteScheduler.scale_noise``.

Cases: both ends of the schedule (sigma near 1 and near 0), all-equal rewards, single-sample groups (no pair), and
beta's limits (tiny: the loss is log 2 with a vanishing gradient; huge: the saturated hinge). Tolerance 1e-12
(float64: the same operations); the noised data 1e-6 (diffusers computes it in float32).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sp_diffusers.flowgrpo.algorithms.diffusion_dpo import (
    DiffusionDPO,
    dpo_loss,
    logit_normal_index,
    online_pairs,
)
from sp_diffusers.flowgrpo.config import ConfigError, TrainConfig
from sp_diffusers.flowgrpo.sampling.pipeline_schedule import pipeline_schedule
from sp_diffusers.flowgrpo.sampling.trajectory import Trajectory
from sp_diffusers.flowgrpo.update import micro_batches

TOL = 1e-12


def _reference_loss(noise, latent, model_pred, ref_pred, beta):
    """DPOLoss.compute_loss's arithmetic (its metrics as returned, before ``.item()``)."""
    target = noise.float() - latent.float() if noise.dtype != torch.float64 else noise - latent
    model_err = ((model_pred - target) ** 2).flatten(1).mean(dim=1)
    ref_err = ((ref_pred - target) ** 2).flatten(1).mean(dim=1)
    w_diff = model_err[0::2] - ref_err[0::2]
    l_diff = model_err[1::2] - ref_err[1::2]
    inside = -0.5 * beta * (w_diff - l_diff)
    acc = (inside > 0).sum().double() / inside.size(0)
    loss = -F.logsigmoid(inside).mean()
    with torch.no_grad():
        chosen, rejected = -0.5 * beta * w_diff, -0.5 * beta * l_diff
        metrics = {"acc": acc, "chosen": chosen.mean(), "rejected": rejected.mean(), "margin": (chosen - rejected).mean()}
    return loss, metrics


def _reference_pairs(uids, scores):
    """build_online_dpo_pair_indices: per uid (in first-seen order) the top and the bottom of a stable sort."""
    groups: dict = {}
    for i, uid in enumerate(uids):
        groups.setdefault(uid, []).append(i)
    out = []
    for members in groups.values():
        if len(members) < 2:
            continue
        ordered = sorted(members, key=lambda i: scores[i], reverse=True)
        out.extend([ordered[0], ordered[-1]])
    return out


def _pair_case(seed: int, sigma: float, pairs: int = 3):
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(2 * pairs, 4, 6, generator=g, dtype=torch.float64)
    noise = torch.randn(pairs, 4, 6, generator=g, dtype=torch.float64).repeat_interleave(2, dim=0)
    x_t = (1 - sigma) * x0 + sigma * noise
    target = noise - x0
    # a reference that is off the target by O(1), a policy a little off the reference, both as functions of x_t
    ref = target + 0.5 * torch.randn(x0.shape, generator=g, dtype=torch.float64) + 0.1 * x_t
    model = ref + 0.02 * torch.randn(x0.shape, generator=g, dtype=torch.float64)
    return x0, noise, model, ref


@pytest.mark.parametrize("sigma", [0.999, 0.002], ids=["near_noise", "near_data"])
@pytest.mark.parametrize("beta", [2000.0, 100.0, 1e-6, 1e7], ids=["default", "recipe", "tiny_beta", "huge_beta"])
def test_dpo_loss_equals_verl_omni(sigma, beta):
    for seed in range(3):
        x0, noise, model, ref = _pair_case(seed, sigma)
        ours_v, theirs_v = model.clone().requires_grad_(), model.clone().requires_grad_()
        ours, metrics = dpo_loss(ours_v, ref, x0, noise, beta=beta)
        theirs, m = _reference_loss(noise, x0, theirs_v, ref, beta)
        assert abs(ours.item() - theirs.item()) <= TOL * max(1.0, abs(theirs.item()))
        ours.backward()
        theirs.backward()
        torch.testing.assert_close(ours_v.grad, theirs_v.grad, atol=TOL, rtol=1e-10)
        assert float(metrics["implicit_acc"]) == float(m["acc"])
        for ours_key, key in (("implicit_reward_chosen", "chosen"), ("implicit_reward_rejected", "rejected"),
                              ("implicit_reward_margin", "margin")):
            assert abs(float(metrics[ours_key]) - float(m[key])) <= TOL * max(1.0, abs(float(m[key])))
        if beta == 1e-6:  # no preference strength: log 2, and almost no gradient
            assert abs(ours.item() - math.log(2)) < 1e-6 and float(ours_v.grad.abs().max()) < 1e-6
        if beta == 1e7:  # saturated: the loss is the hinge max(0, -inside), still finite, and so is its gradient
            assert math.isfinite(ours.item()) and bool(torch.isfinite(ours_v.grad).all())


def test_dpo_loss_is_log2_when_the_policy_is_the_reference():
    """On-policy at the first step (LoRA B = 0): policy = reference, every margin 0, the loss log 2; the gradient
    pushes the chosen sample's error down and the rejected one's up."""
    x0, noise, _, ref = _pair_case(0, 0.5)
    v = ref.clone().requires_grad_()
    loss, metrics = dpo_loss(v, ref, x0, noise, beta=2000.0)
    assert abs(loss.item() - math.log(2)) <= TOL and float(metrics["implicit_reward_margin"]) == 0.0
    loss.backward()
    target = noise - x0
    step = -1e-9 * v.grad  # a tiny gradient step lowers the chosen error and raises the rejected one
    err = ((ref + step - target) ** 2).flatten(1).mean(1) - ((ref - target) ** 2).flatten(1).mean(1)
    assert (err[0::2] < 0).all() and (err[1::2] > 0).all()


@pytest.mark.parametrize(
    "uids, scores",
    [
        ([0, 0, 0, 0, 1, 1, 1, 1], [0.1, 0.9, 0.5, 0.2, 0.3, 0.3, 0.7, 0.1]),
        ([0, 0, 0, 0], [0.5, 0.5, 0.5, 0.5]),  # all-equal rewards: the first and the last
        ([0, 0, 1, 2, 2, 2], [0.2, 0.4, 0.9, 0.1, 0.1, 0.3]),  # a single-sample group gives no pair
        ([3, 1, 3, 1, 3, 1], [1.0, 2.0, 1.0, 0.0, 3.0, 2.0]),  # interleaved groups, ties at both ends
    ],
    ids=["two_groups", "all_equal", "single_sample_group", "interleaved_ties"],
)
def test_online_pairs_equal_verl_omni(uids, scores):
    chosen, rejected = online_pairs(torch.tensor(scores, dtype=torch.float64), torch.tensor(uids))
    ours = torch.stack([chosen, rejected], dim=1).flatten().tolist()
    assert ours == _reference_pairs(uids, scores)
    assert all(scores[c] >= scores[r] for c, r in zip(chosen.tolist(), rejected.tolist(), strict=True))


def test_labels_and_kept_lay_pairs_out_chosen_then_rejected():
    config = TrainConfig()
    config.flowgrpo.algorithm, config.lora.enabled = "diffusion_dpo", True
    algo = DiffusionDPO(config)
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.2, 0.3, 0.3, 0.7, 0.1, 0.0, 1.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0])
    groups = torch.arange(4).repeat_interleave(4)
    labels = algo.advantages(rewards, groups)
    assert labels.tolist() == [-1, 1, 0, 0, 0, 0, 1, -1, -1, 1, 0, 0, 1, 0, 0, -1]
    # two dp ranks of two groups each: each keeps its own pairs, chosen first
    assert algo.kept(labels, 0, 2, 0).tolist() == [1, 0, 6, 7]
    assert algo.kept(labels, 1, 2, 0).tolist() == [1, 0, 4, 7]


@pytest.mark.parametrize("kind", ["sd3", "qwenimage"])
def test_pair_timesteps_and_noised_data_equal_the_reference(kind):
    """The training grid is the scheduler's own; with the same normal draws our index is the one diffusers'
    compute_density_for_timestep_sampling gives, its timestep the scheduler's, and x_t its scale_noise."""
    import diffusers
    from diffusers.training_utils import compute_density_for_timestep_sampling

    from sp_diffusers.families.scheduler_configs import SCHEDULER_DEFAULTS

    cfg = {k: v for k, v in SCHEDULER_DEFAULTS[kind].items() if not k.startswith("_")}
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler.from_config(cfg)  # not set_timesteps: the training grid
    schedule = pipeline_schedule(kind, 6, image_seq_len=64)
    torch.testing.assert_close(schedule.train_sigmas, scheduler.sigmas.float(), atol=0, rtol=0)
    torch.manual_seed(5)
    u = compute_density_for_timestep_sampling(
        weighting_scheme="logit_normal", batch_size=64, logit_mean=0, logit_std=1, mode_scale=1.29
    )
    theirs = (u * scheduler.config.num_train_timesteps).long()
    torch.manual_seed(5)
    z = torch.normal(mean=0.0, std=1.0, size=(64,), device="cpu")
    ours = logit_normal_index(z, schedule.train_sigmas.numel())
    assert ours.tolist() == theirs.tolist()
    assert ours.min() < 150 and ours.max() > 850  # both ends of the schedule are reached
    timesteps = scheduler.timesteps[theirs]
    torch.testing.assert_close(schedule.train_sigmas[ours] * 1000.0, timesteps.float(), atol=1e-3, rtol=0)
    x0, noise = torch.randn(64, 3, 4, 4), torch.randn(64, 3, 4, 4)
    sigma = schedule.train_sigmas[ours].view(-1, 1, 1, 1)
    torch.testing.assert_close((1 - sigma) * x0 + sigma * noise, scheduler.scale_noise(x0, timesteps, noise),
                               atol=1e-6, rtol=0)


def test_forward_point_shared_by_a_pair_and_independent_of_the_micro_batches():
    config = TrainConfig()
    config.flowgrpo.algorithm, config.lora.enabled = "diffusion_dpo", True
    algo = DiffusionDPO(config)
    schedule = pipeline_schedule("qwenimage", 6, image_seq_len=64)
    final = torch.randn(8, 16, 4)
    traj = Trajectory(final.new_zeros((8, 0, 16, 4)), final.new_zeros((8, 0)), 0, final)
    traj.noise_seed = 1234
    pairs = torch.tensor([1, 3, 4, 6, 2, 0, 5, 7])  # four pairs, chosen first
    sigma, timestep, noise = algo.forward_point(traj, 0, pairs, schedule)
    assert torch.equal(sigma[0::2], sigma[1::2]) and torch.equal(noise[0::2], noise[1::2])
    assert torch.equal(timestep, sigma * 1000.0)
    assert all(not torch.equal(noise[2 * a], noise[2 * b]) for a in range(4) for b in range(a))  # a noise per pair
    for micro in pairs.reshape(-1, 2)[torch.tensor([2, 0])].flatten(), pairs[4:]:  # another order, a part
        s2, _, n2 = algo.forward_point(traj, 0, micro, schedule)
        for j, i in enumerate(micro.tolist()):
            row = pairs.tolist().index(i)
            assert float(s2[j]) == float(sigma[row]) and torch.equal(n2[j], noise[row])


def test_micro_batches_keep_pairs_whole_and_singles_unchanged():
    indices = torch.tensor([3, 1, 0, 2, 7, 6, 5, 4, 9, 8, 11, 10])
    for seed in range(5):
        for mini in (1, 2, 3):
            for micro in micro_batches(indices, mini, 4, seed, unit=2):
                for m in micro:
                    pairs = set(map(tuple, m.reshape(-1, 2).tolist()))
                    assert pairs <= set(map(tuple, indices.reshape(-1, 2).tolist()))
        # unit 1: the shuffle and cuts as before the unit existed
        perm = indices[torch.randperm(12, generator=torch.Generator().manual_seed(seed))]
        expected = [mb.split(4) for mb in perm.chunk(2)]
        got = micro_batches(indices, 2, 4, seed)
        assert [[t.tolist() for t in mb] for mb in got] == [[t.tolist() for t in mb] for mb in expected]
    with pytest.raises(ValueError, match="multiples of the unit 2"):
        micro_batches(indices, 1, 3, 0, unit=2)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("flowgrpo.group_size", 1, "group_size >= 2"),
        ("flowgrpo.micro_batch_size", 3, "even micro_batch_size"),
        ("flowgrpo.mini_batches", 3, "mini_batches <= prompts_per_rank"),
        ("flowgrpo.dpo.beta", 0.0, "flowgrpo.dpo.beta=0.0"),
        ("flowgrpo.dpo.beta", float("nan"), "flowgrpo.dpo.beta=nan"),
    ],
)
def test_dpo_config_refusals(key, value, match):
    from sp_diffusers.flowgrpo.algorithms.registry import algorithm_for
    from sp_diffusers.flowgrpo.config import apply_overrides

    config = TrainConfig()
    config.flowgrpo.algorithm, config.lora.enabled = "diffusion_dpo", True
    config.flowgrpo.micro_batch_size = 4
    apply_overrides(config, [f"{key}={value}"])
    with pytest.raises(ConfigError, match=match):
        algorithm_for(config)
