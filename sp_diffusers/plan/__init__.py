"""The planner: which (ulysses, ring, dp, checkpointing) layout fits a model and a video on N GPUs, from fake-tensor
runs of the real diffusers class through ``FSDPEngine`` on a fake process group of N ranks (no memory allocated),
with per-GPU memory by part (torch's memory trackers) and FLOPs (torch's FLOP formulas).

    models.py       the built-in model configs (released checkpoints' config.json) and family facts
    shapes.py       pixels or a token count -> latent grid -> tokens; the forward inputs of that size
    fake_world.py   the fake process group, fake tensors and what value reads see there
    fake_module_to.py  Module.to of fake parameters (peft moves each new adapter with it)
    tracker.py      torch's trackers recording each place's peak, the FLOPs and the bytes each collective sends
    trace.py        one fake run of FSDPEngine.train_step (and a rollout forward) at one layout
    extrapolate.py  the block shortcut: runs with 3 and 4 blocks -> the whole model
"""
