import json
import sys

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import train
from draftsmith.extract import HiddenStates
from draftsmith.train import (TrainConfig, accept_length, batches, build_drafter, pack, run, scored, steps,
                             target_features, ttt_loss)
from draftsmith.target import load_target


def drafter_and_head(tiny_target_dir, tiny_hidden, vocab: int = 128, depth: int = 3):
    target = load_target(str(tiny_target_dir))
    data = HiddenStates(tiny_hidden)
    cfg = TrainConfig(target=str(tiny_target_dir), data=str(tiny_hidden), out="unused", draft_vocab_size=vocab, ttt_depth=depth)
    drafter, _, _ = build_drafter(cfg, target, data, list(range(len(data))), (0, 1, 2))
    return drafter, target.model.lm_head.weight[drafter.to_target(torch.arange(vocab))].detach(), data


def loss_and_grads(drafter, head, batch, depth, chunk_tokens=None, **options):
    drafter.zero_grad(set_to_none=True)
    loss, stats = ttt_loss(drafter, head, batch, depth, chunk_tokens, **options)
    loss.backward()
    return loss.detach(), stats, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def assert_same_step(a, b):
    (loss_a, stats_a, grads_a), (loss_b, stats_b, grads_b) = a, b
    assert torch.allclose(loss_a, loss_b, rtol=1e-5)
    assert [n for _, _, n in stats_a] == [n for _, _, n in stats_b] and all(n > 0 for _, _, n in stats_a)
    assert all(abs(x - y) < 1e-5 for sa, sb in zip(stats_a, stats_b) for x, y in zip(sa[:2], sb[:2]))
    assert grads_a.keys() == grads_b.keys()
    for k in grads_a:
        assert torch.allclose(grads_a[k], grads_b[k], rtol=1e-4, atol=1e-6), k


def test_ttt_loss_falls_when_overfitting_one_batch(tiny_target_dir, tiny_hidden):
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden)
    batch = pack([[data[0], data[1]]], "cpu")
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(40):
        loss, stats = ttt_loss(drafter, head, batch, 3)
        if first is None:
            first, first_acc = float(loss.detach()), stats[0][1]
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first
    assert stats[0][1] > max(0.75, first_acc + 0.3)  # step-0 agreement with the target's greedy token


def test_the_loss_weighs_step_j_by_step_decay_to_the_j(tiny_target_dir, tiny_hidden):
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden)
    batch = pack([[data[0], data[1]]], "cpu")
    losses = {}
    for decay in (0.8, 0.5):
        loss, stats = ttt_loss(drafter, head, batch, 3, step_decay=decay)
        assert float(loss) == pytest.approx(sum(decay**j * lj for j, (lj, _, _) in enumerate(stats)), rel=1e-5)
        losses[decay] = (float(loss), stats)
    assert losses[0.8][1] == losses[0.5][1]  # the steps' own losses do not depend on their weights
    assert float(ttt_loss(drafter, head, batch, 3)[0]) == losses[0.8][0]  # 0.8, EAGLE's and SpecForge's, by default
    with pytest.raises(ValueError, match="step_decay"):
        TrainConfig(target="t", data="d", out="o", step_decay=0)


@pytest.mark.parametrize("rows_per_pack, loss_chunk_tokens", [(1, 4096), (3, 32)])
def test_resumed_run_matches_an_uninterrupted_one(rows_per_pack, loss_chunk_tokens, tiny_target_dir, tiny_hidden, tmp_path):
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=128, ttt_depth=2,
                  epochs=2, batch_tokens=128, lr=1e-3, save_every=2, eval_fraction=0.2, rows_per_pack=rows_per_pack,
                  loss_chunk_tokens=loss_chunk_tokens)
    full = run(TrainConfig(out=str(tmp_path / "full"), **common))
    part = run(TrainConfig(out=str(tmp_path / "part"), max_steps=5, **common))  # "crash" after 5 steps
    assert part.steps == 5 < full.steps
    resumed = run(TrainConfig(out=str(tmp_path / "part"), **common))
    assert resumed.steps == full.steps
    a = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "part" / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.eval == full.eval
    steps = [json.loads(l)["step"] for l in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines() if "step" in json.loads(l)]
    assert steps == list(range(1, full.steps + 1))  # every step logged exactly once
    if rows_per_pack > 1:  # packs of another size are another schedule
        with pytest.raises(ValueError, match="rows_per_pack"):
            run(TrainConfig(out=str(tmp_path / "part"), **{**common, "rows_per_pack": 1}))


def test_time_boxed_runs_add_up_to_an_uninterrupted_one(tiny_target_dir, tiny_hidden, tmp_path):
    """max_seconds=0 stops after every first step, checkpointed; reruns continue the same schedule."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=128, ttt_depth=2,
                  epochs=2, batch_tokens=128, lr=1e-3, save_every=100, eval_fraction=0.2)
    full = run(TrainConfig(out=str(tmp_path / "full"), **common))
    boxed = [run(TrainConfig(out=str(tmp_path / "boxed"), max_seconds=0, **common)) for _ in range(2)]
    assert [r.steps for r in boxed] == [1, 2]  # one step a call (the clock includes loading)
    while boxed[-1].steps < full.steps:
        boxed.append(run(TrainConfig(out=str(tmp_path / "boxed"), max_seconds=0, **common)))
    a = load_file(str(tmp_path / "full" / "checkpoint" / "model.safetensors"))
    b = load_file(str(tmp_path / "boxed" / "checkpoint" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_an_extra_evaluation_set_is_scored_every_epoch(tiny_target_dir, tiny_hidden, tmp_path):
    """--eval-data: e.g. the target's answers to the benchmark's prompts, scored beside the held-out split."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=64, ttt_depth=2, epochs=2,
                  batch_tokens=128, lr=1e-3, eval_fraction=0.2)
    plain = run(TrainConfig(out=str(tmp_path / "a"), **common))
    both = run(TrainConfig(out=str(tmp_path / "b"), eval_data=str(tiny_hidden), **common))
    records = [json.loads(l) for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if "epoch" in r]
    assert len(epochs) == 2 and all(len(r["eval_data"]["acc"]) == 2 and r["eval_data"]["accept_length"] >= 1 for r in epochs)
    assert {k: v for k, v in both.eval.items() if k != "eval_data"} == plain.eval  # training itself is unchanged
    assert both.eval["eval_data"] == epochs[-1]["eval_data"]  # nothing trained after the last epoch's evaluation
    # --eval-data-sampled (the target's sampled answers, for the T=1 score) is scored beside it, by name
    three = run(TrainConfig(out=str(tmp_path / "c"), eval_data=str(tiny_hidden), eval_data_sampled=str(tiny_hidden), **common))
    assert three.eval["eval_data_sampled"] == three.eval["eval_data"] == both.eval["eval_data"]
    assert three.eval["eval_data_sampled"]["accept_length_t1"] >= 1


def test_scores_can_unroll_more_draft_steps_than_training_did(tiny_target_dir, tiny_hidden, tmp_path):
    """eval_depth: drafters trained at different TTT depths are compared over the same draft steps."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=64, ttt_depth=2, epochs=1,
                  batch_tokens=128, lr=1e-3, eval_fraction=0.2)
    plain = run(TrainConfig(out=str(tmp_path / "a"), **common))
    deep = run(TrainConfig(out=str(tmp_path / "b"), eval_depth=4, **common))
    assert len(plain.eval["acc"]) == 2 and len(deep.eval["acc"]) == 4
    assert deep.eval["acc"][:2] == pytest.approx(plain.eval["acc"], abs=1e-6)  # the first steps score the same
    assert deep.eval["accept_length"] == pytest.approx(accept_length(deep.eval["acc"]))
    assert len(deep.eval["overlap"]) == 4 and all(0 < o <= 1 for o in deep.eval["overlap"])  # and at T=1
    assert deep.eval["accept_length_t1"] == pytest.approx(accept_length(deep.eval["overlap"]))
    a, b = (load_file(str(tmp_path / d / "drafter" / "drafter.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # training itself is unchanged
    with pytest.raises(ValueError, match="eval_depth"):
        TrainConfig(eval_depth=0, **{**common, "out": "o"})


def test_training_starts_from_an_earlier_drafter(tiny_target_dir, tiny_hidden, tmp_path):
    """--init: the earlier drafter's weights and draft vocab (not a new one), whatever draft_vocab_size says."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), ttt_depth=2, batch_tokens=128, eval_fraction=0.2)
    first = run(TrainConfig(out=str(tmp_path / "a"), draft_vocab_size=64, lr=1e-3, **common))
    frozen = dict(lr=0.0, draft_vocab_size=128, max_steps=2, **common)  # lr 0: the weights stay as loaded
    again = run(TrainConfig(out=str(tmp_path / "b"), init=str(tmp_path / "a" / "drafter"), **frozen))
    scratch = run(TrainConfig(out=str(tmp_path / "c"), **frozen))
    assert again.eval == first.eval != scratch.eval
    a = load_file(str(tmp_path / "a" / "drafter" / "drafter.safetensors"))
    b = load_file(str(tmp_path / "b" / "drafter" / "drafter.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert b["d2t"].numel() == 64


@pytest.mark.parametrize("rows_per_pack, tokens", [(1, 192), (2, 96)])
def test_steps_cut_the_global_pack_sequence(rows_per_pack, tokens, tiny_hidden):
    """A step of W x grad_accum packs takes the next packs of the one global sequence, and its
    cursor resumes exactly after them, whatever W x grad_accum is; a pack is rows_per_pack
    consecutive rows of the one greedy packing."""
    data = HiddenStates(tiny_hidden)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    one_row = [[s["input_ids"].tolist() for s in row] for _, [row] in batches(data, order, tokens)]
    packs = list(batches(data, order, tokens, rows_per_pack))
    ids = [[[s["input_ids"].tolist() for s in row] for row in p] for _, p in packs]
    assert [row for p in ids for row in p] == one_row
    assert all(len(p) == rows_per_pack for p in ids[:-1])
    for per_step in (1, 2, 3):
        grouped = list(steps(data, order, tokens, 0, per_step, rows_per_pack))
        assert [[[s["input_ids"].tolist() for s in row] for row in p] for _, ps in grouped for p in ps] == ids
        assert [len(ps) for _, ps in grouped] == [min(per_step, len(ids) - i) for i in range(0, len(ids), per_step)]
        assert [c for c, _ in grouped] == [packs[min(i + per_step, len(packs)) - 1][0] for i in range(0, len(packs), per_step)]
        rest = list(steps(data, order, tokens, grouped[1][0], per_step, rows_per_pack))
        assert [c for c, _ in rest] == [c for c, _ in grouped[2:]]


def test_packed_rows_match_one_concatenated_row(tiny_target_dir, tiny_hidden):
    """A (3, T) pack of rows padded to the longest scores and trains like the same samples
    concatenated into one row: the same loss, per-step stats and gradients, up to float rounding."""
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden)
    samples = [data[i] for i in range(6)]
    samples[1] = {k: v[:40] for k, v in samples[1].items()}  # rows of unequal length
    rows = [samples[:2], samples[2:3], samples[3:]]
    one, batched = pack([samples], "cpu"), pack(rows, "cpu")
    lengths = [sum(len(s["input_ids"]) for s in row) for row in rows]
    assert batched["input_ids"].shape == (3, max(lengths))
    for b, n in enumerate(lengths):  # padding: its own segment, never scored, position 0
        assert (batched["segment_ids"][b, n:] == -1).all() and (batched["segment_ids"][b, :n] >= 0).all()
        assert not batched["loss_mask"][b, n:].any() and not batched["position_ids"][b, n:].any()
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(5):  # move off the initial drafter, so that acc_j is not 0 everywhere
        loss_and_grads(drafter, head, one, 3)
        opt.step()
    a, b = loss_and_grads(drafter, head, one, 3), loss_and_grads(drafter, head, batched, 3)
    assert any(acc > 0 for _, acc, _ in a[1])
    assert_same_step(a, b)
    # TrainConfig.pad_packs: one shape for every pack, rows of padding alone included, and the same step
    padded = pack(rows, "cpu", (5, max(lengths) + 37))
    assert padded["input_ids"].shape == (5, max(lengths) + 37) and (padded["segment_ids"][3:] == -1).all()
    assert_same_step(a, loss_and_grads(drafter, head, padded, 3))
    with pytest.raises(ValueError, match="does not fit"):
        pack(rows, "cpu", (2, max(lengths)))


@pytest.mark.parametrize("options", [{}, {"target_cache_mb": 0}, pytest.param(
    {"compile_loss": True}, marks=pytest.mark.filterwarnings("ignore:.*torch.jit.script_method"))], ids=["cached", "per-chunk", "compiled"])
def test_chunked_loss_matches_one_chunk_and_keeps_no_vocab_sized_tensor(options, tiny_target_dir, tiny_hidden):
    """Checkpointed chunks of 16 scored tokens give the loss and gradients of one chunk, and the
    autograd graph then saves no (tokens, Vd) tensor: backward recomputes them chunk by chunk. So with
    the target's log-probs kept for the pack or recomputed per chunk, and with the KL compiled (what
    CUDA runs; inductor on the CPU here, a few seconds per compile) against the eager one."""
    vocab = 100  # no other saved matrix is this wide
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden, vocab=vocab)
    batch = pack([[data[0], data[1]], [data[2]]], "cpu")

    def vocab_sized_saved(chunk_tokens, **options):
        saved = []

        def keep(t):
            if t.dim() == 2 and t.shape[1] == vocab:
                saved.append(tuple(t.shape))
            return t
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            result = loss_and_grads(drafter, head, batch, 3, chunk_tokens, **options)
        return result, saved

    (whole, saved_whole), (chunked, saved_chunked) = vocab_sized_saved(None, **options), vocab_sized_saved(16, **options)
    assert all(n > 16 for _, _, n in whole[1])  # every step really splits
    assert saved_whole and not saved_chunked
    assert_same_step(whole, chunked)
    if options:
        assert_same_step(vocab_sized_saved(None)[0], whole)


def test_target_log_probs_are_computed_once_per_pack(tiny_target_dir, tiny_hidden, monkeypatch):
    """Step j scores row t against target row t+1+j: the rows of all steps overlap, so each distinct
    target row's (Vd,) log-probs are computed once per pack, and the loss, stats and gradients are
    those of recomputing them per step and chunk (target_cache_mb=0, the fallback past the limit)."""
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden, vocab=100)
    batch = pack([[data[0], data[1]], [data[2]]], "cpu")
    computed, target_logp = [], train.target_logp
    monkeypatch.setattr(train, "target_logp", lambda h, final: computed.append(len(final)) or target_logp(h, final))
    where = scored(batch["segment_ids"], batch["loss_mask"].bool(), 3).flatten(1)
    hit = where.nonzero()
    distinct = len(set((hit[:, 1] + 1 + hit[:, 0]).tolist()))
    for chunk in (None, 16):
        computed.clear()
        once = loss_and_grads(drafter, head, batch, 3, chunk)
        assert sum(computed) == distinct < len(hit) / 2
        computed.clear()
        per_chunk = loss_and_grads(drafter, head, batch, 3, chunk, target_cache_mb=0)
        assert sum(computed) == len(hit) * (2 if chunk else 1)  # checkpointed chunks recompute in backward
        assert_same_step(once, per_chunk)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled CUDA paths need a CUDA device")
def test_cuda_default_paths_match_the_old_ones(tiny_target_dir, tiny_hidden):
    """On CUDA ttt_loss's fast paths (compiled flex attention, the target's log-probs once per pack,
    the compiled KL) give in fp32 the loss, stats and gradients of the old paths (materialised
    attention, log-probs per chunk, eager KL), chunked or not; under bf16 autocast a loss close to theirs."""
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden, vocab=100)
    drafter, head = drafter.cuda(), head.cuda()
    batch = pack([[data[0], data[1]], [data[2]]], "cuda")
    old = {"attn_impl": "eager", "target_cache_mb": 0, "compile_loss": False}
    for chunk in (None, 16):
        assert_same_step(loss_and_grads(drafter, head, batch, 3, chunk, **old),
                         loss_and_grads(drafter, head, batch, 3, chunk, attn_impl="flex"))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        (a, _, _), (b, _, _) = (loss_and_grads(drafter, head, batch, 3, 16, **old),
                                loss_and_grads(drafter, head, batch, 3, 16, attn_impl="flex"))
    assert abs(a - b) <= 2e-2 * abs(a)


def test_the_t1_overlap_is_the_chance_speculative_sampling_keeps_a_draft_token():
    """overlap_terms from the draft vocab's renormalised target log-probs and vocab_mass (the target's
    probability on the draft vocab) is the rate at which decode.speculative_accept keeps a token drawn
    from the draft at T=1, whose drafts never leave the draft vocab while the target's mass does."""
    from draftsmith.decode import speculative_accept

    g = torch.Generator().manual_seed(0)
    V, H, d2t = 50, 16, torch.randperm(50, generator=g)[:30]  # a draft vocab of 30 of the target's 50 tokens
    full_head = torch.randn(V, H, generator=g)
    final = torch.randn(3, H, generator=g)
    p_full = torch.softmax(final @ full_head.T, -1)  # (3, V)
    mass = train.vocab_mass(full_head, d2t, final, torch.tensor([2, 0, 1, 2]))
    assert torch.allclose(mass, p_full[[2, 0, 1, 2]][:, d2t].sum(-1), atol=1e-6)
    q_logits = torch.randn(1, 30, generator=g) * 2
    log_p = torch.log_softmax((final[:1] @ full_head[d2t].T), -1)
    overlap = float(train.overlap_terms(q_logits, log_p, mass[1:2]))
    q_full = torch.zeros(1, V)
    q_full[0, d2t] = torch.softmax(q_logits[0], -1)
    p = p_full[:1].expand(2, V)
    draws = 20000
    kept = sum(speculative_accept(p, q_full, torch.multinomial(q_full[0], 1, generator=g), generator=g)[0]
               for _ in range(draws)) / draws
    assert 0.05 < overlap < 0.95 and abs(kept - overlap) < 4 * (overlap * (1 - overlap) / draws) ** 0.5


def test_evaluation_scores_t1_acceptance_and_training_is_unchanged(tiny_target_dir, tiny_hidden):
    """With the target's whole head, ttt_loss outside autograd adds each step's mean T=1 overlap (the same
    chunked or not, step 0's equal to a direct computation from the target's whole-vocab softmax); under
    autograd (training) the stats and loss are those without it."""
    target = load_target(str(tiny_target_dir))
    drafter, head, data = drafter_and_head(tiny_target_dir, tiny_hidden, vocab=100)
    full_head = target.model.lm_head.weight.detach()
    batch = pack([[data[0], data[1]], [data[2]]], "cpu")
    with torch.no_grad():
        loss, stats = ttt_loss(drafter, head, batch, 3, full_head=full_head)
        _, chunked = ttt_loss(drafter, head, batch, 3, 16, full_head=full_head)
        _, without = ttt_loss(drafter, head, batch, 3)
        assert [s[:3] for s in stats] == without and all(len(s) == 4 and 0 < s[3] < 1 for s in stats)
        assert [s[3] for s in chunked] == pytest.approx([s[3] for s in stats], abs=1e-6)
        outs = drafter.ttt(batch["input_ids"].long(), batch["aux"].float(), 3, batch["position_ids"], batch["segment_ids"], "eager")
        rows = scored(batch["segment_ids"], batch["loss_mask"].bool(), 3)[0].flatten().nonzero()[:, 0]
        p = torch.softmax(batch["final"].flatten(0, 1)[rows + 1].float() @ full_head.T, -1)[:, drafter.to_target(torch.arange(100))]
        q = torch.softmax(drafter.logits(outs[0].flatten(0, 1)[rows]), -1)
        assert stats[0][3] == pytest.approx(float(torch.minimum(p, q).sum(-1).mean()), abs=1e-5)
    trained = loss_and_grads(drafter, head, batch, 3, full_head=full_head)
    assert all(len(s) == 3 for s in trained[1])
    assert_same_step(trained, loss_and_grads(drafter, head, batch, 3))


def test_simulated_accept_length():
    assert accept_length([1.0, 1.0, 1.0]) == 4.0
    assert accept_length([0.5, 0.5]) == 1.0 + 0.5 + 0.25
    assert accept_length([0.0, 1.0]) == 1.0


def test_online_features_equal_extracted_ones(tiny_target_dir, tiny_hidden):
    """The target in the loop on a packed row gives the features extract stored per sample."""
    target = load_target(str(tiny_target_dir))
    data = HiddenStates(tiny_hidden)
    samples = [data[3], data[4], data[5]]
    for rows in ([samples], [samples[:2], samples[2:]]):  # one row, and a (2, T) pack with a padded row
        packed = pack([[{k: s[k] for k in ("input_ids", "loss_mask")} for s in row] for row in rows], "cpu")
        online = target_features(target.model, packed, (0, 1, 2))
        offline = pack(rows, "cpu")
        real = offline["segment_ids"] >= 0  # padding is computed online, zeros offline
        assert (online["aux"] - offline["aux"].float())[real].abs().max() < 0.05  # offline is stored in bf16
        assert (online["final"] - offline["final"].float())[real].abs().max() < 0.05
        assert (online["argmax"] == offline["argmax"].long())[real].float().mean() > 0.99


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the compiled flex kernel (the one that skips tiles) needs a CUDA device")])])
def test_target_flex_attention_equals_the_dense_mask(tiny_target_dir, device):
    """target_attn "flex" (a block mask that skips the tiles no query of a sample sees) gives the features of the
    dense same-sample causal mask, over rows longer than one 128-token tile, with samples across tile edges and a
    padded tail (segment -1). On the CPU flex runs unfused (the mask alone); on CUDA compiled, reading the tile tables."""
    target = load_target(str(tiny_target_dir), device)
    g = torch.Generator().manual_seed(0)
    lengths = [[150, 100, 50], [7, 200, 60, -33]]  # a negative length: that many padding tokens
    T = 300
    seg, pos = torch.empty(2, T, dtype=torch.long), torch.empty(2, T, dtype=torch.long)
    for b, row in enumerate(lengths):
        at = 0
        for i, n in enumerate(row):
            seg[b, at:at + abs(n)] = i if n > 0 else -1
            pos[b, at:at + abs(n)] = torch.arange(abs(n))
            at += abs(n)
    batch = {k: v.to(device) for k, v in {"input_ids": torch.randint(0, target.model.args.vocab_size, (2, T), generator=g),
                                          "segment_ids": seg, "position_ids": pos}.items()}
    dense = target_features(target.model, batch, (0, 1, 2), "sdpa")
    flex = target_features(target.model, batch, (0, 1, 2), "flex")
    tol = 1e-4 if device == "cpu" else 2e-3  # fp32 either way; on CUDA two different kernels' sums
    for k in ("aux", "final"):
        torch.testing.assert_close(flex[k], dense[k], atol=tol, rtol=tol)
    assert (flex["argmax"] == dense["argmax"]).float().mean() >= (1.0 if device == "cpu" else 0.99)
    with pytest.raises(ValueError, match="target_attn"):
        TrainConfig(target="x", data="x", out="y", target_attn="flash")
    with pytest.raises(ValueError, match="CUDA"):
        TrainConfig(target="x", data="x", out="y", target_attn="flex", target_compile=True)


@pytest.mark.parametrize("attn,device", [("sdpa", "cpu"), pytest.param("flex", "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="inductor builds the compiled flex kernel for CUDA (its CPU one fails to build)")])])
def test_the_compiled_target_pass_equals_the_eager_one(tiny_target_dir, attn, device):
    """TrainConfig.target_compile (Transformer.compile_long): the target's pass over packs of changing length runs
    compiled code, one compilation for every layer, and gives the eager pass's features and greedy tokens."""
    from torch._dynamo.utils import counters

    target = load_target(str(tiny_target_dir), device)
    g = torch.Generator().manual_seed(1)
    packs = []
    for T in (300, 280, 330):  # the cache grows (330), then a shorter pack reads part of it
        seg = torch.zeros(2, T, dtype=torch.long)
        seg[:, T // 3:] = 1
        seg[1, -7:] = -1  # padding
        pos = torch.cat([torch.arange(T // 3), torch.arange(T - T // 3)]).expand(2, T).clone()
        packs.append({k: v.to(device) for k, v in {"input_ids": torch.randint(0, target.model.args.vocab_size, (2, T), generator=g),
                                                   "segment_ids": seg, "position_ids": pos}.items()})
    eager = [target_features(target.model, b, (0, 1, 2), attn) for b in packs]
    graphs = counters["stats"]["unique_graphs"]
    target.model.compile_long()
    for b, ref in zip(packs, eager):
        out = target_features(target.model, b, (0, 1, 2), attn)
        tol = 1e-4 if device == "cpu" else 2e-3  # fp32; on CUDA fused kernels sum in another order
        for k in ("aux", "final"):
            torch.testing.assert_close(out[k], ref[k], atol=tol, rtol=tol)
        assert (out["argmax"] == ref["argmax"]).float().mean() >= (1.0 if device == "cpu" else 0.99)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled code ran
    assert counters["stats"]["unique_graphs"] - graphs < len(target.model.layers) * len(packs)  # not a graph a layer


@pytest.mark.parametrize("rows_per_pack", [1, 2])
def test_online_and_offline_training_agree(rows_per_pack, tiny_target_dir, tiny_answers, tiny_hidden, tmp_path):
    common = dict(target=str(tiny_target_dir), draft_vocab_size=128, ttt_depth=2, epochs=1, batch_tokens=256,
                  lr=1e-3, eval_fraction=0.25, rows_per_pack=rows_per_pack)
    off = run(TrainConfig(data=str(tiny_hidden), out=str(tmp_path / "off"), **common))
    on = run(TrainConfig(data=str(tiny_answers), out=str(tmp_path / "on"), online=True, **common))
    assert on.steps == off.steps
    for a, b in zip(on.eval["loss"], off.eval["loss"]):
        assert abs(a - b) < 0.02 * max(abs(b), 1.0)


def test_online_training_with_the_target_on_flex_attention(tiny_target_dir, tiny_answers, tmp_path):
    """TrainConfig.target_attn reaches the target's pass: "flex" trains the drafter "sdpa" does (one row of up to 512
    tokens: several packed samples across a 128-token tile edge)."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_answers), online=True, draft_vocab_size=128, ttt_depth=2,
                  epochs=1, batch_tokens=512, lr=1e-3, eval_fraction=0.25)
    dense = run(TrainConfig(out=str(tmp_path / "sdpa"), **common))
    flex = run(TrainConfig(out=str(tmp_path / "flex"), target_attn="flex", **common))
    compiled = run(TrainConfig(out=str(tmp_path / "compiled"), target_compile=True, **common))  # and compiled
    padded = run(TrainConfig(out=str(tmp_path / "padded"), target_compile=True, pad_packs=True, **common))  # one shape
    for other in (flex, compiled, padded):
        assert other.steps == dense.steps
        for a, b in zip(other.eval["loss"], dense.eval["loss"]):
            assert abs(a - b) < 1e-4 * max(abs(b), 1.0)


def test_a_failing_compiled_target_pass_falls_back_to_eager(tiny_target_dir, tiny_answers, tmp_path, monkeypatch, capsys):
    """--target-compile whose compiled pass fails (a compiler error on some platform) warns and trains on eager:
    the eager run's losses, and the layers run eager afterwards (no second failure a pack)."""
    from draftsmith.target import Transformer

    calls = []

    def broken(self, backend="inductor"):
        def fail(*args, **kwargs):
            calls.append(1)
            raise RuntimeError("inductor could not build a kernel")
        for layer in self.layers:
            layer.long = fail
        return self

    common = dict(target=str(tiny_target_dir), data=str(tiny_answers), online=True, draft_vocab_size=128, ttt_depth=2,
                  epochs=1, batch_tokens=256, lr=1e-3, eval_fraction=0.25)
    eager = run(TrainConfig(out=str(tmp_path / "eager"), **common))
    monkeypatch.setattr(Transformer, "compile_long", broken)
    fallback = run(TrainConfig(out=str(tmp_path / "fallback"), target_compile=True, **common))
    assert "the compiled target pass failed (RuntimeError: inductor could not build a kernel)" in capsys.readouterr().out
    assert calls == [1]
    assert fallback.steps == eager.steps
    for a, b in zip(fallback.eval["loss"], eager.eval["loss"]):
        assert abs(a - b) < 1e-5 * max(abs(b), 1.0)


def test_tensorboard_scalars(tiny_target_dir, tiny_hidden, tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run(TrainConfig(target=str(tiny_target_dir), data=str(tiny_hidden), out=str(tmp_path), draft_vocab_size=128,
                             ttt_depth=2, batch_tokens=256, eval_fraction=0.25))
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss_0", "train/loss_1", "train/acc_1", "train/accept_length", "train/lr", "train/tokens_per_s",
            "eval/loss_1", "eval/acc_0", "eval/accept_length"} <= tags
    assert [e.step for e in events.Scalars("train/loss_0")] == list(range(1, result.steps + 1))


def test_training_without_tensorboard_says_so_once(tiny_target_dir, tiny_hidden, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when it is not installed
    run(TrainConfig(target=str(tiny_target_dir), data=str(tiny_hidden), out=str(tmp_path), draft_vocab_size=128,
                    ttt_depth=2, batch_tokens=256, eval_fraction=0.25, max_steps=1))
    assert capsys.readouterr().out.count("tensorboard is not installed") == 1
    assert not (tmp_path / "tb").exists()


def test_profiled_steps_say_where_the_time_goes(tiny_target_dir, tiny_hidden, tmp_path):
    """profile_steps writes profile.json after steps profile_from..profile_from+n-1 (10 by default); the run's results
    are those of an unprofiled run."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=128, ttt_depth=2, batch_tokens=64,
                  eval_fraction=0.25, schedule_steps=13, lr=1e-3)
    plain = run(TrainConfig(out=str(tmp_path / "plain"), **common))
    profiled = run(TrainConfig(out=str(tmp_path / "profiled"), profile_steps=2, **common))
    prof = json.loads((tmp_path / "profiled" / "profile.json").read_text())
    assert prof["steps"] == 2 and prof["from_step"] == 10 and prof["wall_ms_per_step"] > 0
    assert any("mm" in name for name in prof["top_host_self_ms_per_step"])  # the step's matmuls were seen
    assert not (tmp_path / "plain" / "profile.json").exists()
    assert profiled.eval["loss"] == plain.eval["loss"]
    run(TrainConfig(out=str(tmp_path / "late"), profile_steps=1, profile_from=12, **common))
    assert json.loads((tmp_path / "late" / "profile.json").read_text())["from_step"] == 12


def test_a_wider_drafter_mlp_trains_and_exports_its_width(tiny_target_dir, tiny_hidden, tmp_path):
    """draft_intermediate_size sets the drafter's MLP width; the SGLang export carries it (config and shapes)
    and reloads to the same logits."""
    from draftsmith.export import ExportConfig, load_any, load_trained
    from draftsmith.export import run as export

    res = run(TrainConfig(target=str(tiny_target_dir), data=str(tiny_hidden), out=str(tmp_path / "t"), draft_vocab_size=128,
                          draft_intermediate_size=96, ttt_depth=2, batch_tokens=128, eval_fraction=0.2, max_steps=2))
    drafter, _ = load_trained(tmp_path / "t" / "drafter")
    assert drafter.cfg.intermediate_size == 96 != load_target(str(tiny_target_dir)).model.args.intermediate_size
    assert res.steps == 2
    export(ExportConfig(checkpoint=str(tmp_path / "t" / "drafter"), out=str(tmp_path / "sglang"), dtype="float32"))
    cfg = json.loads((tmp_path / "sglang" / "config.json").read_text())
    sd = load_file(str(tmp_path / "sglang" / "model.safetensors"))
    assert cfg["intermediate_size"] == 96
    assert sd["midlayer.mlp.gate_proj.weight"].shape == (96, cfg["hidden_size"])
    assert sd["midlayer.mlp.down_proj.weight"].shape == (cfg["hidden_size"], 96)
    back = load_any(str(tmp_path / "sglang"), drafter.embed_tokens.weight.detach())
    torch.manual_seed(0)
    ids = torch.randint(0, drafter.cfg.vocab_size, (1, 10))
    aux = torch.randn(1, 10, 3 * drafter.cfg.target_hidden_size)
    with torch.no_grad():
        want = [drafter.logits(o) for o in drafter.ttt(ids, aux, depth=2)]
        got = [back.logits(o) for o in back.ttt(ids, aux, depth=2)]
    assert all(torch.equal(w, g) for w, g in zip(want, got))


def test_the_default_learning_rate_depends_on_where_training_starts(tiny_target_dir, tiny_hidden, tmp_path):
    """lr unset: 1e-3 from scratch (the measured H200 recipe), 1e-4 when continuing a trained drafter;
    the resolved value is what the optimizer uses and what train_config.json records."""
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=64, ttt_depth=2, batch_tokens=128,
                  rows_per_pack=1, eval_fraction=0.2, max_steps=1)
    run(TrainConfig(out=str(tmp_path / "a"), **common))
    run(TrainConfig(out=str(tmp_path / "b"), init=str(tmp_path / "a" / "drafter"), **common))
    lrs = [json.loads((tmp_path / n / "train_config.json").read_text())["lr"] for n in ("a", "b")]
    assert lrs == [1e-3, 1e-4]
    first = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"step"' in l][0]
    assert 0 < first["lr"] <= 1e-3  # the warmup's first step of a 1e-3 schedule


@pytest.mark.parametrize("impl", ["flex", "split"])
def test_flex_attention_on_the_cpu_is_refused_up_front(impl):
    """torch has no flex_attention backward on the CPU: the config says so and names the fix instead of
    training failing at its first backward."""
    with pytest.raises(ValueError, match="needs CUDA.*--attn-impl auto or eager"):
        TrainConfig(target="t", data="d", out="o", attn_impl=impl)
    assert TrainConfig(target="t", data="d", out="o", attn_impl=impl, device="cuda").attn_impl == impl


def test_an_export_can_cut_the_draft_vocab_to_the_most_frequent_training_tokens(tiny_target_dir, tiny_hidden, tmp_path):
    """Training keeps the answers' token counts beside the drafter (its draft vocab is their top draft_vocab_size);
    export --draft-vocab N cuts to the N most frequent of them, logits unchanged over the kept tokens."""
    from draftsmith.export import TOKEN_COUNTS, ExportConfig, ExportError, load_any, load_trained
    from draftsmith.export import run as export
    from draftsmith.vocab import build_vocab

    run(TrainConfig(target=str(tiny_target_dir), data=str(tiny_hidden), out=str(tmp_path / "t"), draft_vocab_size=128,
                    ttt_depth=2, batch_tokens=128, eval_fraction=0.2, max_steps=2))
    folder = tmp_path / "t" / "drafter"
    drafter, _ = load_trained(folder)
    counts = load_file(str(folder / TOKEN_COUNTS))["counts"]
    assert counts.shape == (drafter.cfg.vocab_size,) and torch.equal(build_vocab(counts, 128).d2t, drafter.d2t)

    export(ExportConfig(checkpoint=str(folder), out=str(tmp_path / "cut"), dtype="float32", draft_vocab=48))
    assert json.loads((tmp_path / "cut" / "config.json").read_text())["draft_vocab_size"] == 48
    back = load_any(str(tmp_path / "cut"), drafter.embed_tokens.weight.detach())
    want = drafter.shrink_vocab(counts, 48)
    assert torch.equal(back.to_target(torch.arange(48)), want.to_target(torch.arange(48)))
    torch.manual_seed(0)
    ids = torch.randint(0, drafter.cfg.vocab_size, (1, 10))
    aux = torch.randn(1, 10, 3 * drafter.cfg.target_hidden_size)
    with torch.no_grad():
        assert all(torch.equal(want.logits(w), back.logits(g)) for w, g in zip(want.ttt(ids, aux, depth=2), back.ttt(ids, aux, depth=2)))

    with pytest.raises(ExportError, match="trained with 128 draft tokens"):
        export(ExportConfig(checkpoint=str(folder), out=str(tmp_path / "big"), draft_vocab=256))
    (folder / TOKEN_COUNTS).unlink()
    with pytest.raises(ExportError, match="no token_counts.safetensors"):
        export(ExportConfig(checkpoint=str(folder), out=str(tmp_path / "old"), draft_vocab=48))
