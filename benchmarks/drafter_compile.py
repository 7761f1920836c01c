"""What compiling the drafting steps costs and gives, by tree shape: traces, seconds to the first
decoded prompt (tracing and compiling included) and drafting milliseconds a cycle after it, for the
drafter compiled as the decoders compile it now (static shapes, row-major arguments: 633125d) and as
before it ("old": torch.compile's default automatic dynamic shapes; uncaptured, as here, the prompt's
last hidden row and a cycle's differed in strides, so each step was traced again on the first cycle
with symbolic shapes and every later cycle ran that trace). Modes take turns (old, new, old, new), each
in a fresh process with an empty inductor cache, on the same prompts and seed; the tokens must be the
same in every run. Medians by mode and shape. Mode "eager": the drafter fused but not compiled (the CPU
bench's and demo's drafter).

    python benchmarks/drafter_compile.py --out benchmarks/results/logs/drafter-compile-cpu-<commit>.json

On the CPU the timings say what inductor's CPU code does, not what a GPU's does: the device bench's
draft_s against an earlier run with the same drafter is the GPU's answer.
"""

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.bench import device_name, git_commit, spread  # noqa: E402
from draftsmith.data import load_eval, prompt_ids  # noqa: E402
from draftsmith.decode import TreeSpec, decode_chain, decode_tree  # noqa: E402
from draftsmith.draft import Eagle3Drafter  # noqa: E402
from draftsmith.export import load_any  # noqa: E402
from draftsmith.target import load_target  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "draftsmith" / "assets"


def old_compiled(self, fn):  # Eagle3Drafter.compiled before 633125d
    backend = getattr(self, "compile_backend", None)
    return torch.compile(fn, backend=backend, fullgraph=True) if backend else fn


def one_mode(a) -> dict:
    """Every shape in turn in this process, compiled as `a.mode` says."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if a.mode == "old":
        Eagle3Drafter.compiled = old_compiled
    target = load_target(a.target, "cpu", torch.float32)
    model = target.model.optimize()
    counter = CompileCounterWithBackend(a.backend)  # counts the graphs torch.compile hands the backend
    drafter = load_any(a.drafter, model.embed_tokens.weight.detach()).eval().optimize(None if a.mode == "eager" else counter)
    prompts = [torch.tensor([prompt_ids(target.tokenizer, p.turns)]) for p in spread(load_eval(a.prompts), a.num_prompts)]
    longest = max(x.shape[1] for x in prompts) + a.max_new_tokens + 64
    model.setup_caches(1, longest)  # one cache size for every prompt, as the device bench sizes them
    drafter.setup_caches(1, longest)
    out = {}
    for entry in a.shapes.split(","):
        shape, _, temp = entry.partition("@")
        k, steps, nodes = (int(x) for x in shape.split("x"))
        temp = float(temp or 0)
        gen = torch.Generator().manual_seed(0)
        before, runs, digest = counter.frame_count, [], hashlib.sha256()
        t0 = time.perf_counter()
        for i, x in enumerate(prompts):
            if k == 1 and nodes == steps and temp == 0:
                g = decode_chain(model, drafter, x, a.max_new_tokens, steps, target.eos_ids)
            else:
                g = decode_tree(model, drafter, x, a.max_new_tokens, TreeSpec(k, steps, nodes), target.eos_ids,
                                None, temp, 1.0, gen)
            if i == 0:
                first_s = time.perf_counter() - t0
            else:
                runs.append(g)
            digest.update(json.dumps(g.tokens).encode())
        cycles = sum(len(g.accept_lengths) for g in runs)
        out[entry] = {"traces": counter.frame_count - before, "first_prompt_s": round(first_s, 1),
                      "draft_ms_per_cycle": round(1e3 * sum(g.draft_seconds for g in runs) / cycles, 3),
                      "verify_ms_per_cycle": round(1e3 * sum(g.verify_seconds for g in runs) / cycles, 3),
                      "cycles": cycles, "tau_mean": round(sum(x for g in runs for x in g.accept_lengths) / cycles, 3),
                      "tokens_sha256": digest.hexdigest()[:16]}
        print(entry, json.dumps(out[entry]), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=str(ASSETS / "drafter"))
    ap.add_argument("--prompts", default=str(ASSETS / "eval" / "mt_bench.jsonl"))
    ap.add_argument("--num-prompts", type=int, default=4, help="the first is the warm-up (traces and compiles)")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--shapes", default="1x5x5,4x5x15,8x6x48,4x5x15@1,4x2x8@1",
                    help="top-k x depth x nodes[@temperature], in this order in one process (1xKxK at T=0: the chain)")
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--modes", default="old,new,old,new", help="old, new or eager, in turn, each in a process of its own")
    ap.add_argument("--mode", help=argparse.SUPPRESS)  # one mode, in a process of its own
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.mode:
        Path(a.out).write_text(json.dumps(one_mode(a)))
        return
    res = {"command": shlex.join(["python", *sys.argv]), "commit": git_commit(), "device": device_name("cpu"),
           "target": a.target, "drafter": a.drafter, "prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens,
           "backend": a.backend, "runs": []}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    for mode in a.modes.split(","):  # e.g. old,new,old,new: each in a fresh process with an empty compile cache
        part = Path(a.out).with_suffix(f".{mode}.part")
        t = time.perf_counter()
        with tempfile.TemporaryDirectory() as cache:
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--mode", mode, "--out", str(part)], check=True,
                           env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache})
        res["runs"].append({"mode": mode, "wall_s": round(time.perf_counter() - t, 1), "shapes": json.loads(part.read_text())})
        part.unlink()
    runs = res["runs"]
    res["same_tokens"] = all(r["shapes"][s]["tokens_sha256"] == runs[0]["shapes"][s]["tokens_sha256"]
                             for r in runs for s in r["shapes"])
    res["median"] = {mode: {s: {f: statistics.median(r["shapes"][s][f] for r in runs if r["mode"] == mode)
                                for f in ("traces", "first_prompt_s", "draft_ms_per_cycle", "verify_ms_per_cycle")}
                            for s in runs[0]["shapes"]} for mode in dict.fromkeys(r["mode"] for r in runs)}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res["median"], indent=1))


if __name__ == "__main__":
    main()
