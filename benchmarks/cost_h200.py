"""The cost model (draftsmith/cost.py) applied to the H200 bench runs (or, with --card h100, the H100's):
per-cycle costs of chain and tree speculation on SmolLM2, the accept length each engine needs to break
even and to reach 2x and 3x, and what the issue's accept-length targets would buy at those costs.

    python benchmarks/cost_h200.py [--card h200|h100] [--out benchmarks/results/cost-model-CARD.json]

Decode-only: prefill is taken out of both sides (bench.json's prefill_s), as decode_tok_s does.
A cycle's accept length counts the bonus token; each prompt's first token comes from prefill.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.cost import CycleCosts, acceptance_needed  # noqa: E402

LOGS = Path(__file__).parent / "results" / "logs"
RUNS = {  # engine -> bench log (the shipped drafter, all 80 MT-bench first turns, 256 new tokens, bf16)
    "compiled (bb19a48)": LOGS / "bench-compiled-shipped-drafter-bb19a48.json",
    "triton, swept tiles (8114dc5)": LOGS / "bench-triton-sweep-shipped-drafter-8114dc5.json",
    "triton, one-launch KV commit (8c7a00e)": LOGS / "bench-full-8c7a00e.json",
    "triton, KV commit and split attention (8c7a00e)": LOGS / "bench-triton-split128-shipped-drafter-8c7a00e.json",
    # run 11's 8K cut; a tree token's attention one token a program (its one-token step's bits), prompts and the
    # drafter's prompt pass in captured passes, one cycle in 8 timed
    "triton, bit-exact tree, captured prefill (1011bf3)": LOGS / "bench-full-1011bf3.json",
    # the device-resident chain; PDL alone, then kernels.Tuning()'s default since (PDL, K split 4, pairs 32, split 64)
    "triton_pdl, device-resident chain (50882f9)": LOGS / "bench-full-h200-50882f9.json",
    "default tuning, device-resident chain (50882f9)": LOGS / "bench-k4-h200-50882f9.json",
}
RUNS_H100 = {  # the same bench on H100s (the shipped run-11 cut): 333a911's two on one machine
    # the chain on the device-resident cycle (decode.verify_chain)
    "triton, device-resident chain (333a911)": LOGS / "h100-bench-triton-333a911.json",
    "triton_pdl, device-resident chain (333a911)": LOGS / "h100-bench-triton_pdl-333a911.json",
    # another H100 each: the greedy head and fewer kernels a step (the default tuning, 32-slot chunks by the sweep),
    # then the weights read before the PDL wait (the default since)
    "fewer kernels a step, split 32 (6bd8ada)": LOGS / "bench-h100-6bd8ada.json",
    "early weights, the default tuning (3dbfcea)": LOGS / "bench-early-h100-3dbfcea.json",
}
STEPS = {"chain5": 5, "tree": 6, "tree_4x5x15": 5}  # drafter steps a cycle: 5 drafts; the trees' depths (8x6x48, 4x5x15)
TARGETS = {"chain5": 3.5, "tree": 5.0, "tree_4x5x15": 5.0}  # issue 4's accept lengths


def cycle_costs(sm: dict, mode: str) -> tuple[CycleCosts, float, float]:
    """(costs, accept length, measured decode-only speedup) of one mode of one bench run."""
    r, plain = sm[mode], sm["plain"]
    cycles = (r["tokens"] - sm["prompts"]) / r["tau_mean"]
    decode_s = r["tokens"] / r["decode_tok_s"]
    other = decode_s - r["draft_s"] - r["verify_s"]  # host work and bookkeeping, prefill excluded
    costs = CycleCosts.from_totals(1e3 / plain["decode_tok_s"], cycles, STEPS[mode], r["draft_s"], r["verify_s"], max(other, 0.0))
    return costs, r["tau_mean"], r["decode_tok_s"] / plain["decode_tok_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--card", choices=("h200", "h100"), default="h200", help="whose bench runs")
    ap.add_argument("--out", help="default: benchmarks/results/cost-model-CARD.json")
    a = ap.parse_args()
    runs = RUNS if a.card == "h200" else RUNS_H100
    out = a.out or str(Path(__file__).parent / "results" / f"cost-model-{a.card}.json")
    res = {"command": "python benchmarks/cost_h200.py" + ("" if a.card == "h200" else f" --card {a.card}"),
           "inputs": {k: str(v.relative_to(LOGS.parent)) for k, v in runs.items()},
           "model": "speedup = tau * T_ar / (S * T_draft + T_verify + T_other), decode-only (draftsmith/cost.py)"}
    for engine, path in runs.items():
        sm = json.loads(path.read_text())["smollm2"]
        sec = res[engine] = {}
        for mode in (m for m in STEPS if m in sm):  # tree_4x5x15: only in runs with --greedy-trees 4x5x15
            c, tau, measured = cycle_costs(sm, mode)
            sec[mode] = {
                "step_ms": round(c.step_ms, 4), "draft_ms": round(c.draft_ms, 4), "verify_ms": round(c.verify_ms, 4),
                "other_ms": round(c.overhead_ms, 4), "cycle_ms": round(c.cycle_ms, 4),
                "tau": tau, "predicted_speedup": round(c.speedup(tau), 3), "measured_decode_speedup": round(measured, 3),
                "break_even_tau": round(c.break_even_tau, 3),
                "tau_for_2x": round(c.tau_needed(2.0), 3), "tau_for_3x": round(c.tau_needed(3.0), 3),
                f"speedup_at_tau_{TARGETS[mode]}": round(c.speedup(TARGETS[mode]), 3),
            }
            if mode == "chain5":
                sec[mode]["acceptance_for_2x"] = acceptance_needed(c.tau_needed(2.0), 5)
                sec[mode]["acceptance_for_3x"] = acceptance_needed(c.tau_needed(3.0), 5)
            print(engine, mode, json.dumps(sec[mode]))
    Path(out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
