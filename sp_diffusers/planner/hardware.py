"""GPU presets and the step-time estimate.

Step time, per micro-batch on one GPU (stated as a model, not measured):

    compute  = FLOPs of the traced rank / (peak TFLOP/s x efficiency)
    sp       = bytes the SP collectives send / bandwidth      (the all-to-alls sit between the projections and
                                                                attention: nothing hides them)
    fsdp     = bytes FSDP's all-gathers and reduce-scatters send / bandwidth   (prefetched: hidden behind compute)
    step     = compute + sp + max(0, fsdp - compute)

Compiled (``plan --rl --compile blocks``), compute is divided by a stated speedup; sp and fsdp are unchanged (the
collectives inside the graphs send the same bytes), so less of fsdp is hidden (:func:`compute_scaled`).

A collective whose group spreads over more consecutive ranks than one node holds (``--nodes``: the GPUs divided
evenly; else 8 per node) uses the inter-node bandwidth: a data-parallel FSDP group of 16 ranks on 2 nodes, or
HSDP's replica groups (ranks one node apart), while HSDP's shard groups stay inside a node.
"""

from __future__ import annotations

from dataclasses import dataclass

from .models import PlanError

__all__ = ["GPUS", "Hardware", "compute_scaled", "hardware", "step_seconds"]


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float  # what torch.cuda reports as total memory, in GiB
    tflops_bf16: float  # dense peak
    tflops_fp32: float  # TF32 tensor-core peak (fp32 matmuls run as TF32 when allowed)
    bandwidth: float  # GB/s per GPU per direction inside a node (NVLink)
    inter_node_bandwidth: float  # GB/s per GPU between nodes (InfiniBand / RoCE)
    gpus_per_node: int = 8
    efficiency: float = 0.5  # achieved fraction of peak (peers report 0.47-0.54 for long-sequence training)

    def tflops(self, dtype: str) -> float:
        return self.tflops_bf16 if dtype == "bf16" else self.tflops_fp32


# vendor datasheets (SXM parts): H100 / H200 989 TFLOP/s bf16 dense, 494 TF32, NVLink 4 900 GB/s both
# directions; A100 312 / 156, NVLink 3 600 GB/s; 400 Gb/s (H100/H200) and 200 Gb/s (A100) per GPU between nodes
GPUS: dict[str, Hardware] = {
    "h100": Hardware("H100 80GB SXM", 79.1, 989.0, 494.0, 450.0, 50.0),
    "h200": Hardware("H200 141GB SXM", 139.8, 989.0, 494.0, 450.0, 50.0),
    "a100": Hardware("A100 80GB SXM", 79.1, 312.0, 156.0, 300.0, 25.0),
}


def hardware(
    preset: str = "h100",
    memory_gib: float | None = None,
    tflops: float | None = None,
    bandwidth: float | None = None,
    efficiency: float | None = None,
    gpus_per_node: int | None = None,
) -> Hardware:
    """A preset with any of its figures replaced (``--gpu-memory``, ``--tflops``, ``--bandwidth``)."""
    key = preset.lower()
    if key not in GPUS:
        raise PlanError(
            f"--gpu {preset!r} is not a preset; fix: one of {', '.join(GPUS)}, or give --tflops/--bandwidth"
        )
    base = GPUS[key]
    for name, value in (("--gpu-memory", memory_gib), ("--tflops", tflops), ("--bandwidth", bandwidth)):
        if value is not None and not value > 0:
            raise PlanError(f"{name} {value} is invalid: it must be a positive number")
    if efficiency is not None and not 0 < efficiency <= 1:
        raise PlanError(f"--efficiency {efficiency} is invalid: it must be in (0, 1]")
    return Hardware(
        base.name if tflops is None and bandwidth is None else f"{base.name} (adjusted)",
        memory_gib if memory_gib is not None else base.memory_gib,
        tflops if tflops is not None else base.tflops_bf16,
        tflops if tflops is not None else base.tflops_fp32,
        bandwidth if bandwidth is not None else base.bandwidth,
        base.inter_node_bandwidth,
        gpus_per_node if gpus_per_node is not None else base.gpus_per_node,
        efficiency if efficiency is not None else base.efficiency,
    )


def step_seconds(
    hw: Hardware, dtype: str, flops: float, comm: dict[tuple[str, int], float]
) -> dict[str, float]:
    """The step-time model of the module doc: its terms and the total, in seconds."""
    compute = flops / (hw.tflops(dtype) * 1e12 * hw.efficiency)
    terms = {"sp": 0.0, "fsdp": 0.0, "other": 0.0}
    for (kind, span), nbytes in comm.items():
        bw = hw.bandwidth if span <= hw.gpus_per_node else hw.inter_node_bandwidth
        terms[kind] += nbytes / (bw * 1e9)
    exposed = terms["sp"] + terms["other"] + max(0.0, terms["fsdp"] - compute)
    return {
        "compute": compute,
        "sp_comm": terms["sp"],
        "fsdp_comm": terms["fsdp"],
        "total": compute + exposed,
    }


def compute_scaled(terms: dict[str, float], speedup: float) -> dict[str, float]:
    """``step_seconds`` terms with the compute divided by ``speedup`` (a compiled forward: ``plan --rl
    --compile``) and the total recomputed: the collectives' bytes and seconds unchanged, the FSDP ones hidden
    behind the smaller compute. Only the terms that are there are used (``total`` defaults to compute + SP)."""
    if speedup == 1.0:
        return dict(terms)
    compute = terms.get("compute", 0.0)
    fsdp = terms.get("fsdp_comm", 0.0)
    total = terms.get("total", compute + terms.get("sp_comm", 0.0) + max(0.0, fsdp - compute))
    rest = total - compute - max(0.0, fsdp - compute)  # the exposed SP and other collectives
    scaled = compute / speedup
    return {**terms, "compute": scaled, "total": scaled + rest + max(0.0, fsdp - scaled)}
