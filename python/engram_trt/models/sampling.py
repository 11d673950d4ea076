"""Sampling one token from a sequence's logits: greedy, or temperature + top-p.

Sampling runs on the CPU from a per-sequence ``torch.Generator``: the same seed gives
the same tokens on any device and whatever other sequences share the step (each
sequence's draw consumes only its own generator).
"""

from __future__ import annotations

import torch


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """One token from ``logits [V]``: greedy when ``temperature == 0``, else
    temperature-scaled nucleus sampling (the smallest set of most likely tokens whose
    probability reaches ``top_p``; the most likely token is always kept, so a tiny
    ``top_p`` is greedy)."""
    logits = logits.detach().float().cpu()
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = (torch.cumsum(sorted_p, dim=-1) - sorted_p) < top_p
        keep[0] = True
        sorted_p = sorted_p * keep
        choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
