"""The draft vocabulary: the Vd target tokens the drafter can propose.

The Vd most frequent target tokens among the loss-masked (assistant) tokens of the training
data, in ascending id order so that slicing target logits with t2d lines up with d2t
(REFERENCE.md §1). d2t holds OFFSETS: target_id = draft_id + d2t[draft_id].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # (Vd,) int64 offsets
    t2d: torch.Tensor  # (V,) bool, True where a target token is in the draft vocab
    coverage: float  # share of the counted assistant tokens the vocab contains

    @property
    def ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t)) + self.d2t  # (Vd,) target ids, ascending


def count_tokens(samples, vocab_size: int) -> torch.Tensor:
    """Frequency of each target token among the loss-masked tokens of `samples` (dicts with
    input_ids and loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        ids = s["input_ids"].long()[s["loss_mask"].bool()]
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def build_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    V = counts.numel()
    if not 0 < draft_vocab_size <= V:
        raise ValueError(f"draft_vocab_size must be in 1..{V} (the target vocab), got {draft_vocab_size}")
    if counts.sum() == 0:
        raise ValueError("no assistant tokens to count: the training data has an empty loss mask")
    # most frequent first; ties (and never-seen tokens, to fill a large Vd) by lower id
    order = torch.sort(-counts, stable=True).indices[:draft_vocab_size]
    ids = order.sort().values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    d2t = ids - torch.arange(draft_vocab_size)
    return DraftVocab(d2t, t2d, float(counts[ids].sum() / counts.sum()))
