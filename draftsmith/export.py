"""Export a trained drafter as the EAGLE-3 checkpoint that SGLang serves (REFERENCE.md §1).

    python -c "from draftsmith.export import ExportConfig, run; print(run(ExportConfig('runs/x/final', 'runs/x/sglang')).command)"

The output folder holds config.json (LlamaForCausalLMEagle3) and model.safetensors with the
drafter's own tensor names minus embed_tokens (the engine shares the target's). Every file is
read back and compared bit for bit before `run` returns.

Aux layer ids, read from the engines' sources:
- SGLang (model_runner.py) passes `eagle_config.eagle_aux_hidden_state_layer_ids` to the
  target's `set_eagle3_layers_to_capture`, which adds 1 and captures the residual stream
  *entering* layer id+1 (models/llama.py), i.e. the OUTPUT of layer id: our ids, unchanged.
- vLLM (eagle3_utils.get_eagle3_aux_layers_from_config) reads the TOP-LEVEL
  `eagle_aux_hidden_state_layer_ids` and captures the stream entering layer id, with no +1
  (models/llama.py): our ids + 1. Both engines' defaults agree: SGLang [2, N//2, N-3] and vLLM
  (2, N//2, N-3) are the inputs of those layers = outputs of 1, N//2-1, N-4.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.draft import DraftConfig, Eagle3Drafter, load_drafter

ARCHITECTURE = "LlamaForCausalLMEagle3"
SGLANG_COMMAND = ("python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                  "--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 1 "
                  "--speculative-num-draft-tokens 6")


class ExportError(ValueError):
    """An export that an engine would load wrongly or not at all."""


@dataclass(frozen=True)
class ExportConfig:
    checkpoint: str  # a draftsmith training output folder (drafter.safetensors + draft_config.json)
    out: str  # output folder
    format: str = "sglang"
    dtype: str = "bfloat16"  # the weights' dtype in the export (what SGLang serves)

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"export format {self.format!r} is not supported; choose one of {sorted(FORMATS)}")
        if not self.checkpoint or not self.out:
            raise ValueError("ExportConfig needs both a checkpoint and an out folder")


@dataclass
class ExportResult:
    out: Path
    tensors: dict[str, tuple[int, ...]]  # name -> shape, as written
    command: str  # how to serve it
    files: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------- the SGLang format


def sglang_shapes(cfg: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor LlamaForCausalLMEagle3 loads, with its shape (REFERENCE.md §1)."""
    H, Ht, I = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    m = "midlayer."
    return {
        "fc.weight": (H, 3 * Ht),
        m + "input_layernorm.weight": (H,),
        m + "hidden_norm.weight": (H,),
        m + "self_attn.q_proj.weight": (q, 2 * H),
        m + "self_attn.k_proj.weight": (kv, 2 * H),
        m + "self_attn.v_proj.weight": (kv, 2 * H),
        m + "self_attn.o_proj.weight": (H, q),
        m + "post_attention_layernorm.weight": (H,),
        m + "mlp.gate_proj.weight": (I, H),
        m + "mlp.up_proj.weight": (I, H),
        m + "mlp.down_proj.weight": (H, I),
        "norm.weight": (H,),
        "lm_head.weight": (cfg.draft_vocab_size, H),
        "d2t": (cfg.draft_vocab_size,),
        "t2d": (cfg.vocab_size,),
    }


def sglang_config(cfg: DraftConfig, target_config: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> dict:
    """config.json for the draft model. target_config (the target's HF config) is cross-checked."""
    n = cfg.target_num_layers
    if max(cfg.aux_layer_ids) >= n - 1:
        # both engines tap the stream entering a layer, so the last layer's output is never captured
        raise ExportError(f"aux layer {max(cfg.aux_layer_ids)} is the target's last layer (N={n}); "
                          "SGLang and vLLM can only capture outputs of layers 0..N-2")
    if target_config is not None:
        want = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.target_hidden_size, "num_hidden_layers": n}
        bad = {k: (target_config.get(k), v) for k, v in want.items() if target_config.get(k) != v}
        if bad:
            raise ExportError(f"drafter does not fit this target (target, drafter): {bad}")
    name = str(dtype).removeprefix("torch.")
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": name,
        "dtype": name,
        # SGLang: output of layer i (it adds 1 and taps the input of layer i+1)
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids), "use_aux_hidden_state": True},
        # vLLM: input of layer i (no +1), hence our output ids + 1
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
        "draftsmith": {"aux_layer_outputs": list(cfg.aux_layer_ids), "target_num_layers": n,
                       "target": {k: target_config.get(k) for k in ("_name_or_path", "model_type")} if target_config else None},
    }
    if cfg.rope_scaling:
        out["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.target_hidden_size != cfg.hidden_size:
        out["target_hidden_size"] = cfg.target_hidden_size
    return out


def draft_config_from_sglang(c: dict) -> DraftConfig:
    """Rebuild our DraftConfig from an exported config.json (standard keys + our aux record)."""
    ours = c.get("draftsmith") or {}
    return DraftConfig(
        hidden_size=c["hidden_size"], target_hidden_size=c.get("target_hidden_size", c["hidden_size"]),
        intermediate_size=c["intermediate_size"], num_heads=c["num_attention_heads"],
        num_kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"], vocab_size=c["vocab_size"],
        draft_vocab_size=c["draft_vocab_size"],
        aux_layer_ids=tuple(ours.get("aux_layer_outputs") or c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        target_num_layers=ours["target_num_layers"], rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
        rope_scaling=c.get("rope_scaling"), max_position_embeddings=c["max_position_embeddings"],
    )


def check_tensors(tensors: dict[str, torch.Tensor], cfg: DraftConfig, where: str):
    shapes = sglang_shapes(cfg)
    missing, extra = sorted(set(shapes) - set(tensors)), sorted(set(tensors) - set(shapes))
    if missing or extra:
        raise ExportError(f"{where}: tensor names differ from what SGLang loads: missing {missing}, unexpected {extra}")
    wrong = {k: (tuple(t.shape), shapes[k]) for k, t in tensors.items() if tuple(t.shape) != shapes[k]}
    if wrong:
        raise ExportError(f"{where}: shapes (file, config) disagree: {wrong}")
    if tensors["d2t"].dtype != torch.int64 or tensors["t2d"].dtype != torch.bool:
        raise ExportError(f"{where}: d2t must be int64 offsets and t2d bool, got {tensors['d2t'].dtype}, {tensors['t2d'].dtype}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


def export_sglang(drafter: Eagle3Drafter, out: Path, target_config: dict | None = None) -> Path:
    """Write config.json + model.safetensors, read both back and check them bit for bit."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.cfg
    tensors = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    check_tensors(tensors, cfg, "drafter")
    config = sglang_config(cfg, target_config, drafter.fc.weight.dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    back = load_file(out / "model.safetensors")
    check_tensors(back, cfg, str(out / "model.safetensors"))
    changed = [k for k in tensors if back[k].dtype != tensors[k].dtype or not torch.equal(_bits(back[k]), _bits(tensors[k]))]
    if changed:
        raise ExportError(f"{out}: tensors changed between write and read-back: {changed}")
    if draft_config_from_sglang(json.loads((out / "config.json").read_text())) != cfg:
        raise ExportError(f"{out / 'config.json'} does not describe the drafter it was written for")
    return out


def load_export(folder, embed: torch.Tensor | None = None) -> tuple[Eagle3Drafter, dict]:
    """Read an exported folder back into our drafter (fp32 parameters; embed_tokens from `embed`,
    else left at its random init, since the engine takes it from the target)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if config.get("architectures") != [ARCHITECTURE]:
        raise ExportError(f"{folder}: architectures {config.get('architectures')} is not [{ARCHITECTURE!r}]")
    cfg = draft_config_from_sglang(config)
    tensors = load_file(folder / "model.safetensors")
    check_tensors(tensors, cfg, str(folder / "model.safetensors"))
    return load_drafter(tensors, cfg, embed), config


# --------------------------------------------------------------------------- trained checkpoints


def save_trained(drafter: Eagle3Drafter, folder, target_info: dict | None = None) -> Path:
    """The trainer's final output: our full state dict (with embed_tokens) and the DraftConfig."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}, folder / "drafter.safetensors")
    (folder / "draft_config.json").write_text(json.dumps(drafter.cfg.to_dict(), indent=2) + "\n")
    if target_info is not None:
        (folder / "target.json").write_text(json.dumps(target_info, indent=2) + "\n")
    return folder


def load_trained(folder) -> tuple[Eagle3Drafter, dict]:
    folder = Path(folder)
    if folder.is_file():  # the drafter.safetensors itself
        folder = folder.parent
    if not (folder / "drafter.safetensors").exists():
        raise FileNotFoundError(f"{folder} is not a draftsmith checkpoint (no drafter.safetensors)")
    cfg = DraftConfig(**json.loads((folder / "draft_config.json").read_text()))
    drafter = load_drafter(load_file(folder / "drafter.safetensors"), cfg)
    info = folder / "target.json"
    return drafter, json.loads(info.read_text()) if info.exists() else {}


# --------------------------------------------------------------------------- stage entry point


FORMATS = {"sglang": (export_sglang, SGLANG_COMMAND)}  # format -> (writer, serving command template)


def run(config: ExportConfig) -> ExportResult:
    drafter, target = load_trained(config.checkpoint)
    writer, command = FORMATS[config.format]
    from draftsmith.common import dtype_of

    out = writer(drafter.to(dtype_of(config.dtype)).eval(), Path(config.out), target.get("hf_config"))
    (out / "draftsmith_export.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    shapes = sglang_shapes(drafter.cfg)
    return ExportResult(out=out, tensors=shapes, command=command.format(target=target.get("path") or "<TARGET>", out=out),
                        files=sorted(p.name for p in out.iterdir()))
