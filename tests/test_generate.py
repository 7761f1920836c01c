import json

import pytest

from draftsmith import decode, generate
from draftsmith.generate import GenerateConfig, read_done

from helpers import interrupt_on_call


def write_prompts(path, n):
    path.write_text("".join(json.dumps({"question": f"What is {i} plus {i}?"}) + "\n" for i in range(n)))
    return path


def ids_in(path):
    return [json.loads(line)["id"] for line in path.read_text().splitlines()]


def test_interrupted_run_resumes_without_redoing_or_duplicating(tiny_target_dir, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    cfg = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "gen"),
                         max_new_tokens=8, batch_size=3)
    real = interrupt_on_call(monkeypatch, generate, "generate_batch", 3)
    with pytest.raises(KeyboardInterrupt):
        generate.run(cfg)
    assert len(ids_in(tmp_path / "gen" / "answers.jsonl")) == 6  # two finished batches kept
    monkeypatch.setattr(generate, "generate_batch", real)
    result = generate.run(cfg)
    assert result.written == 4 and result.total == 10
    ids = ids_in(tmp_path / "gen" / "answers.jsonl")
    assert sorted(ids) == sorted(f"p/{i}" for i in range(10))
    assert generate.run(cfg).written == 0  # a third run has nothing to do
    assert (tmp_path / "gen" / "generate_config.json").exists()


def test_several_sampled_answers_per_prompt_each_once_after_a_crash(tiny_target_dir, tmp_path, monkeypatch):
    from draftsmith.train import split

    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    cfg = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "gen"),
                         max_new_tokens=8, batch_size=4, samples=3, temperature=1.0)
    real = interrupt_on_call(monkeypatch, generate, "generate_batch", 2)
    with pytest.raises(KeyboardInterrupt):
        generate.run(cfg)
    monkeypatch.setattr(generate, "generate_batch", real)
    assert generate.run(cfg).total == 15
    ids = ids_in(tmp_path / "gen" / "answers.jsonl")
    assert sorted(ids) == sorted(f"p/{i}#sample{k}" for i in range(5) for k in range(3))
    answers = {}
    for line in (tmp_path / "gen" / "answers.jsonl").read_text().splitlines():
        r = json.loads(line)
        answers.setdefault(r["id"].split("#")[0], set()).add(r["conversations"][1]["content"])
    assert any(len(a) > 1 for a in answers.values())  # sampled, not three copies of one answer
    train_idx, held_idx = split(ids, 0.4, 0)  # a prompt's samples stay on one side
    held = {ids[i].split("#")[0] for i in held_idx}
    assert len(held) == 2 and len(held_idx) == 6 and not held & {ids[i].split("#")[0] for i in train_idx}
    with pytest.raises(ValueError, match="temperature"):
        GenerateConfig(target="x", prompts=("p",), out="o", samples=2)


def test_torn_last_line_is_dropped_and_redone(tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"id": "a"}) + "\n" + '{"id": "b", "conv')
    assert read_done(path) == {"a"}
    assert path.read_text() == json.dumps({"id": "a"}) + "\n"


def test_answers_are_the_targets_own_greedy_output(tiny_target_dir, tmp_path):
    from draftsmith.data import prompt_ids
    from draftsmith.target import load_target
    import torch

    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    generate.run(GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "g"),
                                max_new_tokens=12, batch_size=4))
    target = load_target(str(tiny_target_dir))
    rec = [json.loads(l) for l in (tmp_path / "g" / "answers.jsonl").read_text().splitlines()]
    for r in rec:  # batched, left-padded generation equals one-at-a-time greedy decoding
        ids = torch.tensor([prompt_ids(target.tokenizer, [r["conversations"][0]["content"]])])
        plain = decode.decode_plain(target.model, ids, 12, target.eos_ids).tokens
        assert r["answer_tokens"] == len(plain)
        stop = plain[-1] in target.eos_ids
        assert r["conversations"][1]["content"] == target.tokenizer.decode(plain[:-1] if stop else plain)


def test_original_answers_are_the_files_own_in_the_same_format_without_the_target(tiny_target_dir, tmp_path, monkeypatch):
    from draftsmith.target import load_tokenizer

    prompts = tmp_path / "mix.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in [
        {"question": "What is 2 plus 2?", "answer": "2 + 2 = <<2+2=4>>4\n#### 4"},
        {"question": "A question with no answer given"},
        {"instruction": "Name a colour.", "output": "Blue."},
    ]))
    monkeypatch.setattr(generate, "load_target", lambda *a, **k: pytest.fail("the target is not needed"))
    cfg = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "g"),
                         original_answers=True)
    result = generate.run(cfg)
    assert (result.written, result.total, result.without_answer) == (2, 2, 1)
    rec = [json.loads(l) for l in (tmp_path / "g" / "answers.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rec] == ["mix/0", "mix/2"] and {r["finish"] for r in rec} == {"original"}
    assert [r["conversations"] for r in rec] == [
        [{"role": "user", "content": "What is 2 plus 2?"}, {"role": "assistant", "content": "2 + 2 = <<2+2=4>>4\n#### 4"}],
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]]
    tok = load_tokenizer(str(tiny_target_dir))
    assert rec[1]["answer_tokens"] == len(tok("Blue.", add_special_tokens=False)["input_ids"]) > 0
    assert result.tokens == sum(r["answer_tokens"] for r in rec)
    assert generate.run(cfg).written == 0  # a rerun has nothing left to write
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps({"question": "no answer here"}) + "\n")
    with pytest.raises(ValueError, match="carries its own answer"):
        generate.run(GenerateConfig(target=str(tiny_target_dir), prompts=(str(bare),), out=str(tmp_path / "b"),
                                    original_answers=True))
    with pytest.raises(ValueError, match="--original-answers"):
        GenerateConfig(target="x", prompts=("p",), out="o", original_answers=True, self_prompts=4)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="prompt file"):
        GenerateConfig(target="x", prompts=(), out="o")
    with pytest.raises(ValueError, match="top_p"):
        GenerateConfig(target="x", prompts=("p",), out="o", top_p=0)


def test_the_target_writes_its_own_prompts_each_kept_once_after_a_crash(tiny_target_dir, tmp_path, monkeypatch):
    from draftsmith.data import user_header_ids
    from draftsmith.target import load_target

    tok = load_target(str(tiny_target_dir)).tokenizer
    header = "<|im_start|>system\nYou are a tiny test model.<|im_end|>\n<|im_start|>user\n"
    assert user_header_ids(tok) == tok(header, add_special_tokens=False)["input_ids"]
    prompts = write_prompts(tmp_path / "p.jsonl", 3)
    # the random tiny target ends ~10% of its user turns usably, near write_self_prompts' 5% floor after 4 batches:
    # a seed under which it clears the floor (the draws are deterministic; seed 2 does not)
    cfg = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "gen"),
                         max_new_tokens=8, batch_size=8, self_prompts=5, self_prompt_max_tokens=48, seed=1)
    real = generate.generate_batch
    calls = []

    def crash_after_one_useful_batch(model, rows, *args):
        out = real(model, rows, *args)
        calls.append(rows[0] == user_header_ids(tok))
        if calls[-1] and (tmp_path / "gen" / "self_prompts.jsonl").exists() and \
                (tmp_path / "gen" / "self_prompts.jsonl").read_text():
            raise KeyboardInterrupt  # a crash after at least one batch of self prompts is on disk
        return out

    monkeypatch.setattr(generate, "generate_batch", crash_after_one_useful_batch)
    with pytest.raises(KeyboardInterrupt):
        generate.run(cfg)
    before = (tmp_path / "gen" / "self_prompts.jsonl").read_text().splitlines()
    assert 0 < len(before) < 5
    monkeypatch.setattr(generate, "generate_batch", real)
    result = generate.run(cfg)
    lines = (tmp_path / "gen" / "self_prompts.jsonl").read_text().splitlines()
    assert lines[: len(before)] == before and len(lines) == 5  # nothing kept was lost or redone
    texts = [json.loads(l)["prompt"] for l in lines]
    assert len(set(texts)) == 5 and all(len(t) >= 16 for t in texts)
    assert result.total == 3 + 5  # the self-written prompts are answered with the given ones
    assert result.self_prompts == 5
    ids = ids_in(tmp_path / "gen" / "answers.jsonl")
    assert sorted(ids) == sorted([f"p/{i}" for i in range(3)] + [f"self_prompts/{json.loads(l)['id']}" for l in lines])
    answered = {json.loads(l)["conversations"][0]["content"] for l in (tmp_path / "gen" / "answers.jsonl").read_text().splitlines()}
    assert set(texts) <= answered
    assert generate.run(cfg).written == 0


def test_self_written_prompts_can_be_steered_by_topic(tiny_target_dir, tmp_path, monkeypatch):
    """--self-prompt-topics: try i is written under the system message naming topic i mod len, in place of
    the template's own, and the kept prompt records its topic."""
    from draftsmith.data import user_header_ids
    from draftsmith.target import load_target

    tok = load_target(str(tiny_target_dir)).tokenizer
    topics = ("cooking", "astronomy", "tax law")
    heads = {t: user_header_ids(tok, generate.TOPIC_SYSTEM.format(t)) for t in topics}
    assert all(tok.decode(h).startswith(f"<|im_start|>system\nThe user asks for help with {t}.<|im_end|>") for t, h in heads.items())
    assert len({tuple(h) for h in heads.values()} | {tuple(user_header_ids(tok))}) == 4
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    cfg = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "gen"), max_new_tokens=4,
                         batch_size=8, self_prompts=6, self_prompt_max_tokens=48, self_prompt_topics=topics)
    real, batches = generate.generate_batch, []

    def spy(model, rows, max_new, *args):
        if max_new == 48:  # the self-prompt tries (answers get 4 new tokens)
            batches.append(rows)
        return real(model, rows, max_new, *args)

    monkeypatch.setattr(generate, "generate_batch", spy)
    assert generate.run(cfg).self_prompts == 6
    tried = [row for rows in batches for row in rows]
    assert tried and tried == [heads[topics[i % 3]] for i in range(len(tried))]
    kept = [json.loads(l) for l in (tmp_path / "gen" / "self_prompts.jsonl").read_text().splitlines()]
    assert len(kept) == 6 and all(r["topic"] == topics[int(r["id"]) % 3] for r in kept)


def test_a_target_that_never_ends_its_user_turn_gets_a_clear_error(tiny_target_dir, tmp_path, monkeypatch):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    cfg = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "gen"),
                         batch_size=4, self_prompts=3)
    same = "Tell me a story about the sea."
    from draftsmith.target import load_target

    t = load_target(str(tiny_target_dir))
    ids = t.tokenizer(same, add_special_tokens=False)["input_ids"] + [t.eos_ids[0]]
    monkeypatch.setattr(generate, "generate_batch", lambda model, rows, *a: [list(ids) for _ in rows])
    with pytest.raises(RuntimeError, match="drop --self-prompts"):  # one prompt over and over: kept once, then stuck
        generate.run(cfg)
    assert [json.loads(l)["prompt"] for l in (tmp_path / "gen" / "self_prompts.jsonl").read_text().splitlines()] == [same]
    with pytest.raises(ValueError, match="self_prompt_temperature"):
        GenerateConfig(target="x", prompts=("p",), out="o", self_prompts=2, self_prompt_temperature=0)


def test_a_server_gives_the_same_answers_and_self_prompts_as_the_local_engine(tiny_target_dir, tmp_path):
    """generate --server against an OpenAI-compatible server running the same model: the same greedy
    answers as the local engine, and self-written prompts through text completions of the user header's
    token ids, kept and answered like local ones."""
    from draftsmith.data import user_header_ids
    from draftsmith.target import load_target

    from helpers import StubOpenAIServer

    prompts = write_prompts(tmp_path / "p.jsonl", 4)
    local = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "local"),
                           max_new_tokens=12, batch_size=4)
    generate.run(local)
    target = load_target(str(tiny_target_dir))
    with StubOpenAIServer(target) as server:
        remote = GenerateConfig(target=str(tiny_target_dir), prompts=(str(prompts),), out=str(tmp_path / "remote"),
                                max_new_tokens=12, server=server.url, batch_size=4, self_prompts=3,
                                self_prompt_max_tokens=48)
        result = generate.run(remote)
        assert generate.run(remote).written == 0  # a rerun asks the server nothing new
    def answers(folder):
        return {json.loads(l)["id"]: json.loads(l)["conversations"] for l in (folder / "answers.jsonl").read_text().splitlines()}

    got, want = answers(tmp_path / "remote"), answers(tmp_path / "local")
    assert {k: v for k, v in got.items() if k.startswith("p/")} == want
    own = [json.loads(l) for l in (tmp_path / "remote" / "self_prompts.jsonl").read_text().splitlines()]
    assert len(own) == 3 and result.total == 4 + 3
    assert {got[f"self_prompts/{r['id']}"][0]["content"] for r in own} == {r["prompt"] for r in own}
    texts = [body for route, body in server.requests if route.endswith("/v1/completions")]
    assert texts and all(body["prompt"] == user_header_ids(target.tokenizer) for body in texts)
    assert len({body["seed"] for body in texts}) == len(texts)  # every try its own draw
