"""Bytes each kernel of the Llama-3.1-8B-shaped decode step streams over its profiled time: which kernels
fall short of the copy bandwidth (the engine profile's profile_T1, h200_run.py engine at 8c7a00e).

    python benchmarks/kernel_bandwidth.py benchmarks/results/logs/engine-8b-sweep-8c7a00e.json --out bw.json
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from h200_run import LLAMA8B  # noqa: E402  the shape the profile ran

m, BF16 = LLAMA8B, 2
H, D, LAYERS = m.hidden_size, m.head_dim, m.num_layers
WEIGHT_BYTES = {  # a kernel's weight bytes over all layers (one call a layer; _linear is o_proj and down_proj)
    "_qkv_rope_cache": LAYERS * (m.num_heads + 2 * m.num_kv_heads) * D * H * BF16,
    "_linear_residual": LAYERS * (m.num_heads * D * H + m.intermediate_size * H) * BF16,
    "_gate_up": LAYERS * 2 * m.intermediate_size * H * BF16,
    "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT": m.vocab_size * H * BF16,  # the lm_head (cuBLAS)
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log")
    ap.add_argument("--out")
    a = ap.parse_args()
    section = json.loads(Path(a.log).read_text())["llama8b_shape"]
    res = {"source": a.log, "copy_bandwidth_TBs": section["copy_bandwidth_TBs"], "variants": {}}
    for variant in ("triton", "triton_sweep"):
        top = section[variant]["profile_T1"]["top"]
        rows = {}
        for name, bytes_ in WEIGHT_BYTES.items():
            if name in top:
                calls, ms = top[name]
                rows[name] = {"calls": calls, "ms": ms, "GB": round(bytes_ / 1e9, 3), "TBs": round(bytes_ / (ms * 1e-3) / 1e12, 2)}
        res["variants"][variant] = rows
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
