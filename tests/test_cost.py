import json
import random

import pytest

from draftsmith.bench import BenchConfig
from draftsmith.bench import run as bench_run
from draftsmith.cli import main
from draftsmith.cost import CostConfig, CycleCosts, acceptance_needed, expected_tau, run
from draftsmith.export import save_trained
from draftsmith.target import load_target

from helpers import tiny_drafter
from test_bench import write_prompts


def test_expected_tau_is_the_mean_accept_length_of_a_bernoulli_chain():
    rng = random.Random(0)
    for a, k in [(0.0, 5), (0.3, 3), (0.6, 5), (0.9, 7), (1.0, 4)]:
        cycles = []
        for _ in range(20000):
            n = 0
            while n < k and rng.random() < a:  # a draft counts only if every earlier one was accepted
                n += 1
            cycles.append(n + 1)  # + the target's bonus token
        assert expected_tau(a, k) == pytest.approx(sum(cycles) / len(cycles), abs=0.03)
    assert expected_tau(0.0, 5) == 1.0 and expected_tau(1.0, 5) == 6.0


def test_acceptance_needed_inverts_expected_tau_and_knows_what_is_out_of_reach():
    for a, k in [(0.2, 3), (0.55, 5), (0.95, 7)]:
        assert acceptance_needed(expected_tau(a, k), k) == pytest.approx(a, abs=1e-9)
    assert acceptance_needed(1.0, 5) == pytest.approx(0.0, abs=1e-9)
    assert acceptance_needed(6.5, 5) is None  # 5 drafts + the bonus token emit at most 6


def test_break_even_and_needed_accept_lengths():
    c = CycleCosts(step_ms=10.0, verify_ms=12.0, draft_ms=1.0, draft_steps=5, overhead_ms=3.0)
    assert c.cycle_ms == 20.0 and c.break_even_tau == 2.0
    assert c.speedup(c.break_even_tau) == pytest.approx(1.0)
    for s in (0.5, 1.5, 3.0):
        assert c.speedup(c.tau_needed(s)) == pytest.approx(s)
    # the founding benchmark: SGLang 90.0 tok/s plain, 82.3 tok/s with a drafter accepting 2.1 of 5 drafts
    kimi = CycleCosts(step_ms=1e3 / 90.0, verify_ms=1e3 * 2.1 / 82.3, draft_ms=0.0, draft_steps=5)
    assert kimi.speedup(2.1) == pytest.approx(82.3 / 90.0)
    assert 2.1 < kimi.break_even_tau < 2.35 and kimi.tau_needed(2.0) == pytest.approx(4.59, abs=0.01)


def test_cost_config_names_what_is_missing():
    with pytest.raises(ValueError, match="--verify-ms, --draft-ms"):
        CostConfig(step_ms=10.0, draft_steps=5)
    with pytest.raises(ValueError, match="tau counts the bonus token"):
        CostConfig(step_ms=10.0, verify_ms=11.0, draft_ms=1.0, draft_steps=5, tau=0.5)
    assert main(["cost", "--step-ms", "10"]) == 2


def test_costs_from_a_bench_run_reproduce_its_speedup(tiny_target_dir, tmp_path):
    target = load_target(str(tiny_target_dir))
    drafter = save_trained(tiny_drafter(target.model, draft_vocab=200), tmp_path / "trained")
    prompts = write_prompts(tmp_path / "mt.jsonl")
    for mode, steps in (("chain", 3), ("tree", 2)):
        out = tmp_path / mode
        b = bench_run(BenchConfig(target=str(tiny_target_dir), drafter=str(drafter), prompts=str(prompts), out=str(out),
                                  num_prompts=2, max_new_tokens=24, mode=mode, draft_tokens=3, topk=2, steps=2,
                                  num_draft_tokens=4))
        r = run(CostConfig(bench=str(out / "bench.json"), out=str(tmp_path / f"cost-{mode}")))
        assert r.mode == mode and r.costs["draft_steps"] == steps and r.tau == b.tau_mean
        cycles = sum(b.tau_hist.values())
        spec_s = b.draft_s + b.verify_s + b.overhead_s
        assert r.cycle_ms == pytest.approx(1e3 * spec_s / cycles)  # the cycle is the whole speculative run's time
        # tau * cycles leaves out each prompt's prefill token, which the measured tok/s counts
        tokens = sum(p["spec_tokens"] for p in b.per_prompt)
        assert r.predicted_speedup == pytest.approx(b.speedup * (tokens - b.prompts) / tokens, rel=1e-6)
        saved = json.loads((tmp_path / f"cost-{mode}" / "cost.json").read_text())
        assert saved["break_even_tau"] == pytest.approx(r.break_even_tau)
    with pytest.raises(FileNotFoundError, match="draftsmith bench --out"):
        run(CostConfig(bench=str(tmp_path / "nothing" / "bench.json")))
