import copy
import json

import pytest

from draftsmith.data import Prompt, encode_conversation, load_eval, load_prompts, prompt_ids


def write_json(path, obj):
    path.write_text(json.dumps(obj))
    return path


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def masked_text(tokenizer, enc):
    return tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if m])


def unmasked_text(tokenizer, enc):
    return tokenizer.decode([t for t, m in zip(enc.input_ids, enc.loss_mask) if not m])


# --------------------------------------------------------------------------- formats


def test_sharegpt_keeps_user_turns_only(tmp_path):
    f = write_json(tmp_path / "sg.json", [
        {"id": "a", "conversations": [
            {"from": "system", "value": "be nice"}, {"from": "human", "value": "q1"},
            {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "only an answer"}]},  # no user turn: skipped
    ])
    assert load_prompts([f]) == [Prompt(id="sg/a", turns=("q1", "q2"), source="sg.json", answer="a1")]


def test_openai_messages(tmp_path):
    f = write_json(tmp_path / "oa.json", [{"messages": [
        {"role": "system", "content": "sys"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "  "}]}])
    assert load_prompts([f]) == [Prompt(id="oa/0", turns=("hello there",), source="oa.json", answer="hi")]


def test_jsonl_shapes(tmp_path):
    f = write_jsonl(tmp_path / "mixed.jsonl", [
        {"question_id": 7, "category": "x", "turns": ["turn one", "turn two"]},
        {"question": "How many clips?", "answer": "72"},
        {"instruction": "Fix the grammar.", "input": "me go home"},
        {"id": "t1", "instruction": "Summarise.", "instances": [{"input": "A long text.", "output": "Short."}]},
        {"id": "t2", "instruction": "Tell a joke.", "instances": [{"input": "", "output": "..."}]},
        {"prompt": "Plain prompt"},
    ])
    got = load_prompts([f])
    assert [p.turns for p in got] == [
        ("turn one", "turn two"), ("How many clips?",), ("Fix the grammar.\n\nme go home",),
        ("Summarise.\n\nA long text.",), ("Tell a joke.",), ("Plain prompt",),
    ]
    assert [p.id for p in got] == ["mixed/7", "mixed/1", "mixed/2", "mixed/t1", "mixed/t2", "mixed/5"]


def test_a_records_own_answer_to_its_first_turn_is_kept_where_it_has_one(tmp_path):
    f = write_jsonl(tmp_path / "mixed.jsonl", [
        {"question_id": 7, "category": "x", "turns": ["turn one", "turn two"]},  # questions only
        {"question": "How many clips?", "answer": "48 + 24 = 72\n#### 72"},  # GSM8K
        {"instruction": "Fix the grammar.", "input": "me go home", "output": "I go home."},  # Alpaca
        {"id": "t1", "instruction": "Summarise.", "instances": [{"input": "A long text.", "output": " Short. "}]},
        {"id": "t2", "instruction": "Tell a joke.", "instances": [{"input": "", "output": "  "}]},  # blank: none
        {"prompt": "Plain prompt", "completion": "Plain answer"},
        {"conversations": [{"from": "human", "value": "q"}, {"from": "human", "value": "q again"},
                           {"from": "gpt", "value": "a reply to the second turn, not the first"}]},
        {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                      {"role": "assistant", "content": "r"}]},
        {"data": ["uc question", "uc answer", "follow-up"]},
        {"data": "a bare string"},
    ])
    assert [p.answer for p in load_prompts([f])] == [
        None, "48 + 24 = 72\n#### 72", "I go home.", "Short.", None, "Plain answer", None, "r", "uc answer", None]


def test_ultrachat_takes_first_string(tmp_path):
    listed = write_json(tmp_path / "uc.json", [{"class": "c", "data": ["question", "answer", "follow-up"]},
                                               {"class": "c", "data": "a bare string"}])
    single = write_json(tmp_path / "one.json", {"data": ["only object", "its answer"]})
    assert [p.turns for p in load_prompts([listed, single])] == [("question",), ("a bare string",), ("only object",)]


def test_format_is_detected_by_content_not_name(tmp_path):
    f = write_jsonl(tmp_path / "lines.json", [{"prompt": "x"}, {"prompt": "y"}])
    assert [p.turns[0] for p in load_prompts([f])] == ["x", "y"]


def test_unknown_shape_names_file_record_and_keys(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"text": "?", "label": 1}])
    with pytest.raises(ValueError, match=r"bad\.jsonl.*record 1.*\['label', 'text'\].*supported"):
        load_prompts([f])


def test_file_without_usable_records_is_an_error(tmp_path):
    f = write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "   "}, {"turns": []}])
    with pytest.raises(ValueError, match="empty.jsonl"):
        load_prompts([f])


# --------------------------------------------------------------------------- dedup, exclude, limit


def test_dedup_on_normalised_first_turn_across_files(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Hello   World"}, {"prompt": "other"}])
    b = write_json(tmp_path / "b.json", [{"id": "z", "conversations": [{"from": "human", "value": " hello world\n"}]}])
    got = load_prompts([a, b])
    assert [p.id for p in got] == ["a/0", "a/1"]  # first occurrence wins, file order kept


def test_exclude_matches_any_turn_of_eval_set(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "Keep me"}, {"prompt": "eval FIRST"},
                                                   {"prompt": "eval second"}])
    ev = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 1, "category": "c", "turns": ["Eval first", "Eval  second"]}])
    assert [p.turns[0] for p in load_prompts([train], exclude=[ev])] == ["Keep me"]


def test_limit_applies_after_dedup(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a"}, {"prompt": "A"}, {"prompt": "b"}, {"prompt": "c"}])
    assert [p.turns[0] for p in load_prompts([f], limit=2)] == ["a", "b"]


def test_load_eval(tmp_path):
    f = write_jsonl(tmp_path / "mt_bench.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["t1", "t2"]},
        {"question_id": 82, "category": "math", "turns": ["u1"], "reference": ["r"]},
    ])
    assert load_eval(f) == [Prompt("81", ("t1",), "mt_bench.jsonl"), Prompt("82", ("u1",), "mt_bench.jsonl")]
    assert load_eval(f, turns="all")[0].turns == ("t1", "t2")
    with pytest.raises(ValueError):
        load_eval(f, turns="second")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "no id"}])
    with pytest.raises(ValueError, match="bad.jsonl"):
        load_eval(bad)


# --------------------------------------------------------------------------- tokenizing


def test_mask_covers_answers_and_end_of_turn(tiny_tokenizer):
    msgs = [{"role": "user", "content": "question one"}, {"role": "assistant", "content": "answer one"}]
    enc = encode_conversation(tiny_tokenizer, msgs)
    assert len(enc.input_ids) == len(enc.loss_mask)
    assert masked_text(tiny_tokenizer, enc) == "answer one<|im_end|>\n"
    assert "question one" in unmasked_text(tiny_tokenizer, enc)
    full = tiny_tokenizer.apply_chat_template(msgs, tokenize=False)
    assert enc.input_ids == tiny_tokenizer(full, add_special_tokens=False)["input_ids"]


def test_multi_turn_masks_every_answer_and_no_prompt(tiny_tokenizer):
    msgs = [
        {"role": "system", "content": "system words"},
        {"role": "user", "content": "question one"}, {"role": "assistant", "content": "answer one"},
        {"role": "user", "content": "question two"}, {"role": "assistant", "content": "answer two"},
    ]
    enc = encode_conversation(tiny_tokenizer, msgs)
    assert masked_text(tiny_tokenizer, enc) == "answer one<|im_end|>\nanswer two<|im_end|>\n"
    rest = unmasked_text(tiny_tokenizer, enc)
    for text in ("system words", "question one", "question two", "<|im_start|>assistant\n"):
        assert text in rest


def test_prompt_only_conversation_has_empty_mask(tiny_tokenizer):
    enc = encode_conversation(tiny_tokenizer, [{"role": "user", "content": "hi"}])
    assert sum(enc.loss_mask) == 0


def test_template_that_rewrites_history_is_rejected(tiny_tokenizer):
    tok = copy.deepcopy(tiny_tokenizer)
    # drops every assistant message except the last, like templates that strip past reasoning
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
        "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    msgs = [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]
    with pytest.raises(ValueError, match="prefix-stable"):
        encode_conversation(tok, msgs)


def test_prompt_ids_end_with_generation_prompt(tiny_tokenizer):
    ids = prompt_ids(tiny_tokenizer, ["What is the capital of France?", "ignored second turn"])
    header = tiny_tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert ids[-len(header):] == header
    text = tiny_tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system")
    assert "What is the capital of France?" in text and "ignored" not in text
