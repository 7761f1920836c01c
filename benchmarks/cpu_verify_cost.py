"""Cost of one target pass over T tokens relative to one token, on this machine's CPU, for the
embedded SmolLM2 target (fp32, aux layers captured, logits for every row, as verification does).

    python benchmarks/cpu_verify_cost.py     # writes benchmarks/results/cpu-verify-cost.json; last line is the JSON
"""

import json
import time
from pathlib import Path

import torch

from draftsmith.bench import device_name, git_commit
from draftsmith.target import load_target


@torch.no_grad()
def main() -> dict:
    model = load_target("smollm2-135m").model
    model.setup_caches(1, 512)
    ms = {}
    for T in (1, 2, 3, 4, 6):
        x = torch.randint(0, 1000, (1, T))
        times = []
        for i in range(18):
            t = time.perf_counter()
            out = model(x, torch.arange(200, 200 + T), capture=(1, 14, 26))
            model.logits(out.hidden[0]).argmax(-1)
            if i >= 3:  # warm-up excluded
                times.append(time.perf_counter() - t)
        ms[T] = sorted(times)[len(times) // 2] * 1e3
    res = {"command": "python benchmarks/cpu_verify_cost.py", "commit": git_commit(), "device": device_name("cpu"),
           "median_ms": {str(k): round(v, 1) for k, v in ms.items()},
           "over_one_token": {str(k): round(v / ms[1], 2) for k, v in ms.items()}}
    out = Path(__file__).parent / "results" / "cpu-verify-cost.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    print(json.dumps(main()))
