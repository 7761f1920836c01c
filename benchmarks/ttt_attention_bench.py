"""Why the compiled flex TTT attention's forward took 107 ms of a 465 ms SmolLM2 training step on the H200
(run 7's profile, train.json train_profile) while its backward took 25 ms: time one TTT depth's attention
(forward, and forward + backward) at the training shape, step by step (keys of 1..depth steps), for
variants that each change one thing: static vs dynamic compilation, packed segments vs one segment per
row, the materialised (eager) path, and "split" (flex over step 0's keys with one block mask a pack, the
later steps' own keys merged in by log-sum-exp). Writes $OUT/ttt_attention_bench.json.

    python benchmarks/ttt_attention_bench.py --out $OUT
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import draftsmith.draft as D  # noqa: E402
from torch.nn.attention.flex_attention import flex_attention  # noqa: E402


def timed(fn, reps: int, device: str) -> float:
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def segments(B: int, T: int, packed: bool, device: str) -> torch.Tensor:
    """(B, T) segment ids: rows of a few samples (lengths as greedy packing leaves them), or one each."""
    if not packed:
        return torch.zeros(B, T, dtype=torch.long, device=device)
    g = torch.Generator().manual_seed(0)
    seg = torch.empty(B, T, dtype=torch.long)
    for b in range(B):
        cuts = sorted(torch.randint(1, T, (3,), generator=g).tolist())
        edges = [0, *cuts, T]
        for i in range(4):
            seg[b, edges[i]:edges[i + 1]] = i
    return seg.to(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2000, help="T: a pack's length (2000: not a multiple of 128, as most)")
    ap.add_argument("--depth", type=int, default=7)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev, B, T, h, kv, Dh = a.device, a.rows, a.tokens, 9, 3, 64  # SmolLM2's drafter heads
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "shape": {"rows": B, "T": T, "heads": h, "kv_heads": kv, "head_dim": Dh, "depth": a.depth}}
    g = torch.Generator(dev).manual_seed(0)
    q = torch.randn(B, h, T, Dh, device=dev, dtype=dtype, generator=g, requires_grad=True)
    ks = [torch.randn(B, kv, T, Dh, device=dev, dtype=dtype, generator=g, requires_grad=True) for _ in range(a.depth)]
    vs = [torch.randn(B, kv, T, Dh, device=dev, dtype=dtype, generator=g, requires_grad=True) for _ in range(a.depth)]
    variants = {
        "flex_dynamic_packed": (torch.compile(flex_attention, dynamic=True), True),
        "split_dynamic_packed": ("split", True),  # what attn_impl="split" runs: flex over K0, the rest merged in
        "flex_static_packed": (torch.compile(flex_attention, dynamic=False), True),
        "flex_dynamic_one_segment": (torch.compile(flex_attention, dynamic=True), False),
        "eager_packed": (None, True),
    }
    for name, (fn, packed) in variants.items():
        seg = segments(B, T, packed, dev)
        rep = h // kv
        allowed = (torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None] & (seg[:, :, None] == seg[:, None, :]))[:, None]

        base = D.broadcast_block_mask(D.causal_segment_mask_mod(seg), B, T, T, dev) if fn == "split" else None

        def attend(j):
            if fn == "split":
                return D.ttt_attention_split(q, ks[: j + 1], vs[: j + 1], base)
            if fn is None:
                return D.ttt_attention_eager(q, [k.repeat_interleave(rep, 1) for k in ks[: j + 1]],
                                             [v.repeat_interleave(rep, 1) for v in vs[: j + 1]], allowed)
            k, v = torch.cat(ks[: j + 1], dim=2), torch.cat(vs[: j + 1], dim=2)
            mask = D.broadcast_block_mask(D.ttt_mask_mod(seg, k.shape[2]), B, T, k.shape[2], q.device)
            with torch._dynamo.config.patch(recompile_limit=64):
                return fn(q, k, v, block_mask=mask, enable_gqa=True)

        def forward():
            with torch.no_grad():
                for j in range(a.depth):
                    attend(j)

        def forward_backward():
            total = sum(attend(j).float().square().mean() for j in range(a.depth))
            total.backward()

        try:
            t0 = time.perf_counter()
            forward_backward()  # compiles
            forward()
            res[name] = {"compile_and_first_s": round(time.perf_counter() - t0, 1),
                         "forward_ms": round(1e3 * timed(forward, a.reps, dev), 2),
                         "forward_backward_ms": round(1e3 * timed(forward_backward, a.reps, dev), 2)}
        except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
            res[name] = {"error": repr(e)[:400]}
        print(name, res[name], flush=True)
        Path(a.out).mkdir(parents=True, exist_ok=True)  # after every variant: a call cut short keeps what ran
        (Path(a.out) / "ttt_attention_bench.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
