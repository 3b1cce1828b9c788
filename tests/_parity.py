"""Tolerances for comparing a parallel layout with one process, each derived from what it passes through.

Gradients: fp32, ``|g - g_ref| <= GRAD_ATOL + GRAD_RTOL * |g_ref|`` elementwise. Only the order of fp32 sums
differs between layouts (per-rank partial gradients, FSDP's reduce-scatter, the vector width and thread count
of the CPU), so the error is a few ulps of the largest partial sum: 1e-5 absolute covers gradients of O(1)
models, 1e-4 relative the large entries.

Parameters after one AdamW step are not compared at that tolerance: AdamW amplifies. Its first step moves a
parameter by ``lr * f(g)`` with ``f(g) = g / (|g| + eps)`` (m and v are bias-corrected to g and g^2), and f
is steep where ``|g|`` is near ``eps``: for two gradients a, b of the same sign
``|f(a) - f(b)| = eps |a - b| / ((|a| + eps)(|b| + eps))``, and for any signs
``|f(a) - f(b)| <= |a - b| / (min(|a|, |b|) + eps)``. Applied to every gradient the gradient check admits
(``|a - b| <= tol_g``, ``min(|a|, |b|) >= max(|g_ref| - tol_g, 0)``), the step may differ by

    lr * tol_g / (max(|g_ref| - tol_g, 0) + eps)      plus the rounding of ``p - lr * f(g)`` itself.

With eps = 1e-8 that bound is ~2 lr wherever |g| is below ~1e-5: the check would test nothing there. The
parity tests therefore run AdamW with ``eps = lr = 1e-3``: the bound is then at most ``tol_g`` everywhere,
and where ``|g| < eps`` the step is nearly linear in g, so a wrong gradient contract (a MEAN over the SP group
halves the gradients, a missing dp average doubles them) moves parameters by ~|g| / 2 and is caught by the
parameter check as well as by the gradient check.
"""

from __future__ import annotations

import torch

GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-4
PARITY_LR = 1e-3
PARITY_EPS = 1e-3  # AdamW eps of the parity tests: see the module docstring
_ULP = 2.0**-23  # fp32 relative spacing


def grad_tolerance(g_ref: torch.Tensor) -> torch.Tensor:
    """Elementwise admissible |g - g_ref| (fp32 reduction order)."""
    return GRAD_ATOL + GRAD_RTOL * g_ref.abs()


def adam_step_tolerance(p_ref: torch.Tensor, g_ref: torch.Tensor, lr: float, eps: float) -> torch.Tensor:
    """Elementwise admissible |p - p_ref| after one AdamW step (no weight decay, no clipping) from identical
    parameters, given gradients within :func:`grad_tolerance` of ``g_ref``: the Lipschitz bound of
    ``lr * g / (|g| + eps)`` over that ball, plus two ulps of the parameter and 1e-6 lr for the update's own
    rounding (bias corrections, sqrt, division)."""
    tol_g = grad_tolerance(g_ref)
    lipschitz = lr * tol_g / ((g_ref.abs() - tol_g).clamp_min(0.0) + eps)
    return lipschitz + 2 * _ULP * p_ref.abs() + 1e-6 * lr


def worst_grad(g: torch.Tensor, g_ref: torch.Tensor) -> tuple[bool, float]:
    """(within tolerance everywhere, max |g - g_ref|)."""
    diff = (g - g_ref).abs()
    return bool((diff <= grad_tolerance(g_ref)).all()), diff.max().item()


def worst_step(
    p: torch.Tensor, p_ref: torch.Tensor, g_ref: torch.Tensor, lr: float, eps: float
) -> tuple[bool, float, float]:
    """(within the AdamW-step bound everywhere, max |p - p_ref|, the largest ratio |p - p_ref| / bound)."""
    diff = (p - p_ref).abs()
    ratio = (diff / adam_step_tolerance(p_ref, g_ref, lr, eps)).max().item()
    return ratio <= 1.0, diff.max().item(), ratio


def assert_update_matches(got: dict, ref: dict, layout: str) -> None:
    """A distributed update equals one process's: every gradient within :func:`grad_tolerance`, the reference's step
    moved the model, every parameter with a gradient within the AdamW-step bound (``PARITY_LR``, ``PARITY_EPS``)."""
    assert set(got["grads"]) == set(ref["grads"]) and len(ref["grads"]) > 0
    for name, g_ref in ref["grads"].items():
        ok, err = worst_grad(got["grads"][name], g_ref)
        assert ok, f"{layout}: grad {name} off by {err:.3e}"
    assert ref["step_moved"] > 0.1 * PARITY_LR
    for name, p_ref in ref["params"].items():
        g_ref = ref["grads"].get(name)
        if g_ref is None:
            continue
        ok, err, ratio = worst_step(got["params"][name], p_ref, g_ref, PARITY_LR, PARITY_EPS)
        assert ok, f"{layout}: parameter {name} off by {err:.3e} ({ratio:.2f} x its bound)"


def adam_resumed_step_tolerance(
    p_ref: torch.Tensor,
    g_ref: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    eps: float,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.Tensor:
    """Elementwise admissible |p - p_ref| after AdamW step ``step`` (no weight decay, no clipping) from identical
    parameters and moments (``exp_avg``, ``exp_avg_sq`` before the step), given gradients within
    :func:`grad_tolerance` of ``g_ref``.

    The update is ``u(g) = lr * A / (sqrt(B) + eps)`` with ``A = (b1 m + (1 - b1) g) / c1`` and
    ``B = (b2 v + (1 - b2) g^2) / c2`` (c1, c2 the bias corrections), and
    ``|du/dg| <= lr [(1 - b1) / c1 / (sqrt(B) + eps) + |A| sqrt((1 - b2) / c2) / (sqrt(B) + eps)^2]`` (using
    ``sqrt(B) >= sqrt((1 - b2) / c2) |g|``). Taking the largest |A| and the smallest B over the gradient ball
    bounds the Lipschitz constant there; plus the rounding of the update as in :func:`adam_step_tolerance`.
    """
    b1, b2 = betas
    c1, c2 = 1 - b1**step, 1 - b2**step
    tol_g = grad_tolerance(g_ref)
    a_max = (b1 * exp_avg.abs() + (1 - b1) * (g_ref.abs() + tol_g)) / c1
    low = (g_ref.abs() - tol_g).clamp_min(0.0)
    root_b = ((b2 * exp_avg_sq + (1 - b2) * low.square()) / c2).sqrt()
    lipschitz = lr * ((1 - b1) / c1 / (root_b + eps) + a_max * ((1 - b2) / c2) ** 0.5 / (root_b + eps) ** 2)
    return lipschitz * tol_g + 2 * _ULP * p_ref.abs() + 1e-6 * lr
