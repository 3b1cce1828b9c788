"""The planner: which (ulysses, ring, dp, checkpointing) layout fits a model and a video on N GPUs, from fake-tensor
runs of the real diffusers class through ``FSDPEngine`` on a fake process group of N ranks (no memory allocated),
with per-GPU memory by part (torch's memory trackers) and FLOPs (torch's FLOP formulas).
"""
