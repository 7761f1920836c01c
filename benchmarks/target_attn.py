"""The target's pass over a training pack (train.target_features, what online training runs each step before the
drafter's TTT) with each TrainConfig.target_attn: "sdpa", a dense (B, 1, T, T) same-sample causal mask, against
"flex", flex_attention with a block mask of it that skips the tiles no query sees. SmolLM2-135M's shape with
random weights in bf16 on CUDA, packs of --rows rows of --tokens tokens holding samples of random lengths (as
training packs them); each pack's outputs are checked against the dense mask's before anything is timed.

    python benchmarks/target_attn.py --out $OUT/target-attn.json

Prints a line a setting and, last, one JSON document (also written to --out): ms a pack for each, the speedup of
flex, the largest feature difference and the argmax agreement between the two.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from h200_run import SMOLLM2, random_model  # noqa: E402

from draftsmith.bench import git_commit  # noqa: E402
from draftsmith.train import target_features  # noqa: E402


def pack(rows: int, tokens: int, mean_len: int, gen: torch.Generator) -> dict:
    """A (rows, tokens) batch of samples with lengths drawn around mean_len, each row filled greedily, the tail padding."""
    seg = torch.full((rows, tokens), -1, dtype=torch.long)
    pos = torch.zeros(rows, tokens, dtype=torch.long)
    for b in range(rows):
        at, i = 0, 0
        while True:
            n = int(torch.randint(mean_len // 4, 2 * mean_len, (1,), generator=gen))
            if at + n > tokens:
                break
            seg[b, at:at + n], pos[b, at:at + n] = i, torch.arange(n)
            at, i = at + n, i + 1
    ids = torch.randint(0, SMOLLM2.vocab_size, (rows, tokens), generator=gen)
    return {"input_ids": ids.cuda(), "segment_ids": seg.cuda(), "position_ids": pos.cuda()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8, help="rows a pack (TrainConfig.rows_per_pack)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens a row (TrainConfig.batch_tokens)")
    ap.add_argument("--mean-len", type=int, default=400, help="typical sample length in tokens")
    ap.add_argument("--packs", type=int, default=8, help="distinct packs, each timed --reps times")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("target_attn.py times CUDA kernels: run it on a machine with a GPU")
    torch.manual_seed(0)
    model = random_model(SMOLLM2)
    aux = SMOLLM2.default_aux_layers()
    gen = torch.Generator().manual_seed(0)
    packs = [pack(a.rows, a.tokens, a.mean_len, gen) for _ in range(a.packs)]
    res = {"command": "python benchmarks/target_attn.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": a.rows, "tokens": a.tokens,
           "mean_len": a.mean_len, "packs": a.packs, "reps": a.reps}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        worst, agree = 0.0, []
        for batch in packs:  # checks first: also the warm-up (flex compiles here)
            dense, flex = (target_features(model, batch, aux, attn) for attn in ("sdpa", "flex"))
            real = batch["segment_ids"] >= 0
            worst = max(worst, float((flex["aux"] - dense["aux"]).abs().amax()))
            agree.append(float((flex["argmax"] == dense["argmax"])[real].float().mean()))
        res.update(max_abs_aux_diff=round(worst, 4), argmax_agreement=round(min(agree), 4))
        for attn in ("sdpa", "flex"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.reps):
                for batch in packs:
                    target_features(model, batch, aux, attn)
            torch.cuda.synchronize()
            res[f"{attn}_ms_a_pack"] = round((time.perf_counter() - t0) * 1e3 / (a.reps * a.packs), 2)
            print(f"{attn}: {res[f'{attn}_ms_a_pack']} ms a pack", flush=True)
    res["flex_speedup"] = round(res["sdpa_ms_a_pack"] / res["flex_ms_a_pack"], 3)
    print(json.dumps(res))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
