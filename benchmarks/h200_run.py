"""One H200 session for issues #3 and #4: the full pipeline on SmolLM2-135M-Instruct, then the
decode benchmark (ours vs HF, chain and tree) for SmolLM2 and for a Llama-3.1-8B-shaped target.

Phases (run back to back on one warm machine; /tmp carries state between them):
  python benchmarks/h200_run.py train --gguf /tmp/SmolLM2.gguf --data .device-data --out $OUT
  python benchmarks/h200_run.py bench --gguf /tmp/SmolLM2.gguf --data .device-data --out $OUT
  python benchmarks/h200_run.py ttt --out $OUT [--ttt-rows 8]   # 8B-shape drafter training, new vs old TTT paths
Each phase writes its JSON under --out as it goes; the last stdout line is a JSON summary.

A training run longer than one device call (10 min): give every call the same --train-steps and a
--deadline (unix time); training stops checkpointed before it and the next call resumes from /tmp/run
while the machine is warm. Keep --bring-back drafter (the default) in every call: a machine that is
given back between calls takes the checkpoint with it, and only what came back under --out survives.
"""

import argparse
import dataclasses
import gzip
import itertools
import json
import os
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith import export, generate, train  # noqa: E402
from draftsmith.bench import accept_by_position, device_name, git_commit, spread, warm_prompt_shapes  # noqa: E402
from draftsmith.cudagraph import Graphs  # noqa: E402
from draftsmith.data import SAMPLE_SEP, load_eval, prompt_ids, prompt_of  # noqa: E402
from draftsmith.decode import TreeSpec, decode_chain, decode_plain, decode_tree, target_step  # noqa: E402
from draftsmith.draft import DraftConfig, Eagle3Drafter  # noqa: E402
from draftsmith.export import load_any, load_trained  # noqa: E402
from draftsmith.target import ModelArgs, Transformer, load_target  # noqa: E402

RUN = Path("/tmp/run")
AGREEMENT_FLOOR = 0.99  # bf16 speculative tokens that plain greedy decoding must pick after the same prefix


def dump(out: Path, name: str, obj: dict):
    (out / name).write_text(json.dumps(obj, indent=2, default=str))


def probe_step_s(cfg: dict, name: str, steps: int = 60) -> float:
    """Mean seconds of a training step with these settings over the probe's second half, steps that
    took over 3x the median (a compilation for a new shape) left out. Run 11 (H100, 5f0f461) timed
    steps 9-20 of a 20-step probe: their median, 0.278 s, still held the recompilations that new pack
    shapes bring early on, and scheduled 2,801 steps for 780 s that then took 471 s (0.168 s a step;
    its own steps 1-170 ran at ~0.21 s). Where a run of the same settings was timed, --train-steps is surer."""
    probe = train.run(train.TrainConfig(out=str(RUN / f"probe-{name}"), max_steps=steps, **{**cfg, "eval_data": None}))
    logged = [json.loads(line) for line in open(Path(probe.out) / "metrics.jsonl")]
    tail = [r["seconds"] for r in logged if r.get("step", 0) > steps // 2 and "seconds" in r]
    med = statistics.median(tail)
    return statistics.fmean(s for s in tail if s <= 3 * med)


def probe_fastest(cfg: dict, key: str, choices, label: str, name: str, res: dict) -> float:
    """Set cfg[key] to the choice whose training step is fastest (probe_step_s, run as name.format(choice)); a
    choice that fails its probe is not chosen (its error in res["{label}_probe_{choice}_error"]). Records
    res["{label}_probe_step_s"] and res[key]; returns the chosen choice's step time."""
    probed = {}
    for choice in choices:
        try:
            probed[choice] = probe_step_s({**cfg, key: choice}, name.format(choice))
        except Exception as e:  # noqa: BLE001 - a path that fails here is simply not chosen
            res[f"{label}_probe_{choice}_error"] = repr(e)[:500]
    cfg[key] = min(probed, key=probed.get)
    res.update({f"{label}_probe_step_s": {k: round(v, 4) for k, v in probed.items()}, key: cfg[key]})
    return probed[cfg[key]]


# --self-prompt-topics tasks: generic kinds of request, one a self-prompt try in turn (generate.TOPIC_SYSTEM). They
# span MT-bench's and Spec-Bench's categories by name (writing, role-play, reasoning, math, coding, extraction, STEM,
# humanities; summarization, translation, questions); no evaluation prompt is used (generate still excludes them)
TASK_TOPICS = ("creative writing", "a role-play", "a reasoning puzzle", "a math problem", "programming",
               "extracting information from a text", "a science or engineering question", "history, philosophy or the arts",
               "summarizing a text", "translating a text", "everyday advice", "a task at work")


def self_prompt_topics(text: str) -> tuple[str, ...]:
    """--self-prompt-topics: "" (none: the template's own system prompt), "tasks" (TASK_TOPICS) or topics, comma-separated."""
    return TASK_TOPICS if text == "tasks" else tuple(t.strip() for t in text.split(",") if t.strip())


def source_fractions(text: str | None) -> dict[str, float]:
    """--source-fraction "gsm8k=0.3,alpaca=0.5" -> {file name prefix: share of its prompts kept}."""
    out = {}
    for part in filter(None, (text or "").split(",")):
        prefix, _, f = part.partition("=")
        if not prefix or not 0 <= float(f or -1) <= 1:
            raise SystemExit(f"--source-fraction wants PREFIX=F with F in [0, 1], comma-separated, not {part!r}")
        out[prefix] = float(f)
    return out


def carried(r: dict, sources: tuple[str, ...] | None, fractions: dict[str, float]) -> bool:
    """Whether a carried answer is trained on: its prompt file is among `sources` (all when None), and for a file
    in `fractions` its prompt is in that share, drawn by a hash of the prompt's id (its samples stay with it)."""
    if sources and not r["source"].startswith(sources):
        return False
    share = next((f for prefix, f in fractions.items() if r["source"].startswith(prefix)), 1.0)
    return zlib.crc32(prompt_of(r["id"]).encode()) < share * 2**32


def target_pass_defaults(a):
    """--target-compile and --pad-packs left unset: on for CUDA (run 20: a step 64.7 ms against run 19's 87.5 on the
    eager pass, the same scores; h200-recipe.json finding_run20), off elsewhere (compiling on a CPU costs more than it
    saves)."""
    for name in ("target_compile", "pad_packs"):
        if getattr(a, name) is None:
            setattr(a, name, a.device.startswith("cuda"))
    return a


def phase_train(a):
    t0 = time.perf_counter()
    target_pass_defaults(a)
    data = Path(a.data)
    prompts = tuple(sorted(str(p) for p in (data / "prompts").iterdir()))
    evals = (str(data / "eval" / "mt_bench.jsonl"), str(data / "eval" / "spec_bench.jsonl"))
    res = {"phase": "train", "command": " ".join(sys.argv), "commit": git_commit(), "device": device_name(a.device)}
    out = Path(a.out)
    answers = RUN / "gen" / "answers.jsonl"
    extra = RUN / "gen-extra" / "answers.jsonl"
    sources = tuple(a.answer_sources.split(",")) if a.answer_sources else None
    filtered = False  # carried answers cut by --answer-sources / --source-fraction: they are the training set as they are
    if a.original_answers:  # the prompt files' own answers (generate --original-answers), not the target's
        files = tuple(p for p in prompts if not sources or Path(p).name.startswith(sources))
        answers = RUN / "gen-original" / "answers.jsonl"
        answers.unlink(missing_ok=True)
        o = generate.run(generate.GenerateConfig(target=a.gguf, prompts=files, out=str(answers.parent), exclude=evals,
                                                 max_prompt_tokens=1024, original_answers=True))
        res.update(original_answers=True, answer_sources=[Path(p).name for p in files], prompts=o.total,
                   tokens_original=o.tokens, without_answer=o.without_answer, skipped_long=o.skipped_long)
    elif a.answers and a.answers.endswith(".gz"):  # answers regenerated by an earlier run (answers.jsonl.gz it brought back)
        lines = gzip.decompress(Path(a.answers).read_bytes()).decode().splitlines(keepends=True)
        records = [json.loads(line) for line in lines]
        fractions = source_fractions(a.source_fraction)
        if sources or fractions:  # only the answers to these prompt files (by file name prefix), or a share of some
            kept = [carried(r, sources, fractions) for r in records]
            lines = [line for line, k in zip(lines, kept) if k]
            records = [r for r, k in zip(records, kept) if k]
            res.update(answer_sources=list(sources or ()), source_fraction=fractions)
            filtered = True
            extra.unlink(missing_ok=True)  # an earlier call's samples on this machine are not this set's
            if a.resume_generation:
                raise SystemExit("--resume-generation cannot go with --answer-sources or --source-fraction: generation"
                                 " would answer again the prompts they leave out; drop one of them")
        is_sample = [SAMPLE_SEP in r["id"] for r in records]
        sampled = [line for line, k in zip(lines, is_sample) if k]
        if sampled and a.extra_samples:  # the earlier run's sampled answers seed --extra-samples (only new samples are
            # made); with --extra-samples 0 they are left out: one greedy answer per prompt
            extra.parent.mkdir(parents=True, exist_ok=True)
            extra.write_text("".join(sampled))
        lines = [line for line, k in zip(lines, is_sample) if not k]
        records = [r for r, k in zip(records, is_sample) if not k]
        answers.parent.mkdir(parents=True, exist_ok=True)
        answers.write_text("".join(lines))
        own = [r for r in records if r["id"].startswith("self_prompts/")]
        if own:  # the target's own prompts come back with their answers: generate goes on from them, ids unchanged
            (answers.parent / generate.SELF_PROMPTS).write_text("".join(json.dumps(
                {"id": r["id"].split("/", 1)[1], "prompt": r["conversations"][0]["content"]}) + "\n" for r in own))
        res.update(answers_from=a.answers, answers_carried=len(lines), extra_carried=len(sampled) if a.extra_samples else 0,
                   answer_tokens_carried=sum(r["answer_tokens"] for r in records))
    elif a.answers:  # this machine's own file from an earlier call (still warm)
        answers = Path(a.answers)
        res.update(answers_from=a.answers)
    g = generate.GenerateResult(str(answers), 0, 0, 0, 0, 0.0)

    def answer(prompts, out, **kw):  # the target answers on this device, in this run's batches
        return generate.run(generate.GenerateConfig(
            target=a.gguf, prompts=prompts, out=str(out), batch_size=a.gen_batch, max_batch_tokens=a.gen_batch_tokens,
            max_prompt_tokens=1024, device=a.device, dtype=a.dtype, **kw))

    # generate resumes (self prompts included); not over a filtered carried set, whose left-out prompts it would answer
    if not a.original_answers and not filtered and (not a.answers or a.resume_generation or a.self_prompts):
        topics = self_prompt_topics(a.self_prompt_topics)
        g = answer(prompts, answers.parent, exclude=evals, max_new_tokens=a.max_new, max_seconds=a.gen_seconds,
                   self_prompts=a.self_prompts, self_prompt_topics=topics)
        res.update(prompts=g.total, tokens_generated=g.tokens, generate_s=round(g.seconds, 1), skipped_long=g.skipped_long)
        if a.self_prompts:  # the target's own prompts (generate.SELF_PROMPTS), answered with the rest
            res.update(self_prompts=g.self_prompts, self_prompt_topics=list(topics))
        if "answers" in a.bring_back:  # back at once: a later failure keeps them
            (out / "answers.jsonl.gz").write_bytes(gzip.compress(Path(g.path).read_bytes()))
    train_data = g.path
    samples = None  # sampled answers trained on beside the greedy ones
    if a.extra_samples and not a.original_answers and filtered:  # the kept ones as carried: sampling anew would
        samples = extra if extra.exists() else None  # answer the prompts the filter left out
    elif a.extra_samples and not a.original_answers:  # more text for the chat-like prompts
        prefixes = tuple(a.extra_sources.split(","))
        chat = tuple(p for p in prompts if Path(p).name.startswith(prefixes))
        own = answers.parent / generate.SELF_PROMPTS
        if "self_prompts" in prefixes and own.exists():  # the target's own prompts, sampled too (ids as the greedy ones')
            chat += (str(own),)
        e = answer(chat, extra.parent, exclude=evals, max_new_tokens=a.max_new, temperature=a.extra_temperature,
                   samples=a.extra_samples, seed=a.extra_seed)  # resumes: samples already there are kept
        res.update(extra_sources=[Path(p).name for p in chat], extra_answers=e.total, extra_tokens=e.tokens,
                   extra_temperature=a.extra_temperature, extra_seed=a.extra_seed,
                   extra_generate_s=round(e.seconds, 1))
        if "answers" in a.bring_back:
            (out / "answers-extra.jsonl.gz").write_bytes(gzip.compress(Path(e.path).read_bytes()))
        samples = Path(e.path)
    if samples:
        train_data = RUN / "gen-all" / "answers.jsonl"  # held out by prompt: a prompt's answers stay together
        train_data.parent.mkdir(parents=True, exist_ok=True)
        train_data.write_bytes(Path(g.path).read_bytes() + samples.read_bytes())
    eval_data = None
    eval_sampled = None
    if a.eval_mtbench:  # the target's own answers to MT-bench's first turns, scored every epoch (never trained on)
        eval_data = answer((evals[0],), RUN / "gen-mtbench", max_new_tokens=a.max_new_bench).path
        if a.eval_mtbench_sampled:  # and its sampled ones (T=1): their accept_length_t1 scores sampled decoding
            eval_sampled = answer((evals[0],), RUN / "gen-mtbench-t1", max_new_tokens=a.max_new_bench, temperature=1.0,
                                  seed=1).path
    res.update(target_attn=a.target_attn, target_compile=a.target_compile, pad_packs=a.pad_packs)  # a probe replaces "probe"
    dump(out, "train.json", res)
    print(json.dumps(res), flush=True)
    cfg = dict(target=a.gguf, data=str(train_data), eval_data=eval_data, eval_data_sampled=eval_sampled, online=True,
               device=a.device,
               target_dtype=a.dtype, ttt_depth=a.depth, eval_depth=a.eval_depth, step_decay=a.step_decay,
               draft_vocab_size=a.vocab, draft_intermediate_size=a.draft_intermediate, lr=a.lr, batch_tokens=a.batch_tokens,
               rows_per_pack=a.rows_per_pack,
               loss_chunk_tokens=a.loss_chunk, eval_fraction=0.02, save_every=200,  # --deadline saves on stopping; this bounds a kill
               attn_impl="auto" if a.attn_impl == "probe" else a.attn_impl, compile_loss=a.compile_loss,
               target_attn="sdpa" if a.target_attn == "probe" else a.target_attn,  # a probe sets these below
               target_compile=a.target_compile, pad_packs=a.pad_packs)
    fastest = None  # the probed step time of the chosen setting, if a probe ran
    # settings decided by measurement: each choice trained for a few steps, the faster step wins (the target's
    # attention first, then the TTT attention with it)
    for key, flag, choices, label, name in (
            ("target_attn", a.target_attn, train.TARGET_ATTENTION, "target_attn", "target-{}"),
            ("attn_impl", a.attn_impl, ("eager", "flex", "split"), "attn", "{}")):  # res keys as since run 3
        if flag == "probe":
            fastest = probe_fastest(cfg, key, choices, label, name, res)
            dump(out, "train.json", res)
            print(json.dumps(res), flush=True)
    if a.train_steps:  # the step count from an earlier probe of the same settings
        steps = a.train_steps
    else:
        step_s = probe_step_s(cfg, cfg["attn_impl"]) if fastest is None else fastest
        res.update(probe_peak_gb=round(torch.cuda.max_memory_allocated() / 2**30, 1), probe_step_s=round(step_s, 4))
        steps = max(50, int(a.train_seconds / max(step_s, 1e-3)))
    res.update(schedule_steps=steps)
    budget = a.deadline - time.time() - 45 if a.deadline else None  # 45 s kept for evaluation and export
    t2 = time.perf_counter()
    tr = train.run(train.TrainConfig(out=str(RUN / f"train{a.tag}"), schedule_steps=steps, max_seconds=budget,
                                     profile_steps=a.profile_steps, profile_from=a.profile_from, **cfg))
    if (RUN / f"train{a.tag}" / "profile.json").exists():  # where a training step's time went
        res["train_profile"] = json.loads((RUN / f"train{a.tag}" / "profile.json").read_text())
    res.update(train_s=round(time.perf_counter() - t2, 1), train_steps=tr.steps, train_loop_s=round(tr.loop_seconds, 1),
               finished=tr.steps >= steps, heldout=tr.eval, vocab_coverage=tr.vocab_coverage)
    ckpt = str(RUN / f"train{a.tag}" / "drafter")
    ex = export.run(export.ExportConfig(checkpoint=ckpt, out=str(RUN / "sglang")))
    exports = {"": RUN / "sglang"}
    if a.export_vocab:  # the drafter the bench runs and a deployment would serve: its draft vocab cut (export --draft-vocab)
        export.run(export.ExportConfig(checkpoint=ckpt, out=str(RUN / "sglang-cut"), draft_vocab=a.export_vocab))
        exports["cut-"] = RUN / "sglang-cut"
        res.update(export_vocab=a.export_vocab)
    if "drafter" in a.bring_back:
        for prefix, folder in exports.items():
            blob = (folder / "model.safetensors").read_bytes()
            for i in range(0, len(blob), 15 << 20):  # result files come back at most 16 MiB each
                (out / f"{prefix}model.safetensors.part{i // (15 << 20)}").write_bytes(blob[i : i + (15 << 20)])
            (out / f"{prefix}config.json").write_text((folder / "config.json").read_text())
    if "metrics" in a.bring_back:
        metrics = RUN / f"train{a.tag}" / "metrics.jsonl"
        (out / "metrics.jsonl.gz").write_bytes(gzip.compress(metrics.read_bytes()))
    res.update(pipeline_train_wall_s=round(time.perf_counter() - t0, 1), export=str(ex.out))
    dump(out, "train.json", res)
    print(json.dumps(res), flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps=3):
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_smollm(a, res):
    """SmolLM2 with the trained drafter, optimised engine (fused + compiled layers, CUDA graphs):
    plain vs chain (5 drafts) vs tree at T=0, tree at T=1, bf16 greedy agreement, fp32 exactness."""
    import draftsmith.decode as dec
    dt = getattr(torch, a.dtype)
    target = load_target(a.gguf, a.device, dt)
    model = target.model
    optimize_for(model, a.engine if a.device.startswith("cuda") else "fused")
    if hasattr(model, "tuning_sweep"):  # --engine triton_sweep: the table it chose from, on these weights
        res["engine_sweep"] = model.__dict__.pop("tuning_sweep")
    if a.drafter:  # an exported drafter carried in (SGLang folder), e.g. an earlier run's
        drafter = load_any(a.drafter, model.embed_tokens.weight.detach().float().cpu())
    elif a.export_vocab:  # this run's drafter as exported with its draft vocab cut (phase_train)
        if not (RUN / "sglang-cut").exists():
            raise SystemExit(f"bench --export-vocab {a.export_vocab}: no {RUN / 'sglang-cut'} (the train phase ran with "
                             "--export-vocab 0): bench with --export-vocab 0, or pass --drafter")
        drafter = load_any(RUN / "sglang-cut", model.embed_tokens.weight.detach().float().cpu())
    else:
        drafter, _ = load_trained(RUN / f"train{a.tag}" / "drafter")
    drafter = drafter.to(a.device, dt).eval()  # Rotary keeps its fp32 tables
    plain_drafter = None
    if a.compile_drafter and a.device.startswith("cuda"):  # drafting steps compiled whole; the A/B keeps one as trained
        import copy
        plain_drafter = copy.deepcopy(drafter) if a.drafter_ab else None
        drafter.optimize("inductor")
    qs = spread(load_eval(Path(a.data) / "eval" / "mt_bench.jsonl"), a.num_prompts)  # all 80 by default
    ids = [torch.tensor([prompt_ids(target.tokenizer, q.turns)], device=a.device) for q in qs]
    tree = TreeSpec(topk=a.topk, steps=a.tree_steps, num_draft_tokens=a.tree_tokens)
    sampled_specs = sampled_trees(a.sampled_trees, tree)  # parsed before any timing: a bad entry stops here
    other_trees = {f"tree_{e}": tree_shape(e) for e in a.greedy_trees.split(",") if e}  # the same, T=0 and timed alike
    chain_tree = TreeSpec(1, 5, 5)  # chain5_device: the chain of 5 on the device-resident tree cycle (same tokens and accepts)
    # Caches sized to the longest prompt + new tokens + a draft's worth (as gpt-fast sizes its static
    # cache), in steps of 128, one size for every prompt so the graphs captured over them stay valid:
    # the decode step's attention reads every slot of the cache, so 2,048 slots for ~700 used ones
    # cost plain and speculative decoding alike (the random-weight engine runs use 1,024).
    need = max(x.shape[1] for x in ids) + a.max_new_bench + max(max(t.num_draft_tokens, t.steps * t.topk, 5)
                                                                for t in (tree, *other_trees.values())) + 2
    slots = min(-(-need // 128) * 128, model.args.max_position_embeddings)
    model.setup_caches(1, slots, exact=True)  # not the 1,024 slots a --engine triton_sweep left
    drafter.setup_caches(1, slots)
    graphs = Graphs(a.device.startswith("cuda"))
    t = time.perf_counter()
    for x in ids[:2]:  # warm-up, compilation and graph capture
        decode_plain(model, x, 32, target.eos_ids, graphs)
        decode_chain(model, drafter, x, 32, 5, target.eos_ids, graphs)
        decode_tree(model, drafter, x, 32, tree, target.eos_ids, graphs)
        if a.chain_device:
            decode_tree(model, drafter, x, 32, chain_tree, target.eos_ids, graphs)
        for spec in other_trees.values():
            decode_tree(model, drafter, x, 32, spec, target.eos_ids, graphs)
    warm_prompt_shapes(model, ids, target.eos_ids, graphs)
    sm = {"prompts": len(ids), "max_new_tokens": a.max_new_bench, "cache_slots": model.max_len, "warmup_s": round(time.perf_counter() - t, 1),
          "drafter_vocab": drafter.cfg.draft_vocab_size}
    res["smollm2"] = sm
    runs = {"plain": [], "chain5": [], "tree": [], **({"chain5_device": []} if a.chain_device else {}), **{n: [] for n in other_trees}}
    if plain_drafter is not None:
        for x in ids[:2]:
            decode_tree(model, plain_drafter, x, 32, tree, target.eos_ids, graphs)
        runs["tree_uncompiled_drafter"] = []
    def summary(gens, base=None):
        n, secs = sum(len(g.tokens) for g in gens), sum(g.seconds for g in gens)
        acc = [x for g in gens for x in g.accept_lengths]
        # tok_s counts prefill (as HF generate's figure does); decode_tok_s leaves each prompt's prefill and the
        # token it makes out, which is what the random-weight engine runs measure
        prefill = sum(g.prefill_seconds for g in gens)
        out = {"tok_s": round(n / secs, 1), "tokens": n, "prefill_s": round(prefill, 2),
               "decode_tok_s": round((n - len(gens)) / (secs - prefill), 1)}
        if acc:
            deepest = max(acc)
            out.update(tau_mean=round(sum(acc) / len(acc), 3),
                       accept_by_position=[round(x, 3) for x in accept_by_position(acc, deepest - 1)],
                       draft_s=round(sum(g.draft_seconds for g in gens), 2), verify_s=round(sum(g.verify_seconds for g in gens), 2),
                       other_s=round(secs - sum(g.draft_seconds + g.verify_seconds for g in gens), 2))
        if base is not None:
            out["speedup"] = round(out["tok_s"] / base, 3)
        return out

    for i, x in enumerate(ids):
        if i and i % 16 == 0:  # what is timed so far, so a bench cut by a time limit still leaves figures
            plain_tok_s = summary(runs["plain"])["tok_s"]
            sm["partial"] = {"prompts_done": i, **{n: summary(r, plain_tok_s) for n, r in runs.items()}}
            dump(Path(a.out), "bench.json", res)
        runs["plain"].append(decode_plain(model, x, a.max_new_bench, target.eos_ids, graphs))
        runs["chain5"].append(decode_chain(model, drafter, x, a.max_new_bench, 5, target.eos_ids, graphs))
        runs["tree"].append(decode_tree(model, drafter, x, a.max_new_bench, tree, target.eos_ids, graphs))
        if a.chain_device:
            runs["chain5_device"].append(decode_tree(model, drafter, x, a.max_new_bench, chain_tree, target.eos_ids, graphs))
        for name, spec in other_trees.items():  # each prompt's runs side by side, so every run meets the same clocks
            runs[name].append(decode_tree(model, drafter, x, a.max_new_bench, spec, target.eos_ids, graphs))
        if plain_drafter is not None:
            runs["tree_uncompiled_drafter"].append(decode_tree(model, plain_drafter, x, a.max_new_bench, tree, target.eos_ids, graphs))

    sm.pop("partial", None)
    sm["plain"] = summary(runs["plain"])
    base = sm["baseline_tok_s"] = sm["plain"]["tok_s"]
    for name in [n for n in ("chain5", "tree", "chain5_device", *other_trees) if n in runs]:
        sm[name] = summary(runs[name], base)
        same = sum(p.tokens == g.tokens for p, g in zip(runs["plain"], runs[name]))
        agree = sum(dec.greedy_agreement(model, x, g.tokens, graphs) for x, g in zip(ids, runs[name]))
        sm[name].update(identical_prompts=f"{same}/{len(ids)}", greedy_agreement=round(agree / sm[name]["tokens"], 5))
    for name, spec in (("tree", tree), *other_trees.items()):
        sm[name]["settings"] = {"topk": spec.topk, "steps": spec.steps, "num_draft_tokens": spec.num_draft_tokens}
    sm["drafter_compiled"] = getattr(drafter, "compile_backend", None) or False
    if plain_drafter is not None:  # the same tree decoding with the drafter's steps left uncompiled
        sm["tree_uncompiled_drafter"] = summary(runs["tree_uncompiled_drafter"], base)
        sm["tree_uncompiled_drafter"]["identical_to_compiled_prompts"] = sum(
            u.tokens == c.tokens for u, c in zip(runs["tree_uncompiled_drafter"], runs["tree"]))
    sm["bf16_greedy_agreement_ge_99pct"] = all(sm[n]["greedy_agreement"] >= AGREEMENT_FLOOR for n in ("chain5", "tree"))
    dump(Path(a.out), "bench.json", res)
    for temp in [float(t) for t in a.sampled_temps.split(",")] if a.t1 else []:
        # plain sampling vs lossless tree sampling at temp, same engine: plain_t1 / tree_t1 at T=1; with several
        # --sampled-trees a section each (tree_t0.7_top, tree_t1_16x6x48_sample, ...)
        name = f"t{temp:g}"
        try:
            gen = torch.Generator(a.device).manual_seed(0)
            for x in ids[:2]:  # graph capture outside the timing
                decode_plain(model, x, 32, target.eos_ids, graphs, temp, 1.0, gen)
                for spec in sampled_specs.values():
                    dec.decode_tree_sampled(model, drafter, x, 32, spec, temp, 1.0, target.eos_ids, gen, graphs)
            sm[f"plain_{name}"] = summary([decode_plain(model, x, a.max_new_bench, target.eos_ids, graphs, temp, 1.0, gen)
                                           for x in ids])
            for entry, spec in sampled_specs.items():
                key = f"tree_{name}" + (f"_{entry.replace(':', '_')}" if len(sampled_specs) > 1 else "")
                sm[key] = summary([dec.decode_tree_sampled(model, drafter, x, a.max_new_bench, spec, temp, 1.0, target.eos_ids,
                                                           gen, graphs) for x in ids], sm[f"plain_{name}"]["tok_s"])
                sm[key].update(tree=f"{spec.topk}x{spec.steps}x{spec.num_draft_tokens}", draws=spec.draws_at(temp))
                dump(Path(a.out), "bench.json", res)  # each shape as it ends: a bench cut by the deadline keeps it
        except Exception as e:  # noqa: BLE001
            sm[f"tree_{name}_error"] = repr(e)[:500]
        dump(Path(a.out), "bench.json", res)
    try:  # HF transformers generate, bf16, batch 1, on the same folder
        if not a.hf:
            raise RuntimeError("skipped (--no-hf)")
        from transformers import AutoModelForCausalLM
        hf = AutoModelForCausalLM.from_pretrained(target.path, dtype=dt).to(a.device).eval()
        x = ids[0]
        hf.generate(x, max_new_tokens=8, do_sample=False)
        s = timed(lambda: hf.generate(x, max_new_tokens=64, min_new_tokens=64, do_sample=False), reps=2)
        sm["hf_tok_s"] = round(64 / s, 1)
        del hf
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        sm["hf_error"] = repr(e)
    # fp32 separates rounding (bf16 kernels differ between 1-token and k-token passes) from a real
    # bug: in fp32 speculative output must equal plain output exactly
    m32, d32 = model.float(), drafter.float()
    g32 = Graphs(a.device.startswith("cuda"))
    exact = 0
    for x in ids[:8]:
        p = decode_plain(m32, x, 128, target.eos_ids, g32)
        c = decode_chain(m32, d32, x, 128, 5, target.eos_ids, g32)
        t = decode_tree(m32, d32, x, 128, tree, target.eos_ids, g32)
        exact += (p.tokens == c.tokens) + (p.tokens == t.tokens)
    sm["fp32_exact_runs"] = f"{exact}/{2 * len(ids[:8])}"
    del model, drafter, target
    torch.cuda.empty_cache()


def copy_bandwidth() -> float:
    x = torch.empty(1 << 30, dtype=torch.float32, device="cuda").normal_()
    y = torch.empty_like(x)
    s = timed(lambda: y.copy_(x), reps=10)
    return 2 * x.numel() * 4 / s  # bytes read + written per second


LLAMA8B = ModelArgs(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=2048)
SMOLLM2 = ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                    head_dim=64, rope_theta=100000.0, max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5)


def random_model(args: ModelArgs) -> Transformer:
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.rotary = type(model.rotary)(args.head_dim, args.max_position_embeddings, args.rope_theta, None).cuda()
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.eval()


def kernel_profile(run, top_n: int = 40) -> dict:
    """Kernels one call of `run` (a graph replay) puts on the GPU, their summed device time, and the
    top_n kernel names by total time with their counts: how far the step is from back-to-back useful
    work, and which kernels a layer is made of (a count of num_layers is one a layer) to fuse next."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    top = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:top_n]
    return {"kernels": len(kernels), "kernel_ms": round(sum(e.self_device_time_total for e in kernels) / 1e3, 4),
            "top": {e.key[:80]: [e.count, round(e.self_device_time_total / 1e3, 4)] for e in top}}


# Triton engine variants: kernels.Tuning fields each sets over BASE, the Tuning default until 2026-12-06, so that
# a name means what it meant in the logs; triton_default is kernels.Tuning() itself (triton_pdl_ksplit4_pairs32_split64
# from 6e62d1b, with Tuning.early_weights since 3dbfcea; triton_default_late is it without). kernels.py is imported
# only when one is used: its kernels read TRITON_INTERPRET when defined, which tests set before importing it
BASE = {"split": 128, "pairs": 16, "ksplit": 1, "pdl": False, "early_weights": False}
TRITON_VARIANTS = {name: {**BASE, **fields} for name, fields in {
    "triton": {}, "triton_torch_commit": {"move_slots": False}, "triton_unsplit": {"split": 0},
    "triton_split64": {"split": 64}, "triton_split256": {"split": 256}, "triton_pairs32": {"pairs": 32},
    "triton_cols32": {"cols": 32}, "triton_cols64": {"cols": 64}, "triton_torch_head": {"head": False},
    "triton_ksplit2": {"ksplit": 2}, "triton_ksplit4": {"ksplit": 4}, "triton_merge_last": {"merge_last": True},
    "triton_cols16_ksplit2": {"cols": 16, "ksplit": 2}, "triton_pdl": {"pdl": True},
    "triton_pdl_merge_last": {"pdl": True, "merge_last": True},
    "triton_pdl_ksplit2": {"pdl": True, "ksplit": 2}, "triton_pdl_ksplit4": {"pdl": True, "ksplit": 4},
    # the fastest measured at both shapes (H100 8B shape, logs/engine-8b-sweep-h100-3ff982a.json; H200 both, 50882f9)
    "triton_pdl_ksplit4_pairs32_split64": {"pdl": True, "ksplit": 4, "pairs": 32, "split": 64}}.items()}
TRITON_VARIANTS["triton_default"] = {}
TRITON_VARIANTS["triton_default_late"] = {"early_weights": False}  # the default, weights read after the PDL wait (until 3dbfcea)
TRITON_VARIANTS["triton_default_early1"] = {"early_rows": 1}  # early weights for one-token steps only (the 8B trade)
TRITON_VARIANTS["triton_default_nopdl"] = {"pdl": False}  # its kernel profiles time each kernel alone (no PDL overlap)
ENGINE_VARIANTS = ("graphs", "compiled", "compiled_model", "compiled_model_cdt", "compiled_sdpa", "compiled_autotune", "triton",
                   "triton_default", "triton_sweep")  # engine's default --variants


def optimize_for(model: Transformer, variant: str):
    # autotune: inductor benchmarks Triton templates against cuBLAS for each matmul and can then fuse a
    # layer's pointwise work (rotary, residual adds) into the matmul's epilogue: fewer kernels a step,
    # which is what bounds SmolLM2's decoding (~560 kernels of ~2 us). Our CUDA graphs stay ours.
    import torch._inductor.config as inductor
    inductor.max_autotune = variant == "compiled_autotune"
    if variant == "fused":
        model.optimize()
    elif variant in ("compiled", "compiled_autotune"):
        model.optimize("inductor")
    elif variant in TRITON_VARIANTS:  # batch-1 short queries as five Triton kernels a layer (kernels.py), compiled layers otherwise
        from draftsmith.kernels import Tuning
        model.optimize("inductor", kernels="triton", tuning=Tuning(**TRITON_VARIANTS[variant]))
    elif variant == "triton_sweep":  # the same, with the Tuning whose captured one-token step was fastest
        model.optimize("inductor", kernels="triton", tuning=sweep_tunings(model))
    elif variant == "compiled_sdpa":  # compiled layers, short queries through SDPA as well
        model.optimize("inductor", attention="sdpa")
    elif variant.startswith("compiled_model"):
        # cdt: inductor's coordinate-descent tuning of its own kernels' launch configs (as gpt-fast sets)
        inductor.coordinate_descent_tuning = variant.endswith("cdt")
        model.optimize("inductor", scope="model")


SWEEP = {"bk_max": (64, 256, 1024), "slots": (128, 256), "warps": (4, 8)}  # --sweep: the grid triton_sweep tries


def parse_sweep(text: str) -> dict[str, tuple[int, ...]]:
    """'bk_max=64,256;cols=0,16' -> {"bk_max": (64, 256), "cols": (0, 16)}: kernels.Tuning fields and their values."""
    from draftsmith.kernels import Tuning
    grid = {}
    for part in filter(None, text.split(";")):
        name, _, values = part.partition("=")
        if name not in Tuning.__dataclass_fields__ or not values:
            raise SystemExit(f"--sweep: {part!r} is not field=v1,v2 with a kernels.Tuning field ({', '.join(Tuning.__dataclass_fields__)})")
        kind = type(getattr(Tuning(), name))  # int, or bool for switches given as 0/1
        grid[name] = tuple(kind(int(v)) for v in values.split(","))
    return grid


def sweep_tunings(model: Transformer) -> "Tuning":
    """Times a captured 1- and 8-token step for each kernels.Tuning in the SWEEP grid (tile widths,
    attention slots a step, warps, ...), checks each against the unoptimised model's hidden states,
    prints and keeps the table (model.tuning_sweep) and returns the fastest correct one."""
    from draftsmith.kernels import Tuning
    x = torch.randint(0, model.args.vocab_size, (1, 128), device="cuda")
    pos = torch.tensor([300], device="cuda")
    model.setup_caches(1, max(model.max_len, 1024))
    for layer in model.layers:  # the reference is the unoptimised layer (fixed_steps runs it for short queries)
        layer.__dict__.pop("fast", None)
    reference = fixed_steps(model, x)
    table, best = {}, None
    for values in itertools.product(*SWEEP.values()):
        fields = dict(zip(SWEEP, values))
        try:
            t = Tuning(**fields)
        except ValueError as e:  # a combination Tuning refuses: not a tuning
            print("sweep skips", fields, e, flush=True)
            continue
        name = "_".join(f"{k}{v}" for k, v in fields.items())
        try:
            model.optimize("inductor", kernels="triton", tuning=t)
            err = max(hidden_errors(model, x, reference).values())
            row = {"hidden_rel_err": round(err, 5), **step_times(model, pos, (1, 8))}
            if err <= HIDDEN_TOLERANCE and (best is None or row["step_T1_ms"] < table[best[0]]["step_T1_ms"]):
                best = (name, t)
        except Exception as e:  # noqa: BLE001 - a tile too big for the SM's memory fails to compile: next
            row = {"error": repr(e)[:300]}
        table[name] = row
        print("sweep", name, json.dumps(row), flush=True)
    model.tuning_sweep = {"table": table, "best": best[0] if best else None}
    return best[1] if best else Tuning()


HIDDEN_TOLERANCE = 0.1  # largest |hidden - reference| over the reference's largest entry that counts as the same model


def hidden_errors(model: Transformer, x, reference: dict) -> dict[int, float]:
    """fixed_steps' largest deviation from the reference's, relative to the reference's largest entry."""
    return {T: ((h - reference[T]).abs().max() / reference[T].abs().max()).item() for T, h in fixed_steps(model, x).items()}


def step_times(model: Transformer, pos, rows, graphs=None) -> dict[str, float]:
    """ms of one captured target pass over T random tokens at slot pos, for each T in rows (step_T{T}_ms)."""
    graphs, step, out = graphs or Graphs(True), target_step(model), {}
    for T in rows:
        tok = torch.randint(0, 1000, (1, T), device="cuda")
        graphs(("plain", T), step, tok, pos)
        out[f"step_T{T}_ms"] = round(timed(lambda: [graphs(("plain", T), step, tok, pos) for _ in range(50)], reps=5) / 50 * 1e3, 4)
    return out


@torch.no_grad()
def fixed_steps(model: Transformer, x) -> dict[int, torch.Tensor]:
    """Final hidden states of a 1-token and an 8-token pass after the same eager prefill of x (1, 128):
    the check that an engine variant computes what the plain model does (bf16 rounding apart)."""
    out = {}
    for T in (1, 8):
        model(x, torch.arange(128, device=x.device))
        out[T] = model(x[:, :T], torch.arange(128, 128 + T, device=x.device)).hidden.float()
    return out


def engine_speed(model: Transformer, bw: float, label: str, variants=ENGINE_VARIANTS, rows=(1, 8)) -> dict:
    """Batch-1 greedy decode speed of one target, for each engine variant in turn (the model is
    optimised in place): CUDA graphs over eager kernels; + fused qkv/gate-up and compiled layers;
    + the whole forward compiled as one graph; + inductor's coordinate-descent tuning. rows: the pass
    sizes timed (step_T{n}_ms); 1 and 8 always (verify8_over_step), more to see what a tree's size costs."""
    args = model.args
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if not args.tie_word_embeddings:
        weight_bytes -= model.embed_tokens.weight.numel() * 2  # the embedding is a lookup, not a read
    sec = {"weight_bytes": weight_bytes, "floor_tok_s": round(bw / weight_bytes, 1)}
    x = torch.randint(0, args.vocab_size, (1, 128), device="cuda")
    pos = torch.tensor([300], device="cuda")
    model.setup_caches(1, 1024)
    reference = fixed_steps(model, x)  # the unoptimised model's hidden states, which every variant must reproduce
    for variant in variants:
        t = time.perf_counter()
        try:
            optimize_for(model, variant)
            v = {f"hidden_rel_err_T{T}": round(e, 5) for T, e in hidden_errors(model, x, reference).items()}
            v["matches_reference"] = max(v.values()) <= HIDDEN_TOLERANCE
            graphs = Graphs(True)
            decode_plain(model, x, 16, (), graphs)  # capture (and compile) outside the timing
            runs = [decode_plain(model, x, 256, (), graphs) for _ in range(3)]
            v["tok_s"] = round(statistics.median(255 / (r.seconds - r.prefill_seconds) for r in runs), 1)
            v.update(step_times(model, pos, sorted({1, 8, *rows}), graphs))
            v["verify8_over_step"] = round(v["step_T8_ms"] / v["step_T1_ms"], 3)
            step, tok1 = target_step(model), torch.zeros(1, 1, dtype=torch.long, device="cuda")
            v["profile_T1"] = kernel_profile(lambda: graphs(("plain", 1), step, tok1, pos))
            # where a chain's 8-token verify pass (verify8_over_step) and the widest (a tree's) spend their time,
            # kernel by kernel, beside profile_T1: which kernels an 8-token pass makes slower
            for wide in sorted({8, max(rows)}):
                tokw = torch.zeros(1, wide, dtype=torch.long, device="cuda")
                v[f"profile_T{wide}"] = kernel_profile(lambda: graphs(("plain", wide), step, tokw, pos))
            v["achieved_TBs"] = round(weight_bytes / (v["step_T1_ms"] / 1e3) / 1e12, 3)
        except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
            v = {"error": repr(e)[:500]}
        v["setup_and_measure_s"] = round(time.perf_counter() - t, 1)
        if variant == "triton_sweep" and hasattr(model, "tuning_sweep"):
            v["sweep"] = model.__dict__.pop("tuning_sweep")
        sec[variant] = v
        print(label, variant, json.dumps(v), flush=True)
    # the baseline is the fastest variant that computes the plain model's hidden states (bf16 rounding apart)
    best = max((sec[v] for v in variants if "tok_s" in sec[v] and sec[v]["matches_reference"]), key=lambda v: v["tok_s"], default=None)
    if best:
        sec.update(baseline_tok_s=best["tok_s"], verify8_over_step=best["verify8_over_step"], step_T1_ms=best["step_T1_ms"])
    return sec


def hf_speed(args: ModelArgs, x) -> float:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                      num_hidden_layers=args.num_layers, num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
                      head_dim=args.head_dim, max_position_embeddings=args.max_position_embeddings, rope_theta=args.rope_theta,
                      tie_word_embeddings=args.tie_word_embeddings)
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg)
    hf = hf.to_empty(device="cuda").to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.02)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=cfg).cuda()
    hf.generate(x, max_new_tokens=4, do_sample=False, pad_token_id=0)
    s = timed(lambda: hf.generate(x, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0), reps=2)
    del hf
    return round(32 / s, 2)


def tree_shape(shape: str) -> TreeSpec:
    """ "KxDxN" -> TreeSpec(topk K, D draft steps, N draft tokens verified)."""
    try:
        k, d, n = (int(v) for v in shape.split("x"))
        return TreeSpec(k, d, n)
    except ValueError as e:
        raise SystemExit(f"tree shape {shape!r}: expected KxDxN (topk x draft steps x draft tokens), e.g. 8x6x48 ({e})")


def sampled_trees(text: str, tree: TreeSpec) -> dict:
    """--sampled-trees: comma-separated entries, each a TreeSpec.draws ("auto": the bench's tree, drafted
    by draws), a shape "KxDxN" (auto draws) or both, "KxDxN:draws" -> {entry: TreeSpec}."""
    specs = {}
    for entry in text.split(","):
        shape, _, draws = entry.partition(":") if "x" in entry else ("", "", entry)
        spec = tree_shape(shape) if shape else tree
        specs[entry] = dataclasses.replace(spec, draws=draws or "auto")
    return specs


def bench_8b(a, res):
    bw = copy_bandwidth()
    model = random_model(LLAMA8B)
    sec = {"copy_bandwidth_TBs": round(bw / 1e12, 3), **engine_speed(model, bw, "llama8b", tuple(a.variants.split(",")), a.rows)}
    dcfg = DraftConfig.from_target(LLAMA8B, 32000)
    drafter = Eagle3Drafter(dcfg).cuda().to(torch.bfloat16).eval()
    drafter.setup_caches(1, 1024)
    h = torch.randn(1, 1, 4096, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor([300], device="cuda")

    def dstep(h, pos):
        tok = drafter.to_target(drafter.logits(h[:, -1]).argmax(-1))
        return drafter(tok[None], h, pos)

    graphs = Graphs(True)
    graphs(("dstep", 1), dstep, h, pos)
    d_ms = timed(lambda: [graphs(("dstep", 1), dstep, h, pos) for _ in range(50)], reps=5) / 50 * 1e3
    sec["draft_step_ms"] = round(d_ms, 4)
    sec["draft_step_over_step"] = round(d_ms / sec["step_T1_ms"], 4)
    res["llama8b_shape"] = sec
    del model, drafter, graphs
    torch.cuda.empty_cache()
    try:
        sec["hf_tok_s"] = hf_speed(LLAMA8B, torch.randint(0, 1000, (1, 128), device="cuda"))
    except Exception as e:  # noqa: BLE001
        sec["hf_error"] = repr(e)


def bench_smollm2_shape(a, res):
    """SmolLM2-135M's shape with random weights: engine speed only (accept lengths need the real model)."""
    bw = copy_bandwidth()
    sec = engine_speed(random_model(SMOLLM2), bw, "smollm2_shape", tuple(a.variants.split(",")), a.rows)
    try:
        sec["hf_tok_s"] = hf_speed(SMOLLM2, torch.randint(0, 1000, (1, 128), device="cuda"))
    except Exception as e:  # noqa: BLE001
        sec["hf_error"] = repr(e)
    res["smollm2_shape"] = sec
    torch.cuda.empty_cache()


TTT_PATHS = {  # section -> ttt_loss options: what training runs on CUDA now, and the paths it replaced
    "train_8b": {},  # target log-probs once per pack, compiled KL, TTT attention "auto" (split on CUDA)
    "train_8b_split": {"attn_impl": "split"},  # flex over step 0's keys, the later steps' own keys merged in
    "train_8b_flex": {"attn_impl": "flex"},  # compiled flex over every step's keys ("auto" on CUDA before 51f596f)
    "train_8b_eager": {"attn_impl": "eager"},  # materialised attention (train_8b_flex before flex was the default)
    "train_8b_old": {"attn_impl": "eager", "target_cache_mb": 0, "compile_loss": False},  # as before this session
}


def train_mfu_8b(res, name="train_8b", rows=1, **options):
    """Drafter training throughput at the Llama-3.1-8B shape: H=4096, Vd=32000, TTT 7, rows x 2048 tokens.
    options: ttt_loss's (attn_impl, target_cache_mb, compile_loss); none: what training picks on CUDA."""
    from draftsmith.train import ttt_loss
    args = dataclasses.replace(LLAMA8B, max_position_embeddings=4096)
    H, I, Vd, T, depth, kv = 4096, 14336, 32000, 2048, 7, 8 * 128
    d = Eagle3Drafter(DraftConfig.from_target(args, Vd)).cuda()
    d.d2t.copy_(torch.zeros(Vd, dtype=torch.long))
    head = torch.randn(Vd, H, device="cuda", dtype=torch.bfloat16) * 0.02
    B = rows
    batch = {"input_ids": torch.randint(0, Vd, (B, T), device="cuda"), "aux": torch.randn(B, T, 3 * H, device="cuda", dtype=torch.bfloat16),
             "final": torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16), "argmax": torch.randint(0, Vd, (B, T), device="cuda"),
             "loss_mask": torch.ones(B, T, device="cuda", dtype=torch.uint8), "segment_ids": torch.zeros(B, T, device="cuda", dtype=torch.long),
             "position_ids": torch.arange(T, device="cuda").expand(B, T)}
    opt = torch.optim.AdamW([p for p in d.parameters() if p.requires_grad], lr=1e-4, fused=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _ = ttt_loss(d, head, batch, depth, **options)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t = time.perf_counter()
    for _ in range(3):  # the first compiles (flex attention, the KL) on the default path
        step()
    sync()
    warmup_s = time.perf_counter() - t
    torch.cuda.reset_peak_memory_stats()
    s = timed(step, reps=5)
    peak_gb = torch.cuda.max_memory_allocated() / 2**30
    macs = 3 * H * H + depth * (2 * H * (H + 2 * kv) + H * H + 3 * H * I + H * Vd)  # per token, weights
    attn = sum(2 * (T / 2 + j) * H for j in range(depth))  # QK^T and PV per token per step, causal average
    flops_per_token = 6 * macs + 6 * attn  # forward + backward
    a_ = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b_ = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    peak = 2 * 8192**3 / timed(lambda: [a_ @ b_ for _ in range(10)], reps=3) * 10
    res[name] = {"options": options, "rows": B, "tokens_per_s": round(B * T / s, 1), "step_s": round(s, 4),
                 "flops_per_token": flops_per_token, "achieved_tflops": round(flops_per_token * B * T / s / 1e12, 1),
                 "peak_bf16_tflops": round(peak / 1e12, 1), "train_mfu_8b": round(flops_per_token * B * T / s / peak, 3),
                 "peak_memory_gb": round(peak_gb, 2), "warmup_s": round(warmup_s, 1)}
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    top = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:15]
    res[name]["top_kernels_ms"] = {e.key[:90]: round(e.self_device_time_total / 1e3, 2) for e in top}
    res[name]["profiled_step_ms"] = round(sum(e.self_device_time_total for e in prof.key_averages()) / 1e3, 1)


def train_8b(name):
    """A phase section: train_mfu_8b on one of TTT_PATHS, its memory given back afterwards."""
    def section(a, res):
        try:
            train_mfu_8b(res, name, a.ttt_rows, **TTT_PATHS[name])
        finally:
            torch.cuda.empty_cache()
    return section


def phase_ttt(a):
    """Only the 8B-shape drafter training, on each of TTT_PATHS: the new default against the old paths."""
    res = {"phase": "ttt", "command": " ".join(sys.argv), "commit": git_commit(), "device": device_name(a.device)}
    for name in a.ttt_paths.split(","):
        t = time.perf_counter()
        try:
            train_8b(name)(a, res)
        except Exception as e:  # noqa: BLE001 - one path failing must not lose the others
            res[name + "_error"] = repr(e)[:1000]
        res[name + "_wall_s"] = round(time.perf_counter() - t, 1)
        dump(Path(a.out), "ttt.json", res)
        print(json.dumps(res), flush=True)


def phase_engine(a):
    """Issue #3 speed: engine variants on the Llama-3.1-8B and SmolLM2-135M shapes (random weights),
    HF generate on the same shapes, and the 8B-shape drafter training throughput."""
    res = {"phase": "engine", "command": " ".join(sys.argv), "commit": git_commit(), "device": device_name(a.device)}
    out = Path(a.out)
    sections = {"smollm2_shape": bench_smollm2_shape, "llama8b_shape": bench_8b, **{n: train_8b(n) for n in TTT_PATHS}}
    for name in a.sections.split(","):
        fn = sections[name]
        t = time.perf_counter()
        try:
            fn(a, res)
        except Exception as e:  # noqa: BLE001 - one section failing must not lose the others
            res[name + "_error"] = repr(e)[:1000]
        res[name + "_wall_s"] = round(time.perf_counter() - t, 1)
        dump(out, "engine.json", res)
        print(json.dumps(res), flush=True)


def failed_checks(res: dict) -> list[str]:
    """The bench's correctness checks that failed: bf16 greedy speculation must agree with plain greedy
    decoding on >= 99% of tokens, fp32 speculation must equal it exactly, and the SmolLM2 section must run."""
    sm, failed = res.get("smollm2", {}), []
    if "smollm2_error" in res:
        failed.append(f"the SmolLM2 section failed: {res['smollm2_error']}")
    for name, sec in sm.items():  # chain5, tree, chain5_device and the --greedy-trees sections
        agree = sec.get("greedy_agreement") if isinstance(sec, dict) else None
        if agree is not None and agree < AGREEMENT_FLOOR:
            failed.append(f"bf16 {name} agrees with plain greedy decoding on {agree:.2%} of tokens (< 99%)")
    exact = sm.get("fp32_exact_runs")
    if exact is not None and exact.split("/")[0] != exact.split("/")[1]:
        failed.append(f"fp32 speculative output equals plain output on only {exact} runs")
    return failed


def phase_bench(a) -> list[str]:
    """Runs the sections, writing bench.json as it goes; returns the failed checks (failed_checks)."""
    res = {"phase": "bench", "command": " ".join(sys.argv), "commit": git_commit(), "device": device_name(a.device)}
    out = Path(a.out)
    sections = [("smollm2", bench_smollm)]
    if a.device.startswith("cuda") and a.with_8b:  # issue 3's engine sections in the same run
        sections += [("smollm2_shape", bench_smollm2_shape), ("llama8b_shape", bench_8b),
                     *((n, train_8b(n)) for n in a.ttt_paths.split(",") if n)]
    for name, fn in sections:
        t = time.perf_counter()
        try:
            fn(a, res)
        except Exception as e:  # noqa: BLE001 - one section failing must not lose the other
            res[name + "_error"] = repr(e)
        res[name + "_wall_s"] = round(time.perf_counter() - t, 1)
        res["failed_checks"] = failed_checks(res)
        dump(out, "bench.json", res)
        print(json.dumps(res), flush=True)
    return res["failed_checks"]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=["train", "bench", "both", "engine", "ttt"])
    ap.add_argument("--tag", default="")
    ap.add_argument("--t1", action=argparse.BooleanOptionalAction, default=True, help="bench: also plain vs tree sampling"
                    " at --sampled-temps")
    ap.add_argument("--sampled-temps", default="1", help="bench: temperatures of the sampled runs, comma-separated")
    ap.add_argument("--sampled-trees", default="auto", help="bench: the sampled trees, comma-separated, each a"
                    " TreeSpec.draws for the bench's tree (top,sample: both), a shape KxDxN or KxDxN:draws; a section each")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="bench: also HF generate")
    ap.add_argument("--drafter", help="bench: an exported drafter folder instead of this run's training output")
    ap.add_argument("--variants", default=",".join(ENGINE_VARIANTS), help="engine, and bench's 8B shape: which engine"
                    " variants, in order (graphs,compiled: the default engine and its uncompiled base)")
    ap.add_argument("--rows", type=lambda v: tuple(int(n) for n in v.split(",")), default=(1, 8),
                    help="engine: pass sizes to time besides 1 and 8, e.g. 16,17,32,49,64 (a tree's verify rows)")
    ap.add_argument("--sweep", help="triton_sweep's grid as kernels.Tuning fields, e.g. 'bk_max=256;cols=0,16,64;stages=0,4'"
                    f" (default {';'.join(k + '=' + ','.join(map(str, v)) for k, v in SWEEP.items())})")
    ap.add_argument("--sections", default=",".join(["smollm2_shape", "llama8b_shape", *TTT_PATHS]), help="engine: which sections, in order")
    ap.add_argument("--compile-drafter", action=argparse.BooleanOptionalAction, default=True,
                    help="bench: compile the drafter's drafting steps (Eagle3Drafter.optimize)")
    ap.add_argument("--chain-device", action=argparse.BooleanOptionalAction, default=False,
                    help="bench: also the chain of 5 as a top-1 tree on the device-resident cycle (chain5_device; measured"
                    " at 8c7a00e: the same accepts, 1610.9 decode tok/s against the host chain's 1656.0)")
    ap.add_argument("--drafter-ab", action=argparse.BooleanOptionalAction, default=False,
                    help="bench: also time the tree with the drafter uncompiled (run 6 measured it: 0.96x vs 1.45x)")
    ap.add_argument("--engine", default="triton_default", choices=sorted({*ENGINE_VARIANTS[1:], *TRITON_VARIANTS}),
                    help="bench: how the SmolLM2 engine is optimised (triton_default: kernels.Tuning(), the fastest measured:"
                    " plain 1381.7 tok/s and chain 2254.6 on the H200 at 50882f9 against 1217.0 and 2047.6 with triton_pdl,"
                    " logs/bench-k4-h200-50882f9.json, logs/bench-full-h200-50882f9.json; since 3dbfcea with early_weights:"
                    " 1440.3 and 2365.3 on an H100, logs/bench-early-h100-3dbfcea.json)")
    ap.add_argument("--with-8b", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gguf")
    ap.add_argument("--data")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--gen-batch", type=int, default=1024)
    ap.add_argument("--gen-batch-tokens", type=int, default=1 << 20, help="cap on rows x (prompt + max new) per generation batch")
    ap.add_argument("--bring-back", default="answers,drafter,metrics", help="train: which outputs to write under --out"
                    " (at most 8 files come back from a device call)")
    ap.add_argument("--deadline", type=float, help="train: unix time by which this call must be done (training stops"
                    " checkpointed before it; rerun with the same --tag and --train-steps to continue)")
    ap.add_argument("--gen-seconds", type=float, default=220)
    ap.add_argument("--eval-mtbench", action=argparse.BooleanOptionalAction, default=True,
                    help="train: also score the target's MT-bench answers every epoch")
    ap.add_argument("--eval-mtbench-sampled", action=argparse.BooleanOptionalAction, default=True,
                    help="train: and its sampled (T=1) MT-bench answers (heldout.eval_data_sampled: accept_length_t1 there"
                    " is the T=1 score; the greedy answers overstate sampled decoding, logs/t1-sim-vs-decode-cpu-4b36540.json)")
    # the measured recipe (h200-recipe.json finding_run18): greedy answers to every prompt, 12,000 prompts the target
    # writes itself, one sampled answer to every chat-like and every self-written prompt (since run 18; runs 9-15: 2
    # per chat-like prompt, --extra-sources without self_prompts; before 2026-12-04 no samples and no self prompts)
    ap.add_argument("--extra-samples", type=int, default=1, help="train: also this many sampled answers per prompt of --extra-sources")
    ap.add_argument("--extra-temperature", type=float, default=0.8, help="for the samples made in this run")
    ap.add_argument("--extra-seed", type=int, default=1, help="sampling seed of this run's extra answers (vary it when adding"
                    " samples to carried ones)")
    ap.add_argument("--extra-sources", default="sharegpt,ultrachat,self_instruct,alpaca,self_prompts", help="prompt file name prefixes;"
                    " self_prompts: the prompts the target wrote itself (--self-prompts) too")
    ap.add_argument("--self-prompts", type=int, default=12000, help="train: the target also writes this many prompts itself"
                    " (generate --self-prompts), answered greedily with the rest")
    ap.add_argument("--self-prompt-topics", default="", help="train: steer the self-written prompts, a topic a try in turn:"
                    " 'tasks' (TASK_TOPICS) or topics, comma-separated; '': unsteered (runs 9-12)")
    ap.add_argument("--answers", help="answers.jsonl.gz of an earlier run (or answers.jsonl on this machine): skip generation")
    ap.add_argument("--answer-sources", help="train: only the answers to these prompt files (comma-separated file name "
                    "prefixes, e.g. gsm8k,alpaca); with --answers, of the carried ones")
    ap.add_argument("--source-fraction", help="train: with --answers, keep only this share of some files' carried "
                    "prompts (with their samples), e.g. gsm8k=0.3: the data mix")
    ap.add_argument("--original-answers", action="store_true", help="train: on the prompt files' own answers (generate "
                    "--original-answers), not regenerated ones: the recipe's baseline; no generation, no self prompts")
    ap.add_argument("--resume-generation", action="store_true", help="with --answers: answer the prompts it lacks")
    ap.add_argument("--train-steps", type=int, help="schedule steps (skips the timing probe)")
    ap.add_argument("--train-seconds", type=float, default=170)
    ap.add_argument("--depth", type=int, default=3, help="train: TTT depth; 3 for SmolLM2 since run 13 (h200-recipe.json"
                    " finding_run13: +7%% MT-bench score, +9%% chain accept over depth 7 at less training time); the"
                    " library's default (train --ttt-depth) stays 7")
    ap.add_argument("--eval-depth", type=int, default=7, help="train: draft steps the scores unroll, whatever --depth is,"
                    " so that scores compare across depths")
    ap.add_argument("--step-decay", type=float, default=train.STEP_DECAY, help="train: TTT step j's loss weight is this to the j")
    ap.add_argument("--profile-steps", type=int, default=0, help="train: profile this many steps (from --profile-from) into"
                    " train.json's train_profile")
    ap.add_argument("--profile-from", type=int, default=10, help="train: the first profiled step; late (e.g. 1000) the compiled"
                    " shapes and caches have settled")
    ap.add_argument("--ttt-paths", default=",".join(TTT_PATHS), help="ttt, and bench with the 8B shape: which of TTT_PATHS"
                    " to time (train_8b alone gives train_mfu_8b)")
    ap.add_argument("--target-attn", default="sdpa", choices=("sdpa", "flex", "probe"), help="train: the target's"
                    " attention over a pack (TrainConfig.target_attn); probe: time both (60 steps each), train with the faster")
    ap.add_argument("--target-compile", action=argparse.BooleanOptionalAction, help="train: the target's pass over a"
                    " pack compiled (TrainConfig.target_compile; default: on CUDA); benchmarks/train_ab.sh times it")
    ap.add_argument("--pad-packs", action=argparse.BooleanOptionalAction, help="train: every pack padded to rows-per-pack"
                    " x batch-tokens (TrainConfig.pad_packs; default: on CUDA): one shape for the compiled target pass")
    ap.add_argument("--attn-impl", default="auto", help="train: TTT attention (auto | eager | flex | split | probe: time"
                    " each, train with the fastest)")
    ap.add_argument("--compile-loss", action=argparse.BooleanOptionalAction, default=None, help="train: compiled KL (default: on CUDA)")
    ap.add_argument("--ttt-rows", type=int, default=1, help="rows of 2048 tokens in the 8B-shape training step")
    ap.add_argument("--vocab", type=int, default=8192, help="train: draft vocab (8,192 since run 13: as good as 32,000 in"
                    " the recipe arms, a cheaper step; runs 1-12 trained 32,000)")
    ap.add_argument("--export-vocab", type=int, default=0, help="train: also export the drafter with its draft vocab cut"
                    " to this many tokens (export --draft-vocab), which the bench of this run's drafter then runs; 0: bench"
                    " the trained vocab (runs 1-13 did; run 12's 32K head cut to 8,192 lost 1.5%% of its accept length on"
                    " the CPU)")
    ap.add_argument("--draft-intermediate", type=int, help="train: the drafter's MLP width (default: the target's)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch-tokens", type=int, default=2048)
    ap.add_argument("--rows-per-pack", type=int, default=8)
    ap.add_argument("--loss-chunk", type=int, default=16384)
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-new-bench", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tree-steps", type=int, default=6)
    ap.add_argument("--tree-tokens", type=int, default=48)
    ap.add_argument("--greedy-trees", default="", help="bench: more greedy trees beside the main one, comma-separated"
                    " shapes KxDxN (topk x draft steps x draft tokens), e.g. 4x5x16,8x6x24: a section tree_KxDxN each, run"
                    " prompt by prompt with the others and checked alike (identical prompts, greedy agreement)")
    return ap


def main():
    a = build_parser().parse_args()
    if a.sweep:
        SWEEP.clear()
        SWEEP.update(parse_sweep(a.sweep))
    Path(a.out).mkdir(parents=True, exist_ok=True)
    RUN.mkdir(parents=True, exist_ok=True)
    if a.phase in ("train", "both"):
        phase_train(a)
    if a.phase in ("bench", "both"):
        failed = phase_bench(a)
        if failed:  # loudly, after every result is written
            print("BENCH CHECKS FAILED:\n  " + "\n  ".join(failed), file=sys.stderr, flush=True)
            sys.exit(1)
    if a.phase == "engine":
        phase_engine(a)
    if a.phase == "ttt":
        phase_ttt(a)


if __name__ == "__main__":
    main()
