"""What one compiled decoder layer of the SmolLM2 shape becomes on this device: inductor's generated
code for a decode step (1 token) and a verify pass (8 tokens) over a 2,048-slot cache, and the
kernels a captured step launches, in order. For engine work (issue #3): which ops become which
kernels, and which copies the step makes.

    python benchmarks/layer_code.py --out $OUT     # writes layer_code.txt and layer_kernels.json
"""

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from draftsmith.cudagraph import Graphs  # noqa: E402
from draftsmith.target import ModelArgs, Transformer  # noqa: E402

SHAPE = ModelArgs(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=2, num_heads=9, num_kv_heads=3,
                  head_dim=64, rope_theta=100000.0, max_position_embeddings=2048, tie_word_embeddings=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/out")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    code = out / "layer_code.txt"
    handler = logging.FileHandler(code, mode="w")
    torch._logging.set_logs(output_code=True)
    logging.getLogger("torch._inductor").addHandler(handler)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    model = Transformer(SHAPE).to(a.device, dtype).eval().requires_grad_(False)
    model.setup_caches(1, 2048)
    model.optimize("inductor")
    graphs = Graphs(a.device.startswith("cuda"))
    res = {"device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu", "torch": torch.__version__}
    with torch.no_grad():
        for T in (1, 8):
            tokens = torch.arange(T, device=a.device)[None] + 5
            pos = torch.arange(T, device=a.device) + 100

            def run():
                return graphs(("layer_code", T), lambda t, p: model(t, p).hidden, tokens, pos)

            for _ in range(3):
                run()
            from torch.profiler import ProfilerActivity, profile
            acts = [ProfilerActivity.CUDA] if a.device.startswith("cuda") else [ProfilerActivity.CPU]
            with profile(activities=acts) as prof:
                run()
                if a.device.startswith("cuda"):
                    torch.cuda.synchronize()
            events = [e for e in prof.events() if e.device_type.name == ("CUDA" if a.device.startswith("cuda") else "CPU")]
            res[f"T{T}"] = [[e.name[:120], round(e.device_time if hasattr(e, "device_time") else 0, 2)] for e in events]
    handler.close()
    (out / "layer_kernels.json").write_text(json.dumps(res, indent=1))
    print(json.dumps({k: (len(v) if isinstance(v, list) else v) for k, v in res.items()}))


if __name__ == "__main__":
    main()
