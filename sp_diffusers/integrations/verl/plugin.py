"""sp-diffusers as a verl engine: ``actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=2``
turns on exact Ulysses SP for a diffusers transformer under FSDP2.

``SPDiffusersEngine`` is a verl ``BaseEngine`` that delegates everything to one ``sp_diffusers.FSDPEngine``
(mesh, sharding, the SP gradient contract, batches, optimizer, checkpoints): there is no second engine.
It is registered with verl's ``EngineRegistry`` for backends ``fsdp`` and ``fsdp2`` (both mean FSDP2
``fully_shard`` here) on devices cuda, npu and cpu, under ``MODEL_TYPE`` ("sp_diffusers_diffusion") and,
when no other engine holds it, under verl-omni's "diffusion_model". Importing this module registers it;
so does ``import verl`` through the ``verl.plugins`` entry point. Built the way verl's workers build engines::

    engine = EngineRegistry.new(model_type="sp_diffusers_diffusion", backend=engine_config.strategy,
                                model_config=DiffusionModelConfig(path=...), engine_config=FSDPEngineConfig(
                                    strategy="fsdp2", ulysses_sequence_parallel_size=2),
                                optimizer_config=FSDPOptimizerConfig(lr=1e-4), checkpoint_config=CheckpointConfig())
    engine.initialize()
    out = engine.train_batch(data, loss_function)   # TensorDict [B, ...]; out["metrics"]

Only ``engine_config.ulysses_sequence_parallel_size`` turns SP on; dp = world / SP, SP ranks adjacent.

The entry point also runs ``sp_diffusers.install()`` in every process that imports verl (Ray workers
included): diffusers then knows ``ulysses_sdpa`` and has the patches its version needs, and where verl-omni
is installed its engine takes ``actor_rollout_ref.model.attn_backend=ulysses_sdpa`` (the ``verl_omni_*``
patches). The install report is logged once, at INFO, by the import that installs.

"""

from __future__ import annotations

import logging
import warnings

try:
    import verl  # noqa: F401  (the error below must name the extra, not a verl submodule)
except ImportError as err:
    raise ImportError(
        f"sp_diffusers.integrations.verl.plugin needs verl ({err}); fix: pip install 'sp-diffusers[verl]' "
        "(verl==0.9.1, installed next to your torch build without verl's extras)"
    ) from err

from .cpu import register_cpu_platform, wants_cpu_platform

# verl resolves its platform when verl.workers.engine is imported; the CPU platform must exist by then.
if wants_cpu_platform():
    register_cpu_platform()

with warnings.catch_warnings():
    # importing verl.workers.engine announces each optional engine it cannot import (torchtitan, megatron, ...),
    # in every process: nothing for a diffusers user to act on, and it is our import that triggers it
    warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
    from .config import BACKENDS, DiffusionModelConfig
    from .engine import INPUT_NAMES, SPDiffusersEngine, engine_loss
    from .registration import (
        DEVICES,
        MODEL_TYPE,
        SHARED_MODEL_TYPE,
        fsdp_engine_via_verl,
        register,
    )

__all__ = [
    "BACKENDS",
    "DEVICES",
    "INPUT_NAMES",
    "MODEL_TYPE",
    "SHARED_MODEL_TYPE",
    "DiffusionModelConfig",
    "SPDiffusersEngine",
    "engine_loss",
    "fsdp_engine_via_verl",
    "register",
]

REGISTERED = register()

_logger = logging.getLogger(__name__)


def _install() -> object | None:
    """``sp_diffusers.install()`` for the plugin: idempotent, its report logged by the import that installs.

    verl swallows a plugin's exceptions (logged at DEBUG), so a failure is logged here as a warning and the
    engine registration above stands; ``context_parallel_config`` / the engine raise it again where SP is used.
    """
    from ...patching import installer

    first = not installer.is_installed()
    try:
        report = installer.install()
    except Exception as err:
        _logger.warning(
            "sp-diffusers: install() failed in the verl plugin (%s: %s); ulysses_sdpa is not registered in "
            "this process. Fix: see the error, or set VERL_USE_EXTERNAL_PLUGINS to leave sp_diffusers out",
            type(err).__name__,
            err,
        )
        return None
    if first:
        _logger.info("%s", report)
    return report


INSTALLED = _install()
