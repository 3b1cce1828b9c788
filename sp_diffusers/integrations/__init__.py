"""Where sp-diffusers plugs into other trainers and rollout engines: ``verl/`` (an engine for verl, its
``verl.plugins`` entry point, the CLI's verl-style keys) and ``vllm_omni`` (the rollout's SP settings)."""
