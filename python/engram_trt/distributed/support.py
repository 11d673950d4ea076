"""Which model families run over several ranks, asked before any rank starts.

``--tp N`` shards what the family declares it can shard (its registry entry's
``tensor_parallel``: engram-llama shards its Engram columns over the TP ranks, the
backbone replicated); a family that cannot is refused in one line naming it, the flag
and what runs today. ``embedding_across_dp`` shards the tables over every rank the same
way, so it is refused for those families too when the model has tables. ``--dp M``
(whole replicas) runs every family.

The check reads the folder's config through the model registry
(:func:`~engram_trt.runtime.engine_folder.peek_model`): no weights, no tables, no
process started.
"""

from __future__ import annotations

from typing import Any

from engram_trt.errors import EngramError


def check_parallel_support(path: Any, tp: int, dp: int, engram_config: Any = None, *, serving: bool = False) -> Any:
    """Refuse (one :class:`EngramError` line) a ``--tp`` / ``embedding_across_dp`` the
    family of ``path`` cannot run; returns the folder's
    :class:`~engram_trt.runtime.engine_folder.ModelPeek` (None for one rank, where
    nothing is read)."""
    from engram_trt.runtime.engine_folder import peek_model

    if tp == 1 and dp == 1:
        return None
    peek = peek_model(path)
    arch = peek.architecture
    family = peek.family
    if tp > 1 and not getattr(arch, "tensor_parallel", False):
        then = ("serve --tp 1 (--dp M serves M whole instances)" if serving else
                "run with --tp 1 (--dp M runs M whole replicas)")
        raise EngramError(f"--tp {tp}: {family} backbones are not sharded yet (issue 42); {then}, or use an "
                          f"engram-llama checkpoint, whose Engram columns --tp shards")
    across = getattr(engram_config, "embedding_across_dp", False)
    if dp > 1 and across and peek.has_tables and not getattr(arch, "tensor_parallel", False):
        raise EngramError(f"--engram-config.embedding_across_dp: {family} tables are not sharded across ranks "
                          f"yet (issue 42); drop it (--engram-config.dp_shared_memory true keeps one /dev/shm copy "
                          f"per node for the {dp} replicas)")
    if engram_config is not None and getattr(engram_config, "given", None):
        engram_config.validate_for(peek.config)  # what each rank would refuse, said once before they start
    return peek
