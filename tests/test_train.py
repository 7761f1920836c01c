import json

import torch
from safetensors.torch import load_file

from draftsmith.extract import HiddenStates
from draftsmith.train import (TrainConfig, accept_length, batches, build_drafter, pack, run, steps, target_features,
                             ttt_loss)
from draftsmith.target import load_target


def test_ttt_loss_falls_when_overfitting_one_batch(tiny_target_dir, tiny_hidden):
    target = load_target(str(tiny_target_dir))
    data = HiddenStates(tiny_hidden)
    cfg = TrainConfig(target=str(tiny_target_dir), data=str(tiny_hidden), out="unused", draft_vocab_size=128, ttt_depth=3)
    drafter, _ = build_drafter(cfg, target, data, list(range(len(data))), (0, 1, 2))
    head = target.model.lm_head.weight[drafter.to_target(torch.arange(128))]
    batch = pack([data[0], data[1]], "cpu")
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


def test_resumed_run_matches_an_uninterrupted_one(tiny_target_dir, tiny_hidden, tmp_path):
    common = dict(target=str(tiny_target_dir), data=str(tiny_hidden), draft_vocab_size=128, ttt_depth=2,
                  epochs=2, batch_tokens=128, lr=1e-3, save_every=2, eval_fraction=0.2)
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


def test_steps_cut_the_global_pack_sequence(tiny_hidden):
    """A step of W x grad_accum packs takes the next packs of the one global sequence, and its
    cursor resumes exactly after them, whatever W x grad_accum is."""
    data = HiddenStates(tiny_hidden)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    packs = list(batches(data, order, 192))
    ids = [[s["input_ids"].tolist() for s in g] for _, g in packs]
    for per_step in (1, 2, 3):
        grouped = list(steps(data, order, 192, 0, per_step))
        assert [[s["input_ids"].tolist() for g in gs for s in g] for _, gs in grouped] == \
            [[x for g in ids[i:i + per_step] for x in g] for i in range(0, len(ids), per_step)]
        assert [c for c, _ in grouped] == [packs[min(i + per_step, len(packs)) - 1][0] for i in range(0, len(packs), per_step)]
        rest = list(steps(data, order, 192, grouped[1][0], per_step))
        assert [c for c, _ in rest] == [c for c, _ in grouped[2:]]


def test_simulated_accept_length():
    assert accept_length([1.0, 1.0, 1.0]) == 4.0
    assert accept_length([0.5, 0.5]) == 1.0 + 0.5 + 0.25
    assert accept_length([0.0, 1.0]) == 1.0


def test_online_features_equal_extracted_ones(tiny_target_dir, tiny_hidden):
    """The target in the loop on a packed row gives the features extract stored per sample."""
    target = load_target(str(tiny_target_dir))
    data = HiddenStates(tiny_hidden)
    samples = [data[3], data[4], data[5]]
    packed = pack([{k: s[k] for k in ("input_ids", "loss_mask")} for s in samples], "cpu")
    online = target_features(target.model, packed, (0, 1, 2))
    offline = pack(samples, "cpu")
    assert (online["aux"] - offline["aux"].float()).abs().max() < 0.05  # offline is stored in bf16
    assert (online["final"] - offline["final"].float()).abs().max() < 0.05
    assert (online["argmax"] == offline["argmax"].long()).float().mean() > 0.99


def test_online_and_offline_training_agree(tiny_target_dir, tiny_answers, tiny_hidden, tmp_path):
    common = dict(target=str(tiny_target_dir), draft_vocab_size=128, ttt_depth=2, epochs=1, batch_tokens=256,
                  lr=1e-3, eval_fraction=0.25)
    off = run(TrainConfig(data=str(tiny_hidden), out=str(tmp_path / "off"), **common))
    on = run(TrainConfig(data=str(tiny_answers), out=str(tmp_path / "on"), online=True, **common))
    assert on.steps == off.steps
    for a, b in zip(on.eval["loss"], off.eval["loss"]):
        assert abs(a - b) < 0.02 * max(abs(b), 1.0)
