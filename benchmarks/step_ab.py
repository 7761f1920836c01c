"""A/B of aae40e0's "fewer kernels a decode step": the CUDA-graph-captured plain greedy step, new form against old,
on one random-weight target (bf16, triton_default engine) in one process. new: decode.next_token_step (slot pos
itself, bf16 rotary tables, kept mask slots, the greedy token in the lm_head's own pass). old, emulated on the same
model: slots pos + arange(1), fp32 rotary rows cast (Rotary.cast emptied), the mask's arange made each pass
(model.slots None), logits then torch argmax. After a 128-token prompt, blocks of --steps replays from slot 300
alternate new, old, ... (round 0 dropped); median of --reps blocks a form. Also kernels a step (one profiled
replay) and each form's token from the same cache state, which must agree.

    python benchmarks/step_ab.py --out $OUT [--shapes smollm2,llama8b] [--reps 7] [--steps 64]
"""

import argparse
import contextlib
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith.cudagraph import Graphs  # noqa: E402
from draftsmith.decode import next_token_step  # noqa: E402
from h200_run import (LLAMA8B, SMOLLM2, device_name, dump, git_commit, kernel_profile, optimize_for,  # noqa: E402
                      random_model, timed)

SHAPES = {"smollm2": SMOLLM2, "llama8b": LLAMA8B}
ENGINE = "triton_default"  # h200_run.optimize_for variant: kernels.Tuning()'s Triton kernels
PROMPT, START, SLOTS = 128, 300, 1024  # prompt tokens at slots 0..127; every block decodes from slot 300 (as step_times)


def feed(nxt, tok, pos, out):
    """decode_plain's advance after the step: out[pos] = nxt, which is the next step's token at pos + 1."""
    out.index_copy_(0, pos, nxt)
    tok.copy_(nxt[None])
    pos.add_(1)


@contextlib.contextmanager
def old_paths(model):
    """The model's rotary and mask paths before aae40e0: no cast tables, no kept slots (restored after)."""
    cast, slots = model.rotary.cast, model.slots
    model.rotary.cast, model.slots = {}, None
    try:
        yield
    finally:
        model.rotary.cast, model.slots = cast, slots


def forms(model) -> dict:
    """name -> (advance(tok (1, 1), pos (1,), out (max_len,)), the context it is captured and replayed in)."""
    step = next_token_step(model)

    def new(tok, pos, out):
        feed(step(tok, pos), tok, pos, out)

    def old(tok, pos, out):
        h = model(tok, pos + torch.arange(1, device=pos.device)).hidden
        feed(model.logits(h[:, -1]).argmax(-1), tok, pos, out)
    return {"new": (new, contextlib.nullcontext), "old": (old, lambda: old_paths(model))}


def kernels_a_step(run) -> dict:
    """h200_run.kernel_profile of run, and the kernels not Triton's (draftsmith.kernels' or inductor's): name -> count."""
    import triton
    from draftsmith import kernels
    ours = {n for n, f in vars(kernels).items() if isinstance(f, triton.runtime.jit.JITFunction)}
    prof = kernel_profile(run, top_n=100_000)
    other = {k: v[0] for k, v in prof.pop("top").items() if k not in ours and not k.startswith("triton_")}
    return {**prof, "non_triton": other}


@torch.no_grad()
def ab(model, steps: int, reps: int, profile=kernels_a_step) -> dict:
    dev = model.embed_tokens.weight.device
    model.setup_caches(1, SLOTS)
    model(torch.randint(0, model.args.vocab_size, (1, PROMPT), device=dev), torch.arange(PROMPT, device=dev))
    start = (torch.randint(0, model.args.vocab_size, (1, 1), device=dev), torch.tensor([START], device=dev),
             torch.zeros(model.max_len, dtype=torch.long, device=dev))
    graphs, fs = Graphs(dev.type == "cuda"), forms(model)

    def load(name):  # the form's token, slot and output buffers back to `start` (captured on first use) -> output
        with fs[name][1]():
            return graphs.start(name, fs[name][0], *start)[2]

    def replay(name, n=1):
        with fs[name][1]():
            for _ in range(n):
                graphs.replay(name)

    outs, first, blocks = {name: load(name) for name in fs}, {}, {name: [] for name in fs}
    for name in fs:  # one step of each from the same cache state
        load(name)
        replay(name)
        first[name] = int(outs[name][START])
    for r in range(reps + 1):  # round 0 warms up (a graph's first replays) and is dropped
        for name in fs:  # alternating, so that drift falls on both forms alike
            load(name)
            s = timed(lambda: replay(name, steps), reps=1)
            if r:
                blocks[name].append(round(s / steps * 1e3, 5))
    res = {f"{name}_step_ms": round(statistics.median(blocks[name]), 5) for name in fs}
    agree = int((outs["new"][START:START + steps] == outs["old"][START:START + steps]).sum())  # the last block's
    res.update(saved_us=round((res["old_step_ms"] - res["new_step_ms"]) * 1e3, 2), same_token=first["new"] == first["old"],
               first_tokens=first, same_block_tokens=f"{agree}/{steps}")
    for name in fs:
        load(name)
        with fs[name][1]():
            prof = profile(lambda: graphs.replay(name))
        res.update({f"{name}_kernels": prof.pop("kernels"), f"{name}_profile": prof})
    return {**res, **{f"{name}_block_ms": blocks[name] for name in fs}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default="smollm2,llama8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=7, help="timed blocks a form (the median is reported)")
    ap.add_argument("--steps", type=int, default=64, help="replays a block")
    a = ap.parse_args()
    shapes = [s for s in a.shapes.split(",") if s]
    if unknown := [s for s in shapes if s not in SHAPES]:
        ap.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    if START + a.steps > SLOTS:
        ap.error(f"--steps must be at most {SLOTS - START} (a block decodes slots {START}.. of {SLOTS})")
    if not torch.cuda.is_available():
        sys.exit("step_ab.py times CUDA-graph replays: it needs a CUDA GPU, and none is available")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join(sys.argv), "commit": git_commit(), "device": device_name("cuda"), "engine": ENGINE,
           "steps": a.steps, "reps": a.reps}
    for name in shapes:
        model = random_model(SHAPES[name])
        optimize_for(model, ENGINE)
        res[name] = r = ab(model, a.steps, a.reps)
        del model
        torch.cuda.empty_cache()
        dump(Path(a.out), "step-ab.json", res)
        print(f"{name}: new {r['new_step_ms']:.4f} ms/step, old {r['old_step_ms']:.4f}, saved {r['saved_us']:.1f} us; kernels"
              f" {r['new_kernels']} vs {r['old_kernels']}; same token {r['same_token']} (block {r['same_block_tokens']})", flush=True)
    if bad := [name for name in shapes if not res[name]["same_token"]]:
        sys.exit(f"the new and old steps picked different tokens from the same cache state: {bad}")


if __name__ == "__main__":
    main()
