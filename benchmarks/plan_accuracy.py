"""The planner's predicted peak against the same step run for real: a narrow WanTransformer3DModel (the real
class; 2 heads x 64, FFN 2048, 4 blocks, so the block shortcut extrapolates) through ``FSDPEngine.train_step`` on
CPU processes (gloo), over tokens x SP degree x activation checkpointing x LoRA / full fine-tuning.

    python benchmarks/plan_accuracy.py [--tokens 4096 16384] [--sp 1 2] [--long-tokens 32768] [--json out.json]
                                       [--plot out.png]
    python benchmarks/plan_accuracy.py --long --tokens 65536   # SP = 2, checkpointing, one point (LONG model)

Prediction: ``sp_diffusers.planner`` with ``target="cpu"`` (a CPU process's habits), fp32, world = SP degree.
Measured on every rank, on two consecutive steps, two ways:
- the growth of the process's peak resident memory over a step run without any tracker (``/proc/self/clear_refs``
  <- 5 resets the high-water mark, ``VmHWM`` reads it), against the predicted peak less the predicted memory at
  the step's start;
- torch's memory tracker on the real tensors of the next step (the tracker the planner runs on fake ones): the
  peak, bytes.
glibc serves allocations of 64 KiB and more with mmap here (``mallopt(M_MMAP_THRESHOLD)``), so freed tensors leave
the resident set at once, as they leave a GPU's allocated bytes. Each point measures a running job's steps: one
train step runs first, unmeasured (AdamW's state, the allocator's arenas and every lazy initialisation exist
afterwards); before each measured step the cached CPU send buffers are dropped, so it creates them as the
planner's single fake step does.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._harness import spawn, write_json

NARROW = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=64,
    in_channels=16,
    out_channels=16,
    text_dim=256,
    freq_dim=64,
    ffn_dim=2048,
    num_layers=4,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
# the long run (--long): 64k tokens of fp32 attention on one CPU core per rank; head dim 16 quarters its cost
LONG = {**NARROW, "attention_head_dim": 16, "num_layers": 3}
TEXT_LEN = 64
LORA_RANK = 8


def narrow_spec(config: dict | None = None):
    from sp_diffusers.planner.models import FAMILIES, ModelSpec

    return ModelSpec(
        "narrow-wan", "wan", dict(config or NARROW), FAMILIES["wan"], source="benchmarks/plan_accuracy.py"
    )


def predict(tokens: int, sp: int, ckpt: bool, lora: bool, config: dict | None = None) -> dict:
    """The planner's figures for one point (world = Ulysses degree = sp)."""
    from sp_diffusers.planner.hardware import hardware
    from sp_diffusers.planner.planner import PlanRequest, make_plan
    from sp_diffusers.planner.shapes import workload_from_tokens

    spec = narrow_spec(config)
    req = PlanRequest(
        spec,
        workload_from_tokens(spec, tokens, text_len=TEXT_LEN),
        sp,
        hardware("h100"),
        dtype="fp32",
        lora_rank=LORA_RANK if lora else None,
        ulysses=sp,
        ring=1,
        checkpointing="on" if ckpt else "off",
        target="cpu",
        workers=1,
    )
    (p,) = make_plan(req).layouts
    return {"peak": p.peak_bytes, "start": p.start_bytes, "where": p.where}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _mmap_large_allocations() -> None:
    """glibc: every allocation of 64 KiB or more gets its own mapping, returned to the OS when freed (a fixed
    threshold also stops glibc from raising it, which would keep freed tensors resident in its heap)."""
    import ctypes

    m_mmap_threshold = -3
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 64 * 1024)


def measure_rank(
    rank: int,
    world: int,
    tokens: int,
    ckpt: bool,
    lora: bool,
    config: dict | None = None,
    warmup: bool = True,
) -> dict:
    """Real train steps at this point: the peak-RSS growth of one without a tracker, then torch's tracker peak and
    start on the next (``warmup``: both after an untraced step; without, the RSS step's one-time allocations count
    too)."""
    _mmap_large_allocations()
    import logging
    import warnings

    import torch
    from diffusers.utils import logging as dlogging

    import sp_diffusers
    from sp_diffusers.engine.settings import EngineSettings, LoraSettings
    from sp_diffusers.parallel.exchange import release_buffers
    from sp_diffusers.planner.shapes import build_inputs, workload_from_tokens
    from sp_diffusers.planner.trace import create_optimizer_state, plan_loss
    from sp_diffusers.planner.tracker import make_tracker

    dlogging.set_verbosity(logging.ERROR)
    warnings.filterwarnings("ignore")
    sp_diffusers.install()
    spec = narrow_spec(config)
    torch.manual_seed(0)
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**spec.config)
    settings = EngineSettings(
        ulysses_sequence_parallel_size=world,
        lora=LoraSettings(rank=LORA_RANK, alpha=float(LORA_RANK)) if lora else None,
        activation_checkpointing=ckpt,
        device="cpu",
    )
    engine = sp_diffusers.FSDPEngine(model, settings)
    torch.manual_seed(1)  # the same micro-batch on every rank of the SP group
    inputs = build_inputs(spec, engine.model, workload_from_tokens(spec, tokens, text_len=TEXT_LEN))
    batch = {"inputs": inputs}
    create_optimizer_state(engine)
    if warmup:
        engine.train_step(batch, plan_loss)  # the running job's previous step
        release_buffers()
    # resident memory on a step without a tracker: a tracker's hooks could hold memory of their own (torch's
    # module tracker did: planner/tracker.py), which a measure under it would count as the step's
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    engine.train_step(batch, plan_loss)
    growth = _rss("VmHWM") - before
    release_buffers()
    lists = {"blocks": spec.config["num_layers"]}
    tracker = make_tracker(
        engine.model, engine.optimizer, lists, tuple(v for v in inputs.values() if torch.is_tensor(v))
    )
    gc.collect()
    try:
        with tracker:
            tracker.start()
            engine.train_step(batch, plan_loss)
    finally:
        tracker.remove_hooks()
    places = tracker.places()
    return {
        "tracker_peak": max(p["total"] for p in places.values()),
        "tracker_start": places[("start",)]["total"],
        "rss_growth": growth,
    }


def _point(
    tokens: int, sp: int, ckpt: bool, lora: bool, config: dict | None = None, warmup: bool = True
) -> dict:
    pred = predict(tokens, sp, ckpt, lora, config)
    ranks = spawn(measure_rank, sp, tokens, ckpt, lora, config, warmup)
    growth_pred = pred["peak"] - pred["start"]
    row = {
        "tokens": tokens,
        "sp": sp,
        "checkpointing": ckpt,
        "lora": lora,
        "predicted_peak": pred["peak"],
        "predicted_growth": growth_pred,
        "peak_at": pred["where"],
        "ranks": ranks,
    }
    row["tracker_error"] = max(
        ((pred["peak"] - r["tracker_peak"]) / r["tracker_peak"] for r in ranks), key=abs
    )
    row["rss_error"] = max(((growth_pred - r["rss_growth"]) / r["rss_growth"] for r in ranks), key=abs)
    mib = 1 << 20
    print(
        f"S={tokens:6d} SP={sp} ckpt={'on ' if ckpt else 'off'} {'lora' if lora else 'full'}: predicted peak "
        f"{pred['peak'] / mib:8.1f} MiB, tracker {max(r['tracker_peak'] for r in ranks) / mib:8.1f} "
        f"({row['tracker_error']:+.1%}); predicted growth {growth_pred / mib:8.1f}, RSS "
        f"{max(r['rss_growth'] for r in ranks) / mib:8.1f} ({row['rss_error']:+.1%})",
        flush=True,
    )
    return row


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mib = 1 << 20
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for key, pred, label, marker in (
        ("tracker_peak", "predicted_peak", "peak (torch's tracker, real tensors)", "o"),
        ("rss_growth", "predicted_growth", "growth of peak RSS over the step", "s"),
    ):
        xs = [r[key] / mib for row in rows for r in row["ranks"]]
        ys = [row[pred] / mib for row in rows for _ in row["ranks"]]
        ax.scatter(xs, ys, label=label, marker=marker, alpha=0.7)
    lo = min(min(r["rss_growth"], r["tracker_peak"]) for row in rows for r in row["ranks"]) / mib / 1.3
    hi = (
        max(max(row["predicted_peak"], *(r["tracker_peak"] for r in row["ranks"])) for row in rows)
        / mib
        * 1.3
    )
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.8, label="y = x")
    ax.plot([lo, hi], [lo * 1.1, hi * 1.1], "k:", lw=0.6, label="+-10%")
    ax.plot([lo, hi], [lo * 0.9, hi * 0.9], "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (MiB per rank)")
    ax.set_ylabel("predicted by sp-diffusers plan (MiB)")
    ax.set_title("planner vs real train_step (narrow Wan, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def long_run(tokens: int) -> dict:
    """Item 3: forward + backward + step at ``tokens`` with SP = 2 and checkpointing on the 2 CPU ranks, against
    the prediction and against the predicted one-process peak at the same length."""
    row = _point(tokens, 2, True, False, LONG)
    one = predict(tokens, 1, True, False, LONG)
    row["predicted_one_process_peak"] = one["peak"]
    row["measured_over_one_process"] = max(r["tracker_peak"] for r in row["ranks"]) / one["peak"]
    print(
        f"per-rank peak / predicted one-process peak ({one['peak'] / (1 << 20):.1f} MiB): "
        f"{row['measured_over_one_process']:.3f}"
    )
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument(
        "--long-tokens",
        type=int,
        nargs="*",
        default=[32768],
        help="extra points at SP = 2 with checkpointing",
    )
    ap.add_argument("--sp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--checkpointing", choices=("on", "off", "both"), default="both")
    ap.add_argument("--lora", choices=("on", "off", "both"), default="both")
    ap.add_argument("--blocks", type=int, default=None, help="the narrow model's block count (default 4)")
    ap.add_argument("--long", action="store_true", help="the long-sequence run (SP = 2, checkpointing) only")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    if args.long:
        result = {"model": LONG, "long": [long_run(t) for t in args.tokens]}
        write_json(args.json, result)
        return result
    flags = {"on": [True], "off": [False], "both": [False, True]}
    model = NARROW if args.blocks is None else {**NARROW, "num_layers": args.blocks}
    rows = [
        _point(t, sp, ckpt, lora, model)
        for t in args.tokens
        for sp in args.sp
        for ckpt in flags[args.checkpointing]
        for lora in flags[args.lora]
    ]
    rows += [_point(t, 2, True, lora, model) for t in args.long_tokens for lora in flags[args.lora]]
    worst = {k: max(abs(r[k]) for r in rows) for k in ("tracker_error", "rss_error")}
    print(
        f"{len(rows)} points; largest |error|: tracker {worst['tracker_error']:.1%}, RSS {worst['rss_error']:.1%}"
    )
    result = {"model": model, "text_len": TEXT_LEN, "lora_rank": LORA_RANK, "rows": rows, "worst": worst}
    write_json(args.json, result)
    if args.plot:
        plot(rows, args.plot)
    return result


if __name__ == "__main__":
    main()
