import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from draftsmith.draft import DraftConfig, Eagle3Drafter, broadcast_block_mask, causal_segment_mask_mod, ttt_mask_mod

from helpers import tiny_drafter, tiny_native


def test_ttt_rows_match_step_by_step_inference():
    """Step j at row t in training sees exactly what drafting token t+2+j sees at inference."""
    target = tiny_native()
    drafter = tiny_drafter(target, draft_vocab=128)
    torch.manual_seed(0)
    T, depth = 12, 4
    ids = torch.randint(0, 320, (1, T))
    aux = torch.randn(1, T, 3 * 64)
    train = drafter.ttt(ids, aux, depth)
    drafter.setup_caches(1, 32)
    for t in [0, 3, 7]:
        # rows 0..t from the target features, then chain steps fed the ground-truth tokens
        h = drafter(ids[:, 1 : t + 2], drafter.fuse(aux[:, : t + 1]), torch.arange(t + 1))[:, -1:]
        assert (h[0, 0] - train[0][0, t]).abs().max() < 1e-4
        for j in range(1, depth):
            if t + 1 + j >= T:
                break
            h = drafter(ids[:, t + 1 + j : t + 2 + j], h, torch.tensor([t + j]))
            assert (h[0, 0] - train[j][0, t]).abs().max() < 1e-4, (t, j)


def test_segments_do_not_see_each_other():
    target = tiny_native()
    drafter = tiny_drafter(target)
    torch.manual_seed(0)
    a, b = torch.randint(0, 320, (1, 8)), torch.randint(0, 320, (1, 6))
    aux_a, aux_b = torch.randn(1, 8, 192), torch.randn(1, 6, 192)
    packed = drafter.ttt(torch.cat([a, b], 1), torch.cat([aux_a, aux_b], 1), 3,
                         position_ids=torch.cat([torch.arange(8), torch.arange(6)])[None],
                         segment_ids=torch.cat([torch.zeros(8), torch.ones(6)])[None].long())
    alone = drafter.ttt(b, aux_b, 3)
    for j in range(3):
        valid = 6 - 1 - j  # rows whose step-j input token lies inside b
        assert (packed[j][0, 8 : 8 + valid] - alone[j][0, :valid]).abs().max() < 1e-4


def test_config_rejects_bad_aux_layers():
    target = tiny_native()
    try:
        DraftConfig.from_target(target.args, 100, aux_layer_ids=(1, 2, 9))
    except ValueError as e:
        assert "outside" in str(e)
    else:
        raise AssertionError("aux layer 9 of a 4-layer target was accepted")


def test_init_from_target_copies_embedding_and_head_rows():
    target = tiny_native()
    drafter = tiny_drafter(target, draft_vocab=50)
    ids = drafter.to_target(torch.arange(50))
    assert torch.equal(drafter.lm_head.weight, target.lm_head.weight[ids])
    assert torch.equal(drafter.embed_tokens.weight, target.embed_tokens.weight)
    assert drafter.t2d.sum() == 50 and drafter.t2d[ids].all()
    assert not drafter.embed_tokens.weight.requires_grad
    assert isinstance(drafter, Eagle3Drafter)


def test_shrunk_vocab_keeps_the_most_frequent_tokens_and_their_logits():
    target = tiny_native()
    drafter = tiny_drafter(target, draft_vocab=120)
    counts = torch.randint(0, 1000, (target.args.vocab_size,))
    small = drafter.shrink_vocab(counts, 40)
    ids, kept = drafter.to_target(torch.arange(120)), small.to_target(torch.arange(40))
    assert torch.equal(kept, kept.sort().values) and small.t2d.sum() == 40 and small.t2d[kept].all()
    assert set(kept.tolist()) == set(ids[torch.sort(-counts[ids], stable=True).indices[:40]].tolist())
    hidden = torch.randn(1, 5, 64)
    rows = torch.searchsorted(ids, kept)  # where each kept token sat in the old draft vocab
    assert torch.equal(small.logits(hidden), drafter.logits(hidden)[..., rows])
    with pytest.raises(ValueError, match="size"):
        drafter.shrink_vocab(counts, 121)


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """torch refuses flex_attention's backward on the CPU by a device check; the unfused implementation
    behind it is plain autograd on any device, so lifting the check lets a CPU test compare gradients."""
    monkeypatch.setattr(flex_module, "_validate_device", lambda q, k, v: None)


def ttt_outputs_and_grads(drafter, ids, aux, depth, attn_impl, **packing):
    drafter.zero_grad(set_to_none=True)
    outs = drafter.ttt(ids, aux, depth, attn_impl=attn_impl, **packing)
    weights = torch.Generator().manual_seed(0)  # a loss that weighs every output differently
    sum(o.mul(torch.randn(o.shape, generator=weights).to(o.device)).sum() for o in outs).backward()
    return [o.detach() for o in outs], {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
@pytest.mark.parametrize("impl", ["flex", "split"])
def test_flex_ttt_attention_matches_eager(flex_backward_on_cpu, impl):
    """flex_attention over [K0; K1; ...; Kj] ("flex"), or over K0 merged with the later steps' own keys by
    log-sum-exp ("split"), gives the outputs of every step and the gradients of every weight of the
    materialised path: packed rows (segments, restarting positions, a padding segment), T not a
    multiple of flex's 128-row blocks, grouped-query heads, 4 steps."""
    target = tiny_native()
    assert target.args.num_heads != target.args.num_kv_heads
    drafter = tiny_drafter(target, draft_vocab=100)
    torch.manual_seed(0)
    B, T, depth = 2, 200, 4
    ids, aux = torch.randint(0, 320, (B, T)), torch.randn(B, T, 192)
    lengths = [[70, 90, 40], [150, 30]]  # row 1 ends with 20 padding tokens, as pack() lays them out
    seg, pos = torch.full((B, T), -1), torch.zeros(B, T, dtype=torch.long)
    for b, row in enumerate(lengths):
        starts = [sum(row[:i]) for i in range(len(row))]
        for i, (s, n) in enumerate(zip(starts, row)):
            seg[b, s:s + n], pos[b, s:s + n] = i, torch.arange(n)
    packing = dict(position_ids=pos, segment_ids=seg)
    for kw in (packing, {}):
        assert_flex_matches_eager(drafter, ids, aux, depth, impl, **kw)


def assert_flex_matches_eager(drafter, ids, aux, depth, impl="flex", **packing):
    eager, grads_eager = ttt_outputs_and_grads(drafter, ids, aux, depth, "eager", **packing)
    flex, grads_flex = ttt_outputs_and_grads(drafter, ids, aux, depth, impl, **packing)
    assert len(flex) == depth
    for a, b in zip(eager, flex):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    assert grads_eager.keys() == grads_flex.keys() and "fc.weight" in grads_eager
    for n, g in grads_eager.items():  # sums over all rows: fp32 rounding relative to the largest entry
        assert (g - grads_flex[n]).abs().max() <= 1e-5 * g.abs().max(), n


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled flex kernel needs a CUDA device")
@pytest.mark.parametrize("impl", ["flex", "split"])
def test_compiled_flex_ttt_matches_eager_and_compiles_once_for_all_lengths(impl):
    """What training runs on CUDA: the compiled flex kernel gives the outputs and gradients of the
    materialised path (fp32), and once two lengths have been seen, packs of other lengths T (not
    multiples of 128) compile nothing more: dynamic shapes, not one compile per pack. "split" needs
    the compiled kernel's gradient through its log-sum-exp."""
    from torch._dynamo.utils import counters
    drafter = tiny_drafter(tiny_native(), draft_vocab=100).cuda()

    def check(T):
        torch.manual_seed(T)
        ids, aux = torch.randint(0, 320, (2, T), device="cuda"), torch.randn(2, T, 192, device="cuda")
        cut = torch.arange(T, device="cuda") >= T // 3  # two packed samples per row
        seg, pos = cut.long().expand(2, T), torch.where(cut, torch.arange(T, device="cuda") - T // 3, torch.arange(T, device="cuda"))
        assert_flex_matches_eager(drafter, ids, aux, 3, impl, position_ids=pos.expand(2, T), segment_ids=seg)

    check(200)
    check(333)
    graphs = counters["stats"]["unique_graphs"]
    for T in (457, 129, 300):
        check(T)
    assert counters["stats"]["unique_graphs"] == graphs


def test_ttt_attention_impl_is_checked():
    drafter = tiny_drafter(tiny_native())
    with pytest.raises(ValueError, match="attn_impl"):
        drafter.ttt(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, 192), 2, attn_impl="sdpa")


@pytest.mark.parametrize("T", [100, 128, 200, 300])
def test_broadcast_block_mask_equals_create_block_mask(T):
    """The block mask built from tensor ops is create_block_mask's, tensor for tensor and contiguous (partial and full
    tiles, both directions): T below, at and not a multiple of the 128-row tiles, packed rows with a
    padding segment (-1), an unpacked row (full tiles), every step j of a depth-4 TTT, and the "split"
    attention's step-0 mask."""
    seg = torch.full((2, T), -1)
    seg[0, :T // 3], seg[0, T // 3:T - 7] = 0, 1  # row 0: two samples, 7 padding tokens
    seg[1] = 0  # row 1: one sample, whole causal tiles
    # every step j of flex's TTT mask, then split's step-0 mask (None)
    for j in (0, 1, 2, 3, None):
        kv = (j + 1) * T if j is not None else T
        mod = ttt_mask_mod(seg, kv) if j is not None else causal_segment_mask_mod(seg)
        ours = broadcast_block_mask(mod, 2, T, kv, "cpu")
        ref = flex_module.create_block_mask(mod, 2, None, T, kv, device="cpu")
        assert ours.seq_lengths == ref.seq_lengths and ours.BLOCK_SIZE == ref.BLOCK_SIZE
        assert torch.equal(ours.to_dense(), ref.to_dense())
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                     "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
            assert torch.equal(getattr(ours, name), getattr(ref, name)), (name, j)
            # and laid out alike: the compiled kernels read them row-major (a transposed q_indices gave the
            # H200's compiled backward wrong dK, dV while the forward stayed exact)
            assert getattr(ours, name).is_contiguous() and getattr(ref, name).is_contiguous(), (name, j)
    if T >= 256:  # whole tiles below the diagonal exist (row 1): the full-tile path was exercised
        assert ref.full_kv_num_blocks.sum() > 0
