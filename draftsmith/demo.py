"""The demo: every stage, at small scale, on the embedded default target, on a CPU.

generate (the target answers prompts shipped in draftsmith/assets) -> extract -> train ->
export (SGLang folder) -> bench (MT-bench first turns, speculation vs plain decoding),
then a result JSON with the figures issue #2 asks for. Each stage writes into its own
folder under `out`, so an interrupted demo rerun resumes every stage where it stopped.

Training starts from the drafter that ships in draftsmith/assets/drafter (`--start-from shipped`,
the default): the one the full pipeline trained on a GPU from all 12.4K prompts and 20K the target
wrote itself (its provenance.json and benchmarks/ship_drafter.py say how it was made), which a CPU
could not train in 15 minutes.
The demo trains it further on the answers it has just generated; `--start-from scratch` trains a
new drafter instead (much weaker at this scale), and a path starts from any drafter of this target.

    draftsmith demo --out runs/demo --result benchmarks/results/demo-cpu.json
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftsmith import bench, export, extract, generate, train

ASSETS = Path(__file__).parent / "assets"
DEMO_PROMPTS = tuple(str(ASSETS / "prompts" / f) for f in
                     ("alpaca_seed_tasks.jsonl", "self_instruct_user_oriented.jsonl", "gsm8k_train_1500.jsonl"))
MT_BENCH = str(ASSETS / "eval" / "mt_bench.jsonl")
SHIPPED_DRAFTER = ASSETS / "drafter"


@dataclass(frozen=True)
class DemoConfig:
    out: str = "runs/demo"
    target: str = "smollm2-135m"
    prompts: tuple[str, ...] = DEMO_PROMPTS
    eval_prompts: str = MT_BENCH
    num_train: int = 224  # prompts the target answers
    max_new_tokens: int = 192
    max_prompt_tokens: int = 200
    batch_size: int = 64
    start_from: str = "shipped"  # shipped | scratch | a drafter folder (train's drafter/ or an SGLang export)
    draft_vocab_size: int = 2048  # from scratch only: a drafter started from another keeps its vocab
    ttt_depth: int = 3
    epochs: int | None = None  # default: 1 from a trained drafter, 6 from scratch
    lr: float | None = None  # default: from a trained drafter TrainConfig's (1e-4), from scratch 2e-3
    batch_tokens: int = 512  # small packs: more optimizer steps per CPU second, and T^2 attention stays cheap
    bench_prompts: int = 8
    bench_max_new_tokens: int = 256  # as the H200 bench; MT-bench answers run longer, and their openings are the hardest to draft
    mode: str = "chain"  # chain | tree
    draft_tokens: int = 3  # chain
    topk: int = 4  # tree
    steps: int = 4  # tree
    num_draft_tokens: int = 8  # tree
    threads: int | None = None  # torch CPU threads; default: torch's choice
    result: str | None = None  # where to write the demo's JSON summary


def initial_drafter(start_from: str) -> str | None:
    if start_from == "scratch":
        return None
    path = SHIPPED_DRAFTER if start_from == "shipped" else Path(start_from)
    try:
        export.load_any(path)  # a bad path fails now, not after generate and extract
    except (FileNotFoundError, ValueError) as e:
        raise FileNotFoundError(f"no drafter at {path} ({e}): give --start-from scratch, or a train drafter/ or "
                                "SGLang export folder") from e
    return str(path)


def run(config: DemoConfig) -> bench.BenchResult:
    init = initial_drafter(config.start_from)
    if config.threads:
        torch.set_num_threads(config.threads)
    t0 = time.perf_counter()
    out = Path(config.out)
    gen = generate.run(generate.GenerateConfig(
        target=config.target, prompts=config.prompts, out=str(out / "generate"), exclude=(config.eval_prompts,),
        limit=config.num_train, max_new_tokens=config.max_new_tokens, batch_size=config.batch_size,
        max_prompt_tokens=config.max_prompt_tokens))
    extract.run(extract.ExtractConfig(target=config.target, data=gen.path, out=str(out / "hidden")))
    trained = train.run(train.TrainConfig(
        target=config.target, data=str(out / "hidden"), out=str(out / "train"), draft_vocab_size=config.draft_vocab_size,
        ttt_depth=config.ttt_depth, epochs=config.epochs or (1 if init else 6), lr=config.lr or (None if init else 2e-3),
        batch_tokens=config.batch_tokens, rows_per_pack=1, eval_fraction=0.05, init=init))  # one small row a step on a CPU
    exported = export.run(export.ExportConfig(checkpoint=str(out / "train" / "drafter"), out=str(out / "sglang")))
    print(f"exported for SGLang: {exported.out}\n  serve with: {exported.command}")
    result = bench.run(bench.BenchConfig(
        target=config.target, drafter=str(exported.out), prompts=config.eval_prompts, out=str(out / "bench"),
        num_prompts=config.bench_prompts, max_new_tokens=config.bench_max_new_tokens, mode=config.mode,
        draft_tokens=config.draft_tokens, topk=config.topk, steps=config.steps, num_draft_tokens=config.num_draft_tokens))
    wall = time.perf_counter() - t0
    summary = {
        "command": " ".join(["draftsmith", *sys.argv[1:]]) if sys.argv[0].endswith(("draftsmith", "__main__.py")) else "draftsmith demo",
        "commit": bench.git_commit(),
        "device": result.device,
        "wall_s": round(wall, 1),
        "tau_mean": round(result.tau_mean, 3),
        "tau_hist": result.tau_hist,
        "speedup": round(result.speedup, 3),
        "baseline_tok_s": round(result.baseline_tok_s, 2),
        "spec_tok_s": round(result.spec_tok_s, 2),
        "draft_tokens": result.draft_tokens,
        "mode": config.mode,
        "started_from": init or "scratch",
        "lossless": result.lossless,
        "bench_prompts": result.prompts,
        "bench_new_tokens": result.new_tokens,
        "train_samples": gen.total,
        "train_steps": trained.steps,
        "heldout_accept_length": round(trained.eval.get("accept_length", float("nan")), 3),
        "config": asdict(config),
    }
    (out / "demo.json").write_text(json.dumps(summary, indent=2))
    if config.result:
        Path(config.result).parent.mkdir(parents=True, exist_ok=True)
        Path(config.result).write_text(json.dumps(summary, indent=2) + "\n")
    print(f"demo finished in {wall:.0f}s")
    return result
