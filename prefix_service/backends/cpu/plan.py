"""A step as the decoder stack reads it (`StackPlan`): each row's cache slot and position, the decodes'
block tables and context lengths, the prefills' new tokens, cached context and packed-template
prefix, and the packed templates' pointers per row and layer (stack.py hands it to ps_decoder_stack)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from prefix_service.backends.base import StepTensors

if TYPE_CHECKING:
    from prefix_service.backends.cpu.packed_template import PackedTemplate
    from prefix_service.engine.step import ScheduledRow, StepBatch


@dataclass
class StackPlan:
    """A step as ps_decoder_stack reads it: the decodes' rows first, then the prefills'."""
    slots: torch.Tensor  # [T] int64: each row's cache slot
    positions: torch.Tensor  # [T] int64
    num_decodes: int
    decode_tables: torch.Tensor  # [Nd, W] int32, -1 padded
    decode_context: torch.Tensor  # [Nd] int32, the new token included
    decode_skip: torch.Tensor | None  # [Nd] int32: blocks each reads from its packed template; None: none has one
    prefill_info: torch.Tensor  # [Np, 3] int32: new tokens, cached context, of those the leading ones packed
    prefill_tables: torch.Tensor  # [Np, W] int32, -1 padded
    templates: torch.Tensor | None  # [Nd + Np, layers, 3] int64: packed K panels, V rows, matrix handle; 0: none

    @classmethod
    def build(cls, step: StepBatch, host: StepTensors, num_layers: int,
              template_of: Callable[[ScheduledRow], PackedTemplate | None]) -> StackPlan:
        nd = step.num_decodes
        dec = [template_of(r) for r in step.decodes]
        pre = [template_of(r) for r in step.prefills]
        info = [[r.num_new_tokens, r.num_computed, p.num_tokens if p is not None else 0]
                for r, p in zip(step.prefills, pre)]
        templates = None
        if any(p is not None for p in dec + pre):
            none = torch.zeros(num_layers, 3, dtype=torch.int64)
            templates = torch.stack([p.pointers if p is not None else none for p in dec + pre])
        return cls(
            slots=host.slots,
            positions=host.positions,
            num_decodes=nd,
            decode_tables=host.block_tables[:nd],
            decode_context=host.context_lens[:nd],
            decode_skip=(torch.tensor([p.num_blocks if p is not None else 0 for p in dec], dtype=torch.int32)
                         if any(p is not None for p in dec) else None),
            prefill_info=torch.tensor(info, dtype=torch.int32).view(-1, 3),
            prefill_tables=host.block_tables[nd:],
            templates=templates)
