import json

import pytest

from draftsmith.bench import BenchConfig, run, table
from draftsmith.decode import TreeSpec
from draftsmith.export import export_sglang, save_trained

from helpers import tiny_drafter
from draftsmith.target import load_target


def h200_run():
    """benchmarks/h200_run.py as a module (the device driver: not part of the package)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("h200_run", Path(__file__).parents[1] / "benchmarks" / "h200_run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_prompts(path):
    path.write_text("".join(json.dumps({"question_id": i, "turns": [f"Tell me about {w}.", "More?"]}) + "\n"
                            for i, w in enumerate(["the sea", "Paris", "a fox", "code"])))
    return path


def test_bench_reports_identical_outputs_and_accept_lengths(tiny_target_dir, tmp_path):
    target = load_target(str(tiny_target_dir))
    drafter = tiny_drafter(target.model, draft_vocab=200)
    prompts = write_prompts(tmp_path / "mt.jsonl")
    for path in (save_trained(drafter, tmp_path / "trained"), export_sglang(drafter, tmp_path / "sglang")):
        r = run(BenchConfig(target=str(tiny_target_dir), drafter=str(path), prompts=str(prompts), out=str(tmp_path / "b"),
                            num_prompts=3, max_new_tokens=20, draft_tokens=3))
        assert r.prompts == 3 and r.lossless and r.mismatched_prompts == []
        assert 1.0 <= r.tau_mean <= 4.0
        assert sum(int(k) * v for k, v in r.tau_hist.items()) + 3 >= r.new_tokens  # + the prefill token per prompt
        assert r.speedup > 0 and "identical to plain" in table(r) and "T=0)" in table(r)
        assert r.greedy_agreement == 1.0 and len(r.accept_by_position) == max(int(k) for k in r.tau_hist) - 1
        # position i was accepted in exactly the cycles whose accept length exceeds i
        cycles = sum(r.tau_hist.values())
        for i, a in enumerate(r.accept_by_position, start=1):
            assert abs(a - sum(v for k, v in r.tau_hist.items() if int(k) > i) / cycles) < 1e-9
    saved = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert saved["lossless"] is True and len(saved["per_prompt"]) == 3


@pytest.mark.parametrize("mode", ["tree", "chain"])
def test_bench_samples_with_trees(tiny_target_dir, tmp_path, monkeypatch, mode):
    """At T > 0 both modes run the device-resident sampled tree cycle (a chain of k: TreeSpec(1, k, k, "sample"))."""
    import draftsmith.bench as bench

    target = load_target(str(tiny_target_dir))
    path = save_trained(tiny_drafter(target.model, draft_vocab=200), tmp_path / "trained")
    prompts = write_prompts(tmp_path / "mt.jsonl")
    shapes, real = [], bench.decode_tree_sampled
    monkeypatch.setattr(bench, "decode_tree_sampled", lambda *a, **k: shapes.append(a[4]) or real(*a, **k))
    r = run(BenchConfig(target=str(tiny_target_dir), drafter=str(path), prompts=str(prompts), num_prompts=2,
                        max_new_tokens=12, mode=mode, topk=2, steps=3, num_draft_tokens=4, draft_tokens=3,
                        temperature=0.8, top_p=0.9))
    assert set(shapes) == {TreeSpec(2, 3, 4) if mode == "tree" else TreeSpec(1, 3, 3, "sample")}
    assert r.prompts == 2 and r.tau_mean >= 1.0 and r.draft_s > 0 and r.verify_s > 0
    assert sum(int(k) * v for k, v in r.tau_hist.items()) + 2 >= sum(p["spec_tokens"] for p in r.per_prompt)
    # sampled runs are not compared token by token: the report says so instead of claiming identical outputs
    assert r.lossless is None and r.greedy_agreement is None and all(p["identical"] is None for p in r.per_prompt)
    assert "T=0.8, top-p 0.9" in table(r) and "not compared: sampled" in table(r) and "yes, every prompt" not in table(r)


def test_small_benchmarks_spread_over_the_file():
    from draftsmith.bench import pick_prompts, spread
    mt = [f"{cat}-{i}" for cat in "ABCDEFGH" for i in range(10)]  # MT-bench's layout: 8 categories x 10
    assert spread(mt, 8) == [f"{c}-0" for c in "ABCDEFGH"] and spread(mt, 80) == mt and spread(mt, 99) == mt
    assert len(set(spread(mt, 24))) == 24 and {x[0] for x in spread(mt, 24)} == set("ABCDEFGH")
    picked = pick_prompts(mt, 8, warmup=1)
    assert picked[1:] == spread(mt, 8) and picked[0] not in picked[1:]  # warm-up on a prompt that is not measured
    assert pick_prompts(mt[:3], 3, warmup=1) == [mt[0], *mt[:3]]  # nothing left over: warm up on a measured one


def test_device_bench_fails_loudly_when_speculation_disagrees():
    """benchmarks/h200_run.py exits non-zero (after writing its results) when bf16 speculation agrees
    with plain greedy decoding on < 99% of tokens, fp32 speculation is not exact, or the section broke."""

    h200 = h200_run()
    good = {"smollm2": {"chain5": {"greedy_agreement": 1.0}, "tree": {"greedy_agreement": 0.994}, "fp32_exact_runs": "16/16"}}
    assert h200.failed_checks(good) == []
    low = {"smollm2": {**good["smollm2"], "tree": {"greedy_agreement": 0.985}}}
    assert [m for m in h200.failed_checks(low) if "tree" in m and "98.50%" in m]
    inexact = {"smollm2": {**good["smollm2"], "fp32_exact_runs": "15/16"}}
    assert [m for m in h200.failed_checks(inexact) if "15/16" in m]
    assert h200.failed_checks({"smollm2_error": "RuntimeError('boom')"})
    other_tree = {"smollm2": {**good["smollm2"], "tree_8x6x47": {"greedy_agreement": 0.97}}}  # --greedy-trees
    assert [m for m in h200.failed_checks(other_tree) if "tree_8x6x47" in m and "97.00%" in m]


def test_bench_config_names_bad_kernel_choices():
    for bad in ("cuda-graphs", "triton_pdl"):  # triton_pdl: what triton is since the default Tuning has PDL
        with pytest.raises(ValueError, match="kernels must be torch or triton"):
            BenchConfig(target="t", drafter="d", prompts="p", kernels=bad)
    with pytest.raises(ValueError, match="kernels triton needs a CUDA device"):
        BenchConfig(target="t", drafter="d", prompts="p", kernels="triton")


def test_the_device_jobs_default_sweep_and_variants_are_ones_the_scripts_take():
    """engine_session.sh's defaults reach the device untried: its engine variants must be ones h200_run.py
    knows (ENGINE_VARIANTS or TRITON_VARIANTS), and its 8B sweep must parse into valid kernels.Tuning values
    of the fields' own types (switches as bools), every combination of them a Tuning. A field that is not
    one is refused by name, before any GPU time."""
    import itertools
    import re
    from pathlib import Path

    from draftsmith.kernels import Tuning

    root = Path(__file__).parents[1]
    h200 = h200_run()
    script = (root / "benchmarks" / "engine_session.sh").read_text()
    variants = re.search(r"variants=\$\{2:-([^}]+)\}", script).group(1).split(",")
    assert all(v in h200.ENGINE_VARIANTS or v in h200.TRITON_VARIANTS for v in variants), variants
    grid = h200.parse_sweep(re.search(r'sweep=\$\{3:-"([^"]+)"\}', script).group(1))
    assert all(isinstance(v, type(getattr(Tuning(), k))) for k, vs in grid.items() for v in vs)
    assert len([Tuning(**dict(zip(grid, values))) for values in itertools.product(*grid.values())]) >= 16
    with pytest.raises(SystemExit, match="kernels.Tuning field"):
        h200.parse_sweep("bk_max=256;no_such_field=1")


def test_decode_sessions_defaults_are_variants_and_sweeps_the_scripts_take():
    """decode_session.sh's default engine and bench variants are ones h200_run.py knows, and its two sweeps
    parse into kernels.Tuning fields whose every combination is a Tuning (a field removed from Tuning, as
    gate_ksplit was, fails here rather than on the device)."""
    import itertools
    import re
    from pathlib import Path

    from draftsmith.kernels import Tuning

    root = Path(__file__).parents[1]
    h200 = h200_run()
    script = (root / "benchmarks" / "decode_session.sh").read_text()
    for name in ("ENGINE_VARIANTS", "BENCH_VARIANTS"):
        variants = re.search(rf"\$\{{{name}:-([^}}]+)\}}", script).group(1).split(",")
        assert all(v in h200.ENGINE_VARIANTS or v in h200.TRITON_VARIANTS for v in variants), (name, variants)
    for name in ("SWEEP_8B", "SWEEP_SMOLLM2"):
        grid = h200.parse_sweep(re.search(rf"\$\{{{name}:-([^}}]+)\}}", script).group(1))
        assert len([Tuning(**dict(zip(grid, values))) for values in itertools.product(*grid.values())]) >= 2, name


def test_the_device_job_benches_the_fastest_engine_variant_that_matches_the_plain_model(tmp_path):
    """engine_session.sh picks the bench's engines from its engine.json: the SmolLM2 shape's fastest Triton
    variant (the bench's --engine takes no other) and the 8B shape's fastest of any, skipping a faster one
    that does not reproduce the plain model; the default Tuning's variant and compiled when the step left no file."""
    import json
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = (Path(__file__).parents[1] / "benchmarks" / "engine_session.sh").read_text()
    pick = re.search(r"<<'EOF'\n(.*?)\nEOF\n", script, re.S).group(1)
    row = lambda tok_s, ok=True: {"tok_s": tok_s, "matches_reference": ok}  # noqa: E731
    engine = {"smollm2_shape": {"compiled": row(900), "triton": row(1000), "triton_pdl": row(1100),
                                "triton_pdl_ksplit4": row(1300, ok=False), "floor_tok_s": 5000},
              "llama8b_shape": {"compiled": row(208), "triton": row(200), "triton_sweep": row(230, ok=False)}}
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    run = lambda f: subprocess.run([sys.executable, "-", str(f)], input=pick, capture_output=True, text=True,  # noqa: E731
                                   check=True).stdout.split()
    assert run(tmp_path / "engine.json") == ["triton_pdl", "compiled"]
    assert run(tmp_path / "missing.json") == ["triton_default", "compiled"]


def test_the_device_benchs_sampled_trees_parse_into_tree_specs():
    """h200_run.py bench --sampled-trees: a way of drafting for the bench's own tree, a shape, or both;
    an unknown way is refused by TreeSpec before any GPU time."""
    from draftsmith.decode import TreeSpec

    h200 = h200_run()
    tree = TreeSpec(8, 6, 48)
    got = h200.sampled_trees("top,sample,16x6x48:sample,16x4x48", tree)
    assert got == {"top": TreeSpec(8, 6, 48, "top"), "sample": TreeSpec(8, 6, 48, "sample"),
                   "16x6x48:sample": TreeSpec(16, 6, 48, "sample"), "16x4x48": TreeSpec(16, 4, 48, "auto")}
    assert h200.sampled_trees("auto", tree) == {"auto": tree}
    with pytest.raises(ValueError, match="draws"):
        h200.sampled_trees("16x6x48:greedy", tree)
    # --greedy-trees takes the same shapes; a malformed one is refused by name before any GPU time
    assert h200.tree_shape("4x5x16") == TreeSpec(4, 5, 16)
    for bad in ("4x5", "4x5x16x2", "4xfivex16", "0x5x16"):
        with pytest.raises(SystemExit, match=f"tree shape '{bad}': expected KxDxN"):
            h200.tree_shape(bad)


def test_the_recipe_sessions_default_arms_are_flags_the_script_takes():
    """recipe_session.sh's default arms reach the device untried: each arm's flags, after the shared ones, must
    parse as h200_run.py train flags (a typo would cost the arm's device time), and --source-fraction keeps a
    stable hashed share of a file's prompts, a prompt's samples with it, other files whole."""
    import re
    import shlex
    from pathlib import Path

    root = Path(__file__).parents[1]
    h200 = h200_run()
    script = (root / "benchmarks" / "recipe_session.sh").read_text()
    arms = re.search(r'arms=\$\{ARMS:-"(.*?)"\}', script, re.S).group(1).replace("\\\n", "")
    shared = ["train", "--gguf", "g", "--data", "d", "--answers", "a.jsonl.gz", "--train-steps", "600", "--deadline", "1",
              "--bring-back", "metrics", "--export-vocab", "0"]
    names = []
    for arm in arms.split(";"):
        name, _, flags = arm.partition(":")
        a = h200.build_parser().parse_args([*shared, f"--tag=-{name}", *shlex.split(flags), "--out", "o"])
        names.append(name)
        if name == "original-subset":
            assert a.original_answers and a.answer_sources == "gsm8k,self_instruct,alpaca" and a.self_prompts == 0
        if name.startswith("depth"):
            assert a.eval_depth == 7 and a.depth < 7  # scored over the same 7 steps as depth 7
    assert names[0] == "base" and len(set(names)) == len(names) >= 2
    fractions = h200.source_fractions("gsm8k=0.3")
    records = [{"id": f"gsm8k_train/{i}", "source": "gsm8k_train.jsonl"} for i in range(4000)]
    kept = [h200.carried(r, None, fractions) for r in records]
    assert 0.27 < sum(kept) / len(kept) < 0.33 and kept == [h200.carried(r, None, fractions) for r in records]
    samples = [{"id": f"gsm8k_train/{i}#sample1", "source": "gsm8k_train.jsonl"} for i in range(4000)]
    assert [h200.carried(r, None, fractions) for r in samples] == kept
    assert h200.carried({"id": "alpaca_seed_tasks/1", "source": "alpaca_seed_tasks.jsonl"}, None, fractions)
    assert not h200.carried({"id": "alpaca_seed_tasks/1", "source": "alpaca_seed_tasks.jsonl"}, ("gsm8k",), {})
    with pytest.raises(SystemExit, match="PREFIX=F"):
        h200.source_fractions("gsm8k=2")


def test_a_filtered_carried_answer_set_is_trained_as_it_is(tmp_path, monkeypatch):
    """h200_run.py train --answers X.gz --source-fraction / --answer-sources (the recipe's data-mix arms): the kept
    answers, their samples with them, are the training set. No generation runs over the prompt files (it would answer
    again the prompts the filter left out), and an earlier call's samples on the machine are not mixed in; without a
    filter the same command resumes generation as before."""
    import gzip
    from pathlib import Path

    from draftsmith import generate

    h200 = h200_run()
    data = tmp_path / "data"
    (data / "prompts").mkdir(parents=True)
    for name in ("gsm8k_train.jsonl", "sharegpt_v3_filtered_500.json"):
        (data / "prompts" / name).write_text("")

    def record(rid, source):
        return {"id": rid, "source": source, "conversations": [{"role": "user", "content": rid}], "answer_tokens": 3}
    records = [record(f"gsm8k_train/{i}", "gsm8k_train.jsonl") for i in range(200)]
    records += [record(f"sharegpt/{i}{s}", "sharegpt_v3_filtered_500.json") for i in range(20)
                for s in ("", f"{h200.SAMPLE_SEP}0", f"{h200.SAMPLE_SEP}1")]
    records += [record(f"self_prompts/{i}", "self_prompts.jsonl") for i in range(30)]
    carried = tmp_path / "answers.jsonl.gz"
    carried.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in records).encode()))
    run_dir = tmp_path / "run"
    monkeypatch.setattr(h200, "RUN", run_dir)
    stale = run_dir / "gen-extra" / "answers.jsonl"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps(record(f"stale{h200.SAMPLE_SEP}0", "sharegpt_v3_filtered_500.json")) + "\n")
    generated, trained = [], []

    def fake_generate(cfg):  # the target answers nothing here: the call is what is checked
        generated.append(sorted(Path(p).name for p in cfg.prompts))
        path = Path(cfg.out) / "answers.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        return generate.GenerateResult(str(path), 0, 0, 0, 0, 0.0)

    class Stop(Exception):
        pass

    def fake_train(cfg):
        trained.append({json.loads(line)["id"] for line in Path(cfg.data).read_text().splitlines()})
        chosen.append(cfg.target_attn)
        impls.append(cfg.attn_impl)
        compiled.append((cfg.target_compile, cfg.pad_packs))
        raise Stop
    chosen, impls, compiled = [], [], []

    monkeypatch.setattr(h200.generate, "run", fake_generate)
    monkeypatch.setattr(h200.train, "run", fake_train)

    def train_on(*flags):
        generated.clear()
        a = h200.build_parser().parse_args(["train", "--gguf", "g", "--data", str(data), "--answers", str(carried),
                                            "--train-steps", "5", "--device", "cpu", *flags, "--out", str(tmp_path / "out")])
        (tmp_path / "out").mkdir(exist_ok=True)
        with pytest.raises(Stop):
            h200.phase_train(a)
        return trained[-1]

    fractions = h200.source_fractions("gsm8k=0.3,self_prompts=0")
    kept = {r["id"] for r in records if h200.carried(r, None, fractions)}
    assert train_on("--source-fraction", "gsm8k=0.3,self_prompts=0") == kept
    assert generated == [["mt_bench.jsonl"]] * 2  # the MT-bench answers the scores need (greedy, sampled), nothing else
    assert 40 < sum(i.startswith("gsm8k") for i in kept) < 80 and not any(i.startswith("self") for i in kept)
    assert sum(h200.SAMPLE_SEP in i for i in kept) == 40  # every sharegpt sample, none stale
    gsm8k = {r["id"] for r in records if r["source"].startswith("gsm8k")}
    assert train_on("--answer-sources", "gsm8k", "--no-eval-mtbench-sampled") == gsm8k
    assert generated == [["mt_bench.jsonl"]]
    with pytest.raises(SystemExit, match="--resume-generation cannot go with"):
        train_on("--source-fraction", "gsm8k=0.3", "--resume-generation")
    train_on()  # no filter: generation resumes over the prompt files (self prompts, samples), as in runs 12 and 13;
    # since run 18 the carried self-written prompts get sampled answers too (--extra-sources with self_prompts)
    assert generated[:2] == [["gsm8k_train.jsonl", "sharegpt_v3_filtered_500.json"],
                             ["self_prompts.jsonl", "sharegpt_v3_filtered_500.json"]]
    train_on("--extra-sources", "sharegpt")  # the chat-like prompts alone (runs 9-15)
    assert generated[1] == ["sharegpt_v3_filtered_500.json"]
    own = (run_dir / "gen" / generate.SELF_PROMPTS).read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in own) == sorted(str(i) for i in range(30))

    # --target-attn probe: both attentions timed (probe_step_s), the faster trains; one that fails is not chosen
    step_s = {"sdpa": 0.08, "flex": 0.05}

    def fake_probe(cfg, name):
        if step_s[cfg["target_attn"]] is None:
            raise RuntimeError("no kernel")
        return step_s[cfg["target_attn"]] + {"eager": 0.01, "flex": 0.02, "split": 0.03}.get(cfg["attn_impl"], 0.0)
    monkeypatch.setattr(h200, "probe_step_s", fake_probe)
    train_on("--answer-sources", "gsm8k", "--target-attn", "probe")
    assert chosen[-1] == "flex"
    step_s["flex"] = None
    train_on("--answer-sources", "gsm8k", "--target-attn", "probe")
    assert chosen[-1] == "sdpa"
    assert "no kernel" in json.loads((tmp_path / "out" / "train.json").read_text())["target_attn_probe_flex_error"]
    train_on("--answer-sources", "gsm8k", "--target-attn", "flex")
    assert chosen[-1] == "flex" and compiled[-1] == (False, False)
    train_on("--answer-sources", "gsm8k", "--target-compile", "--pad-packs")  # the target's pass compiled over one shape
    assert (chosen[-1], compiled[-1]) == ("sdpa", (True, True))
    assert json.loads((tmp_path / "out" / "train.json").read_text())["target_compile"] is True
    train_on("--answer-sources", "gsm8k")  # unset: off on the CPU, on for CUDA (run 20), and the --no- flags win
    assert compiled[-1] == (False, False)
    for flags, want in (((), (True, True)), (("--no-target-compile",), (False, True)), (("--no-pad-packs",), (True, False))):
        cuda = h200.target_pass_defaults(h200.build_parser().parse_args(
            ["train", "--gguf", "g", "--data", "d", "--out", "o", "--device", "cuda", *flags]))
        assert (cuda.target_compile, cuda.pad_packs) == want
    train_on("--answer-sources", "gsm8k", "--target-attn", "probe", "--attn-impl", "probe")  # both, one after the other
    assert (chosen[-1], impls[-1]) == ("sdpa", "eager")  # eager: what the CPU can train
    assert json.loads((tmp_path / "out" / "train.json").read_text())["attn_probe_step_s"] == pytest.approx(
        {"eager": 0.09, "flex": 0.10, "split": 0.11})


def test_target_attn_names_the_fastest_setting_that_passed():
    """benchmarks/target_attn.py's choice, which pipeline_session.sh trains with: the fastest setting on ragged packs
    as h200_run.py flags, none when eager sdpa (the default) is within min_gain of it or was not timed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("target_attn", Path(__file__).parents[1] / "benchmarks" / "target_attn.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = {"sdpa_ragged_ms_a_pack": 44.0, "flex_ragged_ms_a_pack": 41.0, "sdpa_compiled_ragged_ms_a_pack": 30.0,
           "flex_compiled_ragged_ms_a_pack": 32.0, "sdpa_fixed_ms_a_pack": 10.0}
    assert mod.choose(res, 1.03) == {"fastest_ragged": "sdpa_compiled", "fastest_ragged_speedup": 1.467,
                                     "train_flags": ["--target-attn", "sdpa", "--target-compile"]}
    del res["sdpa_compiled_ragged_ms_a_pack"]  # a setting whose check failed is not timed
    assert mod.choose(res, 1.03)["train_flags"] == ["--target-attn", "flex", "--target-compile"]
    assert mod.choose({"sdpa_ragged_ms_a_pack": 44.0, "flex_ragged_ms_a_pack": 43.5}, 1.03)["train_flags"] == []
    assert mod.choose({"flex_ragged_ms_a_pack": 43.5}, 1.03) == {"train_flags": []}
    parsed = h200_run().build_parser().parse_args(["train", "--gguf", "g", "--data", "d", "--out", "o",
                                                   *mod.choose(res, 1.03)["train_flags"]])
    assert (parsed.target_attn, parsed.target_compile) == ("flex", True)
