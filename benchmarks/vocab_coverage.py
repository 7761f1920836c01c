"""How much accept length a cut draft vocabulary costs: decode MT-bench first turns with chain
speculation and count the target's greedy tokens the drafter cannot propose (outside its t2d), and
the rejections that happen at such a token (the cycle's correction token is out of the draft vocab:
no drafter with this vocab could have been accepted there). The shipped drafter's vocab was cut to
8,192 tokens (benchmarks/ship_drafter.py); this says what that cut leaves on the table.

    python benchmarks/vocab_coverage.py --drafter draftsmith/assets/drafter \
        --out benchmarks/results/vocab-coverage-cpu.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.bench import device_name, git_commit, spread  # noqa: E402
from draftsmith.data import load_eval, prompt_ids  # noqa: E402
from draftsmith.decode import decode_chain  # noqa: E402
from draftsmith.export import load_any  # noqa: E402
from draftsmith.target import load_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def cycles_at_unreachable(tokens: list[int], accept_lengths: list[int], k: int, in_vocab: torch.Tensor) -> tuple[int, int]:
    """(rejecting cycles, those whose correction token is outside the draft vocab). tokens[0] comes
    from prefill; each cycle then adds accept_lengths[i] tokens, the last of which is the target's
    own choice (the correction when fewer than k drafts were accepted)."""
    rejected = unreachable = 0
    i = 1
    for a in accept_lengths:
        if a < k + 1 and i + a - 1 < len(tokens):
            rejected += 1
            unreachable += int(not in_vocab[tokens[i + a - 1]])
        i += a
    return rejected, unreachable


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=str(ROOT / "draftsmith/assets/drafter"))
    ap.add_argument("--prompts", default=str(ROOT / "draftsmith/assets/eval/mt_bench.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--draft-tokens", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    target = load_target(a.target)
    model = target.model.optimize(None)
    drafter = load_any(a.drafter, model.embed_tokens.weight.detach().float()).eval()
    in_vocab = drafter.t2d  # bool over the target vocab
    rows = []
    for p in spread(load_eval(a.prompts), a.num_prompts):
        x = torch.tensor([prompt_ids(target.tokenizer, p.turns)])
        g = decode_chain(model, drafter, x, a.max_new_tokens, a.draft_tokens, target.eos_ids)
        rejected, unreachable = cycles_at_unreachable(g.tokens, g.accept_lengths, a.draft_tokens, in_vocab)
        oov = int((~in_vocab[torch.tensor(g.tokens)]).sum())
        rows.append({"id": p.id, "tokens": len(g.tokens), "out_of_vocab_tokens": oov, "cycles": len(g.accept_lengths),
                     "rejecting_cycles": rejected, "rejections_at_out_of_vocab": unreachable,
                     "tau": round(sum(g.accept_lengths) / len(g.accept_lengths), 3)})
        print(json.dumps(rows[-1]), flush=True)
    total = {key: sum(r[key] for r in rows) for key in ("tokens", "out_of_vocab_tokens", "cycles", "rejecting_cycles",
                                                        "rejections_at_out_of_vocab")}
    res = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "device": device_name("cpu"),
           "drafter": a.drafter, "draft_vocab": drafter.cfg.draft_vocab_size, "draft_tokens": a.draft_tokens,
           "max_new_tokens": a.max_new_tokens, **total,
           "out_of_vocab_share": round(total["out_of_vocab_tokens"] / total["tokens"], 4),
           "rejections_at_out_of_vocab_share": round(total["rejections_at_out_of_vocab"] / max(total["rejecting_cycles"], 1), 4),
           "per_prompt": rows}
    print(json.dumps({k: v for k, v in res.items() if k != "per_prompt"}))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
