import json

import pytest
import torch

from draftsmith import extract
from draftsmith.data import encode_conversation
from draftsmith.extract import ExtractConfig, HiddenStates
from draftsmith.target import load_target

from helpers import interrupt_on_call


def test_shards_hold_the_targets_hidden_states(tiny_target_dir, tiny_answers, tiny_hidden):
    data = HiddenStates(tiny_hidden)
    manifest = json.loads((tiny_hidden / "manifest.json").read_text())
    assert len(data) == 12 and len(manifest["shards"]) == 3
    assert manifest["aux_layer_ids"] == [0, 1, 2]  # 4-layer target: engines cannot tap the last layer
    target = load_target(str(tiny_target_dir))
    convs = {json.loads(l)["id"]: json.loads(l)["conversations"] for l in tiny_answers.read_text().splitlines()}
    ids = [i for s in manifest["shards"] for i in s["ids"]]
    for k in [0, 7, 11]:
        s = data[k]
        enc = encode_conversation(target.tokenizer, convs[ids[k]])
        assert s["input_ids"].tolist() == enc.input_ids and s["loss_mask"].tolist() == enc.loss_mask
        x = torch.tensor([enc.input_ids])
        target.model.setup_caches(1, x.shape[1])
        out = target.model(x, torch.arange(x.shape[1]), capture=(0, 1, 2))
        assert (s["aux"].float() - out.aux[0]).abs().max() < 0.05  # stored in bf16
        assert (s["final"].float() - out.hidden[0]).abs().max() < 0.05
        assert torch.equal(s["argmax"].long(), target.model.logits(out.hidden[0]).argmax(-1))


def test_estimate_writes_nothing(tiny_target_dir, tiny_answers, tmp_path, capsys):
    r = extract.run(ExtractConfig(target=str(tiny_target_dir), data=str(tiny_answers), out=str(tmp_path / "x"), estimate=True))
    assert r.estimate_only and r.bytes == r.tokens * (4 * 64 * 2 + 9)
    assert "MiB" in capsys.readouterr().out
    assert not (tmp_path / "x").exists()


def test_crash_mid_run_resumes_after_last_shard(tiny_target_dir, tiny_answers, tmp_path, monkeypatch):
    cfg = ExtractConfig(target=str(tiny_target_dir), data=str(tiny_answers), out=str(tmp_path / "hs"),
                        shard_samples=4, batch_tokens=2048)
    real = interrupt_on_call(monkeypatch, extract, "write_shard", 2)
    with pytest.raises(KeyboardInterrupt):
        extract.run(cfg)
    monkeypatch.setattr(extract, "write_shard", real)
    extract.run(cfg)
    ids = [i for s in json.loads((tmp_path / "hs" / "manifest.json").read_text())["shards"] for i in s["ids"]]
    assert len(ids) == len(set(ids)) == 12


def test_not_answers_file_is_a_clear_error(tiny_target_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(ValueError, match="conversations"):
        extract.run(ExtractConfig(target=str(tiny_target_dir), data=str(bad), out=str(tmp_path / "o")))


def test_training_offline_on_what_is_not_extracted_says_what_to_do(tmp_path):
    """An answers file given to offline training points at --online; an empty folder at extract."""
    answers = tmp_path / "answers.jsonl"
    answers.write_text(json.dumps({"conversations": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(FileNotFoundError, match="--online"):
        extract.HiddenStates(answers)
    with pytest.raises(FileNotFoundError, match="run extract first"):
        extract.HiddenStates(tmp_path)
