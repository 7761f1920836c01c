"""The Triton engine's kernel launches, with their grids, for a decode step and a verify pass of each size,
recorded on meta tensors (no GPU): which kernels a longer pass makes bigger. At the Llama-3.1-8B shape it shows
that an 8-token pass launches the matmuls on the same grids as a one-token step and only the attention on more
programs, so the 8-token pass's extra time (verify8 1.16-1.24 steps) is not more matmul programs.

    python benchmarks/launch_grids.py --shape llama8b --rows 1,8 --out benchmarks/results/logs/launch-grids-8b.json
"""

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from compile_kernels import SHAPES  # noqa: E402
from draftsmith import kernels  # noqa: E402
from draftsmith.bench import git_commit  # noqa: E402
from draftsmith.decode import tree_mask  # noqa: E402
from draftsmith.target import Transformer  # noqa: E402


def layer_launches(args, rows: tuple[int, ...], slots: int = 1024, p0: int = 300) -> dict:
    """{T: the first layer's launches [(kernel, grid, programs)]} for a causal pass of T tokens at slot p0."""
    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((self.name, list(grid), math.prod(grid)))

    jitted = {n: f for n, f in vars(kernels).items() if isinstance(f, triton.runtime.jit.JITFunction)}
    for n in jitted:
        setattr(kernels, n, Recorder(n))
    try:
        with torch.device("meta"):
            model = Transformer(args).to(torch.bfloat16).eval()
        model.optimize(kernels="triton", tuning=kernels.Tuning())
        model.setup_caches(1, slots)
        out = {}
        for T in rows:
            launches.clear()
            pos = torch.arange(p0, p0 + T, device="meta")
            mask = tree_mask(torch.eye(T, dtype=torch.bool).tril(), torch.tensor(p0), slots).to("meta")
            model(torch.zeros(1, T, dtype=torch.long, device="meta"), pos, mask)
            per_layer = len(launches) // args.num_layers
            out[T] = {"launches": len(launches), "first_layer": launches[:per_layer]}
        return out
    finally:
        for n, f in jitted.items():
            setattr(kernels, n, f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama8b", choices=sorted(SHAPES))
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = {"command": " ".join(["python", *sys.argv]), "commit": git_commit(), "device": "meta tensors (no GPU)",
           "shape": a.shape, "slots": 1024, "first_slot": 300,
           "passes": layer_launches(SHAPES[a.shape], tuple(int(r) for r in a.rows.split(",")))}
    Path(a.out).write_text(json.dumps(res, indent=1))
    for T, p in res["passes"].items():
        print(T, p["launches"], [(n, g) for n, g, _ in p["first_layer"]])


if __name__ == "__main__":
    main()
