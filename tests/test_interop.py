"""Import of foreign EAGLE-3 drafters and round trips between our format, SGLang's and vLLM's."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftsmith.export import load_any
from draftsmith.export import export_sglang, export_vllm, load_export, load_trained, load_vllm_export
from draftsmith.interop import ImportConfig, InteropError, load_foreign, read_tensor_file, run

from helpers import tiny_drafter

N, H, V, VD = 8, 64, 320, 100



@pytest.fixture
def drafter(target8):
    return tiny_drafter(target8[1], draft_vocab=VD)


def logits(drafter):
    torch.manual_seed(0)
    ids, aux = torch.randint(0, V, (2, 12)), torch.randn(2, 12, 3 * H)
    with torch.no_grad():
        return [drafter.logits(o) for o in drafter.ttt(ids, aux, depth=3)]


def max_diff(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(logits(a), logits(b)))


def test_sglang_ours_vllm_round_trips_are_exact(drafter, target8, tmp_path):
    folder, _, hf_config = target8
    embed = drafter.embed_tokens.weight
    export_sglang(drafter, tmp_path / "sglang", hf_config)
    ours1, _ = load_export(tmp_path / "sglang", embed)
    export_vllm(ours1, tmp_path / "vllm", hf_config, verifier=str(folder))
    ours2, _ = load_vllm_export(tmp_path / "vllm", embed)
    export_sglang(ours2, tmp_path / "sglang2", hf_config)
    assert max_diff(drafter, ours1) == 0 and max_diff(drafter, ours2) == 0
    for name in ("vllm", "sglang2"):  # the generic importer reads both layouts the same way
        imported, _, _ = load_foreign(tmp_path / name, str(folder))
        assert max_diff(drafter, imported) == 0
    assert torch.equal(ours2.d2t, drafter.d2t) and torch.equal(ours2.t2d, drafter.t2d)
    assert ours2.cfg == drafter.cfg


def test_import_writes_a_folder_bench_and_training_load(drafter, target8, tmp_path):
    folder = target8[0]
    export_vllm(drafter, tmp_path / "vllm", target8[2], verifier=str(folder))
    result = run(ImportConfig(source=str(tmp_path / "vllm" / "model.safetensors"), target=str(folder),
                              out=str(tmp_path / "imported")))
    assert result.layout == "speculators" and result.aux_layer_ids == (1, 3, 4)
    back, info = load_trained(tmp_path / "imported")
    assert info["layout"] == "speculators" and info["hf_config"]["num_hidden_layers"] == N
    assert torch.equal(back.embed_tokens.weight, drafter.embed_tokens.weight)  # from the target
    assert max_diff(drafter, back) == 0
    assert max_diff(drafter, load_any(str(tmp_path / "imported"), drafter.embed_tokens.weight)) == 0
    assert (tmp_path / "imported" / "import_config.json").exists()


def eagle_original(drafter, folder, names="midlayer", vocab=True, model_prefix=False, bin_file=False):
    """The original EAGLE / SpecForge layout: no draftsmith record, no eagle_config (engine defaults)."""
    folder.mkdir(parents=True, exist_ok=True)
    c = drafter.cfg
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
              "intermediate_size": c.intermediate_size, "num_attention_heads": c.num_heads,
              "num_key_value_heads": c.num_kv_heads, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings, "vocab_size": V,
              "draft_vocab_size": c.draft_vocab_size, "bias": False, "tie_word_embeddings": False}
    (folder / "config.json").write_text(json.dumps(config))
    state = {k: v.clone() for k, v in drafter.state_dict().items()}
    if not vocab:
        state.pop("d2t"), state.pop("t2d")
    if names == "layers.0":
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    if model_prefix:
        state = {("model." + k if "lm_head" not in k else k): v for k, v in state.items()}
    if bin_file:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("names,prefix,bin_file", [("midlayer", False, True), ("layers.0", True, False)])
def test_import_eagle_and_specforge_layouts(drafter, target8, tmp_path, names, prefix, bin_file):
    folder = eagle_original(drafter, tmp_path / "eagle", names, model_prefix=prefix, bin_file=bin_file)
    imported, foreign, notes = load_foreign(folder, str(target8[0]))
    assert foreign.layout == "eagle3" and "embed_tokens taken from the checkpoint" in notes
    assert imported.cfg.aux_layer_ids == (1, 3, 4)  # engine defaults: inputs of 2, N//2, N-3
    assert max_diff(drafter, imported) == 0


def test_missing_vocab_maps_full_vocab_to_identity_and_refuses_a_partial_one(target8, tmp_path):
    full = tiny_drafter(target8[1])  # Vd == V
    imported, _, notes = load_foreign(eagle_original(full, tmp_path / "full", vocab=False), str(target8[0]))
    assert torch.equal(imported.d2t, torch.zeros(V, dtype=torch.long)) and bool(imported.t2d.all())
    assert max_diff(full, imported) == 0 and "identity mapping" in notes[0]
    with pytest.raises(InteropError, match="neither d2t nor t2d"):
        load_foreign(eagle_original(tiny_drafter(target8[1], draft_vocab=VD), tmp_path / "part", vocab=False),
                     str(target8[0]))


def test_d2t_is_rebuilt_from_t2d(drafter, target8, tmp_path):
    folder = eagle_original(drafter, tmp_path / "e")
    state = load_file(folder / "model.safetensors")
    del state["d2t"]
    save_file(state, folder / "model.safetensors")
    imported, _, notes = load_foreign(folder, str(target8[0]))
    assert torch.equal(imported.d2t, drafter.d2t) and "d2t rebuilt from t2d" in notes[0]


class NotATensor:
    pass


def test_a_pickle_that_is_not_weights_only_is_refused(drafter, tmp_path):
    path = tmp_path / "pytorch_model.bin"
    torch.save({"fc.weight": NotATensor()}, path)
    with pytest.raises(InteropError, match=r"pytorch_model\.bin is a pickle that torch\.load\(weights_only=True\) "
                                           r"refuses.*safetensors"):
        read_tensor_file(path)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(InteropError, match=r"model\.gguf: only \.safetensors"):
        read_tensor_file(tmp_path / "model.gguf")


def test_variant_flags_are_refused(drafter, target8, tmp_path):
    folder = eagle_original(drafter, tmp_path / "e")
    c = json.loads((folder / "config.json").read_text())
    c["norm_before_residual"] = True
    (folder / "config.json").write_text(json.dumps(c))
    with pytest.raises(InteropError, match="norm_before_residual"):
        load_foreign(folder, str(target8[0]))


def test_speculators_package_loads_our_vllm_export(drafter, target8, tmp_path):
    # REFERENCE.md §6: speculators pulls a ~6 GB CUDA torch, so it is not a test dependency.
    speculators = pytest.importorskip(
        "speculators", reason="the speculators package is not installed (optional: it pulls a 6 GB torch)")
    from speculators.models.eagle3 import Eagle3DraftModel

    folder = export_vllm(drafter, tmp_path / "vllm", target8[2], verifier=str(target8[0]))
    theirs = Eagle3DraftModel.from_pretrained(str(folder)).float().eval()
    assert speculators and list(theirs.config.eagle_aux_hidden_state_layer_ids) == [2, 4, 5]
    theirs.embed_tokens.weight.data.copy_(drafter.embed_tokens.weight)
    torch.manual_seed(0)
    ids, aux = torch.randint(0, V, (1, 10)), torch.randn(1, 10, 3 * H)
    with torch.no_grad():
        hidden = theirs.fc(aux)
        emb = theirs.embed_tokens(ids)
        pos = torch.arange(10)[None]
        layer_in = torch.cat([emb, hidden], dim=-1)
        theirs.layers[0].self_attn.config._attn_implementation = "eager"  # takes a plain additive causal mask
        causal = torch.full((10, 10), float("-inf")).triu(1)[None, None]
        out = theirs.layers[0](layer_in, attention_mask=causal, position_ids=pos,
                               position_embeddings=theirs.rotary_emb(layer_in, pos))
        out = out[0] if isinstance(out, tuple) else out
        got = theirs.lm_head(theirs.norm(out))
        drafter.setup_caches(1, 16)
        want = drafter.logits(drafter(ids, drafter.fuse(aux), torch.arange(10)))
    assert (got - want).abs().max() < 1e-4
