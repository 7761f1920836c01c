"""How far apart two correct bf16 passes of a Llama-3.1-8B-shaped layer are, on the CPU: the basis of
the 8B-layer GPU test's tolerance (tests/test_kernels.py). One random layer (4096 wide, 32 heads of
128, 8 kv heads, 14336 MLP) with a random cache, 8 query tokens at slots 300..307:

- the Triton kernels in fp32 (under Triton's interpreter) against the torch layer in fp32: the
  kernels' logic at this shape;
- the torch layer in bf16 against the same layer in fp32 (the same bf16-rounded weights, cache
  and input): how far one bf16 pass is from exact.

    python benchmarks/kernel_precision_8b.py --out benchmarks/results/logs/kernel-precision-8b-cpu.json   (~6 min)
    python benchmarks/kernel_precision_8b.py --split 0 --out ...   (attention unsplit)
"""

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before kernels.py is imported
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from draftsmith import kernels  # noqa: E402
from draftsmith.bench import git_commit  # noqa: E402
from draftsmith.target import causal_mask  # noqa: E402
from helpers import tiny_native  # noqa: E402

SHAPE = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
             max_position_embeddings=1024)


def layer_out(model, x, pos, cache):
    layer = model.layers[0]
    layer.self_attn.kv_cache.k.copy_(cache[0])
    layer.self_attn.kv_cache.v.copy_(cache[1])
    cos, sin = model.rotary(pos[None], x.dtype)
    return layer(x, cos, sin, pos, causal_mask(pos, 1024)).float()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--split", type=int, default=kernels.Tuning().split, help="Tuning.split (0: attention unsplit)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    t0 = time.perf_counter()
    model = tiny_native(layers=1, **SHAPE).optimize()
    model.setup_caches(1, 1024)
    g = torch.Generator().manual_seed(0)
    cache = [torch.randn(model.layers[0].self_attn.kv_cache.k.shape, generator=g) for _ in range(2)]
    pos = torch.arange(300, 300 + a.tokens)
    x = torch.randn(1, a.tokens, 4096, generator=g)
    ref = layer_out(model, x, pos, cache)
    layer = model.layers[0]
    cos, sin = model.rotary(pos[None], x.dtype)
    layer.self_attn.kv_cache.k.copy_(cache[0])
    layer.self_attn.kv_cache.v.copy_(cache[1])
    tuning = kernels.Tuning(split=a.split)
    out = kernels.layer_forward(layer, x, cos, sin, pos, causal_mask(pos, 1024), tuning).float()
    largest = ref.abs().max().item()
    res = {"command": shlex.join(["python", *sys.argv]), "commit": git_commit(), "tokens": a.tokens, "tuning": repr(tuning),
           "fp32_kernels_vs_torch_max_abs": (out - ref).abs().max().item(), "fp32_largest_output": largest}
    m16 = model.to(torch.bfloat16)
    m16.setup_caches(1, 1024)
    r16 = layer_out(m16, x.bfloat16(), pos, [c.bfloat16() for c in cache])
    m32 = m16.float()  # the bf16-rounded weights, in fp32
    m32.setup_caches(1, 1024)
    r32 = layer_out(m32, x.bfloat16().float(), pos, [c.bfloat16().float() for c in cache])
    res.update(bf16_torch_vs_fp32_max_abs=(r16 - r32).abs().max().item(), bf16_largest_output=r32.abs().max().item())
    res["fp32_kernels_rel"] = res["fp32_kernels_vs_torch_max_abs"] / largest
    res["bf16_torch_rel"] = res["bf16_torch_vs_fp32_max_abs"] / res["bf16_largest_output"]
    res["seconds"] = round(time.perf_counter() - t0, 1)
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
