import pytest
import torch

from draftsmith.extract import HiddenStates
from draftsmith.vocab import build_vocab, count_tokens


def test_d2t_offsets_map_draft_ids_to_the_most_frequent_targets():
    counts = torch.tensor([0, 5, 9, 0, 7, 1, 3, 0, 2, 8])
    v = build_vocab(counts, 4)
    assert v.ids.tolist() == [1, 2, 4, 9]  # the 4 most frequent, ascending
    draft = torch.arange(4)
    assert (draft + v.d2t[draft]).tolist() == [1, 2, 4, 9]  # target_id = draft_id + d2t[draft_id]
    assert v.t2d.nonzero().flatten().tolist() == [1, 2, 4, 9]
    assert v.coverage == pytest.approx(29 / 35)


def test_vocab_from_extracted_assistant_tokens(tiny_hidden):
    data = HiddenStates(tiny_hidden)
    samples = [data[i] for i in range(len(data))]
    counts = count_tokens(samples, 320)
    assert counts.sum() == sum(int(s["loss_mask"].sum()) for s in samples)
    v = build_vocab(counts, 64)
    ids = torch.arange(64) + v.d2t
    assert torch.equal(ids, v.t2d.nonzero().flatten())  # t2d agrees with d2t
    assert (ids[1:] > ids[:-1]).all() and ids.max() < 320
    top = counts.argmax()
    assert v.t2d[top]


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab(torch.ones(10), 11)
    with pytest.raises(ValueError, match="empty loss mask"):
        build_vocab(torch.zeros(10, dtype=torch.long), 5)
