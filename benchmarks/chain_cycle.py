"""Where a chain cycle's time goes, and what a prompt pass costs at a new length, on the device.

The H100 bench at 5f0f461 (logs/h100-bench-shipped-5f0f461.json) found the chain 16% slower than at
3ff982a while plain and tree decoding were not: +1.1 s of prefill over 80 prompts (the chain runs the
drafter over each prompt first; the target's prompt pass no longer warms that length) and ~100 us more
a cycle. This script, on a random SmolLM2-shaped target and a random drafter of the shipped shape
(8K draft vocab; accept lengths are ~1, which is fine: the cost of a cycle does not depend on them):
1. prompt passes at lengths never run before and again at the same lengths: the target (run_prompt)
   and the drafter (draft_prompt), each eager (one pass) and in captured 256-token passes;
2. decode_chain with its ways of timing a cycle, interleaved prompt by prompt: CUDA events on one cycle in 8
   (the default) or on every cycle (5f0f461), a sync and host clock at each mark (before 5f0f461), and
   none; plain decoding beside.

usage: python3 benchmarks/chain_cycle.py --out DIR [--prompts 24] [--new 256] [--reps 2] [--variant triton]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_run import SMOLLM2, optimize_for, random_model  # noqa: E402

from draftsmith import decode as dec  # noqa: E402
from draftsmith.cudagraph import Graphs  # noqa: E402
from draftsmith.draft import DraftConfig, Eagle3Drafter  # noqa: E402


def commit() -> str:
    return os.environ.get("DRAFTSMITH_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def timed_ms(fn) -> float:
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dec.sync(dev)
    t = time.perf_counter()
    fn()
    dec.sync(dev)
    return (time.perf_counter() - t) * 1e3


def prompt_passes(model, drafter, lengths: list[int], graphs: Graphs, eager: Graphs) -> dict:
    """Median ms of each prompt pass at a length run for the first time, then again at that length
    (lengths: multiples of 4; each kind of pass adds its own offset 0..3, so no two share a length)."""
    capture = drafter.cfg.aux_layer_ids
    out = {}
    for name, how in (("target_eager", eager), ("target_chunked", graphs), ("drafter_eager", eager),
                      ("drafter_chunked", graphs)):
        first, again = [], []
        for T in lengths:
            T += len(out)  # a length no earlier pass of this script ran
            x = torch.randint(3, model.args.vocab_size, (1, T), device=model.embed_tokens.weight.device)
            if name.startswith("target"):
                run = lambda: dec.run_prompt(model, x, capture, how)  # noqa: E731
            else:
                aux = torch.randn(1, T, drafter.fc.weight.shape[1], device=x.device, dtype=drafter.fc.weight.dtype)
                run = lambda: dec.draft_prompt(drafter, x, x[0, -1:], aux, how)  # noqa: E731
            first.append(timed_ms(run))
            again.append(timed_ms(run))
        out[name] = {"first_ms": round(statistics.median(first), 3), "again_ms": round(statistics.median(again), 3)}
    return out


# how a cycle is timed: (mark, elapsed, cycles of which one is timed on CUDA). "events" is the default since
# 837feb9 (one cycle in 8); "events_every_cycle" was 5f0f461's; "synced" the way before it (a sync at each mark)
TIMINGS = {
    "events": (dec.mark, dec.elapsed, dec.TIME_EVERY["cuda"]),
    "events_every_cycle": (dec.mark, dec.elapsed, 1),
    "synced": (lambda dev, on=True: (dec.sync(dev), time.perf_counter())[1], lambda a, b: b - a, 1),
    "none": (lambda dev, on=True: None, lambda a, b: 0.0, 1),
}


def chain_cycles(model, drafter, prompts, new: int, reps: int, graphs: Graphs) -> dict:
    """Per-cycle time (decode time without the prompt pass, over cycles) of decode_chain(k=5) by timing
    variant, and plain decoding's per-token time, interleaved prompt by prompt (order rotated)."""
    names = list(TIMINGS)
    acc = {n: [0.0, 0] for n in names + ["plain"]}
    differ = 0
    for rep in range(reps):
        for i, x in enumerate(prompts):
            p = dec.decode_plain(model, x, new, (), graphs)
            acc["plain"][0] += p.seconds - p.prefill_seconds
            acc["plain"][1] += len(p.tokens) - 1
            for j in range(len(names)):
                n = names[(i + j + rep) % len(names)]
                dec.mark, dec.elapsed, every = TIMINGS[n]
                dec.TIME_EVERY["cuda"] = every
                try:
                    g = dec.decode_chain(model, drafter, x, new, 5, (), graphs)
                finally:
                    dec.mark, dec.elapsed, dec.TIME_EVERY["cuda"] = TIMINGS["events"]
                differ += g.tokens != p.tokens
                acc[n][0] += g.seconds - g.prefill_seconds
                acc[n][1] += len(g.accept_lengths)
    res = {n: {"us_per_cycle": round(s / c * 1e6, 2), "cycles": c} for n, (s, c) in acc.items() if n != "plain"}
    res["plain"] = {"us_per_token": round(acc["plain"][0] / acc["plain"][1] * 1e6, 2), "tokens": acc["plain"][1]}
    res["runs_differing_from_plain"] = differ
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--variant", default="triton_default")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    a = ap.parse_args()
    res = {"command": "benchmarks/chain_cycle.py " + " ".join(sys.argv[1:]), "commit": commit(),
           "device": torch.cuda.get_device_name()}
    torch.manual_seed(0)
    model = random_model(SMOLLM2)
    optimize_for(model, a.variant)
    drafter = Eagle3Drafter(DraftConfig.from_target(SMOLLM2, a.draft_vocab)).cuda().to(torch.bfloat16).eval()
    drafter.optimize("inductor")
    model.setup_caches(1, 1024)
    drafter.setup_caches(1, 1024)
    graphs = Graphs(True)
    t = time.perf_counter()
    warm = torch.randint(3, 49000, (1, 17), device="cuda")
    for g in (graphs, Graphs(True, prefill_chunk=0)):
        dec.decode_plain(model, warm, 32, (), g)
        dec.decode_chain(model, drafter, warm, 32, 5, (), g)
    res["warmup_s"] = round(time.perf_counter() - t, 1)
    gen = torch.Generator().manual_seed(1)
    lengths = sorted(4 * int(i) for i in torch.randperm(90, generator=gen)[:24] + 10)  # 40..396, step 4
    res["prompt_pass"] = prompt_passes(model, drafter, lengths, graphs, Graphs(True, prefill_chunk=0))
    res["prompt_pass"]["lengths"] = [min(lengths), max(lengths) + 3, len(lengths)]
    print(json.dumps(res["prompt_pass"]), flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "chain-cycle.json").write_text(json.dumps(res, indent=1))  # kept if the run is cut short
    prompts = [torch.randint(3, 49000, (1, int(T)), generator=gen).cuda() for T in torch.randint(40, 300, (a.prompts,), generator=gen)]
    for x in prompts:  # every prompt length seen once before timing (prompt passes are not what part 2 times)
        dec.decode_chain(model, drafter, x, 4, 5, (), graphs)
    res["chain"] = chain_cycles(model, drafter, prompts, a.new, a.reps, graphs)
    print(json.dumps(res["chain"]), flush=True)
    (Path(a.out) / "chain-cycle.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
