"""Cost of one greedy tree cycle on CUDA: SmolLM2-135M's shape with random weights (bf16, fused,
CUDA graphs), the device-resident decode_tree against the host-driven loop (tree_loop) and plain
decoding. Fixed shapes make a device cycle cost the same whatever is accepted, so speedup ~=
accept_length * plain_ms / cycle_ms for a trained drafter.

    python benchmarks/tree_cycle.py [--compile] [--topk 4 --steps 5 --tokens 16]
The last stdout line is one JSON document.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith.cudagraph import Graphs  # noqa: E402
from draftsmith.decode import TreeSpec, decode_plain, decode_tree, tree_loop  # noqa: E402
from draftsmith.draft import DraftConfig, Eagle3Drafter  # noqa: E402
from h200_run import SMOLLM2, random_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true", help="optimize('inductor', scope='model') the target")
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = random_model(SMOLLM2)
    if a.compile:
        model.optimize("inductor", scope="model")
    else:
        model.optimize()
    drafter = Eagle3Drafter(DraftConfig.from_target(SMOLLM2, 32000)).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02)
    model.setup_caches(1, 2048)
    drafter.setup_caches(1, 2048)
    spec, graphs = TreeSpec(a.topk, a.steps, a.tokens), Graphs(True)
    x = torch.randint(0, 1000, (1, 128), device="cuda")
    runs = {"plain": lambda: decode_plain(model, x, a.max_new, (), graphs),
            "tree_device": lambda: decode_tree(model, drafter, x, a.max_new, spec, (), graphs),
            "tree_host": lambda: tree_loop(model, drafter, x, a.max_new, spec, (), graphs)}
    res = {"spec": [a.topk, a.steps, a.tokens], "compile": a.compile, "device": torch.cuda.get_device_name()}
    for name, run in runs.items():
        t = time.perf_counter()
        run()  # compilation and capture
        res[name + "_warmup_s"] = round(time.perf_counter() - t, 1)
        gen = min((run() for _ in range(3)), key=lambda g: g.seconds)
        cycles = max(len(gen.accept_lengths), 1)
        res[name] = {"tokens": len(gen.tokens), "ms_per_token": round(1e3 * (gen.seconds - gen.prefill_seconds) / len(gen.tokens), 3)}
        if gen.accept_lengths:
            res[name].update(cycles=cycles, tau=round(sum(gen.accept_lengths) / cycles, 3),
                             cycle_ms=round(1e3 * (gen.seconds - gen.prefill_seconds) / cycles, 3),
                             draft_ms=round(1e3 * gen.draft_seconds / cycles, 3), verify_ms=round(1e3 * gen.verify_seconds / cycles, 3))
        print(name, res[name], flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
