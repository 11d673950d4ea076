"""Float64 NumPy reference of DeepSeek-V4's mHC hyper-connections (what
``plugins/kernels/mhcKernel.cu`` computes; tests tie it to
:class:`~engram_trt.models.deepseek_v4.modules.HyperConnection` / ``HyperHead`` and the
kernel to both). Written from the formulas, not from the torch module, so the two
implementations check each other:

* :func:`mhc_coefficients`: ``(pre, post, comb)`` of ``streams [T, hc, D]`` — the token's
  ``hc * D`` values RMS-normalized (no weight), one linear map ``fn`` to ``(2 + hc) hc``
  numbers, ``pre = sigmoid(. s0 + b) + eps``, ``post = 2 sigmoid(. s1 + b)``,
  ``comb = row softmax(. s2 + b) + eps`` pushed towards doubly stochastic by Sinkhorn-Knopp
  (columns, then ``iters - 1`` rounds of rows and columns, each sum offset by ``eps``);
* :func:`mhc_pre`: the collapse ``sum_c pre[c] streams[c]`` with ``post`` and ``comb``;
* :func:`mhc_post`: ``new[k] = post[k] out + sum_j comb[j, k] streams[j]`` (``comb^T``: the
  matrix is not symmetric);
* :func:`mhc_head`: the final collapse, a ``pre``-only map with one scale.

:func:`mhc_post`'s ``round_to`` (an array -> array callable, optional) rounds ``post`` /
``comb`` before the mixing as the serving dtype's ``.to(dtype)`` does; None keeps float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from engram_trt.errors import EngramError

Rounder = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class MhcParams:
    """One hyper-connection's parameters as float64 arrays: ``fn [(2+hc)*hc, hc*D]``,
    ``base [(2+hc)*hc]``, ``scale [3]`` (a head: ``[hc, hc*D]``, ``[hc]``, ``[1]``)."""

    fn: np.ndarray
    base: np.ndarray
    scale: np.ndarray

    @classmethod
    def of(cls, fn, base, scale) -> "MhcParams":
        return cls(*(np.asarray(a, dtype=np.float64) for a in (fn, base, scale)))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _mixes(streams: np.ndarray, fn: np.ndarray, norm_eps: float) -> np.ndarray:
    x = np.asarray(streams, dtype=np.float64)
    if x.ndim != 3:
        raise EngramError(f"streams must be [T, hc, hidden] (got shape {x.shape})")
    flat = x.reshape(x.shape[0], -1)
    if fn.shape[1] != flat.shape[1]:
        raise EngramError(f"fn must have hc*hidden = {flat.shape[1]} columns (got {fn.shape[1]})")
    flat = flat / np.sqrt(np.mean(flat * flat, axis=-1, keepdims=True) + norm_eps)
    return flat @ fn.T


def sinkhorn(comb: np.ndarray, iters: int, eps: float) -> np.ndarray:
    """``comb [..., hc, hc]`` after Sinkhorn-Knopp: columns, then ``iters - 1`` rounds of rows
    and columns."""
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(int(iters) - 1):
        comb = comb / (comb.sum(axis=-1, keepdims=True) + eps)
        comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    return comb


def mhc_coefficients(
    streams: np.ndarray, params: MhcParams, *, iters: int, hc_eps: float, norm_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(pre [T, hc], post [T, hc], comb [T, hc, hc])`` in float64."""
    hc = np.asarray(streams).shape[1]
    n = (2 + hc) * hc
    if params.fn.shape[0] != n or params.base.shape != (n,) or params.scale.shape != (3,):
        raise EngramError(
            f"an hc={hc} hyper-connection needs fn [{n}, hc*hidden], base [{n}], scale [3] (got "
            f"{params.fn.shape}, {params.base.shape}, {params.scale.shape})"
        )
    m = _mixes(streams, params.fn, norm_eps)
    s, b = params.scale, params.base
    pre = _sigmoid(m[:, :hc] * s[0] + b[:hc]) + hc_eps
    post = 2.0 * _sigmoid(m[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
    z = (m[:, 2 * hc :] * s[2] + b[2 * hc :]).reshape(-1, hc, hc)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    comb = e / e.sum(axis=-1, keepdims=True) + hc_eps
    return pre, post, sinkhorn(comb, iters, hc_eps)


def mhc_pre(
    streams: np.ndarray, params: MhcParams, *, iters: int, hc_eps: float, norm_eps: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(collapsed [T, D], post, comb)``: the sublayer's input and what :func:`mhc_post` needs."""
    pre, post, comb = mhc_coefficients(streams, params, iters=iters, hc_eps=hc_eps, norm_eps=norm_eps)
    x = np.asarray(streams, dtype=np.float64)
    return np.einsum("tc,tcd->td", pre, x), post, comb


def mhc_post(
    streams: np.ndarray, out: np.ndarray, post: np.ndarray, comb: np.ndarray, *, round_to: Rounder | None = None
) -> np.ndarray:
    """The streams after the sublayer: ``new[t, k] = post[t, k] out[t] + sum_j comb[t, j, k] streams[t, j]``."""
    x = np.asarray(streams, dtype=np.float64)
    p, c = np.asarray(post, dtype=np.float64), np.asarray(comb, dtype=np.float64)
    if round_to is not None:
        p, c = round_to(p), round_to(c)
    return p[:, :, None] * np.asarray(out, dtype=np.float64)[:, None, :] + np.einsum("tjk,tjd->tkd", c, x)


def mhc_head(streams: np.ndarray, params: MhcParams, *, hc_eps: float, norm_eps: float) -> np.ndarray:
    """The hyper head's collapse ``[T, D]``: ``pre = sigmoid(m s + b) + eps`` over ``fn [hc, hc*D]``."""
    hc = np.asarray(streams).shape[1]
    if params.fn.shape[0] != hc or params.base.shape != (hc,) or params.scale.shape != (1,):
        raise EngramError(
            f"an hc={hc} hyper head needs fn [{hc}, hc*hidden], base [{hc}], scale [1] (got "
            f"{params.fn.shape}, {params.base.shape}, {params.scale.shape})"
        )
    pre = _sigmoid(_mixes(streams, params.fn, norm_eps) * params.scale[0] + params.base) + hc_eps
    return np.einsum("tc,tcd->td", pre, np.asarray(streams, dtype=np.float64))
