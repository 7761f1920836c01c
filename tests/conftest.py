"""Tiny stand-in models shared by the tests: a random 2-4 layer Llama saved as a real Hugging Face
folder (config.json + safetensors + a trained byte-level BPE tokenizer with a ChatML template), so
every loader and stage runs on the same code path as for a real target, in seconds."""

import json
from pathlib import Path

import pytest
import torch

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "Write a short poem about the sea and the waves of the ocean.",
    "Explain how a transformer language model predicts the next token.",
    "What is the capital of France? Paris is the capital of France.",
    "def add(a, b):\n    return a + b\n",
    "1 2 3 4 5 6 7 8 9 10 + - * / = ( ) [ ] { } : ; , . ! ?",
] * 4


def make_tokenizer(vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    fast.chat_template = CHATML
    return fast


def make_hf_model(layers: int = 4, vocab: int = 320, seed: int = 0, tie: bool = False, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    cfg.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    # random init is too flat to tell models apart; scale up so logits are peaked
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def save_hf_folder(folder: Path, model, tokenizer) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory) -> Path:
    """A 4-layer random Llama target as a Hugging Face folder."""
    return save_hf_folder(tmp_path_factory.mktemp("tiny-target"), make_hf_model(), make_tokenizer())


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return make_tokenizer()
