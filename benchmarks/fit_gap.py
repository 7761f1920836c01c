"""How a pipeline run's drafter fits its data, from its committed metrics and bench: per epoch, the held-out loss_0 /
acc_0 against the training steps' mean over the 150 steps before that evaluation (a widening gap: the drafter is
fitting this data rather than learning more of it), the step time, and the chain's per-position acceptance given the
position before (where a chain loses its tokens).

    python benchmarks/fit_gap.py benchmarks/results/logs/h100-run20-metrics.jsonl.gz benchmarks/results/logs/h100-run20-bench.json
"""

import gzip
import json
import statistics as st
import sys


def main(metrics: str, bench: str):
    rows = [json.loads(line) for line in gzip.open(metrics, "rt")]
    steps, by_epoch = [], []
    for r in rows:  # evaluation rows follow the step they came after
        if "seconds" in r:
            steps.append(r)
        elif "epoch" in r:
            window = steps[max(0, len(steps) - 150):]
            train = {k: round(st.mean(s[k][0] for s in window), 3) for k in ("loss", "acc")}
            held = {k: round(r["eval"][k][0], 3) for k in ("loss", "acc")}
            by_epoch.append({"epoch": r["epoch"], "after_step": len(steps), "train_loss0": train["loss"],
                             "heldout_loss0": held["loss"], "loss_gap": round(held["loss"] - train["loss"], 3),
                             "train_acc0": train["acc"], "heldout_acc0": held["acc"]})
    s = [r["seconds"] for r in steps]
    chain = json.load(open(bench))["smollm2"]["chain5"]["accept_by_position"]
    out = {"metrics": metrics, "bench": bench, "by_epoch": by_epoch,
           "step_ms": {"mean": round(1e3 * st.mean(s), 1), "mean_after_50": round(1e3 * st.mean(s[50:]), 1),
                       "median": round(1e3 * st.median(s), 1)},
           "tokens_per_s": round(sum(r["tokens"] for r in steps) / sum(s)),
           "chain5_accept_by_position": chain,
           "chain5_given_the_one_before": [round(chain[0], 3)] + [round(chain[i] / chain[i - 1], 3) for i in range(1, len(chain))]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
