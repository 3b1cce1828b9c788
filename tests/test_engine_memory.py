"""Weights reach the device only as shards: ``FSDPEngine`` built from a model on ``meta`` (2 gloo ranks).

The per-rank peak while building the engine is measured with torch's own memory tracker
(``torch.distributed._tools.mem_tracker.MemTracker``: every tensor allocated inside, by device) and must stay
within this rank's share of the parameters plus one block plus the buffers (which are not sharded): the
whole model never exists on a rank. The loaded values are the checkpoint's exactly (each rank reads only its
rows of the safetensors file), with LoRA adapters the checkpoint lacks initialised by peft.
"""

from __future__ import annotations

import pytest

from ._dist import run_distributed


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("wan")
    return run_distributed("tests.workers.engine_memory:build_checks", 2, str(folder))


def test_meta_model_builds_within_a_shard_plus_one_block(results):
    for r in results:
        assert r["meta_before"]
        bound = r["param_bytes"] / 2 + r["block_bytes"] + r["buffer_bytes"]
        assert r["param_bytes"] + r["buffer_bytes"] > bound  # the whole model would not fit: not vacuous
        assert 0 < r["peak_bytes"] <= bound, (r["peak_bytes"], bound)
        print(
            f"peak {r['peak_bytes']} B, bound {bound:.0f} B, whole model {r['param_bytes'] + r['buffer_bytes']} B"
        )
        assert r["values_equal"] and r["rope_equal"]
        assert r["n_params"][0] == r["n_params"][1]


def test_resume_loads_in_place(results):
    """The load's peak: this rank's parameter shard once (the rollback copy, in host memory) and the AdamW
    moments it loads into (2 x the shard), plus one block of temporaries; loading into copies of everything
    (parameters and moments again) would exceed it."""
    for r in results:
        shard = r["param_bytes"] / 2
        bound = 3 * shard + r["block_bytes"]
        assert 5 * shard > bound  # the copies would not fit: not vacuous
        assert 0 < r["resume_peak_bytes"] <= bound, (r["resume_peak_bytes"], bound)
        assert r["resumed_equal"]
        print(f"resume peak {r['resume_peak_bytes']} B, bound {bound:.0f} B")


def test_meta_model_sources_and_refusals(results):
    for r in results:
        assert r["lora_base_equal"] and r["lora_b_zero"] and r["lora_a_random"] and r["lora_step_finite"]
        assert r["empty_real"]
        assert r["init_called"] == ["FSDPWanTransformer3DModel"]  # the sharded model itself
        assert r["no_source"].startswith("WeightsError") and "weights=" in r["no_source"]
        assert (
            r["source_for_real_model"].startswith("WeightsError")
            and "meta_model" in r["source_for_real_model"]
        )
        assert r["wrong_folder"].startswith("WeightsError") and "no safetensors" in r["wrong_folder"]
        # an NCCL world's control flow on gloo: agreements on gloo twins over the same ranks
        assert r["twins"] == [("gloo", [0, 1], True), ("gloo", [0, 1], True)]
        assert r["twin_step"] == ("same", (1, 16, 1, 4, 4), True)
    assert "failed on rank 1" in results[0]["one_rank_fails"]
    assert "no safetensors" in results[1]["one_rank_fails"]
