"""Where does a drafter's accept length go? Its training metric against what decoding sees, on the same text.

For each prompt the target answers greedily; then on that very text
  - teacher-forced acc_0: the drafter's first-step prediction at every answer position, fed the
    target's features as training feeds them (one full forward, `Eagle3Drafter.ttt`), against the
    target's greedy token;
  - decode pos-1 acceptance: the share of chain-speculation cycles whose first draft was accepted.
If the two agree, the decoder hands the drafter what training did and a low accept length is the
drafter's (its data); if decoding is far below, the decode path is wrong. Prompts come from an
evaluation set and, with --answers, from the training answers' held-out and training splits.

    python benchmarks/accept_gap.py --drafter runs/x/sglang --answers runs/x/gen/answers.jsonl \
        --out benchmarks/results/accept-gap-cpu.json
"""

import argparse
import json
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.bench import device_name, git_commit  # noqa: E402
from draftsmith.data import load_eval, prompt_ids  # noqa: E402
from draftsmith.decode import decode_chain, decode_plain  # noqa: E402
from draftsmith.export import load_any  # noqa: E402
from draftsmith.extract import read_conversations  # noqa: E402
from draftsmith.target import load_target  # noqa: E402
from draftsmith.train import split  # noqa: E402


@torch.no_grad()
def teacher_forced_acc0(model, drafter, full: torch.Tensor, prompt_len: int) -> float:
    out = model(full, torch.arange(full.shape[1]), capture=drafter.cfg.aux_layer_ids)
    pred = drafter.to_target(drafter.logits(drafter.ttt(full, out.aux, 1)[0]).argmax(-1))[0]  # row r: token r+2
    greedy = model.logits(out.hidden).argmax(-1)[0]  # position r+1's greedy next token = token r+2
    rows = torch.arange(prompt_len - 1, full.shape[1] - 2)
    return float((pred[rows] == greedy[rows + 1]).float().mean())


def measure(target, drafter, turns: list[str], max_new: int, k: int) -> dict:
    x = torch.tensor([prompt_ids(target.tokenizer, turns)], device=target.model.lm_head.weight.device)
    plain = decode_plain(target.model, x, max_new, target.eos_ids)
    full = torch.cat([x, torch.tensor([plain.tokens], device=x.device)], 1)
    chain = decode_chain(target.model, drafter, x, max_new, k, target.eos_ids)
    cycles = chain.accept_lengths
    return {"tf_acc0": round(teacher_forced_acc0(target.model, drafter, full, x.shape[1]), 4),
            "decode_pos1": round(sum(a > 1 for a in cycles) / len(cycles), 4),
            "tau": round(sum(cycles) / len(cycles), 3), "identical": plain.tokens == chain.tokens}


def summary(rows: list[dict]) -> dict:
    return {key: round(sum(r[key] for r in rows) / len(rows), 4) for key in ("tf_acc0", "decode_pos1", "tau")}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="SGLang export or train's drafter/ folder")
    ap.add_argument("--eval", default=str(Path(__file__).resolve().parents[1] / "draftsmith/assets/eval/mt_bench.jsonl"))
    ap.add_argument("--answers", help="generate's answers.jsonl: also held-out and training prompts")
    ap.add_argument("--eval-fraction", type=float, default=0.02, help="the held-out share training used")
    ap.add_argument("--num", type=int, default=6, help="prompts per set")
    ap.add_argument("--max-new", type=int, default=96)
    ap.add_argument("--draft-tokens", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out")
    a = ap.parse_args()
    target = load_target(a.target, a.device, getattr(torch, a.dtype))
    drafter = load_any(a.drafter, target.model.embed_tokens.weight.detach().float().cpu()).to(a.device, getattr(torch, a.dtype)).eval()
    sets = {Path(a.eval).stem: [(q.turns[:1], Path(a.eval).name) for q in load_eval(a.eval)[: a.num]]}
    if a.answers:
        convs = list(read_conversations(a.answers))
        train_idx, eval_idx = split([sid for sid, _ in convs], a.eval_fraction, 0)
        rng = random.Random(0)
        for name, idx in (("heldout", eval_idx), ("train", train_idx)):
            sets[name] = [([m["content"] for m in convs[i][1] if m["role"] == "user"][:1], convs[i][0].split("/")[0])
                          for i in rng.sample(idx, a.num)]
    res = {"command": " ".join(sys.argv), "commit": git_commit(), "device": device_name(a.device), "drafter": a.drafter,
           "max_new_tokens": a.max_new, "draft_tokens": a.draft_tokens, "sets": {}}
    for name, prompts in sets.items():
        rows = [{**measure(target, drafter, turns, a.max_new, a.draft_tokens), "source": source} for turns, source in prompts]
        res["sets"][name] = {**summary(rows), "per_prompt": rows}
        print(name, json.dumps(res["sets"][name] | {"per_prompt": None}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
