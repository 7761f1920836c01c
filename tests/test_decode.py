import pytest
import torch

from draftsmith.decode import decode_chain, decode_plain
from draftsmith.draft import DraftConfig

from helpers import OracleDrafter, tiny_drafter, tiny_native


@pytest.fixture(scope="module")
def target():
    return tiny_native()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_chain_equals_greedy_with_a_random_drafter(target, k):
    drafter = tiny_drafter(target, draft_vocab=200)
    for seed in range(3):
        prompt = torch.randint(3, 320, (1, 9), generator=torch.Generator().manual_seed(seed))
        plain = decode_plain(target, prompt, 40)
        spec = decode_chain(target, drafter, prompt, 40, k)
        assert spec.tokens == plain.tokens
        assert 1 + sum(spec.accept_lengths) >= len(spec.tokens)  # the first token comes from prefill


@pytest.mark.parametrize("p_right,expect", [(0.0, "never"), (1.0, "always"), (0.6, "sometimes")])
def test_chain_equals_greedy_for_stub_drafters(target, p_right, expect):
    k = 4
    prompt = torch.randint(3, 320, (1, 7), generator=torch.Generator().manual_seed(5))
    plain = decode_plain(target, prompt, 50)
    oracle = prompt[0].tolist() + plain.tokens + [0] * 10
    drafter = OracleDrafter(DraftConfig.from_target(target.args, target.args.vocab_size), oracle, p_right)
    spec = decode_chain(target, drafter, prompt, 50, k)
    assert spec.tokens == plain.tokens
    lengths = spec.accept_lengths
    if expect == "never":
        assert set(lengths) == {1}
    elif expect == "always":
        assert all(n == k + 1 for n in lengths[:-1])
    else:
        assert min(lengths) < max(lengths)


def test_eos_and_max_new_are_respected(target):
    prompt = torch.randint(3, 320, (1, 6), generator=torch.Generator().manual_seed(2))
    plain = decode_plain(target, prompt, 30)
    eos = plain.tokens[10]
    cut = decode_plain(target, prompt, 30, eos_ids=(eos,))
    first = plain.tokens.index(eos)
    assert cut.tokens == plain.tokens[: first + 1]
    drafter = tiny_drafter(target)
    assert decode_chain(target, drafter, prompt, 30, 3, eos_ids=(eos,)).tokens == cut.tokens
    assert len(decode_chain(target, drafter, prompt, 13, 5).tokens) == 13
