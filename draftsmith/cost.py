"""The cost model: what accept length a speculative deployment needs to break even, and what a
measured one buys (REFERENCE.md section 4).

    draftsmith cost --step-ms 11.1 --verify-ms 12.4 --draft-ms 1.1 --draft-steps 5 --tau 2.1
    draftsmith cost --bench runs/bench/bench.json      # the per-cycle costs a bench run measured

A speculative cycle is S drafter steps, one target pass over the verify rows and some host work;
it emits tau tokens (accept length, the bonus token included). Plain decoding emits one token per
target step T_ar. So

    speedup = tau * T_ar / (S * T_draft + T_verify + T_overhead),   break-even tau* = cycle / T_ar.

For a chain of k drafts each accepted with probability a (given the earlier ones were), Leviathan's
expected accept length is (1 - a^(k+1)) / (1 - a); acceptance_needed inverts it, so a target
speedup becomes the per-draft acceptance a drafter must reach.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftsmith.common import rows_table, write_result


@dataclass(frozen=True)
class CostConfig:
    step_ms: float | None = None  # T_ar: one plain decoding step of the target
    verify_ms: float | None = None  # T_verify: the target pass over a cycle's verify rows (k + 1, or a tree's nodes + 1)
    draft_ms: float | None = None  # T_draft: one drafter step
    draft_steps: int | None = None  # S: drafter steps a cycle (chain: its k drafts; tree: its depth)
    overhead_ms: float = 0.0  # host work and bookkeeping a cycle
    tau: float | None = None  # a measured accept length to judge
    bench: str | None = None  # a bench.json written by `draftsmith bench --out`: the costs and tau it measured
    speedups: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)  # report the accept length each of these needs
    out: str | None = None

    def __post_init__(self):
        numbers = {"step_ms": self.step_ms, "verify_ms": self.verify_ms, "draft_ms": self.draft_ms, "draft_steps": self.draft_steps}
        if self.bench is None and any(v is None for v in numbers.values()):
            missing = ", ".join("--" + k.replace("_", "-") for k, v in numbers.items() if v is None)
            raise ValueError(f"cost needs either --bench BENCH_JSON or all of the per-cycle costs; missing {missing}")
        if any(v is not None and v <= 0 for v in (self.step_ms, self.verify_ms, self.draft_steps)):
            raise ValueError("step_ms, verify_ms and draft_steps must be > 0")
        if (self.draft_ms is not None and self.draft_ms < 0) or self.overhead_ms < 0:
            raise ValueError("draft_ms and overhead_ms must be >= 0")
        if self.tau is not None and self.tau < 1:
            raise ValueError(f"tau counts the bonus token, so it is >= 1, got {self.tau}")
        if not self.speedups or min(self.speedups) <= 0:
            raise ValueError("speedups must be positive")


@dataclass(frozen=True)
class CycleCosts:
    step_ms: float
    verify_ms: float
    draft_ms: float
    draft_steps: int
    overhead_ms: float = 0.0

    @classmethod
    def from_totals(cls, step_ms: float, cycles: float, draft_steps: int, draft_s: float, verify_s: float,
                    other_s: float) -> "CycleCosts":
        """Per-cycle costs from a run's total seconds of drafting, verifying and the rest over `cycles` cycles."""
        return cls(step_ms=step_ms, verify_ms=1e3 * verify_s / cycles, draft_ms=1e3 * draft_s / cycles / draft_steps,
                   draft_steps=int(draft_steps), overhead_ms=1e3 * other_s / cycles)

    @property
    def cycle_ms(self) -> float:
        return self.draft_steps * self.draft_ms + self.verify_ms + self.overhead_ms

    @property
    def break_even_tau(self) -> float:
        return self.cycle_ms / self.step_ms

    def speedup(self, tau: float) -> float:
        return tau * self.step_ms / self.cycle_ms

    def tau_needed(self, speedup: float) -> float:
        return speedup * self.break_even_tau


def expected_tau(a: float, k: int) -> float:
    """Leviathan's expected accept length (bonus token included) for k drafts of acceptance a each."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


def acceptance_needed(tau: float, k: int) -> float | None:
    """The per-draft acceptance a with expected_tau(a, k) == tau; None when k drafts cannot reach tau."""
    if tau > k + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # expected_tau grows with a: bisection to ~1e-18
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tau(mid, k) < tau else (lo, mid)
    return (lo + hi) / 2


@dataclass
class CostResult:
    costs: dict
    cycle_ms: float
    break_even_tau: float
    tau_needed: dict  # speedup -> accept length
    chain_acceptance_needed: dict  # speedup -> per-draft acceptance for a chain of draft_steps drafts (None: out of reach)
    tau: float | None = None
    predicted_speedup: float | None = None
    measured_speedup: float | None = None  # from --bench: the run's own tok/s ratio
    mode: str = "chain"
    source: dict = field(default_factory=dict)


def costs_from_bench(path: str | Path, draft_steps: int | None = None) -> tuple[CycleCosts, dict]:
    """Per-cycle costs from a bench.json (and the bench_config.json beside it, for the mode and tree
    depth). Prefill is part of both sides: the plain run's per-token time includes its prefill, the
    speculative run's overhead includes its own."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no bench result at {path}: pass the bench.json that `draftsmith bench --out DIR` wrote")
    r = json.loads(path.read_text())
    if "tau_hist" not in r or "verify_s" not in r:
        raise ValueError(f"{path} is not a draftsmith bench result (no tau_hist / verify_s)")
    cfg_path = path.parent / "bench_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    mode = cfg.get("mode", "chain")
    steps = draft_steps or (cfg.get("steps") if mode == "tree" else cfg.get("draft_tokens", r.get("draft_tokens")))
    if not steps:
        raise ValueError(f"{path}: no bench_config.json beside it says how many drafter steps a cycle took; pass --draft-steps")
    cycles = sum(r["tau_hist"].values())
    costs = CycleCosts.from_totals(1e3 / r["baseline_tok_s"], cycles, steps, r["draft_s"], r["verify_s"], r["overhead_s"])
    return costs, {"mode": mode, "tau": r["tau_mean"], "speedup": r["speedup"], "cycles": cycles, "bench": str(path)}


def run(config: CostConfig) -> CostResult:
    source, tau, measured, mode = {}, config.tau, None, "chain"
    if config.bench:
        costs, source = costs_from_bench(config.bench, config.draft_steps)
        tau = tau if tau is not None else source["tau"]
        measured, mode = source["speedup"], source["mode"]
    else:
        costs = CycleCosts(config.step_ms, config.verify_ms, config.draft_ms, config.draft_steps, config.overhead_ms)
    need = {s: costs.tau_needed(s) for s in config.speedups}
    result = CostResult(
        costs=asdict(costs), cycle_ms=costs.cycle_ms, break_even_tau=costs.break_even_tau, tau_needed=need,
        chain_acceptance_needed={s: acceptance_needed(t, costs.draft_steps) for s, t in need.items()},
        tau=tau, predicted_speedup=costs.speedup(tau) if tau is not None else None, measured_speedup=measured,
        mode=mode, source=source)
    print(table(result))
    if config.out:
        write_result(config.out, "cost", config, result)
    return result


def table(r: CostResult) -> str:
    c = r.costs
    rows = [
        ("target step (T_ar)", f"{c['step_ms']:.3f} ms"),
        ("cycle", f"{r.cycle_ms:.3f} ms = {c['draft_steps']} x {c['draft_ms']:.3f} ms draft + {c['verify_ms']:.3f} ms verify"
                  f" + {c['overhead_ms']:.3f} ms other"),
        ("break-even accept length", f"{r.break_even_tau:.2f}"),
    ]
    for s, t in r.tau_needed.items():
        a = r.chain_acceptance_needed[s]
        chain = f" (a chain of {c['draft_steps']}: acceptance {a:.3f} a draft)" if a is not None and r.mode == "chain" else ""
        rows.append((f"accept length for {s:g}x", f"{t:.2f}{chain}" if a is not None else f"{t:.2f} (out of reach: {c['draft_steps']} drafter steps accept at most"
                                                                   f" {c['draft_steps'] + 1})"))
    if r.tau is not None:
        measured = f", measured {r.measured_speedup:.2f}x" if r.measured_speedup is not None else ""
        rows.append((f"at accept length {r.tau:.2f}", f"{r.predicted_speedup:.2f}x predicted{measured}"))
    return rows_table(rows)
