"""The EAGLE-3 draft model: one decoder layer over the target's fused hidden states.

Names follow what SGLang and vLLM load (`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`;
REFERENCE.md §1), so export is an identity map. The same module serves inference (one step
at a time through a static KV cache) and training-time test (`ttt`), where step j at row t
attends to the step-0 keys at rows <= t plus its own keys from steps 1..j, exactly what it
sees at inference when it drafts the (j+1)-th token after row t.

    row t, step 0:  cat(norm(emb(x[t+1])), norm(fc(aux[t])))      -> o0[t]  ~ target z[t+1]
    row t, step j:  cat(norm(emb(x[t+1+j])), norm(o{j-1}[t]))     -> oj[t]  ~ target z[t+1+j]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from draftsmith.target import MLP, Attention, KVCache, Linear, ModelArgs, RMSNorm, Rotary, causal_mask, run_flex


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    target_hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the target's V
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]  # target decoder layers whose OUTPUTS are fused (0-based)
    target_num_layers: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096

    def __post_init__(self):
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} exceeds the target vocab {self.vocab_size}")
        if len(self.aux_layer_ids) != 3:
            raise ValueError(f"EAGLE-3 fuses three target layers, got aux_layer_ids={self.aux_layer_ids}")
        bad = [i for i in self.aux_layer_ids if not 0 <= i < self.target_num_layers]
        if bad:
            raise ValueError(f"aux layers {bad} are outside the target's {self.target_num_layers} layers")
        object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))

    @classmethod
    def from_target(cls, args: ModelArgs, draft_vocab_size: int, aux_layer_ids=None) -> "DraftConfig":
        return cls(
            hidden_size=args.hidden_size,
            target_hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_heads=args.num_heads,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            vocab_size=args.vocab_size,
            draft_vocab_size=draft_vocab_size,
            aux_layer_ids=tuple(aux_layer_ids or args.default_aux_layers()),
            target_num_layers=args.num_layers,
            rms_norm_eps=args.rms_norm_eps,
            rope_theta=args.rope_theta,
            rope_scaling=args.rope_scaling,
            max_position_embeddings=args.max_position_embeddings,
        )

    def layer_args(self) -> ModelArgs:
        return ModelArgs(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict:
        return asdict(self)

    def check_target(self, args: ModelArgs, name: str):
        """Raise unless this drafter was built for a target of `args`' vocab, width and depth."""
        mine, theirs = (self.vocab_size, self.target_hidden_size, self.target_num_layers), (args.vocab_size, args.hidden_size, args.num_layers)
        if mine != theirs:
            raise ValueError(f"drafter {name} was built for another target (vocab, hidden, layers {mine}; this target: {theirs})")


class Midlayer(nn.Module):
    """The single EAGLE-3 decoder layer; attention reads cat(norm(emb), norm(hidden)) of width 2H."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.input_layernorm = RMSNorm(H, args.rms_norm_eps)
        self.hidden_norm = RMSNorm(H, args.rms_norm_eps)
        self.self_attn = Attention(args, in_dim=2 * H)
        self.post_attention_layernorm = RMSNorm(H, args.rms_norm_eps)
        self.mlp = MLP(args)

    def attn_input(self, emb, hidden):
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)  # (B, T, 2H)

    def finish(self, hidden, attn_out):
        h = hidden + attn_out  # residual is the incoming hidden state, not the embedding
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward(self, emb, hidden, cos, sin, input_pos, mask):
        return self.finish(hidden, self.self_attn(self.attn_input(emb, hidden), cos, sin, input_pos, mask))


STEP_TRACES = 64  # traces a compiled drafting step may have: one per tree shape, dtype and drafter met in a process


def row_major(x):
    """x in row-major layout, strides of size-1 dims included (torch.compile guards on them): x itself, a
    view of it where only size-1 dims' strides differ (the same memory), else a row-major copy; anything
    not a tensor as it is."""
    if not torch.is_tensor(x):
        return x
    want, step = [], 1
    for n in reversed(x.shape):
        want.insert(0, step)
        step *= n
    if x.stride() == tuple(want):
        return x
    if all(s == w or n == 1 for s, w, n in zip(x.stride(), want, x.shape)):
        return x.as_strided(x.shape, want)
    return x.clone(memory_format=torch.contiguous_format)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        args = cfg.layer_args()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # shared with (copied from) the target, frozen
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Midlayer(args)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool) if cfg.draft_vocab_size == cfg.vocab_size
                             else torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.max_len = 0

    # ------------------------------------------------------------------ shared pieces

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        return self.fc(aux)  # (B, T, 3Ht) -> (B, T, H)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden)).float()  # (B, T, Vd)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_ids(self) -> torch.Tensor:
        """The target id of every draft token, (Vd,) on the drafter's device."""
        return self.to_target(torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device))

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor):
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def shrink_vocab(self, counts: torch.Tensor, size: int) -> "Eagle3Drafter":
        """A copy that proposes only the `size` tokens of this draft vocab that `counts` (per target
        id) finds most frequent: their lm_head rows, d2t and t2d rebuilt. Over the kept tokens its
        logits are this drafter's; a smaller head makes each draft step cheaper (and the file smaller)."""
        if not 0 < size <= self.cfg.draft_vocab_size:
            raise ValueError(f"size must be in 1..{self.cfg.draft_vocab_size} (the current draft vocab), got {size}")
        ids = self.target_ids().cpu()
        keep = torch.sort(-counts.cpu()[ids], stable=True).indices[:size].sort().values  # draft rows, ascending
        small = Eagle3Drafter(replace(self.cfg, draft_vocab_size=size))
        state = {k: v.detach().cpu() for k, v in self.state_dict().items()}
        state["lm_head.weight"] = state["lm_head.weight"][keep]
        state["d2t"] = ids[keep] - torch.arange(size)
        state["t2d"] = torch.zeros_like(state["t2d"]).index_fill_(0, ids[keep], True)
        small.load_state_dict(state)
        return small.to(self.fc.weight.device, self.fc.weight.dtype)

    def init_from_target(self, target) -> "Eagle3Drafter":
        """Copy the target's embedding (frozen), and start norm + lm_head from the target's head
        restricted to the draft vocab: the drafter then only has to learn the next hidden state."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens.weight)
            if self.cfg.hidden_size == target.args.hidden_size:
                ids = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
                self.lm_head.weight.copy_(target.lm_head.weight[ids])
                self.norm.weight.copy_(target.norm.weight)
        return self

    # ------------------------------------------------------------------ inference

    def optimize(self, compile_backend: str | None = None) -> "Eagle3Drafter":
        """Inference only, like Transformer.optimize: fused qkv and gate/up matmuls; with a
        `compile_backend` (e.g. "inductor") the decoders compile their whole drafting steps (every
        level of a tree draft, a chain's k steps, the catch-up rows) with torch.compile, so norms,
        rotary, cache writes, softmax, top-k bookkeeping and the head fuse into few kernels."""
        if not hasattr(self.midlayer.mlp, "gate_up"):
            self.midlayer.self_attn.fuse()
            self.midlayer.mlp.fuse()
        self.compile_backend = compile_backend
        return self

    def compiled(self, fn):
        """`fn`, a drafting step of this drafter, compiled as optimize() asked (else `fn` itself), with
        static shapes and its tensor arguments row-major (row_major). torch.compile's default traced the
        second shape a step met with symbolic shapes, so that every tree shape after the first (the bench's
        8x6x48 beside 4x5x15, its T=1 trees, whose catch-up step is the greedy trees') ran kernels not
        specialised to it; and uncaptured, the prompt's last hidden row (strides of a transposed matmul on
        the CPU, of the prompt's length on CUDA) and a cycle's differ in strides alone, which traced the step
        again on the first cycle, symbolically, for every cycle after it. A step is traced once per shape,
        dtype and drafter, up to STEP_TRACES times (torch.compile's own limit, 8, fails a fullgraph step)."""
        backend = getattr(self, "compile_backend", None)
        if not backend:
            return fn
        step = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)
        # made once: entering a reused patch costs less than making one (logs/dynamo-config-patch-cost-cpu.json)
        traces = torch._dynamo.config.patch(recompile_limit=STEP_TRACES)

        def run(*args):
            with traces:
                return step(*(row_major(a) for a in args))
        return run

    def setup_caches(self, batch: int, max_len: int):
        """Like Transformer.setup_caches: a large enough cache is kept (graphs stay valid)."""
        p = self.fc.weight
        cache = self.midlayer.self_attn.kv_cache
        if cache is not None and cache.k.shape[0] == batch and self.max_len >= max_len and cache.k.dtype == p.dtype:
            return
        self.midlayer.self_attn.kv_cache = KVCache(batch, self.cfg.num_kv_heads, max_len, self.cfg.head_dim, p.dtype, p.device)
        self.max_len = max_len

    def forward(self, tokens, hidden, input_pos, mask=None, rope_pos=None) -> torch.Tensor:
        """One drafting call through the KV cache. tokens: (B, T); hidden: (B, T, H), either
        fuse(aux) of the target or a previous output. Returns the pre-norm output (B, T, H)."""
        if mask is None:
            mask = causal_mask(input_pos, self.max_len)
        if rope_pos is None:
            rope_pos = input_pos[None]
        emb = self.embed_tokens(tokens)
        cos, sin = self.rotary(rope_pos, emb.dtype)
        return self.midlayer(emb, hidden, cos, sin, input_pos, mask)

    # ------------------------------------------------------------------ training-time test

    def ttt(self, input_ids: torch.Tensor, aux: torch.Tensor, depth: int, position_ids: torch.Tensor | None = None,
            segment_ids: torch.Tensor | None = None, attn_impl: str = "auto") -> list[torch.Tensor]:
        """Unrolled drafting for training. input_ids: (B, T); aux: (B, T, 3Ht). Returns `depth`
        pre-norm outputs (B, T, H); output j at row t predicts the target's distribution z[t+1+j].
        segment_ids (B, T) keep packed sequences from attending to each other; position_ids (B, T)
        restart per sequence. attn_impl: "eager" materialises the (B, heads, T, T) scores, "flex"
        runs flex_attention (compiled on CUDA; no (T, T) scores in memory) over every step's keys, "split"
        runs flex over step 0's keys only and merges the later steps' own keys in (ttt_attention_split).
        "auto" is split on CUDA, eager elsewhere (flex has no CPU backward). On an H100
        (benchmarks/results/logs/ttt-attention-bench-h100-3ff982a.json, SmolLM2's training shape, 8 packed
        rows of 2,000 tokens, TTT 7) split's forward + backward takes 25.7 ms against flex's 94.2 and
        eager's 117.3, and the 8B-shape training step 0.110 s against flex's 0.127 (MFU 0.398 vs 0.336,
        logs/ttt-h100-3ff982a.json); both match eager's outputs and gradients there (tests/test_draft.py,
        -m gpu). Flex was the default before: on the H200, 0.204 vs eager's 0.287 s a SmolLM2 step."""
        if attn_impl not in TTT_ATTENTION:
            raise ValueError(f"attn_impl must be one of {', '.join(map(repr, TTT_ATTENTION))}, not {attn_impl!r}")
        split = attn_impl == "split" or (attn_impl == "auto" and input_ids.is_cuda)
        flex = split or attn_impl == "flex"
        B, T = input_ids.shape
        attn = self.midlayer.self_attn
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if flex:
            segments = segment_ids if segment_ids is not None else torch.zeros_like(input_ids)
            if split:  # step 0's keys under the causal, same-segment mask: one block mask for every step
                base = broadcast_block_mask(causal_segment_mask_mod(segments), B, T, T, input_ids.device)
        else:
            allowed = torch.ones(T, T, dtype=torch.bool, device=input_ids.device).tril()[None]  # (1, T, T)
            if segment_ids is not None:
                allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
            allowed = allowed[:, None]  # (B|1, 1, T, T)
        rep = attn.num_heads // attn.num_kv_heads
        hidden = self.fuse(aux)
        ks, vs, outs = [], [], []  # keys and values of steps 0..j
        for j in range(depth):
            tok = F.pad(input_ids[:, 1 + j:], (0, 1 + j), value=0)  # x[t+1+j] at row t
            emb = self.embed_tokens(tok)
            cos, sin = self.rotary(position_ids + j, emb.dtype)
            q, k, v = attn.project(self.midlayer.attn_input(emb, hidden), cos, sin)  # (B, h|kv, T, D)
            if flex:
                q, k = q.to(v.dtype), k.to(v.dtype)  # autocast leaves q, k in fp32 after the fp32 rotation
                ks.append(k)
                vs.append(v)
                y = ttt_attention_split(q, ks, vs, base) if split else ttt_attention_flex(q, ks, vs, segments)
            else:
                ks.append(k.repeat_interleave(rep, 1))
                vs.append(v.repeat_interleave(rep, 1))
                y = ttt_attention_eager(q, ks, vs, allowed)
            y = attn.o_proj(y.transpose(1, 2).reshape(B, T, -1))
            hidden = self.midlayer.finish(hidden, y)
            outs.append(hidden)
        return outs


def ttt_attention_eager(q, ks, vs, allowed):
    """Step j = len(ks) - 1 of TTT attention with every score materialised. q: (B, h, T, D);
    ks, vs: j + 1 tensors (B, h, T, D), step 0's read under `allowed` (B|1, 1, T, T), later steps'
    only on the diagonal (row t sees its own key of that step)."""
    T, scale = q.shape[2], q.shape[-1] ** -0.5
    s0 = (q @ ks[0].transpose(-1, -2)) * scale  # (B, h, T, T)
    s0 = s0.masked_fill(~allowed, float("-inf"))
    sd = [(q * dk).sum(-1, keepdim=True) * scale for dk in ks[1:]]  # j x (B, h, T, 1)
    p = torch.softmax(torch.cat([s0, *sd], dim=-1).float(), dim=-1).to(q.dtype)
    y = p[..., :T] @ vs[0]
    for i, dv in enumerate(vs[1:]):
        y = y + p[..., T + i: T + i + 1] * dv
    return y  # (B, h, T, D)


TTT_ATTENTION = ("auto", "eager", "flex", "split")


def ttt_attention_flex(q, ks, vs, segment_ids):
    """ttt_attention_eager through flex_attention, the keys of all steps side by side:
    [K0; K1; ...; Kj] (B, kv, (j + 1) T, D); the query at row t may read block 0 at rows <= t of
    its segment and, in blocks >= 1, only row t. Grouped-query heads are not repeated (enable_gqa)."""
    B, T = segment_ids.shape
    k, v = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
    mask = broadcast_block_mask(ttt_mask_mod(segment_ids, k.shape[2]), B, T, k.shape[2], q.device)
    return run_flex(q, k, v, mask)


def ttt_attention_split(q, ks, vs, mask: BlockMask):
    """ttt_attention_flex by parts: flex over step 0's keys alone (`mask`: causal within a segment, the
    same for every step, so built once a pack) returns its output o0 and log-sum-exp; the later steps'
    keys (one per row, its own) are scored elementwise, and the parts are merged by their softmax mass:
    y = (e^lse0 o0 + sum_i e^s_i v_i) / (e^lse0 + sum_i e^s_i), gradients flowing through lse0 too. No
    (B, kv, (j+1)T) key concatenation, and no block tiles that hold a diagonal and nothing else."""
    if len(ks) == 1:
        return run_flex(q, ks[0], vs[0], mask)
    B, h, T, D = q.shape
    kv, j = ks[0].shape[1], len(ks) - 1
    o0, lse0 = run_flex(q, ks[0], vs[0], mask, return_lse=True)  # (B, h, T, D), (B, h, T) fp32
    with torch.autocast(q.device.type, enabled=False):  # fp32 scores and sums, as inside the flex kernel
        qg = q.float().view(B, kv, h // kv, T, D)  # query heads grouped under their kv head
        kd, vd = torch.stack(ks[1:], 2).float(), torch.stack(vs[1:], 2).float()  # (B, kv, j, T, D)
        s = torch.einsum("bgrtd,bgjtd->bgrjt", qg, kd).reshape(B, h, j, T) * D**-0.5  # row t's own key of each step
        m = torch.maximum(lse0, s.amax(2))  # (B, h, T)
        w0, w = (lse0 - m).exp(), (s - m[:, :, None]).exp()  # (B, h, T), (B, h, j, T)
        extra = torch.einsum("bgrjt,bgjtd->bgrtd", w.view(B, kv, h // kv, j, T), vd).reshape(B, h, T, D)
        y = (w0[..., None] * o0.float() + extra) / (w0 + w.sum(2))[..., None]
    return y.to(q.dtype)


def ttt_mask_mod(segment_ids, kv_len):
    """mask_mod of ttt_attention_flex: key n (row n % T of step n // T) is visible from query t if it
    is t's own row of a later step, or a row <= t of step 0 in t's segment."""
    n = torch.arange(kv_len, device=segment_ids.device)
    # row and block of each key as tensors: a Python int captured by mask_mod would be a constant
    # of the compiled kernel and recompile it for every T
    row, first = n % segment_ids.shape[1], n < segment_ids.shape[1]

    def mask_mod(b, h, qi, ki):
        r = row[ki]
        return (r == qi) | (first[ki] & (r < qi) & (segment_ids[b, qi] == segment_ids[b, r]))
    return mask_mod


def causal_segment_mask_mod(segment_ids):
    """mask_mod of ttt_attention_split's step 0: key ki is visible from query qi if ki <= qi in qi's segment
    (ttt_mask_mod over step 0's keys alone, with fewer captured-tensor reads a score)."""
    def mask_mod(b, h, qi, ki):
        return (ki <= qi) & (segment_ids[b, qi] == segment_ids[b, ki])
    return mask_mod


def broadcast_block_mask(mask_mod, B, q_len, kv_len, device, block=128) -> BlockMask:
    """create_block_mask(mask_mod, B, None, q_len, kv_len) for a mask_mod that broadcasts (indexing
    and elementwise ops only) and ignores the head (it gets None). Built from ~20 tensor ops with no
    host sync instead of create_block_mask's vmap over mask_mod and from_kv_blocks' vmapped transpose,
    which are host-bound and ran once per TTT step (CPU, T=256, 7 steps: 115 ms -> 10 ms). Costs one
    transient (B, q_len, kv_len) bool mask on the device. Not cached: every step has its own key
    length, and autograd keeps each step's mask for the backward, so each is built exactly once."""
    b = torch.arange(B, device=device)[:, None, None]
    qi = torch.arange(q_len, device=device)[None, :, None]
    ki = torch.arange(kv_len, device=device)[None, None, :]
    dense = mask_mod(b, None, qi, ki)  # (B, q_len, kv_len)
    nq, nk = -(-q_len // block), -(-kv_len // block)
    # pad to whole tiles with False, as create_block_mask does: a tile reaching past the end is never full
    tiles = F.pad(dense, (0, nk * block - kv_len, 0, nq * block - q_len)).view(B, 1, nq, block, nk, block)
    full = tiles.all(5).all(3)  # (B, 1, nq, nk): no mask_mod needed in the kernel
    partial = tiles.any(5).any(3) & ~full

    def ordered(tile_mask):  # per row: count, then the column indices of the set tiles first (stable)
        # contiguous: the kernels read these row-major. argsort of the transposed (.mT) masks keeps their
        # strides, and a transposed q_indices gave the compiled backward wrong dK, dV (H200: up to 70% of a
        # weight's largest gradient, only when a length was not a multiple of the block; the forward was exact)
        tile_mask = tile_mask.to(torch.int32).contiguous()
        order = tile_mask.argsort(dim=-1, descending=True, stable=True)
        return tile_mask.sum(-1, dtype=torch.int32).contiguous(), order.to(torch.int32).contiguous()

    (kv_n, kv_i), (fkv_n, fkv_i) = ordered(partial), ordered(full)
    (q_n, q_i), (fq_n, fq_i) = ordered(partial.mT), ordered(full.mT)  # the backward's dK, dV walk columns
    return BlockMask(seq_lengths=(q_len, kv_len), kv_num_blocks=kv_n, kv_indices=kv_i,
                     full_kv_num_blocks=fkv_n, full_kv_indices=fkv_i, q_num_blocks=q_n, q_indices=q_i,
                     full_q_num_blocks=fq_n, full_q_indices=fq_i, BLOCK_SIZE=(block, block), mask_mod=mask_mod)


def load_drafter(state: dict[str, torch.Tensor], cfg: DraftConfig, embed: torch.Tensor | None = None) -> Eagle3Drafter:
    """Build a drafter from our (SGLang-named) state dict; embed_tokens comes from the target."""
    model = Eagle3Drafter(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k != "embed_tokens.weight"]
    if missing or unexpected:
        raise ValueError(f"drafter weights do not match the config: missing {missing}, unexpected {unexpected}")
    if embed is not None:
        with torch.no_grad():
            model.embed_tokens.weight.copy_(embed)
    return model
