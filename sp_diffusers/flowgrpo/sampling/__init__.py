"""How a rollout samples: each family's schedule (``schedule``, ``pipeline_schedule``), every stochastic and
deterministic step rule with its log-probability (``sde``), the one denoising loop with a span of stochastic steps
and the per-step log-prob evaluation training shares with it (``denoise``; what it keeps: ``trajectory``),
classifier-free guidance in one forward and the
weights a rollout holds gathered (``guidance``). The math modules import nothing but torch and diffusers'
schedulers; nothing here knows which algorithm runs."""
