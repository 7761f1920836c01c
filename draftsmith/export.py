"""Export a trained drafter as the EAGLE-3 checkpoint SGLang or vLLM serves (REFERENCE.md §1).

    draftsmith export --checkpoint runs/x/final --out runs/x/sglang            # SGLang (and vLLM)
    draftsmith export --checkpoint runs/x/final --out runs/x/vllm --format vllm  # vLLM "speculators"

`sglang`: config.json (LlamaForCausalLMEagle3) and model.safetensors with the drafter's own
tensor names minus embed_tokens (the engine shares the target's); vLLM loads this folder too.
`vllm`: the speculators format (architectures ["Eagle3Speculator"], speculators_config,
transformer_layer_config), tensor names midlayer.* -> layers.0.*. Every file is read back and
compared bit for bit before `run` returns; the result carries the serving command per engine.

Aux layer ids, read from the engines' sources:
- SGLang (model_runner.py) passes `eagle_config.eagle_aux_hidden_state_layer_ids` to the
  target's `set_eagle3_layers_to_capture`, which adds 1 and captures the residual stream
  *entering* layer id+1 (models/llama.py), i.e. the OUTPUT of layer id: our ids, unchanged.
- vLLM (eagle3_utils.get_eagle3_aux_layers_from_config) reads the TOP-LEVEL
  `eagle_aux_hidden_state_layer_ids` and captures the stream entering layer id, with no +1
  (models/llama.py): our ids + 1. Both engines' defaults agree: SGLang [2, N//2, N-3] and vLLM
  (2, N//2, N-3) are the inputs of those layers = outputs of 1, N//2-1, N-4.

The speculators format, read from vllm-project/vllm transformers_utils/configs/speculators/
{base,algos}.py and vllm-project/speculators src/speculators/{config.py,models/eagle3/config.py,
convert/converters/eagle3.py}: vLLM detects it by `speculators_model_type`, builds the draft's
HF config from `transformer_layer_config`, and copies draft_vocab_size, target_hidden_size,
eagle_aux_hidden_state_layer_ids (read like its own top-level key: our ids + 1) and
norm_before_residual, which DEFAULTS TO TRUE there (the speculators library defaults to False),
so it is always written, as false: our residual is the un-normed fused state. Tensors: the
speculators converter maps "midlayer." -> "layers.0." and keeps d2t, t2d, fc., lm_head., norm.;
vLLM's Eagle3LlamaForCausalLM.load_weights skips t2d, renames d2t -> draft_id_to_target_id and
prefixes the rest with "model.".
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.draft import DraftConfig, Eagle3Drafter, load_drafter

ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SGLANG_COMMAND = ("python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                  "--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 1 "
                  "--speculative-num-draft-tokens 6")
DRAFT_TOKENS = 5  # what the commands and speculators_config propose per cycle


def vllm_command(target: str, out) -> str:
    spec = json.dumps({"method": "eagle3", "model": str(out), "num_speculative_tokens": DRAFT_TOKENS}, separators=(",", ":"))
    return f"vllm serve {target} --speculative-config '{spec}'"


class ExportError(ValueError):
    """An export that an engine would load wrongly or not at all."""


@dataclass(frozen=True)
class ExportConfig:
    checkpoint: str  # a draftsmith training output folder (drafter.safetensors + draft_config.json)
    out: str  # output folder
    format: str = "sglang"
    dtype: str = "bfloat16"  # the weights' dtype in the export (what SGLang serves)
    draft_vocab: int = 0  # cut the draft vocab to this many tokens, the most frequent in the training answers
    # (the checkpoint's token counts; Eagle3Drafter.shrink_vocab): the logits over the kept tokens are unchanged and
    # each draft step reads a smaller head (SmolLM2 on H100s: a chain cycle's drafting took 0.19 ms with the shipped
    # 8K-token drafter, 0.28 ms with run 12's 32K one; logs/bench-early-h100-3dbfcea.json, logs/h100-run12-bench.json);
    # 0 keeps the trained vocab

    def __post_init__(self):
        if self.format not in FORMATS:
            raise ValueError(f"export format {self.format!r} is not supported; choose one of {sorted(FORMATS)}")
        if not self.checkpoint or not self.out:
            raise ValueError("ExportConfig needs both a checkpoint and an out folder")
        if self.draft_vocab < 0:
            raise ValueError(f"draft_vocab must be 0 (keep the trained vocab) or a token count, got {self.draft_vocab}")


@dataclass
class ExportResult:
    out: Path
    tensors: dict[str, tuple[int, ...]]  # name -> shape, as written
    command: str  # how to serve it (the format's own engine)
    files: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)  # engine -> serving command


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
    _write_and_verify(out, config, tensors)
    back = load_file(out / "model.safetensors")
    check_tensors(back, cfg, str(out / "model.safetensors"))
    if draft_config_from_sglang(json.loads((out / "config.json").read_text())) != cfg:
        raise ExportError(f"{out / 'config.json'} does not describe the drafter it was written for")
    return out


def _write_and_verify(out: Path, config: dict, tensors: dict[str, torch.Tensor]):
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    back = load_file(out / "model.safetensors")
    changed = [k for k in tensors if k not in back or back[k].dtype != tensors[k].dtype
               or not torch.equal(_bits(back[k]), _bits(tensors[k]))]
    if changed or set(back) != set(tensors):
        raise ExportError(f"{out}: tensors changed between write and read-back: {changed or sorted(set(back) ^ set(tensors))}")


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


# --------------------------------------------------------------------------- vLLM's speculators format

SPECULATORS_RENAME = {"midlayer.": "layers.0."}  # ours -> speculators (convert/converters/eagle3.py)


def _rename(tensors: dict, prefixes: dict) -> dict:
    out = {}
    for k, v in tensors.items():
        for old, new in prefixes.items():
            k = new + k[len(old):] if k.startswith(old) else k
        out[k] = v
    return out


def to_speculators_names(tensors: dict) -> dict:
    return _rename(tensors, SPECULATORS_RENAME)


def from_speculators_names(tensors: dict) -> dict:
    return _rename(tensors, {theirs: ours for ours, theirs in SPECULATORS_RENAME.items()})


def speculators_config(cfg: DraftConfig, target_config: dict | None = None, dtype: torch.dtype = torch.bfloat16,
                       verifier: str | None = None) -> dict:
    """config.json in the speculators format (Eagle3SpeculatorConfig as vLLM reads it)."""
    base = sglang_config(cfg, target_config, dtype)  # same checks, same transformer hyperparameters
    layer = {k: base[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                                  "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps",
                                  "rope_theta", "max_position_embeddings", "vocab_size", "tie_word_embeddings")}
    layer.update(attention_bias=False, mlp_bias=False)
    if "rope_scaling" in base:
        layer["rope_scaling"] = base["rope_scaling"]
    arch = (target_config or {}).get("architectures") or []
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": DRAFT_TOKENS,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(arch)},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size,
        "norm_before_residual": False,  # vLLM's speculators loader assumes True when absent
        # vLLM: the stream entering layer i (no +1), i.e. our output ids + 1
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in cfg.aux_layer_ids],
        "torch_dtype": base["torch_dtype"],
        "draftsmith": base["draftsmith"],
    }


def draft_config_from_speculators(c: dict, target_num_layers: int | None = None) -> DraftConfig:
    """Our DraftConfig from a speculators config.json; aux ids are read the way vLLM reads them."""
    layer, ours = c["transformer_layer_config"], c.get("draftsmith") or {}
    n = ours.get("target_num_layers") or target_num_layers
    if n is None:
        raise ExportError("the speculators config does not say how many layers the target has; pass the target")
    vllm_ids = c.get("eagle_aux_hidden_state_layer_ids")
    aux = ours.get("aux_layer_outputs") or ([i - 1 for i in vllm_ids] if vllm_ids else [1, n // 2 - 1, n - 4])
    heads = layer["num_attention_heads"]
    return DraftConfig(
        hidden_size=layer["hidden_size"], target_hidden_size=c.get("target_hidden_size") or layer["hidden_size"],
        intermediate_size=layer["intermediate_size"], num_heads=heads,
        num_kv_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
        vocab_size=layer["vocab_size"], draft_vocab_size=c.get("draft_vocab_size") or layer["vocab_size"],
        aux_layer_ids=tuple(aux), target_num_layers=n, rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=float(layer.get("rope_theta") or (layer.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        rope_scaling=layer.get("rope_scaling"), max_position_embeddings=layer.get("max_position_embeddings", 4096),
    )


def export_vllm(drafter: Eagle3Drafter, out: Path, target_config: dict | None = None, verifier: str | None = None) -> Path:
    """Write the speculators folder (config.json + model.safetensors) and check it on read-back."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = drafter.cfg
    ours = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items() if k != "embed_tokens.weight"}
    check_tensors(ours, cfg, "drafter")
    config = speculators_config(cfg, target_config, drafter.fc.weight.dtype, verifier)
    _write_and_verify(out, config, to_speculators_names(ours))
    check_tensors(from_speculators_names(load_file(out / "model.safetensors")), cfg, str(out / "model.safetensors"))
    if draft_config_from_speculators(json.loads((out / "config.json").read_text())) != cfg:
        raise ExportError(f"{out / 'config.json'} does not describe the drafter it was written for")
    return out


def load_vllm_export(folder, embed: torch.Tensor | None = None) -> tuple[Eagle3Drafter, dict]:
    """Read a speculators-format folder written by export_vllm back into our drafter."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    cfg = draft_config_from_speculators(config)
    tensors = from_speculators_names(load_file(folder / "model.safetensors"))
    check_tensors(tensors, cfg, str(folder / "model.safetensors"))
    return load_drafter(tensors, cfg, embed), config


# --------------------------------------------------------------------------- trained checkpoints


TOKEN_COUNTS = "token_counts.safetensors"  # a trained folder's training-answer token counts, per target id


def save_trained(drafter: Eagle3Drafter, folder, target_info: dict | None = None, counts: torch.Tensor | None = None) -> Path:
    """The trainer's final output: our full state dict (with embed_tokens) and the DraftConfig; with
    `counts` (the training answers' tokens per target id) also TOKEN_COUNTS, which export --draft-vocab cuts by."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}, folder / "drafter.safetensors")
    (folder / "draft_config.json").write_text(json.dumps(drafter.cfg.to_dict(), indent=2) + "\n")
    if target_info is not None:
        (folder / "target.json").write_text(json.dumps(target_info, indent=2) + "\n")
    if counts is not None:
        save_file({"counts": counts.detach().cpu().to(torch.int64).contiguous()}, folder / TOKEN_COUNTS)
    return folder


def load_counts(folder) -> torch.Tensor:
    """A trained folder's token counts (save_trained's TOKEN_COUNTS)."""
    path = Path(folder) / TOKEN_COUNTS
    if not path.exists():
        raise ExportError(f"{folder} has no {TOKEN_COUNTS}, the training answers' token counts that --draft-vocab cuts by "
                          "(a checkpoint saved before draftsmith kept them): export without --draft-vocab, or cut the export "
                          "with benchmarks/ship_drafter.py --answers <the answers it was trained on>")
    return load_file(path)["counts"]


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


def load_any(path, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """A drafter from an SGLang export (config.json + model.safetensors) or a trained folder."""
    folder = Path(path)
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return load_export(folder, embed)[0]
    return load_trained(folder)[0]


# --------------------------------------------------------------------------- stage entry point


def serving_commands(fmt: str, target: str, out) -> dict[str, str]:
    """engine -> command. vLLM also serves the SGLang folder (it reads the top-level aux ids)."""
    vllm = vllm_command(target, out)
    return {"sglang": SGLANG_COMMAND.format(target=target, out=out), "vllm": vllm} if fmt == "sglang" else {"vllm": vllm}


FORMATS = {  # format -> (writer, tensor shapes as written, the format's own engine)
    "sglang": (export_sglang, sglang_shapes, "sglang"),
    "vllm": (export_vllm, lambda cfg: to_speculators_names(sglang_shapes(cfg)), "vllm"),
}


def run(config: ExportConfig) -> ExportResult:
    drafter, target = load_trained(config.checkpoint)
    writer, shapes, engine = FORMATS[config.format]
    from draftsmith.common import dtype_of

    if config.draft_vocab and config.draft_vocab != drafter.cfg.draft_vocab_size:
        if config.draft_vocab > drafter.cfg.draft_vocab_size:
            raise ExportError(f"--draft-vocab {config.draft_vocab}: {config.checkpoint} was trained with "
                              f"{drafter.cfg.draft_vocab_size} draft tokens, and a cut can only keep fewer")
        drafter = drafter.shrink_vocab(load_counts(config.checkpoint), config.draft_vocab)
    drafter = drafter.to(dtype_of(config.dtype)).eval()
    path = target.get("path")
    if config.format == "vllm":
        out = writer(drafter, Path(config.out), target.get("hf_config"), verifier=path)
    else:
        out = writer(drafter, Path(config.out), target.get("hf_config"))
    (out / "draftsmith_export.json").write_text(json.dumps(asdict(config), indent=2) + "\n")
    commands = serving_commands(config.format, path or "<TARGET>", out)
    for name, command in commands.items():
        print(f"serve with {name}: {command}")
    return ExportResult(out=out, tensors=shapes(drafter.cfg), command=commands[engine],
                        files=sorted(p.name for p in out.iterdir()), commands=commands)
