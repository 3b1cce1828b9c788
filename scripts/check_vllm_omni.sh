#!/usr/bin/env bash
# Rollout/trainer consistency against the real vllm-omni 0.30.0 (CPU, 2 gloo ranks). Not part of CI: it
# builds a separate ~2.3 GB environment (~3 min the first time; vllm-omni cannot share one with verl 0.9.1).
#
#   1. sp_diffusers.integrations.vllm_omni's settings are accepted by vllm-omni's real DiffusionParallelConfig
#      (same sequence_parallel_size and world size), and the settings our validator refuses are refused there.
#   2. ulysses_sdpa's attention forward equals vllm-omni's UlyssesParallelAttention (pre_attention -> its SDPA
#      kernel -> post_attention) on the same Q/K/V shards, and both equal SDPA on the unsharded tensors:
#      plain, key-padding mask, GQA (fp32, max |diff| <= 1e-6).
#
# The environment follows the --no-deps recipe of docs/integrations.md: torch 2.13.0 (CPU), then
# vllm + vllm-omni without their dependencies (the PyPI vllm wheel is a CUDA build and pins another torch),
# then the light runtime dependencies their import needs, pinned to vllm's/vllm-omni's ranges. No triton,
# torchvision, torchcodec or flashinfer. Idempotent (a stamp file skips the install the second time).
#
# Usage: bash scripts/check_vllm_omni.sh     (SP_VLLM_OMNI_VENV=DIR to place the environment elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${SP_PYTHON:-python3}
VENV=${SP_VLLM_OMNI_VENV:-$HOME/.cache/sp-diffusers/vllm-omni-venv}
STAMP="$VENV/.sp-diffusers-vllm-omni"
DEPS=(
  "diffusers==0.40.0" "transformers>=5.13,<5.15" "accelerate==1.12.0" "aenum==3.1.16"
  safetensors omegaconf einops pydantic pydantic-settings pyzmq msgpack prettytable tqdm janus
  msgspec cloudpickle psutil py-cpuinfo requests regex pyyaml numpy sentencepiece tokenizers cachetools
  blake3 cbor2 pybase64 huggingface_hub filelock typing_extensions packaging aiohttp openai-harmony openai
  uvloop prometheus_client "fastapi>=0.133,<0.137" partial-json-parser "llguidance>=1.7,<1.8" tiktoken loguru
)
want="$(sha1sum "$0" | cut -c1-12)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "[vllm-omni] building $VENV"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0" "vllm==0.30.0" "vllm-omni==0.30.0" \
    xgrammar "apache-tvm-ffi==0.1.11"
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" "${DEPS[@]}"
  echo "$want" > "$STAMP"
fi
echo "[vllm-omni] $("$VENV/bin/python" -c 'import importlib.metadata as m; print(*(f"{p} {m.version(p)}" for p in ("torch", "vllm", "vllm-omni", "diffusers")), sep=" | ")')"

# sp-diffusers itself, editable from this checkout
"$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0" -e .
export OMP_NUM_THREADS=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# a file, not stdin: the spawned ranks re-import the main module
cat > "$work/check_vllm_omni.py" <<'EOF'
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TOL = 1e-6


def check_configs() -> None:
    import dataclasses

    from vllm_omni.diffusion.data import DiffusionParallelConfig

    from sp_diffusers.integrations.vllm_omni import (
        RolloutConfigError,
        RolloutParallelSettings,
        rollout_settings,
        validate,
    )

    theirs = {f.name for f in dataclasses.fields(DiffusionParallelConfig)}
    ours = {f.name for f in dataclasses.fields(RolloutParallelSettings)}
    assert ours <= theirs, f"fields vllm-omni does not have: {sorted(ours - theirs)}"
    good = [
        rollout_settings(1),
        rollout_settings(2, num_attention_heads=24, image_tokens=4096),
        rollout_settings(4, num_attention_heads=24),
        rollout_settings(2, cfg_parallel_size=2),
        rollout_settings(4, num_attention_heads=6, ulysses_mode="advanced_uaa"),
    ]
    for s in good:
        pc = DiffusionParallelConfig(**s.parallel_config_kwargs())
        got = (pc.ulysses_degree, pc.ring_degree, pc.sequence_parallel_size, pc.cfg_parallel_size, pc.world_size)
        assert got == (s.ulysses_degree, s.ring_degree, s.sp_size, s.cfg_parallel_size, s.world_size), (s, got)
        print(f"[config] accepted {s.parallel_config_kwargs()} -> world_size {pc.world_size}")
    bad = [
        {"ulysses_degree": 2, "ring_degree": 2, "sequence_parallel_size": 2},
        {"cfg_parallel_size": 0},
        {"ulysses_mode": "loose"},
        {"ulysses_degree": 0},
    ]
    for kwargs in bad:
        try:
            validate(RolloutParallelSettings(**kwargs))
            raise SystemExit(f"our validator accepted {kwargs}")
        except RolloutConfigError as err:
            ours_msg = str(err)
        try:
            DiffusionParallelConfig(**kwargs)
            raise SystemExit(f"vllm-omni accepted {kwargs} that sp-diffusers refuses")
        except Exception as err:  # pydantic ValidationError / AssertionError
            theirs_msg = f"{type(err).__name__}"
        print(f"[config] refused by both: {kwargs} (ours: {ours_msg.split(';')[0]}; vllm-omni: {theirs_msg})")


class _SPGroup:
    """The parts of vllm-omni's SequenceParallelGroupCoordinator that UlyssesParallelAttention reads."""

    def __init__(self, group, rank: int, world: int) -> None:
        self.ulysses_group, self.ulysses_rank, self.ulysses_world_size = group, rank, world
        self.ring_group, self.ring_world_size = None, 1


def _rank(rank: int, world: int, init: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
        import sp_diffusers
        from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
        from torch.distributed.device_mesh import init_device_mesh
        from vllm_omni.diffusion.attention.backends.abstract import AttentionMetadata
        from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl
        from vllm_omni.diffusion.attention.parallel.ulysses import UlyssesParallelAttention

        sp_diffusers.install()
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("ring", "ulysses"))
        config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=world))
        config.setup(rank, world, torch.device("cpu"), mesh=mesh)
        ulysses = UlyssesParallelAttention(_SPGroup(mesh.get_group("ulysses"), rank, world), 2, 1, False)
        results = {}
        for name, heads, kv_heads, masked in (("plain", 4, 4, False), ("key_padding_mask", 4, 4, True),
                                              ("gqa", 4, 2, False)):
            g = torch.Generator().manual_seed(0)
            b, s, d = 2, 16, 8
            qf, kf, vf = (torch.randn(b, s, h, d, generator=g) for h in (heads, kv_heads, kv_heads))
            mask = torch.ones(b, s, dtype=torch.bool)
            if masked:
                mask[0, 11:] = False  # ragged text: padded key positions
                mask[1, 14:] = False
            shard = slice(rank * s // world, (rank + 1) * s // world)
            q, k, v = qf[:, shard], kf[:, shard], vf[:, shard]
            ours = sp_diffusers.ulysses_sdpa_attention(
                q, k, v, attn_mask=mask if masked else None, enable_gqa=heads != kv_heads, _parallel_config=config
            )
            meta = AttentionMetadata(attn_mask=mask.clone() if masked else None)
            q2, k2, v2, meta, ctx = ulysses.pre_attention(q, k, v, meta)
            kernel = SDPAImpl(num_heads=heads // world, head_size=d, softmax_scale=d**-0.5, num_kv_heads=kv_heads)
            theirs = ulysses.post_attention(kernel._forward_impl(q2, k2, v2, meta), ctx)
            ref = torch.nn.functional.scaled_dot_product_attention(
                qf.transpose(1, 2), kf.transpose(1, 2), vf.transpose(1, 2),
                attn_mask=mask[:, None, None, :] if masked else None, enable_gqa=heads != kv_heads,
            ).transpose(1, 2)[:, shard]
            results[name] = {
                "ours_vs_vllm_omni": (ours - theirs).abs().max().item(),
                "ours_vs_full_sdpa": (ours - ref).abs().max().item(),
                "vllm_omni_vs_full_sdpa": (theirs - ref).abs().max().item(),
                "shape": tuple(ours.shape),
            }
        queue.put((rank, results))
    except BaseException:
        import traceback

        queue.put((rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_attention(world: int = 2) -> None:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_rank, args=(r, world, os.path.join(tmp, "rdzv"), queue)) for r in range(world)
        ]
        for p in procs:
            p.start()
        out = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=30)
    failed = False
    for rank in sorted(out):
        if isinstance(out[rank], str):
            raise SystemExit(f"rank {rank} failed:\n{out[rank]}")
        for name, r in out[rank].items():
            ok = max(r["ours_vs_vllm_omni"], r["ours_vs_full_sdpa"], r["vllm_omni_vs_full_sdpa"]) <= TOL
            failed |= not ok
            print(
                f"[attention] rank {rank} {name:17s} {r['shape']}: |ours - vllm-omni| = {r['ours_vs_vllm_omni']:.2e}, "
                f"|ours - SDPA| = {r['ours_vs_full_sdpa']:.2e}, |vllm-omni - SDPA| = {r['vllm_omni_vs_full_sdpa']:.2e}"
                f" {'ok' if ok else 'FAIL'}"
            )
    if failed:
        raise SystemExit(f"attention outputs differ by more than {TOL}")


if __name__ == "__main__":
    check_configs()
    check_attention()
    print("[vllm-omni] all checks passed")
    sys.exit(0)
EOF
"$VENV/bin/python" "$work/check_vllm_omni.py"
