"""Metrics shared by the evals: every method is compared with the full-cache reference on
identical inputs (DESIGN.md, Evaluation)."""

from __future__ import annotations

import math

import torch

__all__ = ["first_divergence", "mcnemar", "token_kl", "trace_length", "wilson"]


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval (95% by default) of ``k`` successes in ``n`` trials."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar(reference: list[bool], other: list[bool]) -> dict:
    """Exact (binomial) two-sided McNemar test of paired outcomes.

    Returns:
        ``{"ref_only": b, "other_only": c, "p": p}`` where ``b`` items only the reference got
        right, ``c`` only the other method, and ``p`` the two-sided p-value of ``b == c``.
    """
    if len(reference) != len(other):
        raise ValueError(f"paired outcomes need equal lengths, got {len(reference)} and "
                         f"{len(other)}.")
    b = sum(r and not o for r, o in zip(reference, other))
    c = sum(o and not r for r, o in zip(reference, other))
    n = b + c
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n if n else 1.0
    return {"ref_only": b, "other_only": c, "p": min(1.0, 2 * tail)}


def token_kl(ref: torch.Tensor, other: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``KL(ref || other)`` per valid position.

    Args:
        ref, other: ``[B, S, V]`` log-probabilities.
        valid: ``[B, S]`` bool, positions to keep.

    Returns:
        ``[n_valid]`` float64 KL values (>= 0 up to rounding).
    """
    kl = (ref.exp() * (ref - other)).sum(-1)
    return kl[valid].double()


def kl_summary(kl: torch.Tensor) -> dict:
    """Mean, 99.9th percentile and max of per-token KL values."""
    if kl.numel() == 0:
        return {"mean": None, "p999": None, "max": None}
    return {"mean": float(kl.mean()), "p999": float(torch.quantile(kl, 0.999)),
            "max": float(kl.max())}


def trace_length(tokens: list[int], eos_id: int) -> int:
    """Generated tokens up to and including the first ``eos_id`` (all of them if none)."""
    return tokens.index(eos_id) + 1 if eos_id in tokens else len(tokens)


def first_divergence(ref: list[int], other: list[int]) -> int | None:
    """First position where two traces differ (None when identical)."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))
