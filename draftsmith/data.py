"""Conversations for training and evaluation: prompt files in, user turns and loss-masked token ids out.

`load_prompts` reads training prompt files in the common public formats (ShareGPT, OpenAI
messages, MT-bench `turns`, GSM8K `question`, Alpaca / self-instruct `instruction`, plain
`prompt`, UltraChat `data`), keeps the user turns (the target model regenerates the answers,
so the drafter learns the target's own distribution), deduplicates them and drops any that
appear in an evaluation set. Where a record also carries its own answer to the first turn
(ShareGPT's first gpt turn, GSM8K's `answer`, Alpaca's `output`, UltraChat's second string) it
is kept as `Prompt.answer`: `generate --original-answers` trains on those instead, the baseline
that regeneration is measured against. `load_eval` reads MT-bench / Spec-Bench question files.

`encode_conversation` renders a conversation with the tokenizer's own chat template and marks
which tokens the drafter is trained on: the assistant answers and the end-of-turn text that
closes them, never the prompt or the role headers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

SUPPORTED = (
    "conversations [{from: human|gpt|system, value}], messages [{role, content}], turns [str], "
    "question, instruction (+ input or instances [{input, output}]), prompt, data (str or [str])"
)
USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt")


SAMPLE_SEP = "#sample"  # generate --samples N: answer k of prompt P has id P#sample<k>


def prompt_of(sample_id: str) -> str:
    """The prompt an answer's id belongs to (itself, unless generate sampled several answers)."""
    return sample_id.split(SAMPLE_SEP)[0]


@dataclass(frozen=True)
class Prompt:
    id: str  # source file stem + record id (or index), stable across runs
    turns: tuple[str, ...]  # user turns only, first turn first
    source: str  # file name it came from
    answer: str | None = None  # the record's own answer to the first turn, where it has one (not the target's)


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where the drafter is trained: assistant text and its end-of-turn marker


# --------------------------------------------------------------------------- reading files


def _read_records(path: Path) -> list:
    """A .json file (one array or object) or a .jsonl file (one object per line), told apart by content."""
    text = path.read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        try:
            return [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: neither a JSON document nor JSON lines ({e})") from None
    return data if isinstance(data, list) else [data]


def _chat_user_turns(messages: list, role_key: str, text_key: str) -> list:
    return [m.get(text_key) for m in messages if isinstance(m, dict) and m.get(role_key) in USER_ROLES]


def _instruction(rec: dict) -> str:
    # self-instruct / Alpaca keep the task's input in the first instance; without it the instruction is incomplete
    extra = rec.get("input") or ""
    instances = rec.get("instances")
    if not extra and isinstance(instances, list) and instances and isinstance(instances[0], dict):
        extra = instances[0].get("input") or ""
    instruction = rec["instruction"]
    return f"{instruction}\n\n{extra}" if isinstance(extra, str) and extra.strip() else instruction


def _chat(rec: dict) -> tuple[list, str, str] | None:
    """A chat record's messages with the keys of their role and text (ShareGPT's or OpenAI's); None for other shapes."""
    if isinstance(rec.get("conversations"), list):
        msgs = rec["conversations"]
        return (msgs, "from", "value") if any(isinstance(m, dict) and "from" in m for m in msgs) else (msgs, "role", "content")
    if isinstance(rec.get("messages"), list):
        return rec["messages"], "role", "content"
    return None


def _record_turns(rec) -> list | None:
    """The user turns of one record in any supported shape; None when the shape is not recognised."""
    if not isinstance(rec, dict):
        return None
    if chat := _chat(rec):
        return _chat_user_turns(*chat)
    if isinstance(rec.get("turns"), list):
        return list(rec["turns"])
    if isinstance(rec.get("instruction"), str):
        return [_instruction(rec)]
    for key in ("question", "prompt"):
        if isinstance(rec.get(key), str):
            return [rec[key]]
    data = rec.get("data")
    if isinstance(data, str):
        return [data]
    if isinstance(data, list) and data:
        return [data[0]]  # UltraChat alternates user / assistant; only the opening question is a prompt
    return None


def _first_reply(messages: list, role_key: str, text_key: str) -> str | None:
    """The assistant message right after the first user message, if that is what follows it."""
    roles = [m.get(role_key) if isinstance(m, dict) else None for m in messages]
    first = next((i for i, r in enumerate(roles) if r in USER_ROLES), None)
    if first is None or first + 1 >= len(messages) or roles[first + 1] not in ASSISTANT_ROLES:
        return None
    return messages[first + 1].get(text_key)


def _record_answer(rec: dict) -> str | None:
    """The record's own answer to its first user turn, in the shapes that carry one; None elsewhere."""
    if chat := _chat(rec):
        return _first_reply(*chat)
    if isinstance(rec.get("turns"), list):
        return None  # MT-bench style: questions only
    if isinstance(rec.get("instruction"), str):  # Alpaca's output, or self-instruct's first instance's
        instances = rec.get("instances")
        first = instances[0] if isinstance(instances, list) and instances and isinstance(instances[0], dict) else {}
        return rec.get("output") or first.get("output")
    if isinstance(rec.get("question"), str):
        return rec.get("answer")  # GSM8K: the worked solution ending in "#### <number>"
    if isinstance(rec.get("prompt"), str):
        return rec.get("completion") or rec.get("response")
    data = rec.get("data")
    if isinstance(data, list) and len(data) > 1:
        return data[1]  # UltraChat alternates user / assistant
    return None


def _record_id(rec: dict, index: int) -> str:
    for key in ("id", "question_id"):
        if rec.get(key) is not None:
            return str(rec[key])
    return str(index)


def read_prompt_file(path: str | Path) -> list[Prompt]:
    """Every usable record of one file, in file order, before any deduplication."""
    path = Path(path)
    prompts = []
    for i, rec in enumerate(_read_records(path)):
        turns = _record_turns(rec)
        if turns is None:
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"{path}: record {i} has an unsupported shape (keys: {keys}); supported fields: {SUPPORTED}")
        turns = tuple(t.strip() for t in turns if isinstance(t, str) and t.strip())
        if turns:  # e.g. a ShareGPT record holding only a system prompt
            answer = _record_answer(rec)
            answer = answer.strip() if isinstance(answer, str) and answer.strip() else None
            prompts.append(Prompt(id=f"{path.stem}/{_record_id(rec, i)}", turns=turns, source=path.name, answer=answer))
    if not prompts:
        raise ValueError(f"{path}: no record with a non-empty user turn")
    return prompts


def normalise(text: str) -> str:
    """The key prompts are compared on: whitespace collapsed, stripped, casefolded."""
    return " ".join(text.split()).casefold()


def excluded_turns(exclude: Sequence[str | Path]) -> set[str]:
    """Every turn (normalised) of the excluded files: a training prompt equal to any of them is dropped."""
    return {normalise(t) for p in exclude for prompt in read_prompt_file(p) for t in prompt.turns}


def load_prompts(
    paths: Sequence[str | Path], exclude: Sequence[str | Path] = (), limit: int | None = None
) -> list[Prompt]:
    """Training prompts from `paths`, deduplicated on the first turn, minus any that appear in `exclude`.

    A prompt is dropped when its first turn equals any turn (not only the first) of an excluded
    file, since a later MT-bench turn seen in training would inflate acceptance on it just the same.
    """
    banned = excluded_turns(exclude)
    seen, kept = set(), []
    for path in paths:
        for prompt in read_prompt_file(path):
            key = normalise(prompt.turns[0])
            if key in seen or key in banned:
                continue
            seen.add(key)
            kept.append(prompt)
            if limit is not None and len(kept) >= limit:
                return kept
    return kept


def load_eval(path: str | Path, turns: str = "first") -> list[Prompt]:
    """MT-bench / Spec-Bench questions ({question_id, category, turns}); turns="first" or "all"."""
    if turns not in ("first", "all"):
        raise ValueError(f"turns must be 'first' or 'all', got {turns!r}")
    path = Path(path)
    prompts = []
    for i, rec in enumerate(_read_records(path)):
        if not (isinstance(rec, dict) and "question_id" in rec and isinstance(rec.get("turns"), list) and rec["turns"]):
            keys = sorted(rec) if isinstance(rec, dict) else type(rec).__name__
            raise ValueError(f"{path}: record {i} is not an eval question {{question_id, turns: [...]}} (keys: {keys})")
        qturns = tuple(rec["turns"]) if turns == "all" else (rec["turns"][0],)
        prompts.append(Prompt(id=str(rec["question_id"]), turns=qturns, source=path.name))
    if not prompts:
        raise ValueError(f"{path}: no eval questions")
    return prompts


# --------------------------------------------------------------------------- tokenizing


def _render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _assistant_spans(tokenizer, messages: list[dict], full: str) -> list[tuple[int, int]]:
    """Character spans of `full` that belong to assistant messages, each ending after its end-of-turn text.

    Rendering prefixes of the conversation lets the template itself say where each answer starts
    (after the generation prompt) and ends (after whatever closes the message), with no
    per-model knowledge of role headers or end tokens.
    """
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = _render(tokenizer, messages[:i], generation_prompt=True)
        end = _render(tokenizer, messages[: i + 1])
        for prefix in (start, end):
            if not full.startswith(prefix):
                raise ValueError(
                    f"the chat template is not prefix-stable: rendering the first {i} message(s) does not give a "
                    "prefix of the full conversation (templates that rewrite earlier turns, e.g. strip reasoning "
                    "from past answers, cannot be loss-masked this way)"
                )
        if len(end) < len(start):
            raise ValueError(f"the chat template renders assistant message {i} before its own generation prompt")
        spans.append((len(start), len(end)))
    return spans


def encode_conversation(tokenizer, messages: list[dict]) -> Encoded:
    """Token ids of the chat-templated conversation and a mask that is 1 on assistant tokens."""
    full = _render(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, full)
    # the rendered text already carries the template's BOS, if any; the tokenizer must not add another
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    # a token belongs to the span its first character falls in
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return Encoded(input_ids=list(enc["input_ids"]), loss_mask=mask)


def user_header_ids(tokenizer, system: str | None = None) -> list[int]:
    """Chat-templated ids up to where a user's first message begins (system prompt and user header
    included): from here a chat model writes a user turn itself (generate --self-prompts). `system`
    replaces the template's own system prompt (generate --self-prompt-topics)."""
    mark = "\x00user text\x00"
    text = _render(tokenizer, [*([{"role": "system", "content": system}] if system else []), {"role": "user", "content": mark}])
    if text.count(mark) != 1:
        raise ValueError("the chat template does not render a user message verbatim, so the target cannot be asked to "
                         "write user turns itself; drop --self-prompts for this target")
    return list(tokenizer(text[: text.index(mark)], add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, turns: Sequence[str]) -> list[int]:
    """Chat-templated ids that ask the target to answer the first user turn."""
    if not turns:
        raise ValueError("prompt_ids needs at least one user turn")
    text = _render(tokenizer, [{"role": "user", "content": turns[0]}], generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
