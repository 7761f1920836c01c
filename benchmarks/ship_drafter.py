"""Make the drafter that ships inside the package (draftsmith/assets/drafter), which the demo starts from.

It is the H200 pipeline's SmolLM2 drafter (an SGLang export brought back from the device) with its
draft vocabulary cut to the `--size` tokens most frequent among the assistant tokens of the answers
it was trained on (Eagle3Drafter.shrink_vocab): over those tokens its logits are unchanged, each
draft step is cheaper on a CPU, and the file is small enough to ship.

    python benchmarks/ship_drafter.py --drafter run5/sglang --answers run5/answers.jsonl.gz --size 8192 \
        --note "H200 run 5 (benchmarks/results/h200-pipeline.json)"

Without --answers (a run whose answers stayed on the device) the vocabulary is kept whole: --size must equal
the drafter's draft vocab, and the coverage is the one its training reported (--coverage, train.json's
vocab_coverage).
"""

import argparse
import gzip
import json
import shlex
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.bench import git_commit  # noqa: E402
from draftsmith.export import export_sglang, load_any  # noqa: E402
from draftsmith.target import load_target  # noqa: E402
from draftsmith.train import Conversations  # noqa: E402
from draftsmith.vocab import count_tokens  # noqa: E402

SHIPPED = Path(__file__).resolve().parents[1] / "draftsmith" / "assets" / "drafter"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", required=True, help="SGLang export of the trained drafter")
    ap.add_argument("--answers", help="the answers.jsonl(.gz) it was trained on (token counts); without it the vocab is kept whole")
    ap.add_argument("--coverage", type=float, help="without --answers: the share of answer tokens its draft vocab covers (train.json)")
    ap.add_argument("--size", type=int, default=8192)
    ap.add_argument("--note", default="", help="where the drafter came from")
    ap.add_argument("--out", default=str(SHIPPED))
    a = ap.parse_args()
    target = load_target(a.target, "cpu", torch.float32)
    drafter = load_any(a.drafter, target.model.embed_tokens.weight)
    if a.answers is None:
        if a.size != drafter.cfg.draft_vocab_size or a.coverage is None:
            sys.exit(f"without --answers the vocab is kept whole: pass --size {drafter.cfg.draft_vocab_size} and "
                     "--coverage (train.json's vocab_coverage), or pass --answers to cut it")
        small = drafter.to(torch.bfloat16)
        coverage = {"source": round(a.coverage, 4), "shipped": round(a.coverage, 4), "from": "training (train.json)"}
    else:
        answers = Path(a.answers)
        with tempfile.TemporaryDirectory() as tmp:
            if answers.suffix == ".gz":
                plain = Path(tmp) / "answers.jsonl"
                plain.write_bytes(gzip.decompress(answers.read_bytes()))
                answers = plain
            counts = count_tokens(Conversations(str(answers), target.tokenizer, 2048).samples, target.model.args.vocab_size)
        ids = drafter.target_ids()
        small = drafter.shrink_vocab(counts, a.size).to(torch.bfloat16)
        kept = small.target_ids()
        coverage = {"source": round(float(counts[ids].sum() / counts.sum()), 4),
                    "shipped": round(float(counts[kept].sum() / counts.sum()), 4)}
    out = export_sglang(small, Path(a.out), target.hf_config)
    info = {"from": a.note, "source_draft_vocab": drafter.cfg.draft_vocab_size, "draft_vocab": a.size,
            "coverage_of_answer_tokens": coverage, "command": shlex.join(["python", *sys.argv]), "commit": git_commit()}
    (out / "provenance.json").write_text(json.dumps(info, indent=1) + "\n")
    print(json.dumps(info))


if __name__ == "__main__":
    main()
