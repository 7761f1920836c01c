"""Accept length of speculation by tree shape, on the CPU: which tree to verify at T=1, where the
H200 bench's greedy-tuned tree (top-k 8, depth 6, 48 nodes) accepts far less than at T=0 (run 8:
2.23 vs 3.34, acceptance by depth 0.67, 0.40, 0.11, 0.03); with --temperature 0, which greedy tree
suits an engine whose verify cost steps with rows in tiles of 16 (the Triton kernels); with --draws
top,sample (the default) and several temperatures, where the greedy tree with the target's own draws
(TreeSpec.draws "top") accepts more than children drawn from the drafter ("sample"): decode.TOP_BELOW.

Accept length only (fp32, one thread pool): a CPU's timings say nothing about the H200's cycle
costs, so speed is left to the device bench. Every shape decodes the same prompts from the same seed.

    python benchmarks/t1_tree_shapes.py --drafter DIR --out benchmarks/results/t1-tree-shapes-cpu.json
    python benchmarks/t1_tree_shapes.py --shapes 8x6x48 --temperature 0.6,0.8,1 --out benchmarks/results/tree-draws-cpu.json
"""

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.bench import accept_by_position, device_name, git_commit, spread  # noqa: E402
from draftsmith.data import load_eval, prompt_ids  # noqa: E402
from draftsmith.decode import TreeSpec, decode_chain, decode_chain_sampled, decode_tree  # noqa: E402
from draftsmith.export import load_any  # noqa: E402
from draftsmith.target import load_target  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "draftsmith" / "assets"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=str(ASSETS / "drafter"))
    ap.add_argument("--prompts", default=str(ASSETS / "eval" / "mt_bench.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", default="1", help="comma-separated: every shape runs at each")
    ap.add_argument("--shapes", default="8x6x48,4x6x24,2x6x12,4x4x16,1x5x5", help="top-k x depth x nodes, comma-separated")
    ap.add_argument("--draws", default="top,sample", help="trees at T > 0: TreeSpec.draws, comma-separated (each shape is"
                    " run with each)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--score-temperatures", default="1", help="greedy trees: divide the drafter's logits by each of these"
                    " before its log-softmax scores (at T=0 only the tree's ranking across nodes changes, not the tokens)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    target = load_target(a.target, "cpu", torch.float32)
    model = target.model.optimize()
    drafter = load_any(a.drafter, model.embed_tokens.weight.detach()).eval()
    prompts = [torch.tensor([prompt_ids(target.tokenizer, p.turns)]) for p in spread(load_eval(a.prompts), a.num_prompts)]
    temps, draws = [float(t) for t in a.temperature.split(",")], a.draws.split(",")
    res = {"command": shlex.join(["python", *sys.argv]), "commit": git_commit(), "device": device_name("cpu"),
           "drafter": a.drafter, "prompts": len(prompts), "max_new_tokens": a.max_new_tokens,
           "temperature": temps[0] if len(temps) == 1 else temps, "shapes": {}}
    logits, first_tokens = drafter.logits, {}
    runs = [(temp, shape, float(st), dr) for temp in temps for st in a.score_temperatures.split(",")
            for shape in a.shapes.split(",") for dr in (draws if temp > 0 else ["top"])]
    for temp, shape, score_t, dr in runs:
        if score_t != 1 and temp != 0:
            raise SystemExit("--score-temperatures applies to greedy trees (--temperature 0) only")
        drafter.logits = logits if score_t == 1 else (lambda h, t=score_t: logits(h) / t)
        name = shape if score_t == 1 else f"{shape}@score_t{score_t:g}"
        name += f"@T{temp:g}" if len(temps) > 1 else ""
        k, steps, nodes = (int(x) for x in shape.split("x"))
        chain = k == 1 and nodes == steps
        if chain and dr != draws[0] and temp > 0:
            continue  # chains have one sampler
        name += f"@{dr}" if len(draws) > 1 and temp > 0 and not chain else ""
        gen, lengths, tokens, t = torch.Generator().manual_seed(a.seed), [], [], time.perf_counter()
        for x in prompts:
            if chain and temp == 0:
                out = decode_chain(model, drafter, x, a.max_new_tokens, steps, target.eos_ids)
            elif chain:  # the sampled chain decoder (Leviathan acceptance)
                out = decode_chain_sampled(model, drafter, x, a.max_new_tokens, steps, temp, 1.0, target.eos_ids, gen)
            else:
                out = decode_tree(model, drafter, x, a.max_new_tokens, TreeSpec(k, steps, nodes, dr), target.eos_ids,
                                  temperature=temp, generator=gen)
            lengths += out.accept_lengths
            tokens.append(out.tokens)
        res["shapes"][name] = {"topk": k, "depth": steps, "nodes": nodes, "temperature": temp,
                                "draws": None if chain or temp == 0 else dr, "score_temperature": score_t,
                                "cycles": len(lengths), "tau_mean": round(sum(lengths) / len(lengths), 3),
                                "accept_by_depth": [round(x, 3) for x in accept_by_position(lengths, steps)],
                                "wall_s": round(time.perf_counter() - t, 1),
                                "same_tokens_as_first_run_of_shape": tokens == first_tokens.setdefault((shape, temp), tokens)}
        print(name, res["shapes"][name], flush=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
