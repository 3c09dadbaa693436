"""`RelativeAttentionBias`: the learned relative position + time attention bias of one HSTU layer.

    rab(i, j) = w_pos[h', clamp(j - i, -P, P) + P] + w_time[h', bucket(ts(min(i + 1, L - 1)) - ts(j))]

added inside the SiLU (docs/design.md "Relative attention bias"; `hstu.ops.reference` spells it
out). The module only owns the weights and hands them to the attention op: the compiled kernel
computes rab in-kernel from the token timestamps (`AttentionInputs.timestamps`), the PyTorch
reference and the softmax baseline build it densely (`hstu.ops.reference.relative_attention_bias`).

A leaf module of the layer modules (imports only `attention_inputs`), so both layers can use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hstu.config.args import RELATIVE_ATTENTION_BIAS
from hstu.modules.attention_inputs import AttentionInputs
from hstu.ops import reference

__all__ = ["RelativeAttentionBias", "relative_bias_terms"]


def relative_bias_terms(kind: str) -> tuple[bool, bool]:
    """(position term, time term) of a `NetworkArgs.relative_attention_bias` value."""
    if kind not in RELATIVE_ATTENTION_BIAS:
        raise ValueError(
            f"NetworkArgs.relative_attention_bias={kind!r} is not supported: one of "
            f"{list(RELATIVE_ATTENTION_BIAS)}"
        )
    return kind in ("position", "position_time"), kind in ("time", "position_time")


class RelativeAttentionBias(nn.Module):
    """The weights of one layer's relative attention bias.

    ``kind``: "position", "time" or "position_time" (`NetworkArgs.relative_attention_bias`);
    ``max_pos``: P, the largest relative distance with its own weight (the model's longest token
    sequence - 1; farther pairs share the end weights); ``num_time_buckets``: NB (1 to 256);
    ``per_head``: one row of weights per head (Hw = num_heads) instead of one shared row (Hw = 1).

    Parameters (N(0, ``init_std``), float32): ``pos_weight`` [Hw, 2P + 1] and ``time_weight``
    [Hw, NB + 1]; an absent term's parameter is None. State dicts of the earlier position-only
    bias (``<prefix>weight``, [2P + 1]) load as ``pos_weight`` [1, 2P + 1].
    """

    def __init__(
        self,
        kind: str,
        num_heads: int,
        max_pos: int,
        *,
        num_time_buckets: int = 128,
        per_head: bool = False,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        use_pos, use_time = relative_bias_terms(kind)
        if not (use_pos or use_time):
            raise ValueError(
                "RelativeAttentionBias needs kind 'position', 'time' or 'position_time'"
            )
        if max_pos < 0:
            raise ValueError(f"RelativeAttentionBias needs max_pos >= 0; got {max_pos}")
        if use_time and not 1 <= num_time_buckets <= reference.MAX_TIME_BUCKETS:
            raise ValueError(
                f"NetworkArgs.num_time_buckets={num_time_buckets} is not supported: 1 to "
                f"{reference.MAX_TIME_BUCKETS}"
            )
        self.kind = kind
        self.num_heads = int(num_heads)
        self.max_pos = int(max_pos)
        self.num_time_buckets = int(num_time_buckets)
        self.per_head = bool(per_head)
        rows = self.num_heads if self.per_head else 1
        # drawn in this order so that a position-only bias starts from the earlier module's
        # weights under the same seed
        if use_pos:
            self.pos_weight = nn.Parameter(torch.randn(rows, 2 * self.max_pos + 1) * init_std)
        else:
            self.register_parameter("pos_weight", None)
        if use_time:
            self.time_weight = nn.Parameter(torch.randn(rows, self.num_time_buckets + 1) * init_std)
        else:
            self.register_parameter("time_weight", None)

    @property
    def uses_time(self) -> bool:
        return self.time_weight is not None

    def attention_kwargs(
        self,
        attn: AttentionInputs,
        pos_weight: torch.Tensor | None = None,
        time_weight: torch.Tensor | None = None,
        *,
        dense: bool = False,
    ) -> dict[str, Any]:
        """Keyword arguments of the attention op for this bias: ``timestamps``, ``pos_weight``,
        ``time_weight``, ``max_pos``, ``last_query_time`` (the in-kernel bias of `hstu.ops.hstu_attention`), or with
        ``dense=True`` a dense ``bias`` [B, Hw, N, N] (the softmax baseline). The weights default
        to this module's parameters; the fused layer passes the tensors of its autograd Function."""
        pos_weight = self.pos_weight if pos_weight is None else pos_weight
        time_weight = self.time_weight if time_weight is None else time_weight
        timestamps = last_query_time = None
        if time_weight is not None:
            timestamps = attn.timestamps
            last_query_time = attn.last_query_time
            if timestamps is None:
                raise ValueError(
                    f"NetworkArgs.relative_attention_bias={self.kind!r} needs the token "
                    "timestamps (AttentionInputs.timestamps), which this forward did not get: the "
                    "batch has no timestamps or the preprocessor was built without them"
                )
        if dense:
            bias = reference.relative_attention_bias(
                attn.seq_offsets,
                attn.max_seqlen,
                timestamps,
                pos_weight,
                time_weight,
                self.max_pos,
                self.num_heads,
                last_query_time,
            )
            return {"bias": bias}
        return {
            "timestamps": timestamps,
            "pos_weight": pos_weight,
            "time_weight": time_weight,
            "max_pos": self.max_pos if pos_weight is not None else 0,
            "last_query_time": last_query_time,
        }

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        old = prefix + "weight"  # the earlier RelativePositionBias: one shared [2P + 1] vector
        if old in state_dict and prefix + "pos_weight" not in state_dict:
            value = state_dict.pop(old)  # type: ignore[attr-defined]
            state_dict[prefix + "pos_weight"] = value.reshape(1, -1)  # type: ignore[index]
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def extra_repr(self) -> str:
        text = f"kind={self.kind!r}, max_pos={self.max_pos}, per_head={self.per_head}"
        if self.uses_time:
            text += f", num_time_buckets={self.num_time_buckets}"
        return text
