"""Cost of one greedy tree cycle on CUDA, engine by engine: SmolLM2-135M's shape with random weights
(bf16, CUDA graphs) and a random drafter of the matching shape (compiled as bench compiles it). Fixed
shapes make a device cycle cost the same whatever is accepted, so for a trained drafter
speedup ~= accept_length * plain_ms / cycle_ms (what `draftsmith cost` computes).

For each variant: the target pass by rows (one token to a 49-row tree), plain decoding's ms a token,
the chain (decode_chain) and the tree cycle for each --specs shape, split
into draft and verify on the device timeline (1x5x5 is the chain of 5 on the device-resident cycle);
the host-driven tree loop (tree_loop) too with --host-loop. Variants:
  compiled             inductor-compiled layers (bench --engine compiled)
  triton_torch_commit  Triton layers, the KV commit as 4 torch ops a layer (Tuning(move_slots=False))
  triton               Triton layers with the default Tuning (one-launch commit, kernels.SlotMover; attention
                       split over the cache in 128-slot chunks, then merged)
  triton_unsplit       the same with one attention program a kv head and row block (Tuning(split=0))
  triton_split64/256   Tuning(split=...): other chunk sizes
  triton_pairs32       Tuning(pairs=32): wider qkv programs (the 8B shape's best)
  triton_cols32/64     Tuning(cols=...) (columns a matmul program)
  triton_torch_head    Tuning(head=False): the final norm and lm_head in torch (cuBLAS) instead of kernels.Head
(the Triton ones are h200_run.TRITON_VARIANTS)

    python benchmarks/tree_cycle.py --variants compiled,triton_torch_commit,triton,triton_unsplit --out $OUT/tree-cycle.json
With --temperatures 0,1 the same shapes are timed at T=1 too (plain sampling and each tree shape's sampled cycle:
draft_sampled then verify_sampled, or verify_top by TreeSpec.draws_at), and with --profile the one-token target
step and every captured tree step (drafts and verifies, greedy and sampled) get h200_run.kernel_profile's kernel count, device ms and
top kernels: where a T=1 cycle's verify spends what a greedy one does not, e.g.
    python benchmarks/tree_cycle.py --variants triton_default --specs 1x2x2,4x5x15 --temperatures 0,1 --profile
The last stdout line is one JSON document (also written to --out).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith.bench import git_commit  # noqa: E402
from draftsmith.cudagraph import Graphs  # noqa: E402
from draftsmith.decode import TreeSpec, decode_chain, decode_plain, decode_tree, tree_loop  # noqa: E402
from draftsmith.draft import DraftConfig, Eagle3Drafter  # noqa: E402
from h200_run import SMOLLM2, TRITON_VARIANTS, kernel_profile, optimize_for, random_model, step_times  # noqa: E402


def spec_name(spec: TreeSpec) -> str:
    return f"{spec.topk}x{spec.steps}x{spec.num_draft_tokens}"


def measure(model, drafter, specs: list[TreeSpec], chain_k: int, max_new: int, rows, host_loop: bool,
            temperatures=(0.0,), profile: bool = False) -> dict:
    graphs = Graphs(True)
    x = torch.randint(0, 1000, (1, 128), device="cuda")
    res = step_times(model, torch.tensor([300], device="cuda"), rows, graphs)
    # name -> (run, the plain run its cycles compare with)
    runs = {"plain": (lambda: decode_plain(model, x, max_new, (), graphs), "plain"),
            f"chain{chain_k}_host": (lambda: decode_chain(model, drafter, x, max_new, chain_k, (), graphs), "plain")}
    for spec in specs:
        runs[f"tree{spec_name(spec)}_device"] = (lambda spec=spec: decode_tree(model, drafter, x, max_new, spec, (), graphs),
                                                 "plain")
        if host_loop:
            runs[f"tree{spec_name(spec)}_host"] = (lambda spec=spec: tree_loop(model, drafter, x, max_new, spec, (), graphs),
                                                   "plain")
    rng = torch.Generator("cuda").manual_seed(0)
    for temp in (t for t in temperatures if t > 0):  # sampled cycles against plain sampling (top-p 1)
        base = f"plain_t{temp:g}"
        runs[base] = (lambda temp=temp: decode_plain(model, x, max_new, (), graphs, temp, generator=rng), base)
        for spec in specs:
            runs[f"tree{spec_name(spec)}_device_t{temp:g}"] = (lambda spec=spec, temp=temp: decode_tree(
                model, drafter, x, max_new, spec, (), graphs, temp, generator=rng), base)
    for name, (run, base) in runs.items():
        t = time.perf_counter()
        run()  # compilation and capture
        res[name + "_warmup_s"] = round(time.perf_counter() - t, 1)
        gen = min((run() for _ in range(3)), key=lambda g: g.seconds)
        cycles = max(len(gen.accept_lengths), 1)
        r = {"tokens": len(gen.tokens), "ms_per_token": round(1e3 * (gen.seconds - gen.prefill_seconds) / len(gen.tokens), 4)}
        if gen.accept_lengths:
            r.update(cycles=cycles, tau=round(sum(gen.accept_lengths) / cycles, 3),
                     cycle_ms=round(1e3 * (gen.seconds - gen.prefill_seconds) / cycles, 4),
                     draft_ms=round(1e3 * gen.draft_seconds / cycles, 4), verify_ms=round(1e3 * gen.verify_seconds / cycles, 4))
            r["cycle_over_step"] = round(r["cycle_ms"] / res[base]["ms_per_token"], 3)
        res[name] = r
        print(" ", name, json.dumps(r), flush=True)  # as it comes: a run cut short still leaves its figures in the log
    if profile:  # the one-token target step and every captured tree step, replayed once more under the profiler
        # (with its last inputs: the same slots; decode_plain's self-advancing loop is left out, a replay would
        # step past its cache)
        res["profile"] = {step_name(key): kernel_profile(graph.replay, top_n=25)
                          for key, (_, graph, _) in graphs.entries.items() if key == ("plain", 1) or key[0] in TREE_STEPS}
    return res


TREE_STEPS = ("tree-draft", "tree-verify")


def step_name(key: tuple) -> str:
    """A Graphs key of step_times or decode_tree as text: step, tree shape, draws, temperature."""
    if key[0] not in TREE_STEPS:
        return f"target step, {key[1]} rows"
    spec = key[1]
    temp = key[key.index("sampled") + 1] if "sampled" in key else 0.0
    return f"{key[0]} {spec_name(spec)} {spec.draws_at(temp)} T={temp:g}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="compiled,triton_torch_commit,triton,triton_unsplit")
    ap.add_argument("--specs", default="8x6x48,1x5x5", help="tree shapes topk x steps x nodes (1xKxK: a chain of K drafts"
                    " on the device-resident cycle, the same tokens and accept lengths as decode_chain K)")
    ap.add_argument("--chain", type=int, default=5, help="drafts of the chain (decode_chain) timed alongside")
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--rows", default="1,8,16,17,32,49,64", help="target pass sizes to time")
    ap.add_argument("--host-loop", action="store_true", help="also time the host-driven loop (tree_loop)")
    ap.add_argument("--temperatures", default="0", help="also time plain sampling and the sampled cycles at each T > 0")
    ap.add_argument("--profile", action="store_true", help="kernel profile of the one-token target step and every captured tree step")
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v != "compiled" and v not in TRITON_VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: compiled or one of {sorted(TRITON_VARIANTS)} (h200_run.TRITON_VARIANTS)")
    torch.manual_seed(0)
    model = random_model(SMOLLM2)
    drafter = Eagle3Drafter(DraftConfig.from_target(SMOLLM2, 32000)).cuda().to(torch.bfloat16).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(0, 0.02)
    drafter.optimize("inductor")  # as bench: the drafting steps and the verify cycle's acceptance and catch-up compiled
    model.setup_caches(1, 1024)
    drafter.setup_caches(1, 1024)
    specs = [TreeSpec(*(int(v) for v in t.split("x"))) for t in a.specs.split(",")]
    rows = tuple(int(n) for n in a.rows.split(","))
    res = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "device": torch.cuda.get_device_name(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "specs": a.specs, "chain": a.chain,
           "torch": torch.__version__}
    for variant in variants:
        t = time.perf_counter()
        try:
            optimize_for(model, variant)
            with torch.no_grad():
                res[variant] = measure(model, drafter, specs, a.chain, a.max_new, rows, a.host_loop,
                                       tuple(float(t) for t in a.temperatures.split(",")), a.profile)
        except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
            res[variant] = {"error": repr(e)[:500]}
        res[variant]["setup_and_measure_s"] = round(time.perf_counter() - t, 1)
        print(variant, json.dumps(res[variant]), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
