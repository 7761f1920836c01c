import pytest
import torch

from draftsmith.target import (SMALL_ROWS, ModelArgs, Transformer, causal_mask, hf_to_native, load_target, resolve_target,
                              small_linear)

from conftest import make_hf_model


def native_from_hf(hf) -> Transformer:
    args = ModelArgs.from_hf(hf.config.to_dict())
    model = Transformer(args).eval()
    sd = hf_to_native(hf.state_dict())
    model.load_state_dict(sd, strict=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
        {"attention_bias": True},
    ],
    ids=["plain", "tied", "llama3-rope", "qkv-bias"],
)
def test_logits_match_transformers(overrides):
    hf = make_hf_model(**overrides)
    model = native_from_hf(hf)
    tokens = torch.randint(0, 320, (2, 37))
    model.setup_caches(2, 64)
    out = model(tokens, torch.arange(37))
    ref = hf(tokens).logits
    assert (model.logits(out.hidden) - ref).abs().max() < 1e-4


def test_decode_through_cache_matches_full_forward():
    hf = make_hf_model()
    model = native_from_hf(hf)
    tokens = torch.randint(0, 320, (1, 24))
    ref = hf(tokens, output_hidden_states=True)
    model.setup_caches(1, 32)
    model(tokens[:, :10], torch.arange(10))  # prefill
    for t in range(10, 24):  # then one token at a time through the KV cache
        out = model(tokens[:, t : t + 1], torch.tensor([t]), capture=(1, 2))
        assert (model.logits(out.hidden)[0, 0] - ref.logits[0, t]).abs().max() < 1e-4
        # captured aux = outputs of layers 1 and 2 = HF hidden_states[2] and [3]
        want = torch.cat([ref.hidden_states[2][0, t], ref.hidden_states[3][0, t]])
        assert (out.aux[0, 0] - want).abs().max() < 1e-4


@pytest.mark.parametrize("overrides, scope, attention", [({}, "layer", "matmul"), ({"attention_bias": True}, "layer", "matmul"),
                                                      ({}, "model", "matmul"), ({}, "layer", "sdpa")],
                         ids=["plain", "qkv-bias", "whole-model", "sdpa-short"])
def test_optimized_model_gives_the_same_logits(overrides, scope, attention):
    """Fused qkv / gate-up matmuls and layers (or the whole forward) traced by torch.compile
    (fullgraph, so a graph break fails), with short queries' attention as matmuls or SDPA, compute
    what the plain model does, in prefill and step by step through the cache."""
    torch._dynamo.reset()
    model = native_from_hf(make_hf_model(**overrides))
    fast = native_from_hf(make_hf_model(**overrides)).optimize(compile_backend="eager", scope=scope, attention=attention)
    assert all(layer.self_attn.fused_short == (attention == "sdpa") for layer in fast.layers)
    assert not any("q_proj" in k or "gate_proj" in k for k in fast.state_dict())
    tokens = torch.randint(0, 320, (1, 40))
    for m in (model, fast):
        m.setup_caches(1, 48)
    ref, out = model(tokens[:, :30], torch.arange(30)), fast(tokens[:, :30], torch.arange(30))
    assert (model.logits(ref.hidden) - fast.logits(out.hidden)).abs().max() < 1e-5
    for t in range(30, 40):
        ref = model(tokens[:, t : t + 1], torch.tensor([t]), capture=(1,))
        out = fast(tokens[:, t : t + 1], torch.tensor([t]), capture=(1,))
        assert (model.logits(ref.hidden) - fast.logits(out.hidden)).abs().max() < 1e-5
        assert (ref.aux - out.aux).abs().max() < 1e-5


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6, SMALL_ROWS, SMALL_ROWS + 1])
def test_small_linear_is_linear(rows):
    """The few-row CPU product (W @ x^T, one row sent twice) is F.linear, values and gradients,
    for 2-d and 3-d inputs, with and without bias, and a strided input."""
    torch.manual_seed(rows)
    w = torch.randn(48, 40, requires_grad=True)
    b = torch.randn(48, requires_grad=True)
    x = torch.randn(rows, 40, requires_grad=True)
    for xi, bi in ((x, None), (x[None], b), (x.T.contiguous().T, b)):
        got, want = small_linear(xi, w, bi), torch.nn.functional.linear(xi, w, bi)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-5
        g = torch.randn_like(want)
        grads = torch.autograd.grad((got * g).sum(), [x, w])
        ref = torch.autograd.grad((want * g).sum(), [x, w])
        assert all((a - r).abs().max() < 1e-4 for a, r in zip(grads, ref))


def test_fused_cpu_verify_pass_agrees_with_one_token_steps():
    """What lossless speculation rests on in fp32: a k+1-token verify pass over the cache gives the
    logits (and greedy tokens) of k+1 one-token steps, in the fused model bench runs on the CPU as
    in the plain one."""
    plain = native_from_hf(make_hf_model())
    fused = native_from_hf(make_hf_model()).optimize()
    tokens = torch.randint(0, 320, (1, 30))
    for model in (plain, fused):
        model.setup_caches(1, 32)
        model(tokens[:, :20], torch.arange(20))
        steps = torch.cat([model.logits(model(tokens[:, t : t + 1], torch.tensor([t]), capture=(1,)).hidden)[0]
                           for t in range(20, 25)])  # (5, V)
        verify = model.logits(model(tokens[:, 20:25], torch.arange(20, 25), capture=(1,)).hidden)[0]  # (5, V)
        assert (steps - verify).abs().max() < 1e-5
        assert torch.equal(steps.argmax(-1), verify.argmax(-1))
        if model is plain:
            ref = verify
    assert (verify - ref).abs().max() < 1e-5


def test_default_aux_layers_follow_reference():
    args = ModelArgs.from_hf(make_hf_model(layers=32).config.to_dict())
    assert args.default_aux_layers() == (1, 15, 28)


def test_load_target_from_folder(tiny_target_dir):
    target = load_target(str(tiny_target_dir))
    hf = make_hf_model()
    tokens = torch.randint(0, 320, (1, 12))
    target.model.setup_caches(1, 16)
    out = target.model(tokens, torch.arange(12))
    assert (target.model.logits(out.hidden) - hf(tokens).logits).abs().max() < 1e-4
    assert 2 in target.eos_ids


def test_bad_targets_have_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_target(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_target(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="gguf"):
        resolve_target(str(tmp_path / "weights.bin"))


def test_sdpa_short_attention_keeps_a_tree_mask():
    """optimize(attention="sdpa"): a verify pass under a tree mask (rows see the prefix and their own
    branch only) gives the logits of the matmul path."""
    model = native_from_hf(make_hf_model()).optimize()
    sdpa = native_from_hf(make_hf_model()).optimize(attention="sdpa")
    tokens = torch.randint(0, 320, (1, 12))
    for m in (model, sdpa):
        m.setup_caches(1, 16)
        m(tokens[:, :8], torch.arange(8))
    parents = [-1, 0, 0, 1]  # root, two children, a grandchild: rows 8..11
    mask = torch.zeros(1, 1, 4, 16, dtype=torch.bool)
    mask[..., :8] = True
    for i, p in enumerate(parents):
        j = i
        while j >= 0:
            mask[0, 0, i, 8 + j] = True
            j = parents[j]
    rope = torch.tensor([[8, 9, 9, 10]])
    out = [m(tokens[:, 8:], torch.arange(8, 12), mask, rope) for m in (model, sdpa)]
    assert (model.logits(out[0].hidden) - sdpa.logits(out[1].hidden)).abs().max() < 1e-5


def test_a_bf16_model_keeps_its_rotary_tables_cast_and_its_slots_for_the_mask():
    """setup_caches keeps the rotary tables in the model's dtype (a step gathers rows without casting
    them) and arange(max_len) for causal_mask: the same cos, sin and mask as computing them each step;
    a move drops the cast tables and the next setup_caches makes them again."""
    model = native_from_hf(make_hf_model()).to(torch.bfloat16)
    pos = torch.tensor([[0, 5, 63]])
    fresh = model.rotary.cos[pos].to(torch.bfloat16), model.rotary.sin[pos].to(torch.bfloat16)
    assert not model.rotary.cast
    model.setup_caches(1, 64)
    assert set(model.rotary.cast) == {torch.bfloat16}
    for got, want in zip(model.rotary(pos, torch.bfloat16), fresh):
        assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(model.rotary(pos, torch.float32)[0], model.rotary.cos[pos])  # other dtypes as before
    input_pos = torch.tensor([3, 9])
    assert torch.equal(causal_mask(input_pos, 64, model.slots), causal_mask(input_pos, 64))
    model.to(torch.float32)  # a move drops them (fp32 needs none); back in bf16, setup_caches makes them again
    assert not model.rotary.cast
    model.to(torch.bfloat16).setup_caches(1, 64)
    assert set(model.rotary.cast) == {torch.bfloat16}


def test_caches_large_enough_are_kept_unless_asked_for_exactly():
    """setup_caches keeps caches of more slots (graphs captured over them stay valid); exact=True sizes them
    to what is asked (the bench after a tuning sweep's 1,024-slot caches), slots for the mask with them."""
    model = native_from_hf(make_hf_model())
    model.setup_caches(1, 64)
    kept = model.layers[0].self_attn.kv_cache
    model.setup_caches(1, 32)
    assert model.layers[0].self_attn.kv_cache is kept and model.max_len == 64
    model.setup_caches(1, 32, exact=True)
    assert model.max_len == 32 and model.layers[0].self_attn.kv_cache.k.shape[2] == 32 and len(model.slots) == 32
    assert model.layers[0].self_attn.kv_cache is not kept
