"""Rewards: the built-in latent rewards (``builtin``), rewards you bring by import path or file (``loading``),
scoring a rollout with them split over the SP group (``scoring``), and a CLIP score reward (``clip``)."""
