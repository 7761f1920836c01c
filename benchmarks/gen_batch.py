"""Batched answer generation on CUDA, greedy and sampled: what the pipeline's regeneration runs
(generate.run -> decode.generate_batch), timed on a random SmolLM2-135M-shaped target in bf16 with
prompts of random tokens. A random EOS set of --eos-tokens ids ends rows at different steps, as real
answers end (sampled rows: about eos_tokens / vocab a step; greedy rows of random weights seldom end).

    python benchmarks/gen_batch.py --max-new 512 --slot-windows 128,0 --compact-at 0.5,0.75 --attention matmul,sdpa \
        --out $OUT/gen-batch.json

Prints one line a (temperature, attention window, compaction share) and, last, one JSON document
(also written to --out as it grows): tok/s, rows, tokens, mean answer length, seconds, the first batch
(graph capture) left out of the timing. --slot-windows: generate_batch's slot_window values to compare
(0: every step reads the whole cache, as before 2026-12-07); --compact-at: its compact_at values (the
live share of a batch at which finished rows are dropped; 0.5 before 2026-12-07); --attention: the
decode steps' attention (the engine's two matmuls, or SDPA as for prefill).
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith.bench import device_name, git_commit  # noqa: E402
from draftsmith.decode import generate_batch  # noqa: E402
from h200_run import SMOLLM2, random_model  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3072, help="prompts timed (after one warm-up batch)")
    ap.add_argument("--batch", type=int, default=1024, help="rows a batch (h200_run --gen-batch)")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=30)
    ap.add_argument("--max-len", type=int, default=300)
    ap.add_argument("--eos-tokens", type=int, default=500)
    ap.add_argument("--temperatures", default="0.8,0")
    ap.add_argument("--slot-windows", default="128", help="generate_batch slot_window values (0: the whole cache)")
    ap.add_argument("--compact-at", default="0.5", help="generate_batch compact_at values")
    ap.add_argument("--attention", default="matmul", help="matmul (the engine's short-query path) and/or sdpa "
                    "(F.scaled_dot_product_attention for the decode steps too, Transformer.optimize(attention='sdpa'))")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gen_batch.py times CUDA generation: no CUDA device here")
    torch.manual_seed(0)
    model = random_model(SMOLLM2)
    V = SMOLLM2.vocab_size
    eos = tuple(torch.randperm(V)[: a.eos_tokens].tolist())
    lens = torch.randint(a.min_len, a.max_len + 1, (a.batch + a.prompts,)).sort().values.tolist()
    prompts = [torch.randint(0, V, (n,)).tolist() for n in lens]
    res = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "device": device_name("cuda"),
           "shape": "SmolLM2-135M (random weights, bf16)", "batch": a.batch, "prompts": a.prompts,
           "max_new": a.max_new, "eos_tokens": a.eos_tokens}
    grid = itertools.product(a.attention.split(","), (float(t) for t in a.temperatures.split(",")),
                             (int(w) for w in a.slot_windows.split(",")), [float(c) for c in a.compact_at.split(",")])
    for attn, temp, w, c in grid:
        if attn not in ("matmul", "sdpa"):
            sys.exit(f"--attention takes matmul and/or sdpa, not {attn}")
        for layer in model.layers:
            layer.self_attn.fused_short = attn == "sdpa"
        name = f"t{temp:g}_window{w}_compact{c:g}" + ("_sdpa" if attn == "sdpa" else "")
        gen = torch.Generator("cuda").manual_seed(0)

        def run(batch):
            return generate_batch(model, batch, a.max_new, eos, temp, 0.95, gen, slot_window=w, compact_at=c)
        try:
            run(prompts[: a.batch])  # warm-up: captures, allocator
            torch.cuda.synchronize()
            t0, tokens = time.perf_counter(), 0
            for i in range(a.batch, len(prompts), a.batch):
                tokens += sum(map(len, run(prompts[i : i + a.batch])))
            torch.cuda.synchronize()
            s = time.perf_counter() - t0
            row = {"tok_s": round(tokens / s, 1), "tokens": tokens, "mean_answer": round(tokens / a.prompts, 1),
                   "seconds": round(s, 2)}
        except Exception as e:  # noqa: BLE001 - recorded; the next setting still runs
            row = {"error": repr(e)[:500]}
        res[name] = row
        print(f"{name}: {row}", flush=True)
        if a.out:  # as it comes: a call cut short keeps what it measured
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
