"""Import EAGLE-3 drafters trained elsewhere into our Eagle3Drafter and trained-checkpoint folder.

    draftsmith import --source yuhuili/EAGLE3-LLaMA3.1-Instruct-8B --target T --out runs/imported
    draftsmith bench --target T --drafter runs/imported --prompts mt_bench.jsonl

Layouts read (REFERENCE.md §1, the export.py docstring):
- EAGLE / SpecForge / SGLang: config.json with architectures LlamaForCausalLMEagle3, weights in
  model.safetensors (or shards) or pytorch_model.bin, names midlayer.* or layers.0.* (with or
  without "model."), embed_tokens optional, d2t / t2d possibly missing.
- vLLM's speculators format: config.json with speculators_model_type "eagle3", a folder or a
  single .safetensors file beside its config.json.
Loading never executes code: safetensors, or torch.load(weights_only=True) for .bin / .pt; any
other file, or a pickle that needs more than tensors, is refused with the file and the fix.
Aux-layer ids are read the way the format's engine reads them (SGLang: eagle_config ids are
layer outputs; vLLM / speculators: top-level ids are layer inputs, so output = id - 1).
"""

from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftsmith.draft import DraftConfig, Eagle3Drafter, load_drafter
from draftsmith.export import draft_config_from_speculators, from_speculators_names, save_trained, sglang_shapes

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
VARIANT_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # all False in our drafter


class InteropError(ValueError):
    """A foreign checkpoint that cannot be read safely or does not fit our drafter."""


@dataclass(frozen=True)
class ImportConfig:
    source: str  # a folder (config.json + weights) or a speculators .safetensors file
    target: str  # the target the drafter serves: supplies its layer count and embedding
    out: str  # our trained-checkpoint folder (drafter.safetensors + draft_config.json)

    def __post_init__(self):
        if not self.source or not self.target or not self.out:
            raise ValueError("ImportConfig needs a source, a target and an out folder")


@dataclass
class ImportResult:
    out: Path
    layout: str  # "eagle3" or "speculators"
    weights: list[str]  # files read
    aux_layer_ids: tuple[int, ...]  # target layer OUTPUTS the drafter reads (ours)
    notes: list[str] = field(default_factory=list)


@dataclass
class Foreign:
    """A checkpoint read from disk, names normalised to ours (midlayer.*), nothing interpreted yet."""
    config: dict
    layout: str
    tensors: dict[str, torch.Tensor]
    files: list[Path]
    names: list[str]  # as stored in the file, before normalising


# --------------------------------------------------------------------------- reading files safely


def read_tensor_file(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error types for truncated headers/data
            raise InteropError(f"{path} is not a readable safetensors file ({e}); re-download or re-save it") from e
    if path.suffix in (".bin", ".pt", ".pth"):
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as e:
            raise InteropError(
                f"{path} is a pickle that torch.load(weights_only=True) refuses: loading it would run code. "
                f"If you trust it, convert it once yourself to safetensors (torch.load it, then "
                f"safetensors.torch.save_file(state_dict, 'model.safetensors')) and import that. ({e})") from e
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise InteropError(f"{path} does not hold a flat state dict of tensors; save one with save_file and retry")
        return dict(state)
    raise InteropError(f"{path}: only .safetensors and weights-only .bin/.pt files are read; convert it to safetensors")


def weight_files(folder: Path) -> list[Path]:
    for pattern in ("model.safetensors", "*.safetensors", "pytorch_model.bin", "*.bin", "*.pt"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    others = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != "config.json")
    raise InteropError(f"{folder} has no weights (model.safetensors or pytorch_model.bin); found {others}")


def normalise_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """model.X -> X, layers.0.* -> midlayer.* (SpecForge, speculators) so every layout reads as ours."""
    out = {}
    for k, v in tensors.items():
        k = k.removeprefix("model.")
        out[k] = v
    return from_speculators_names(out)


def layout_of(config: dict, where) -> str:
    if config.get("speculators_model_type") or "speculators_config" in config:
        if config.get("speculators_model_type", "eagle3") != "eagle3":
            raise InteropError(f"{where}: speculators_model_type {config['speculators_model_type']!r} is not eagle3")
        return "speculators"
    if any(a in EAGLE3_ARCHITECTURES for a in config.get("architectures") or []):
        return "eagle3"
    raise InteropError(f"{where}: architectures {config.get('architectures')} is not an EAGLE-3 drafter "
                       f"({', '.join(EAGLE3_ARCHITECTURES)} or a speculators eagle3 config)")


def read_foreign(source) -> Foreign:
    """config.json + weights of a folder, or a single speculators .safetensors file and its config."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source} not found: give a drafter folder or a .safetensors file")
    folder = source.parent if source.is_file() else source
    if not (folder / "config.json").exists():
        raise InteropError(f"{folder} has no config.json; the drafter's shape cannot be known without it")
    config = json.loads((folder / "config.json").read_text())
    files = [source] if source.is_file() else weight_files(folder)
    tensors = {}
    for f in files:
        tensors.update(read_tensor_file(f))
    return Foreign(config, layout_of(config, folder / "config.json"), normalise_names(tensors), files, sorted(tensors))


# --------------------------------------------------------------------------- interpreting them


def variant_flags(config: dict) -> dict[str, bool]:
    """The flags a config sets, top level or inside eagle_config (vLLM reads both for norm_before_fc)."""
    inner = config.get("eagle_config") or {}
    return {k: bool(inner.get(k, config.get(k))) for k in VARIANT_FLAGS if k in config or k in inner}


def aux_outputs(config: dict, layout: str, n: int) -> tuple[int, ...]:
    """Target layer outputs the format's own engine feeds the drafter."""
    ours = (config.get("draftsmith") or {}).get("aux_layer_outputs")
    if ours:
        return tuple(ours)
    sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if layout == "eagle3" and sglang_ids:
        return tuple(sglang_ids)
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    if vllm_ids:
        return tuple(i - 1 for i in vllm_ids)
    return (1, n // 2 - 1, n - 4)  # both engines' default: inputs of 2, N//2, N-3


def draft_config_of(config: dict, layout: str, target_cfg: dict) -> DraftConfig:
    n, V = target_cfg["num_hidden_layers"], target_cfg["vocab_size"]
    if layout == "speculators":
        layer = config["transformer_layer_config"]
        c = {**config, "transformer_layer_config": {**layer, "vocab_size": layer.get("vocab_size") or V}}
        cfg = draft_config_from_speculators(c, n)
        return DraftConfig(**{**cfg.to_dict(), "aux_layer_ids": aux_outputs(config, layout, n), "target_num_layers": n})
    heads = config["num_attention_heads"]
    return DraftConfig(
        hidden_size=config["hidden_size"], target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
        intermediate_size=config["intermediate_size"], num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads, vocab_size=config.get("vocab_size") or V,
        draft_vocab_size=config.get("draft_vocab_size") or config.get("vocab_size") or V,
        aux_layer_ids=aux_outputs(config, layout, n), target_num_layers=n,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6), rope_theta=float(config.get("rope_theta") or 10000.0),
        rope_scaling=config.get("rope_scaling"), max_position_embeddings=config.get("max_position_embeddings", 4096),
    )


def complete_vocab(tensors: dict, cfg: DraftConfig, notes: list[str]):
    """Fill a missing d2t or t2d from the other one; refuse when the mapping cannot be known."""
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None and t2d is None:
        if Vd != V:
            raise InteropError(f"the checkpoint has neither d2t nor t2d but a draft vocab of {Vd} < {V}: "
                               "which target token each draft id stands for is unknown")
        tensors["d2t"], tensors["t2d"] = torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool)
        notes.append("no d2t/t2d: full vocabulary, identity mapping")
    elif d2t is None:
        ids = t2d.bool().nonzero().squeeze(1)  # ascending: the draft vocab order every tool uses
        tensors["d2t"] = ids - torch.arange(len(ids))
        notes.append("d2t rebuilt from t2d (ascending target ids)")
    elif t2d is None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t.long()] = True
        tensors["t2d"] = t2d
        notes.append("t2d rebuilt from d2t")
    tensors["d2t"], tensors["t2d"] = tensors["d2t"].long(), tensors["t2d"].bool()
    ids = torch.arange(Vd) + tensors["d2t"]
    if ids.min() < 0 or ids.max() >= V or len(ids.unique()) != Vd:
        raise InteropError("d2t does not map the draft vocab onto distinct target ids; it may hold ids, not offsets")


def to_drafter(foreign: Foreign, target_cfg: dict, embed: torch.Tensor | None) -> tuple[Eagle3Drafter, list[str]]:
    flags = {k: v for k, v in variant_flags(foreign.config).items() if v}
    if flags:
        raise InteropError(f"variant flags {flags} change the drafter's function; draftsmith's drafter implements "
                           "none of them, so importing would change what the checkpoint computes")
    cfg = draft_config_of(foreign.config, foreign.layout, target_cfg)
    notes: list[str] = []
    tensors = dict(foreign.tensors)
    own_embed = tensors.pop("embed_tokens.weight", None)
    complete_vocab(tensors, cfg, notes)
    shapes = sglang_shapes(cfg)
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise InteropError(f"tensors our drafter has no place for (bias or another variant?): {extra}")
    wrong = {k: (tuple(v.shape), shapes[k]) for k, v in tensors.items() if tuple(v.shape) != shapes[k]}
    if wrong:
        raise InteropError(f"shapes (file, config) disagree: {wrong}")
    tensors = {k: v if k in ("d2t", "t2d") else v.float() for k, v in tensors.items()}
    if own_embed is not None:
        notes.append("embed_tokens taken from the checkpoint")
    return load_drafter(tensors, cfg, own_embed.float() if own_embed is not None else embed), notes


def target_embedding(target: str) -> tuple[dict, torch.Tensor]:
    """The target's HF config and input embedding, read without building the model."""
    from safetensors import safe_open

    from draftsmith.target import resolve_target

    folder = resolve_target(target)
    cfg = json.loads((folder / "config.json").read_text())
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            for name in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if name in h.keys():
                    return cfg, h.get_tensor(name).float()
    raise InteropError(f"{folder}: no embed_tokens.weight in its safetensors files")


def load_foreign(source, target: str) -> tuple[Eagle3Drafter, Foreign, list[str]]:
    """The drafter a foreign checkpoint holds, as the format's engine would run it for `target`."""
    target_cfg, embed = target_embedding(target)
    foreign = read_foreign(source)
    drafter, notes = to_drafter(foreign, target_cfg, embed)
    return drafter, foreign, notes


def run(config: ImportConfig) -> ImportResult:
    from draftsmith.common import write_config
    from draftsmith.target import resolve_target

    target_cfg, embed = target_embedding(config.target)
    foreign = read_foreign(config.source)
    drafter, notes = to_drafter(foreign, target_cfg, embed)
    info = {"path": str(resolve_target(config.target)), "hf_config": target_cfg,
            "imported_from": str(config.source), "layout": foreign.layout}
    out = save_trained(drafter.eval(), config.out, info)
    write_config(out, "import", config)
    return ImportResult(out=out, layout=foreign.layout, weights=[str(f) for f in foreign.files],
                        aux_layer_ids=drafter.cfg.aux_layer_ids, notes=notes)
