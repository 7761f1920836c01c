"""Cost of one target pass over T tokens relative to one token, on this machine's CPU, for the
embedded SmolLM2 target in fp32, run as bench runs it on the CPU (fused qkv / gate-up,
model.optimize()): aux layers captured and logits for every row, as chain verification does;
also plain decoding's step (one token, no capture). T's are interleaved, so drift on a shared
host hits them alike. The load average and the host's memory bandwidth (a 540 MB sum, what a
step streams) before and after are recorded: a busy neighbour shows up there first.

    python benchmarks/cpu_verify_cost.py                  # writes benchmarks/results/cpu-verify-cost.json
    python benchmarks/cpu_verify_cost.py --compile layer  # torch.compile'd layers (inductor); writes
                                                          # cpu-verify-cost-compiled.json, compile time included
The last stdout line is the JSON.
"""

import argparse
import json
import os
import time
from pathlib import Path

import torch

from draftsmith.bench import device_name, git_commit
from draftsmith.decode import next_token_step
from draftsmith.target import load_target

SIZES = (1, 2, 3, 4, 6)


def memory_gb_s() -> float:
    x = torch.ones(135_000_000)  # 540 MB, the weights a SmolLM2 step reads
    times = []
    for _ in range(7):
        t = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t)
    return round(x.numel() * 4 / sorted(times)[3] / 1e9, 1)


@torch.no_grad()
def main(compile_scope: str | None = None, rounds: int = 15) -> dict:
    load_before, bw_before = os.getloadavg()[0], memory_gb_s()
    model = load_target("smollm2-135m").model
    t0 = time.perf_counter()
    model.optimize("inductor" if compile_scope else None, scope=compile_scope or "layer")
    model.setup_caches(1, 512)
    plain = next_token_step(model)

    def verify(T):
        out = model(torch.randint(0, 1000, (1, T)), torch.arange(200, 200 + T), capture=(1, 14, 26))
        return model.logits(out.hidden[0]).argmax(-1)

    def step():
        return plain(torch.randint(0, 1000, (1, 1)), torch.tensor([200]))

    passes = {**{T: (lambda T=T: verify(T)) for T in SIZES}, "plain": step}
    for run in passes.values():  # warm-up (and compilation)
        run()
    warm_s = time.perf_counter() - t0
    times = {k: [] for k in passes}
    for _ in range(rounds):
        for k, run in passes.items():
            t = time.perf_counter()
            run()
            times[k].append(time.perf_counter() - t)
    ms = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
    res = {"command": "python benchmarks/cpu_verify_cost.py" + (f" --compile {compile_scope}" if compile_scope else ""),
           "commit": git_commit(), "device": device_name("cpu"),
           "path": f"fused qkv / gate-up{', compiled ' + compile_scope + 's (inductor)' if compile_scope else ', eager'}",
           "setup_and_warmup_s": round(warm_s, 1),
           "median_ms": {str(k): round(ms[k], 1) for k in SIZES},
           "over_one_token": {str(k): round(ms[k] / ms[1], 2) for k in SIZES},
           "plain_step_ms": round(ms["plain"], 1),
           "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
           "memory_gb_s": [bw_before, memory_gb_s()]}
    name = "cpu-verify-cost-compiled.json" if compile_scope else "cpu-verify-cost.json"
    (Path(__file__).parent / "results" / name).write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compile", choices=("layer", "model"), help="torch.compile the target (inductor) at this scope")
    print(json.dumps(main(ap.parse_args().compile)))
