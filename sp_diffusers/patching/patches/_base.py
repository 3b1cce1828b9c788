"""What every patch module shares: the probe result, the logger, and the reversible swaps (``patching.swaps``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger("sp_diffusers.patching.patches")


@dataclass(frozen=True)
class Probe:
    """Whether the installed diffusers (on this host) has the defect, and why we think so."""

    needed: bool
    reason: str
