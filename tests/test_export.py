"""Export to the SGLang EAGLE-3 checkpoint format: names, shapes, config keys, aux-layer ids, round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.export import (
    ExportConfig, ExportError, export_sglang, load_export, load_trained, run, save_trained, sglang_config,
)
from draftsmith.target import causal_mask
from draftsmith.draft import DraftConfig, Eagle3Drafter

from helpers import tiny_drafter, tiny_native

N = 8  # target layers; default aux outputs (1, 3, 4)

# What LlamaForCausalLMEagle3 loads, read from sgl-project/sglang python/sglang/srt/models/llama_eagle3.py
# (load_weights: q/k/v_proj -> qkv_proj and gate/up_proj -> gate_up_proj are stacked from these names,
# any other name is looked up as-is or under "model."; "d2t" becomes hot_token_id = d2t + arange,
# "t2d" is skipped). Shapes from the modules it builds: fc = Linear(3 * target_hidden_size, hidden_size),
# midlayer qkv input 2 * hidden_size, lm_head = ParallelLMHead(draft_vocab_size, hidden_size).
# vLLM (vllm-project/vllm vllm/model_executor/models/llama_eagle3.py) reads the same names, renaming
# "midlayer." -> "layers.0." and "d2t" -> "draft_id_to_target_id".
H, I, HEADS, KV, HD, V, VD = 64, 128, 4, 2, 16, 320, 100
SGLANG_NAMES = {
    "fc.weight": (H, 3 * H),
    "midlayer.input_layernorm.weight": (H,),
    "midlayer.hidden_norm.weight": (H,),
    "midlayer.self_attn.q_proj.weight": (HEADS * HD, 2 * H),
    "midlayer.self_attn.k_proj.weight": (KV * HD, 2 * H),
    "midlayer.self_attn.v_proj.weight": (KV * HD, 2 * H),
    "midlayer.self_attn.o_proj.weight": (H, HEADS * HD),
    "midlayer.post_attention_layernorm.weight": (H,),
    "midlayer.mlp.gate_proj.weight": (I, H),
    "midlayer.mlp.up_proj.weight": (I, H),
    "midlayer.mlp.down_proj.weight": (H, I),
    "norm.weight": (H,),
    "lm_head.weight": (VD, H),
    "d2t": (VD,),
    "t2d": (V,),
}


@pytest.fixture(scope="module")
def target():
    return tiny_native(layers=N)


@pytest.fixture
def drafter(target):
    return tiny_drafter(target, draft_vocab=VD)


def test_export_round_trip_gives_identical_logits(drafter, tmp_path):
    export_sglang(drafter, tmp_path)
    back, _ = load_export(tmp_path, embed=drafter.embed_tokens.weight)
    torch.manual_seed(0)
    ids = torch.randint(0, V, (2, 12))
    aux = torch.randn(2, 12, 3 * H)
    with torch.no_grad():
        want = [drafter.logits(o) for o in drafter.ttt(ids, aux, depth=3)]
        got = [back.logits(o) for o in back.ttt(ids, aux, depth=3)]
    assert all((w - g).abs().max() == 0 for w, g in zip(want, got))
    assert torch.equal(back.d2t, drafter.d2t) and torch.equal(back.t2d, drafter.t2d)


def test_file_has_exactly_the_sglang_names_and_shapes(drafter, tmp_path):
    export_sglang(drafter.to(torch.bfloat16), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert {k: tuple(t.shape) for k, t in tensors.items()} == SGLANG_NAMES  # no embed_tokens
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert tensors["fc.weight"].dtype == torch.bfloat16
    # d2t holds offsets: draft id + d2t = target id, and those ids are exactly the t2d set
    target_ids = torch.arange(VD) + tensors["d2t"]
    assert torch.equal(target_ids, tensors["t2d"].nonzero().squeeze(1))


def test_config_keys(drafter, target, tmp_path):
    export_sglang(drafter, tmp_path, target_config={"vocab_size": V, "hidden_size": H, "num_hidden_layers": N})
    c = json.loads((tmp_path / "config.json").read_text())
    want = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": H, "intermediate_size": I, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "head_dim": HD, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "vocab_size": V, "draft_vocab_size": VD, "tie_word_embeddings": False, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    assert {k: c[k] for k in want} == want
    assert c["eagle_config"]["use_aux_hidden_state"] is True
    assert "target_hidden_size" not in c and "rope_scaling" not in c  # H == Ht, default rope


def test_target_hidden_size_and_rope_scaling_are_written(tmp_path):
    from dataclasses import replace
    base = tiny_drafter(tiny_native(layers=N)).cfg
    scaling = {"rope_type": "linear", "factor": 2.0}
    c = sglang_config(replace(base, target_hidden_size=96, rope_scaling=scaling), None)
    assert c["target_hidden_size"] == 96 and c["rope_scaling"] == scaling


def test_aux_layer_ids_convention(drafter, target, tmp_path):
    # Our ids are 0-based decoder-layer OUTPUTS: defaults (1, N//2-1, N-4) = (1, 3, 4).
    # SGLang (python/sglang/srt/model_executor/model_runner.py) reads eagle_config's list and calls
    # set_eagle3_layers_to_capture(ids), which stores [val + 1 for val in ids]; LlamaModel.forward
    # (models/llama.py) appends hidden_states + residual BEFORE running layer i: the output of i-1.
    # vLLM (v1 eagle3_utils.get_eagle3_aux_layers_from_config) reads the TOP-LEVEL key as-is, and its
    # LlamaModel.forward also appends the stream BEFORE layer idx: so it needs our ids + 1.
    assert drafter.cfg.aux_layer_ids == (1, N // 2 - 1, N - 4)
    export_sglang(drafter, tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    sglang_ids, vllm_ids = c["eagle_config"]["eagle_aux_hidden_state_layer_ids"], c["eagle_aux_hidden_state_layer_ids"]
    assert sglang_ids == [1, 3, 4] and vllm_ids == [2, 4, 5]
    # both equal the engines' own defaults (2, N//2, N-3) read as "before layer i"
    assert [i + 1 for i in sglang_ids] == vllm_ids == [2, N // 2, N - 3]
    assert c["draftsmith"]["aux_layer_outputs"] == [1, 3, 4]

    # Emulate the engines' capture loops on the real target: tap the stream entering layer i.
    tokens = torch.randint(0, V, (1, 9))
    pos = torch.arange(9)
    target.setup_caches(1, 16)
    ours = target(tokens, pos, capture=drafter.cfg.aux_layer_ids).aux
    target.setup_caches(1, 16)
    x, (cos, sin), mask = target.embed_tokens(tokens), target.rotary(pos[None], torch.float32), causal_mask(pos, 16)
    entering = []
    for layer in target.layers:
        entering.append(x)
        x = layer(x, cos, sin, pos, mask)
    sglang_taps = torch.cat([entering[i + 1] for i in sglang_ids], dim=-1)  # SGLang adds 1
    vllm_taps = torch.cat([entering[i] for i in vllm_ids], dim=-1)
    assert torch.equal(sglang_taps, ours) and torch.equal(vllm_taps, ours)


def test_last_layer_output_cannot_be_served():
    # engines tap the input of a layer, so a 4-layer target's layer 3 output cannot be served
    target = tiny_native(layers=4)
    drafter = Eagle3Drafter(DraftConfig.from_target(target.args, 320, aux_layer_ids=(0, 1, 3)))
    with pytest.raises(ExportError, match="last layer"):
        sglang_config(drafter.cfg, None)


def test_wrong_target_is_rejected(drafter, tmp_path):
    with pytest.raises(ExportError, match="does not fit"):
        export_sglang(drafter, tmp_path, target_config={"vocab_size": V + 1, "hidden_size": H, "num_hidden_layers": N})


def test_tampered_export_is_caught(drafter, tmp_path):
    export_sglang(drafter, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match=r"missing \['midlayer.hidden_norm.weight'\]"):
        load_export(tmp_path)

    tensors["midlayer.hidden_norm.weight"] = torch.ones(H)
    tensors["d2t"] = tensors["d2t"].int()  # ids stored as int32: an engine would misread them
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ExportError, match="int64"):
        load_export(tmp_path)


def test_bad_format_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="'onnx' is not supported"):
        ExportConfig(checkpoint=str(tmp_path), out=str(tmp_path / "out"), format="onnx")


def test_run_exports_a_trained_checkpoint(drafter, tmp_path):
    info = {"path": "/models/tiny", "hf_config": {"vocab_size": V, "hidden_size": H, "num_hidden_layers": N}}
    save_trained(drafter, tmp_path / "final", info)
    restored, got_info = load_trained(tmp_path / "final")
    assert got_info == info and torch.equal(restored.embed_tokens.weight, drafter.embed_tokens.weight)

    result = run(ExportConfig(checkpoint=str(tmp_path / "final"), out=str(tmp_path / "sglang"), dtype="float32"))
    assert result.tensors == SGLANG_NAMES
    assert "--speculative-algorithm EAGLE3 " in result.command  # "EAGLE" serves an EAGLE-3 head at tau 1.00
    assert result.command.startswith("python -m sglang.launch_server --model-path /models/tiny ")
    assert f"--speculative-draft-model-path {tmp_path / 'sglang'} " in result.command
    resolved = json.loads((tmp_path / "sglang" / "draftsmith_export.json").read_text())
    assert resolved["format"] == "sglang" and resolved["checkpoint"] == str(tmp_path / "final")
    back, _ = load_export(tmp_path / "sglang", embed=drafter.embed_tokens.weight)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in drafter.state_dict().items())


def test_write_time_check_catches_a_changed_tensor(drafter, tmp_path, monkeypatch):
    import draftsmith.export as export

    def corrupt(path):
        tensors = load_file(path)
        tensors["fc.weight"][0, 0] += 1.0
        return tensors

    monkeypatch.setattr(export, "load_file", corrupt)
    with pytest.raises(ExportError, match=r"changed between write and read-back: \['fc.weight'\]"):
        export_sglang(drafter, tmp_path)


# --------------------------------------------------------------------------- vLLM's speculators format

# Our names -> the speculators / vLLM names, read from:
# - vllm-project/speculators src/speculators/convert/converters/eagle3.py: parameter_mappings
#   {"midlayer.": "layers.0."}; keep_parameters d2t, t2d, embed_tokens., fc., lm_head., norm.
# - vllm-project/vllm vllm/model_executor/models/llama_eagle3.py (Eagle3LlamaForCausalLM.load_weights):
#   t2d skipped, d2t -> draft_id_to_target_id, every other name but lm_head gets "model."; midlayer. is
#   also accepted and renamed to layers.0.; q/k/v and gate/up are stacked into qkv_proj / gate_up_proj.
OURS_TO_SPECULATORS = {
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "layers.0.input_layernorm.weight",
    "midlayer.hidden_norm.weight": "layers.0.hidden_norm.weight",
    "midlayer.self_attn.q_proj.weight": "layers.0.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight": "layers.0.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight": "layers.0.self_attn.v_proj.weight",
    "midlayer.self_attn.o_proj.weight": "layers.0.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight": "layers.0.post_attention_layernorm.weight",
    "midlayer.mlp.gate_proj.weight": "layers.0.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight": "layers.0.mlp.up_proj.weight",
    "midlayer.mlp.down_proj.weight": "layers.0.mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
    "d2t": "d2t",
    "t2d": "t2d",
}


def test_vllm_file_has_the_speculators_names_and_shapes(drafter, tmp_path):
    from draftsmith.export import export_vllm

    export_vllm(drafter, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert {k: tuple(t.shape) for k, t in tensors.items()} == {OURS_TO_SPECULATORS[k]: s for k, s in SGLANG_NAMES.items()}


def test_vllm_config_is_what_the_speculators_loaders_read(drafter, tmp_path):
    # vllm transformers_utils/configs/speculators/base.py validates speculators_config.proposal_methods[0]
    # .speculative_tokens, .verifier.name_or_path, speculators_model_type and transformer_layer_config;
    # algos.py update_eagle3 copies draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids and
    # norm_before_residual with a default of TRUE (speculators models/eagle3/config.py defaults it to False).
    from dataclasses import replace

    from draftsmith.export import speculators_config

    scaling = {"rope_type": "linear", "factor": 2.0}
    cfg = replace(drafter.cfg, rope_scaling=scaling, rms_norm_eps=1e-5)
    c = speculators_config(cfg, {"vocab_size": V, "hidden_size": H, "num_hidden_layers": N,
                                 "architectures": ["LlamaForCausalLM"]}, torch.bfloat16, verifier="/models/tiny")
    assert c["architectures"] == ["Eagle3Speculator"] and c["speculators_model_type"] == "eagle3"
    spec = c["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 5
    assert spec["verifier"] == {"name_or_path": "/models/tiny", "architectures": ["LlamaForCausalLM"]}
    assert c["norm_before_residual"] is False  # explicit: vLLM would assume True
    assert c["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM reads inputs of layers: our outputs + 1
    assert c["draft_vocab_size"] == VD and c["target_hidden_size"] == H
    layer = c["transformer_layer_config"]
    assert {k: layer[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "head_dim", "vocab_size",
                                  "rms_norm_eps", "rope_scaling", "num_key_value_heads")} == {
        "model_type": "llama", "num_hidden_layers": 1, "hidden_size": H, "head_dim": HD, "vocab_size": V,
        "rms_norm_eps": 1e-5, "rope_scaling": scaling, "num_key_value_heads": KV}


def test_run_vllm_format_prints_the_vllm_command(drafter, tmp_path, capsys):
    info = {"path": "/models/tiny", "hf_config": {"vocab_size": V, "hidden_size": H, "num_hidden_layers": N}}
    save_trained(drafter, tmp_path / "final", info)
    out = tmp_path / "vllm"
    result = run(ExportConfig(checkpoint=str(tmp_path / "final"), out=str(out), format="vllm", dtype="float32"))
    assert result.command == ("vllm serve /models/tiny --speculative-config "
                              f"'{{\"method\":\"eagle3\",\"model\":\"{out}\",\"num_speculative_tokens\":5}}'")
    assert set(result.commands) == {"vllm"} and result.command in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] == "/models/tiny"
    sglang = run(ExportConfig(checkpoint=str(tmp_path / "final"), out=str(tmp_path / "sglang"), dtype="float32"))
    assert set(sglang.commands) == {"sglang", "vllm"} and sglang.command == sglang.commands["sglang"]
