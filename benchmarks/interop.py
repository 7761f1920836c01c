"""Interop benchmark: plant every known fault in a tiny export, run `check`, count what it catches;
round-trip a tiny drafter sglang -> ours -> vllm -> ours and report the largest logit difference.

    python benchmarks/interop.py            # writes benchmarks/results/interop.json

CPU, a random 8-layer Llama target built on the fly, seconds. The last stdout line is the JSON.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tiny stand-in models the tests use

from conftest import make_hf_model, make_tokenizer, save_hf_folder  # noqa: E402
from helpers import tiny_drafter  # noqa: E402

from draftsmith.check import FAULTS, CheckConfig, inspect  # noqa: E402
from draftsmith.export import export_sglang, export_vllm, load_export, load_vllm_export  # noqa: E402
from draftsmith.target import ModelArgs, Transformer, hf_to_native  # noqa: E402

LAYERS, DRAFT_VOCAB = 8, 100


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def tiny_target(folder: Path):
    hf = make_hf_model(layers=LAYERS)
    save_hf_folder(folder, hf, make_tokenizer())
    model = Transformer(ModelArgs.from_hf(hf.config.to_dict())).eval()
    model.load_state_dict(hf_to_native(hf.state_dict()), strict=False)
    return model, hf.config.to_dict()


def write(fmt: str, drafter, out: Path, hf_config: dict, target_dir: Path) -> Path:
    if fmt == "sglang":
        return export_sglang(drafter, out, hf_config)
    return export_vllm(drafter, out, hf_config, verifier=str(target_dir))


def plant_all(drafter, hf_config, target_dir: Path, work: Path) -> dict:
    rows = {}
    for name, (fmt, plant, code) in FAULTS.items():
        folder = write(fmt, drafter, work / name, hf_config, target_dir)
        plant(folder)
        result = inspect(CheckConfig(str(folder), str(target_dir), live=False))
        codes = sorted({f.code for f in result.errors})
        rows[name] = {"format": fmt, "expected": code, "caught": code in codes and not result.ok, "errors": codes}
    return rows


def logits(drafter):
    torch.manual_seed(0)
    ids, aux = torch.randint(0, drafter.cfg.vocab_size, (2, 16)), torch.randn(2, 16, 3 * drafter.cfg.target_hidden_size)
    with torch.no_grad():
        return [drafter.logits(o) for o in drafter.ttt(ids, aux, depth=3)]


def roundtrip(drafter, hf_config, target_dir: Path, work: Path) -> float:
    embed = drafter.embed_tokens.weight
    export_sglang(drafter, work / "rt-sglang", hf_config)
    ours, _ = load_export(work / "rt-sglang", embed)
    export_vllm(ours, work / "rt-vllm", hf_config, verifier=str(target_dir))
    back, _ = load_vllm_export(work / "rt-vllm", embed)
    return max(float((a - b).abs().max()) for a, b in zip(logits(drafter), logits(back)))


def speculators_status() -> bool | str:
    try:
        import speculators  # noqa: F401
    except ImportError:
        return "not installed: optional, it pulls a ~6 GB CUDA torch (REFERENCE.md §6); tests/test_interop.py skips"
    return True


def main() -> dict:
    work = Path(tempfile.mkdtemp(prefix="draftsmith-interop-"))
    try:
        model, hf_config = tiny_target(work / "target")
        drafter = tiny_drafter(model, draft_vocab=DRAFT_VOCAB)
        good = {fmt: inspect(CheckConfig(str(write(fmt, drafter, work / f"good-{fmt}", hf_config, work / "target")),
                                         str(work / "target"), max_new_tokens=16)) for fmt in ("sglang", "vllm")}
        rows = plant_all(drafter, hf_config, work / "target", work)
        diff = roundtrip(drafter, hf_config, work / "target", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    status = speculators_status()
    return {
        "command": "python benchmarks/interop.py",
        "commit": commit(),
        "target": f"random Llama, {LAYERS} layers, hidden 64, vocab 320; drafter draft vocab {DRAFT_VOCAB}",
        "planted_faults": len(rows),
        "faults_caught": sum(r["caught"] for r in rows.values()),
        "faults": rows,
        "good_exports_pass": {fmt: r.ok for fmt, r in good.items()},
        "good_exports_first_accept": {fmt: r.first_accept for fmt, r in good.items()},
        "roundtrip": "sglang -> ours -> vllm -> ours, fp32, 3 TTT steps",
        "roundtrip_max_abs_diff": diff,
        "speculators_loaded": status is True,
        **({} if status is True else {"speculators_reason": status}),
    }


if __name__ == "__main__":
    result = main()
    out = ROOT / "benchmarks" / "results" / "interop.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    for name, row in result["faults"].items():
        print(f"{name:<30} {'caught' if row['caught'] else 'MISSED':<7} {row['errors']}")
    print(json.dumps(result))
