"""Padding-free passes: a padded batch's rows concatenated into one sequence, and the per-token values mapped back.

TRL's passes take `(rows, width)` tensors: left-padded prompts, right-padded completions. A row's real tokens are
where its attention mask is 1. Packed, those tokens follow each other row after row in one sequence of `T` tokens,
`position_ids` restart at 0 on each row (so a row's positions do not depend on its padding), and each scored
completion token keeps its own id as the label of TRL's fused head, which scores position `t` from the hidden state of
`t - 1`. A row's first token (a prompt token, unless the prompt is empty) is never scored, so no row is scored from
the previous row's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORED_LABEL = -100


@dataclass
class PackedRows:
    """Rows of a padded batch as one sequence, and where each packed token came from."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T): 0, 1, ... within each row
    labels: torch.Tensor  # (1, T): the token where the pass scores it, else IGNORED_LABEL
    cu_seq_lens: torch.Tensor  # (rows + 1,): row bounds in the packed sequence
    max_length: int  # the longest row
    real: torch.Tensor  # (rows, width) bool: the padded positions the packed tokens came from

    def attention_kwargs(self) -> dict[str, torch.Tensor | int]:
        """What the model hands its attention function: the rows' bounds (transformers' flash-attention names)."""
        return {
            "cu_seq_lens_q": self.cu_seq_lens,
            "cu_seq_lens_k": self.cu_seq_lens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, scored_width: int) -> PackedRows:
    """Pack the real tokens of `input_ids` `(rows, width)`; the last `scored_width` columns are the ones scored.

    One host synchronisation: the longest row's length."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    positions = real.cumsum(dim=1) - 1
    scored = real & (positions > 0)  # a row's first token has no earlier token of its own row to be scored from
    scored[:, : input_ids.size(1) - scored_width] = False
    labels = torch.where(scored, input_ids, IGNORED_LABEL)
    cu_seq_lens = torch.nn.functional.pad(lengths.cumsum(dim=0), (1, 0)).to(torch.int32)
    return PackedRows(
        input_ids=input_ids[real].unsqueeze(0),
        position_ids=positions[real].unsqueeze(0),
        labels=labels[real].unsqueeze(0),
        cu_seq_lens=cu_seq_lens,
        max_length=int(lengths.max()) if lengths.numel() else 0,
        real=real,
    )


def unpack_scores(values: torch.Tensor, packed: PackedRows, scored_width: int) -> torch.Tensor:
    """Per-token values of the fused head `(1, T - 1)` (position `t` scores packed token `t + 1`) back to the padded
    layout's last `scored_width` columns `(rows, scored_width)`; zero where nothing was scored."""
    per_token = torch.cat([values.new_zeros(1), values[0]])  # packed token t's value at index t
    out = values.new_zeros(packed.real.shape).masked_scatter(packed.real, per_token)
    return out[:, out.size(1) - scored_width :]
