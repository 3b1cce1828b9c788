"""Where sp-diffusers plugs into other trainers and rollout engines.

verl.py            the ``verl.plugins`` entry point: registers SPDiffusersEngine with verl and runs install() in
                   every process that imports verl (verl-omni's workers get the backend and the verl_omni_*
                   patches from it; needs verl)
verl_engine.py     SPDiffusersEngine: verl's BaseEngine over one FSDPEngine
verl_config.py     verl's model/engine/optimizer configs -> EngineSettings, and back
verl_registry.py   EngineRegistry registration; fsdp_engine_via_verl
verl_weights.py    full-tensor weight export for the rollout's weight sync (LoRA-aware)
verl_cpu.py        an opt-in gloo CPU platform for verl (VERL_PLATFORM=cpu)
verl_overrides.py  ``sp-diffusers train`` with verl-style hydra keys -> the FlowGRPO TrainConfig
vllm_omni.py       the rollout side: vllm-omni's sequence-parallel settings, checked against the trainer's
"""
