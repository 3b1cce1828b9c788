"""HSDP (``dp_replicate``): the degrees refused with their fix, the trainer and verl keys that set it, checkpoints
that resume across sharding layouts both ways, and the ledger's count of HSDP's cross-replica all-reduce.

The step an HSDP engine takes is held to one process in tests/test_engine.py (``hsdp2_*`` layouts). Here the step
after resuming at HSDP is held to the same step under plain FSDP at the same dp 2 x SP 2 (the same samples per
rank, only the order of the fp32 sums differs): gradients within ``1e-5 + 1e-4 |g|``, parameters within the bound
those gradients imply through AdamW with the loaded moments (tests/_parity.py, ``adam_resumed_step_tolerance``).
A load is pure data movement: every parameter and AdamW moment loaded is bitwise what the other layout saved.
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

import pytest
import torch

from ._dist import run_distributed
from ._parity import PARITY_EPS, PARITY_LR, adam_resumed_step_tolerance, worst_grad

# ------------------------------------------------------------------------------------------ the degrees


@pytest.mark.parametrize(
    ("world", "ulysses", "ring", "replicate", "message"),
    [
        (
            4,
            2,
            1,
            3,
            r"dp_replicate=3 does not divide .* dp = world / \(ulysses \* ring\) = 4 / 2 = 2.*"
            r"fix: pick dp_replicate among 1, 2",
        ),
        (8, 2, 2, 4, r"dp_replicate=4 does not divide .* = 8 / 4 = 2.*among 1, 2"),
        (4, 1, 1, 0, r"dp_replicate must be a positive int, got 0; fix: dp_replicate=1"),
        (4, 1, 1, True, r"dp_replicate must be a positive int, got True"),
    ],
)
def test_replica_groups_must_hold_whole_sp_groups(world, ulysses, ring, replicate, message):
    from sp_diffusers.parallel.mesh import MeshError, ParallelDims

    with pytest.raises(MeshError, match=message):
        ParallelDims(world, ulysses, ring, replicate)


def test_hsdp_degrees():
    from sp_diffusers.parallel.mesh import ParallelDims

    dims = ParallelDims(16, 2, 2, 2)  # 2 nodes of 8: dp 4 = 2 replicas x 2 within, each node 2 SP groups of 4
    assert (dims.dp, dims.sp, dims.shard) == (4, 4, 8)
    assert ParallelDims(4, 2).shard == 4  # plain FSDP: every rank


def test_engine_settings_and_trainer_config():
    from sp_diffusers.engine import EngineSettings
    from sp_diffusers.flowgrpo.build import engine_settings
    from sp_diffusers.flowgrpo.config import ConfigError, load_config

    with pytest.raises(
        ValueError, match=r"dp_replicate=2 .* use_fsdp=False .*fix: use_fsdp=True, or dp_replicate=1"
    ):
        EngineSettings(use_fsdp=False, dp_replicate=2)
    assert engine_settings(load_config(None, ["parallel.dp_replicate=2"])).dp_replicate == 2
    with pytest.raises(ConfigError, match=r"parallel\.dp_replicate=0 is invalid: must be >= 1"):
        load_config(None, ["parallel.dp_replicate=0"])


# ------------------------------------------------------------------------------------------- verl keys

FSDP_SIZE = "actor_rollout_ref.actor.fsdp_config.fsdp_size"


def test_verl_fsdp_size_is_the_shard_group():
    """verl's ``create_device_mesh``: fsdp_size < 0 or = world shards over all ranks, a proper divisor N is a
    ``(world / N, N)`` = (ddp, fsdp) mesh: HSDP with world / N replica groups."""
    from sp_diffusers.integrations.verl.config import (
        dp_replicate_of,
        engine_settings,
        fsdp_size_of,
        parallel_dims,
    )

    assert [dp_replicate_of(n, 8, 2) for n in (-1, 8, 4, 2)] == [1, 1, 2, 4]
    assert [fsdp_size_of(r, 8) for r in (1, 2, 4)] == [-1, 4, 2]
    model = SimpleNamespace(ring_degree=1)
    engine = SimpleNamespace(strategy="fsdp2", ulysses_sequence_parallel_size=2, fsdp_size=4)
    assert parallel_dims(model, engine, 8).replicate == 2
    assert engine_settings(model, engine, None, world=8).dp_replicate == 2
    for bad, why in (
        (3, "does not divide the world of 8 ranks"),
        (16, "exceeds the world of 8 ranks"),
        (0, "does not divide"),
        (1, "is not a multiple of the SP degree ulysses x ring = 2"),
    ):
        with pytest.raises(ValueError, match=rf"fsdp_size={bad} {why}.*fix: fsdp_size=-1 .*one of \[2, 4\]"):
            dp_replicate_of(bad, 8, 2)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([f"{FSDP_SIZE}=4", "trainer.n_gpus_per_node=4", "trainer.nnodes=2"], 2),  # a node per replica
        ([f"{FSDP_SIZE}=-1"], 1),
        ([f"{FSDP_SIZE}=4", "trainer.n_gpus_per_node=4", "trainer.nnodes=2", "parallel.dp_replicate=2"], 2),
        ([f"{FSDP_SIZE}=4"], r"world is not given; fix: also give trainer\.n_gpus_per_node"),
        (
            [f"{FSDP_SIZE}=4", "trainer.n_gpus_per_node=4", "trainer.nnodes=2", "parallel.dp_replicate=4"],
            r"parallel\.dp_replicate=4 disagrees with .*fsdp_size=4, which means dp_replicate=2 on a world of 8",
        ),
        (
            [
                f"{FSDP_SIZE}=2",
                "trainer.n_gpus_per_node=4",
                "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4",
            ],
            r"fsdp_size=2 is not a multiple of the SP degree ulysses x ring = 4",
        ),
    ],
)
def test_verl_override_maps_fsdp_size(overrides, expected):
    from sp_diffusers.flowgrpo.config import ConfigError, load_config
    from sp_diffusers.integrations.verl.overrides import translate_overrides

    if isinstance(expected, str):
        with pytest.raises(ConfigError, match=expected):
            translate_overrides(overrides)
        return
    assert load_config(None, translate_overrides(overrides).overrides).parallel.dp_replicate == expected


# ------------------------------------------------------------------------------ checkpoints and ledger


@functools.cache
def _resume(root: str) -> dict:
    from tests.workers.hsdp import PHASES

    out = {}
    for phase, (world, _, _) in PHASES.items():
        out[phase] = run_distributed("tests.workers.hsdp:resume_across_layouts", world, phase, root)
    return out


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("hsdp")
    return root, _resume(str(root))


def _load(root, name: str) -> dict:
    return torch.load(root / f"{name}.pt", weights_only=True)


def _differ(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b) and any(k.startswith("exp_avg_sq:") for k in a)
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_checkpoints_resume_across_hsdp_and_fsdp_layouts(resumed):
    """Plain FSDP (dp 2 x SP 2) -> HSDP (2 replicas x shard 2 = SP 2) -> plain FSDP at dp 2 x SP 1 and at dp 2 x SP
    2: every load bitwise what was saved."""
    root, results = resumed
    meshes = {phase: rs[0]["mesh"] for phase, rs in results.items()}
    assert "(replicate=2, shard=2)" in meshes["b"] and "fsdp=4" in meshes["a"] and "fsdp=2" in meshes["c"]
    assert [r["global_step"] for phase in "abcd" for r in results[phase]] == [3] * 4 + [3] * 4 + [3] * 2 + [
        3
    ] * 4
    assert _differ(_load(root, "a_saved"), _load(root, "b_loaded")) == [], "FSDP -> HSDP changed state"
    b3 = {k: v for k, v in _load(root, "b_step3").items() if not k.startswith(("grad:", "before:"))}
    for phase in "cd":
        assert _differ(b3, _load(root, f"{phase}_loaded")) == [], f"HSDP -> FSDP ({phase}) changed state"


def test_the_step_after_resuming_at_hsdp_matches_plain_fsdp(resumed):
    root, _ = resumed
    ref, got = _load(root, "a_step3"), _load(root, "b_step3")
    names = [k.split(":", 1)[1] for k in ref if k.startswith("exp_avg:")]
    assert names and all(torch.equal(ref[f"before:param:{n}"], got[f"before:param:{n}"]) for n in names)
    moved = 0
    for name in names:
        ok, err = worst_grad(got[f"grad:{name}"], ref[f"grad:{name}"])
        assert ok, f"grad {name} off by {err:.3e}"
        bound = adam_resumed_step_tolerance(
            ref[f"param:{name}"],
            ref[f"grad:{name}"],
            ref[f"before:exp_avg:{name}"],
            ref[f"before:exp_avg_sq:{name}"],
            step=3,
            lr=PARITY_LR,
            eps=PARITY_EPS,
        )
        diff = (got[f"param:{name}"] - ref[f"param:{name}"]).abs()
        assert bool((diff <= bound).all()), f"{name}: off by {diff.max():.3e} ({(diff / bound).max():.2f}x)"
        moved += bool((ref[f"param:{name}"] != ref[f"before:param:{name}"]).any())
    assert moved > 0.8 * len(names), "the step moved too few parameters to test anything"


def test_ledger_counts_the_cross_replica_all_reduce_as_grad_reduce(resumed):
    """Per FSDP group with gradients: one reduce-scatter within the replica group and one all-reduce of the
    reduced shard S across the 2 replicas, whose bus bytes are 2 S (R - 1) / R = S."""
    _, results = resumed
    for r in results["b"]:
        calls, nbytes, all_reduce = r["expected"]
        assert all_reduce > 0 and calls % 2 == 0
        assert r["ledger"] == {"train_backward/grad_reduce": (calls, nbytes)}


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="verl is installed by scripts/setup.sh")
def test_verl_configs_carry_dp_replicate_as_fsdp_size(monkeypatch):
    """``fsdp_engine_via_verl``'s configs: dp_replicate out as verl's fsdp_size and back, on a world of 8."""
    from sp_diffusers.engine import EngineSettings
    from sp_diffusers.integrations.verl import config as verl_config

    monkeypatch.setattr(verl_config, "_world", lambda: 8)
    for replicate, fsdp_size in ((1, -1), (2, 4), (4, 2)):
        settings = EngineSettings(ulysses_sequence_parallel_size=2, dp_replicate=replicate)
        model, engine, optim = verl_config.verl_configs(settings, None)
        assert engine.fsdp_size == fsdp_size
        assert verl_config.engine_settings(model, engine, optim).dp_replicate == replicate
    with pytest.raises(ValueError, match=r"dp_replicate=3 does not divide"):
        verl_config.verl_configs(EngineSettings(dp_replicate=3), None)
