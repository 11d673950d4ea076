"""What a model implements of its config.json, declared as data: every field the
published implementation reads is either honoured (read into the typed config, with the
values accepted), pinned to the one value implemented (``hidden_act: silu``), or known to
have no effect at inference (``attention_dropout``). A field pinned to a value and given
another is refused in one line naming the field, the value and what is supported: a
silently different model is the worst failure a serving stack can have.

Fields the published implementation does not read either (``transformers_version``, a
converter's own notes) change nothing there, so they change nothing here; they are
listed as ignored (``engram-trt inspect`` shows them) and never refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from engram_trt.errors import ConfigError

# Fields every Hugging Face config may carry that no model's numerics depend on at
# inference (PreTrainedConfig's bookkeeping, generation and training switches).
GENERIC_NEUTRAL_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "name_or_path",
        "use_cache",
        "initializer_range",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "torchscript",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
        "tokenizer_class",
        "prefix",
        "sep_token_id",
        "decoder_start_token_id",
        "task_specific_params",
        "finetuning_task",
        "_attn_implementation",
        "attn_implementation",
        "_attn_implementation_autoset",
        "use_bfloat16",
        "tf_legacy_loss",
        "pruned_heads",
        "tie_encoder_decoder",
        "cross_attention_hidden_size",
        "early_stopping",
        "max_length",
        "min_length",
        "do_sample",
        "num_beams",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "output_scores",
        "return_dict_in_generate",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "typical_p",
        "diversity_penalty",
        "num_beam_groups",
        "encoder_no_repeat_ngram_size",
        "epsilon_cutoff",
        "eta_cutoff",
        "generation_config",
    }
)


@dataclass(frozen=True)
class Pinned:
    """A field the implementation supports at these values only; ``default`` is what an
    absent field means (transformers' default), so absent is always accepted."""

    values: tuple[Any, ...]
    default: Any
    why: str = ""


@dataclass(frozen=True)
class FieldContract:
    """One architecture's config.json fields: ``honoured`` are read into its typed
    config (their own reader checks the values), ``pinned`` accept only listed values,
    ``neutral`` have no effect at inference (beside :data:`GENERIC_NEUTRAL_FIELDS`)."""

    architecture: str
    honoured: frozenset[str]
    pinned: Mapping[str, Pinned] = field(default_factory=dict)
    neutral: frozenset[str] = frozenset()
    honoured_prefixes: tuple[str, ...] = ()

    def is_known(self, name: str) -> bool:
        return (
            name in self.honoured
            or name in self.pinned
            or name in self.neutral
            or name in GENERIC_NEUTRAL_FIELDS
            or name.startswith(self.honoured_prefixes)
        )

    def problems(self, d: Mapping[str, Any], source: str | None = None) -> list[str]:
        """One line for each pinned field whose value the implementation does not support."""
        where = f"{source}: " if source else "config: "
        out = []
        for name, rule in self.pinned.items():
            if name not in d:
                continue
            value = d[name]
            if value is None and rule.default is None:
                continue
            if not any(_same(value, v) for v in rule.values):
                supported = " or ".join(json.dumps(v) for v in rule.values)
                note = f" ({rule.why})" if rule.why else ""
                out.append(
                    f"{where}field '{name}'={_shown(value)} is not implemented by engram-trt's {self.architecture} "
                    f"(supported: {supported}{note}); serving it would give a different "
                    "model than the checkpoint declares"
                )
        return out

    def check(self, d: Mapping[str, Any], source: str | None = None) -> None:
        """Refuse the first unsupported value (one line, :class:`ConfigError`)."""
        problems = self.problems(d, source)
        if problems:
            raise ConfigError(problems[0])

    def ignored(self, d: Mapping[str, Any]) -> list[str]:
        """Fields neither this implementation nor the published one reads."""
        return sorted(k for k in d if not self.is_known(k))


def _same(a: Any, b: Any) -> bool:
    """``a == b``, except that a bool equals only a bool (JSON's ``1`` is not ``true``)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."
