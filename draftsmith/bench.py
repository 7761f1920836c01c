"""Stage 5, bench: speculative decoding with the drafter against plain decoding, same engine.

On MT-bench first turns (chat-templated, so the target answers as it does in serving), each
prompt is decoded greedily twice: plain, one target step per token, and with EAGLE-3 chain
speculation (k drafts, verify k+1). Reported: accept length tau (tokens per verification cycle,
bonus token included) mean and distribution, tok/s of each, the speedup, and whether both
produced identical tokens on every prompt (they must, at temperature 0; with --temperature > 0 both
sample, and the runs are compared by speed and accept length only). A warm-up prompt is
decoded first and not counted. The last stdout line is the JSON result.

    python -m draftsmith bench --target smollm2-135m --drafter runs/draft/drafter --prompts mt_bench.jsonl
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.common import Progress, dtype_of, rows_table, write_result
from draftsmith.data import load_eval, prompt_ids
from draftsmith.cudagraph import Graphs
from draftsmith.decode import TreeSpec, decode_chain, decode_plain, decode_tree, decode_tree_sampled, greedy_agreement
from draftsmith.export import load_any
from draftsmith.target import load_target


@dataclass(frozen=True)
class BenchConfig:
    target: str
    drafter: str  # a trained drafter folder (train's out/drafter) or an SGLang export folder
    prompts: str  # MT-bench style JSONL
    out: str | None = None  # folder for bench.json; nothing written when None
    num_prompts: int = 80
    max_new_tokens: int = 256
    mode: str = "chain"  # chain | tree
    draft_tokens: int = 5  # chain: drafts per cycle
    topk: int = 4  # tree: children per node and nodes expanded per level
    steps: int = 5  # tree: depth
    num_draft_tokens: int = 16  # tree: nodes verified per cycle
    tree_draws: str = "auto"  # tree at temperature > 0: top | sample | auto (decode.TreeSpec.draws)
    temperature: float = 0.0  # > 0: lossless speculative sampling (chain or tree), compared by speed only
    top_p: float = 1.0
    seed: int = 0
    warmup: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    optimize: bool = False  # CUDA: fused qkv / gate-up matmuls, torch.compile'd target layers and drafting steps (the CPU always fuses the target)
    # CUDA: "triton" runs the target's batch-1 decode and verify passes as Triton kernels (kernels.py) with the
    # default kernels.Tuning (K split in 4, programmatic dependent launch): SmolLM2 on the H200 at 50882f9, plain
    # 1381.7 tok/s and chain 2254.6 (logs/bench-k4-h200-50882f9.json)
    kernels: str = "torch"

    def __post_init__(self):
        if self.draft_tokens < 1 or self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("draft_tokens, num_prompts and max_new_tokens must be >= 1")
        if self.mode not in ("chain", "tree"):
            raise ValueError(f"mode must be chain or tree, not {self.mode!r}")
        TreeSpec(self.topk, self.steps, self.num_draft_tokens, self.tree_draws)  # the tree's own checks, before any loading
        if self.kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be torch or triton, not {self.kernels!r} (triton launches with PDL, as"
                             " triton_pdl did, and the measured-fastest kernels.Tuning)")
        if self.kernels != "torch" and not self.device.startswith("cuda"):
            raise ValueError(f"kernels {self.kernels} needs a CUDA device (--device cuda); on the CPU leave --kernels torch")


@dataclass
class BenchResult:
    prompts: int
    draft_tokens: int
    tau_mean: float
    tau_hist: dict  # accept length -> cycles
    accept_rate: float  # (tau - 1) / k
    baseline_tok_s: float
    spec_tok_s: float
    speedup: float
    lossless: bool | None  # T=0: every prompt identical to plain decoding; T>0: None, not compared (sampled runs differ
    # by design; sampled speculation is lossless in distribution, which tests/test_decode.py's statistical tests show)
    mismatched_prompts: list
    greedy_agreement: float | None  # T=0: share of speculative tokens that plain greedy picks after the same prefix
    accept_by_position: list  # share of cycles whose i-th draft (chain) or depth-i node (tree) was accepted
    new_tokens: int
    draft_s: float
    verify_s: float
    overhead_s: float  # speculative wall time outside drafting and verification (prefill, catch-up, host work)
    device: str
    per_prompt: list = field(default_factory=list)
    temperature: float = 0.0
    top_p: float = 1.0


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def git_commit() -> str:
    """The checkout's commit; DRAFTSMITH_COMMIT overrides it (a copied tree whose .git is stale)."""
    if os.environ.get("DRAFTSMITH_COMMIT"):
        return os.environ["DRAFTSMITH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def spread(items: list, n: int) -> list:
    """n of items spaced evenly through the file (all of them when n >= len): on MT-bench, whose 80
    prompts come as 8 categories of 10, a subset of 8 is one prompt of every category rather than
    the first 8 (all writing), so a small benchmark measures the set's mix."""
    return list(items) if n >= len(items) else [items[i * len(items) // n] for i in range(n)]


def pick_prompts(prompts: list, n: int, warmup: int) -> list:
    """`warmup` prompts for compilation and caches (ones not measured when the file has enough),
    then the n measured ones (spread)."""
    measured = spread(prompts, n)
    rest = [p for p in prompts if all(p is not m for m in measured)]
    return (rest or measured)[:warmup] + measured


def warm_prompt_shapes(model, ids: list, eos_ids=(), graphs=None):
    """One prefill of every prompt before anything is timed. On CUDA the first pass at a new prompt
    length builds attention plans (~50 ms a length on the H200: the plain runs' prefill took 4.3 s
    for 80 MT-bench prompts against 2.0 s for the speculative runs after them,
    logs/bench-compiled-shipped-drafter-bb19a48.json), and that cost fell on whichever decoding ran
    first for a prompt, plain decoding, which made the speedups look larger. Under CUDA graphs prompts
    now run in fixed 256-token passes (decode.run_prompt), so this captures those once; a prompt too
    long for the padding still runs eagerly. On the CPU nothing is built per length, so nothing is done."""
    if ids and ids[0].device.type == "cuda":
        for x in ids:
            decode_plain(model, x, 1, eos_ids, graphs)


def accept_by_position(accept_lengths: list[int], depth: int) -> list[float]:
    """Share of cycles that accepted at least i drafts (the i-th of a chain, a depth-i node of a tree),
    i = 1..depth; accept lengths count the bonus token."""
    return [sum(n > i for n in accept_lengths) / max(len(accept_lengths), 1) for i in range(1, depth + 1)]


def run(config: BenchConfig) -> BenchResult:
    target = load_target(config.target, config.device, dtype_of(config.dtype))
    model = target.model
    cuda = config.device.startswith("cuda")
    if config.optimize or not cuda or config.kernels != "torch":  # fusing is free; on the CPU it is ~4 ms of a ~50 ms SmolLM2 step
        model.optimize("inductor" if cuda and config.optimize else None, kernels=config.kernels)
    drafter = load_any(config.drafter, model.embed_tokens.weight.detach().float().cpu())
    drafter = drafter.to(config.device, dtype_of(config.dtype)).eval()
    if config.optimize and cuda:  # the drafting steps compiled whole: ~2.3x less drafting time on the H200 (run 6)
        drafter.optimize("inductor")
    drafter.cfg.check_target(model.args, config.drafter)
    prompts = pick_prompts(load_eval(config.prompts), config.num_prompts, config.warmup)
    dev = torch.device(config.device)
    ids = [torch.tensor([prompt_ids(target.tokenizer, p.turns)], device=dev) for p in prompts]
    graphs = Graphs(dev.type == "cuda")
    gen = torch.Generator(config.device).manual_seed(config.seed)
    tree = TreeSpec(config.topk, config.steps, config.num_draft_tokens, config.tree_draws)
    k = config.draft_tokens if config.mode == "chain" else config.num_draft_tokens

    def plain(x, n):
        return decode_plain(model, x, n, target.eos_ids, graphs, config.temperature, config.top_p, gen)

    def spec(x, n):
        if config.temperature > 0:  # a sampled chain is the top-1 sampled tree: Leviathan's rule, on the device
            shape = tree if config.mode == "tree" else TreeSpec(1, k, k, "sample")
            return decode_tree_sampled(model, drafter, x, n, shape, config.temperature, config.top_p, target.eos_ids, gen,
                                       graphs)
        if config.mode == "tree":
            return decode_tree(model, drafter, x, n, tree, target.eos_ids, graphs)
        return decode_chain(model, drafter, x, n, k, target.eos_ids, graphs)

    for x in ids[: config.warmup]:
        plain(x, 16)
        spec(x, 16)
    warm_prompt_shapes(model, ids[config.warmup:], target.eos_ids, graphs)
    per, lengths = [], []
    sampled = config.temperature > 0  # sampled runs differ by design: nothing to compare token by token
    t_plain = t_spec = n_tok = n_spec = d_s = v_s = agree = 0.0
    bar = Progress(len(ids) - config.warmup, "bench", unit="prompt")
    for p, x in zip(prompts[config.warmup:], ids[config.warmup:]):
        base = plain(x, config.max_new_tokens)
        fast = spec(x, config.max_new_tokens)
        same = None if sampled else base.tokens == fast.tokens
        if not sampled:
            agree += len(fast.tokens) if same else greedy_agreement(model, x, fast.tokens, graphs)
        per.append({"id": p.id, "plain_tokens": len(base.tokens), "spec_tokens": len(fast.tokens), "plain_s": base.seconds,
                    "spec_s": fast.seconds, "tau": sum(fast.accept_lengths) / max(len(fast.accept_lengths), 1), "identical": same})
        lengths += fast.accept_lengths
        t_plain, t_spec = t_plain + base.seconds, t_spec + fast.seconds
        n_tok, n_spec = n_tok + len(base.tokens), n_spec + len(fast.tokens)
        d_s, v_s = d_s + fast.draft_seconds, v_s + fast.verify_seconds
        bar.update(1, tau=per[-1]["tau"], speedup=(len(fast.tokens) / fast.seconds) / (len(base.tokens) / base.seconds))
    bar.close()
    tau = sum(lengths) / max(len(lengths), 1)
    depth = max(lengths, default=1) - 1
    result = BenchResult(
        prompts=len(per), draft_tokens=k, tau_mean=tau,
        tau_hist={str(a): v for a, v in sorted(Counter(lengths).items())}, accept_rate=(tau - 1) / k,
        baseline_tok_s=n_tok / t_plain, spec_tok_s=n_spec / t_spec, speedup=(n_spec / t_spec) / (n_tok / t_plain),
        lossless=None if sampled else all(r["identical"] for r in per),
        mismatched_prompts=[r["id"] for r in per if r["identical"] is False],
        greedy_agreement=None if sampled else agree / max(n_spec, 1),
        accept_by_position=accept_by_position(lengths, depth),
        new_tokens=int(n_tok), draft_s=d_s, verify_s=v_s, overhead_s=t_spec - d_s - v_s,
        device=device_name(config.device), per_prompt=per, temperature=config.temperature, top_p=config.top_p,
    )
    if config.out:
        write_result(config.out, "bench", config, result)
    return result


def table(r: BenchResult) -> str:
    hist = "  ".join(f"{k}:{v}" for k, v in r.tau_hist.items())
    rows = [
        ("prompts", f"{r.prompts} ({r.new_tokens} new tokens, T={r.temperature:g}"
                    + (f", top-p {r.top_p:g})" if r.top_p < 1 else ")")),
        ("draft tokens per cycle", str(r.draft_tokens)),
        ("accept length (mean)", f"{r.tau_mean:.2f}   accept rate {r.accept_rate:.2f}"),
        ("accept length histogram", hist),
        ("plain decoding", f"{r.baseline_tok_s:.1f} tok/s"),
        ("speculative decoding", f"{r.spec_tok_s:.1f} tok/s   (draft {r.draft_s:.1f}s, verify {r.verify_s:.1f}s, "
                                 f"other {r.overhead_s:.1f}s)"),
        ("accepted by position", "  ".join(f"{a:.2f}" for a in r.accept_by_position)),
        ("speedup", f"{r.speedup:.2f}x"),
        ("identical to plain", "not compared: sampled (lossless in distribution, tests/test_decode.py)"
         if r.lossless is None else "yes, every prompt" if r.lossless else
         f"NO: {r.mismatched_prompts} (greedy agreement {r.greedy_agreement:.4f})"),
        ("device", r.device),
    ]
    return rows_table(rows)
