"""engram-llama's plugin op on the CPU: EngramAttention (the in-place slot KV cache's
attention) as :func:`engram_attention_reference` (float64 NumPy) and its
``onnx.reference`` OpRun (:func:`reference_ops`, the architecture's)."""

from __future__ import annotations

import numpy as np

from engram_trt.errors import EngramError
from engram_trt.models.export import PLUGIN_DOMAIN


def engram_attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    key_cache: np.ndarray,
    value_cache: np.ndarray,
    token_slot: np.ndarray,
    token_pos: np.ndarray,
    scale: float,
) -> np.ndarray:
    """The EngramAttention plugin's contract in float64: token t's ``k / v [T, kvh, hd]``
    rows go into ``key_cache / value_cache [slots, kvh, max_seq_len, hd]`` at
    ``(token_slot[t], :, token_pos[t])`` (in place, in the caches' dtype), then every token
    attends to its slot's keys ``0 .. token_pos[t]`` (causal, inclusive; query head h reads
    KV head ``h // (H / kvh)``). A token outside the cache writes nothing and gets a zero
    row. Returns ``[T, H, hd]`` float64."""
    T, H, hd = q.shape
    num_slots, kvh, max_len, _ = key_cache.shape
    group = H // kvh
    slots = np.asarray(token_slot, dtype=np.int64)
    pos = np.asarray(token_pos, dtype=np.int64)
    valid = (slots >= 0) & (slots < num_slots) & (pos >= 0) & (pos < max_len)
    live = np.nonzero(valid)[0]
    key_cache[slots[live], :, pos[live]] = k[live]
    value_cache[slots[live], :, pos[live]] = v[live]
    out = np.zeros((T, H, hd), dtype=np.float64)
    qf = np.asarray(q, dtype=np.float64).reshape(T, kvh, group, hd)
    for t in live:
        keys = key_cache[slots[t], :, : pos[t] + 1].astype(np.float64)  # [kvh, P, hd]
        values = value_cache[slots[t], :, : pos[t] + 1].astype(np.float64)
        scores = np.einsum("kgd,kpd->kgp", qf[t], keys) * float(scale)
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        out[t] = np.einsum("kgp,kpd->kgd", probs, values).reshape(H, hd)
    return out


def reference_ops() -> list[type]:
    """The OpRun of EngramAttention: :func:`engram_attention_reference`, the caches
    written in place (the plugin's aliased cache outputs)."""
    from onnx.reference.op_run import OpRun

    class EngramAttention(OpRun):
        op_domain = PLUGIN_DOMAIN

        def _run(
            self,
            q,
            k,
            v,
            key_cache,
            value_cache,
            token_slot,
            token_pos,
            plugin_version=None,  # noqa: ANN001
            plugin_namespace=None,
            num_heads=None,
            num_kv_heads=None,
            head_dim=None,
            scale=None,
        ):
            if q.shape[1:] != (int(num_heads), int(head_dim)) or key_cache.shape[1] != int(num_kv_heads):
                raise EngramError(
                    f"EngramAttention fields (num_heads {num_heads}, num_kv_heads {num_kv_heads}, head_dim "
                    f"{head_dim}) do not match q {q.shape} and key_cache {key_cache.shape}"
                )
            out = engram_attention_reference(q, k, v, key_cache, value_cache, token_slot, token_pos, float(scale))
            return (out.astype(q.dtype), key_cache, value_cache)  # the caches themselves: aliased, in place

    return [EngramAttention]
