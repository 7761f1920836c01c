"""Stage 3, train: an EAGLE-3 drafter with training-time test (TTT) on extracted hidden states.

Offline, the hidden states come from extract's shards; online (`--online`, `--data` is
generate's answers.jsonl) the frozen target runs in the loop on each packed batch, so nothing
touches the disk. Samples are packed greedily into rows of at most `batch_tokens`, and
`rows_per_pack` consecutive rows make a pack: one (B, T) batch, T its longest row, the shorter
rows padded with a segment of their own that no sample attends to and nothing scores. The
drafter is unrolled `ttt_depth` steps (draft.py), and each step's output is scored against the
target's own distribution over the draft vocab, recomputed from the stored final hidden state
with the frozen target head (REFERENCE.md §2):

    loss = sum_j 0.8^j * KL(softmax(z_target[t+1+j] | draft vocab) || q_j[t])  on assistant tokens

each step's KL the mean over its scored tokens in the whole pack. The steps share their target
rows, so those log-probs are computed once per pack (up to `target_cache_mb`). A step scoring more
than `loss_chunk_tokens` tokens computes its loss in checkpointed chunks, so the (tokens, Vd) logits
of a whole pack never exist at once. On CUDA the KL runs through torch.compile (`compile_loss`);
the TTT attention runs through compiled flex_attention on CUDA (`attn_impl` "split", the default there,
or "flex"; less memory and faster than materialised scores, see Eagle3Drafter.ttt). acc_j is agreement with the target's greedy token and
the simulated accept length is 1 + sum_k prod_{i<=k} acc_i; evaluation (each epoch, the held-out split
and `--eval-data` / `--eval-data-sampled`) adds overlap_j, the chance a token drawn from q_j at T=1 is kept
by speculative sampling, and accept_length_t1 from them. Rank 0 logs them per step to
metrics.jsonl and, when tensorboard is installed (the `tb` extra), under <out>/tb. Checkpoints hold
model, optimizer, scheduler, step, data position and RNG state, written atomically;
rerunning the same command resumes exactly.

    python -m draftsmith train --target smollm2-135m --data runs/hs --out runs/draft

Several GPUs (or CPU processes, over gloo): launch the same command under torchrun, e.g.

    torchrun --nproc-per-node 8 -m draftsmith train --device cuda --parallel fsdp ...

Every rank packs the same global sequence of batches; an optimizer step takes the next
W x grad_accum packs (W ranks), rank r training on packs r, r+W, ... of them, and its gradient
is the mean over those packs of each pack's loss. So a run is defined by W x grad_accum alone:
8 GPUs with grad_accum 1 follow the loss curve of 1 GPU with grad_accum 8, and a checkpoint
(always unsharded, written by rank 0) resumes under any W with the same product. `--parallel`
picks DDP (replicated weights) or FSDP2 (sharded weights and optimizer state); parallel.py.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from itertools import islice, repeat
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch.utils.checkpoint import checkpoint

from draftsmith.common import Progress, dtype_of, write_config
from draftsmith.data import encode_conversation, prompt_of
from draftsmith.draft import TTT_ATTENTION, DraftConfig, Eagle3Drafter, broadcast_block_mask, causal_segment_mask_mod
from draftsmith.export import load_any, save_trained
from draftsmith.extract import HiddenStates, read_conversations
from draftsmith.parallel import (World, barrier, close, full_optimizer_state, full_state_dict, gather, init_world,
                                 load_optimizer_state, parallelize, sync_gradients)
from draftsmith.target import load_target
from draftsmith.vocab import build_vocab, count_tokens

STEP_DECAY = 0.8  # TTT step j's loss weight is STEP_DECAY**j (EAGLE, SpecForge; REFERENCE.md section 2)


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str  # extract's output folder; with online, generate's answers.jsonl
    out: str
    online: bool = False  # run the target in the loop instead of reading extracted shards
    aux_layers: tuple[int, ...] | None = None  # online only; offline they come from the shards
    max_length: int = 2048  # online only: conversations are truncated to this many tokens
    draft_vocab_size: int = 32000  # capped at the target vocab
    draft_intermediate_size: int | None = None  # the drafter's MLP width; None: the target's (SGLang and vLLM read it
    # from the exported config)
    ttt_depth: int = 7
    eval_depth: int | None = None  # draft steps the held-out and --eval-data scores unroll (None: ttt_depth); set it
    # when comparing drafters trained at different depths, e.g. a depth-3 drafter scored over 7 steps
    step_decay: float = STEP_DECAY  # TTT step j's loss weight is step_decay**j: lower puts more of the loss on the
    # first draft steps (which a short chain leans on) while the later ones are still trained
    epochs: int = 1
    lr: float | None = None  # None: 1e-3 from scratch (the H200 recipe, h200-recipe.md), 1e-4 from an init drafter
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 2048  # packed tokens per row (defaults here and below: the measured H200 recipe)
    rows_per_pack: int = 8  # rows per pack, one (rows, <= batch_tokens) batch; a step takes world size x grad_accum packs
    grad_accum: int = 1  # packs per rank per optimizer step
    loss_chunk_tokens: int = 4096  # a TTT step scoring more tokens computes its draft-vocab loss in
    # checkpointed chunks of this many (no (tokens, Vd) logits over the whole pack); 0: never chunk
    target_cache_mb: int = 4096  # the target's draft-vocab log-probs of a pack (fp32, scored rows x Vd) are computed
    # once and kept when they fit in this; beyond, each step's chunks recompute theirs; 0: never kept
    attn_impl: str = "auto"  # TTT attention: "flex" (compiled on CUDA), "eager" (materialised scores), "split" (flex over
    # step 0's keys, the later steps' own keys merged in); auto: split on CUDA (an H100: attention forward + backward
    # 25.7 ms against flex's 94.2 at SmolLM2's training shape, MFU 0.398 vs 0.336 at the 8B shape), eager elsewhere
    compile_loss: bool | None = None  # the per-chunk KL through torch.compile; None: on CUDA
    target_attn: str = "sdpa"  # online: the target's attention over a pack, "sdpa" (a dense (T, T) same-sample causal
    # mask) or "flex" (flex_attention with a block mask: the tiles no query of the sample sees are skipped; compiled on CUDA)
    target_compile: bool = False  # online: the target's pass over a pack through torch.compile (Transformer.compile_long:
    # fused norms, rotary and activations; a one-off compilation, seconds on a GPU)
    pad_packs: bool = False  # pad every pack to rows_per_pack x batch_tokens: one shape for compiled code and kernel plans
    # (the same scores: padding is never attended to by a sample nor scored), at the cost of computing the padding
    parallel: str = "ddp"  # under torchrun: "ddp" or "fsdp" (FSDP2 fully_shard)
    eval_fraction: float = 0.05
    eval_data: str | None = None  # also evaluate on this (answers.jsonl online, extracted shards offline) each epoch,
    # e.g. the target's own answers to the benchmark's prompts: the held-out split alone flatters a skewed mix
    eval_data_sampled: str | None = None  # and on this, e.g. the target's sampled (T=1) answers to the same prompts:
    # the text T=1 decoding drafts after, so its accept_length_t1 scores sampled decoding (greedy text overstates it)
    save_every: int = 100  # optimizer steps between checkpoints
    init_head_from_target: bool = True
    init: str | None = None  # start from this drafter (a train output's drafter/ or an SGLang export): its weights
    # and its draft vocab; the target's embedding is copied in as always
    seed: int = 0
    max_steps: int | None = None  # stop early (the schedule still spans all epochs)
    schedule_steps: int | None = None  # train exactly this many steps (epochs repeat as needed), schedule included
    max_seconds: float | None = None  # stop (checkpointed) after the step that crosses this many seconds of this run;
    # a rerun resumes with the schedule intact, so a long run can be cut into time-boxed calls
    device: str = "cpu"
    target_dtype: str = "float32"  # online: the target's compute dtype
    profile_steps: int = 0  # profile this many steps from step profile_from (torch.profiler) into profile.json: where a
    # step's time goes (device kernels vs host), for speeding training up
    profile_from: int = 10  # the first profiled step; late in a run (e.g. 1000) compiled shapes and caches have settled

    def __post_init__(self):
        if self.ttt_depth < 1 or self.epochs < 1 or self.batch_tokens < 16 or (self.eval_depth is not None and self.eval_depth < 1):
            raise ValueError("need ttt_depth >= 1, eval_depth >= 1, epochs >= 1, batch_tokens >= 16")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"step_decay must be in (0, 1], got {self.step_decay}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("eval_fraction must be in [0, 1)")
        if self.grad_accum < 1 or self.parallel not in ("ddp", "fsdp"):
            raise ValueError("need grad_accum >= 1 and parallel in ('ddp', 'fsdp')")
        if self.rows_per_pack < 1 or self.loss_chunk_tokens < 0 or self.target_cache_mb < 0:
            raise ValueError("need rows_per_pack >= 1, loss_chunk_tokens >= 0 and target_cache_mb >= 0")
        if self.attn_impl not in TTT_ATTENTION:
            raise ValueError(f"attn_impl must be one of {', '.join(map(repr, TTT_ATTENTION))}, not {self.attn_impl!r}")
        if self.target_attn not in TARGET_ATTENTION:
            raise ValueError(f"target_attn must be one of {', '.join(map(repr, TARGET_ATTENTION))}, not {self.target_attn!r}")
        if self.target_compile and self.target_attn == "flex" and not self.device.startswith("cuda"):
            raise ValueError("target_compile with target_attn='flex' needs a CUDA device (inductor's CPU flex kernel "
                             "fails to build); on the CPU use target_attn='sdpa' with it")
        if self.attn_impl in ("flex", "split") and not self.device.startswith("cuda"):
            raise ValueError(f"attn_impl {self.attn_impl!r} needs CUDA (torch has no flex_attention backward on the "
                             f"{self.device}): use --attn-impl auto or eager there")


@dataclass
class TrainResult:
    out: str
    steps: int
    seconds: float
    eval: dict  # held-out loss_j, acc_j, accept length
    vocab_coverage: float
    loop_seconds: float = 0.0  # time in optimizer steps (no loading, no evaluation)


# --------------------------------------------------------------------------- data


def split(ids: list[str], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Train / held-out indices, decided on the sample ids (not storage order), so offline shards
    and online conversations split and shuffle identically. Answers sampled from one prompt
    (generate --samples) fall on the same side: held-out prompts are unseen prompts."""
    groups = sorted({prompt_of(i) for i in ids})
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    k = int(len(groups) * eval_fraction) if len(groups) > 1 else 0
    held_out = {groups[i] for i in order[:k]}
    canon = sorted(range(len(ids)), key=lambda i: ids[i])
    return [i for i in canon if prompt_of(ids[i]) not in held_out], [i for i in canon if prompt_of(ids[i]) in held_out]


def pack(rows: list[list[dict]], device, shape: tuple[int, int] | None = None) -> dict:
    """B rows of concatenated samples -> (B, T) tensors with segment and position ids, T the
    longest row. Shorter rows are padded with segment id -1, loss mask 0 and position 0: no
    sample attends to padding (segments differ) and no padded token is scored (loss mask).
    shape (rows, tokens): pad to it instead (TrainConfig.pad_packs), more rows of padding alone if need be."""
    cat = [{k: torch.cat([s[k] for s in row]) for k in row[0]} for row in rows]
    for c, row in zip(cat, rows):
        c["segment_ids"] = torch.cat([torch.full((len(s["input_ids"]),), i) for i, s in enumerate(row)])
        c["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in row])
    B, T = len(cat), max(len(c["input_ids"]) for c in cat)
    if shape is not None:
        if shape[0] < B or shape[1] < T:
            raise ValueError(f"a pack of {B} rows of up to {T} tokens does not fit the shape {shape}")
        B, T = shape
    out = {}
    for k, v in cat[0].items():
        t = torch.full((B, T, *v.shape[1:]), -1 if k == "segment_ids" else 0, dtype=v.dtype)  # (B, T, ...)
        for b, c in enumerate(cat):
            t[b, :len(c[k])] = c[k]
        out[k] = t.to(device)
    return out


def pack_shape(cfg: TrainConfig) -> tuple[int, int] | None:
    """The one (rows, tokens) shape every pack is padded to with pad_packs, else None (each as long as its longest row)."""
    return (cfg.rows_per_pack, cfg.batch_tokens) if cfg.pad_packs else None


def greedy_rows(data: HiddenStates, indices: list[int], batch_tokens: int, start: int = 0):
    """Greedy packing into rows of at most batch_tokens, in the given order; yields (next cursor, samples)."""
    i = start
    while i < len(indices):
        group, n = [], 0
        while i < len(indices):
            s = data[indices[i]]
            length = min(len(s["input_ids"]), batch_tokens)
            if group and n + length > batch_tokens:
                break
            group.append({k: v[:length] for k, v in s.items()})
            n, i = n + length, i + 1
        yield i, group


def grouped(it, k: int):
    """(cursor, item) pairs in groups of k (the last may be short); yields (cursor after the group, items)."""
    while chunk := list(islice(it, k)):
        yield chunk[-1][0], [x for _, x in chunk]


def batches(data, indices: list[int], batch_tokens: int, rows_per_pack: int = 1, start: int = 0):
    """Packs of rows_per_pack consecutive rows; yields (next cursor, rows). A pack is what one
    forward takes, as a (rows_per_pack, <= batch_tokens) batch (pack())."""
    return grouped(greedy_rows(data, indices, batch_tokens, start), rows_per_pack)


def steps(data, indices: list[int], batch_tokens: int, start: int, packs_per_step: int, rows_per_pack: int = 1):
    """The global pack sequence cut into optimizer steps; yields (cursor after the step, packs).
    Every rank computes the same sequence, so the cursor means the same at any world size."""
    return grouped(batches(data, indices, batch_tokens, rows_per_pack, start), packs_per_step)


def pack_tokens(p: list[list[dict]]) -> int:
    return sum(len(s["input_ids"]) for row in p for s in row)


class Conversations:
    """Online data: chat-templated token ids and loss masks; features come from the target per batch."""

    def __init__(self, path: str, tokenizer, max_length: int):
        self.samples, self.ids = [], []
        for sid, conv in read_conversations(path):
            enc = encode_conversation(tokenizer, conv)
            if sum(enc.loss_mask[:max_length]):
                self.ids.append(sid)
                self.samples.append({"input_ids": torch.tensor(enc.input_ids[:max_length], dtype=torch.int32),
                                     "loss_mask": torch.tensor(enc.loss_mask[:max_length], dtype=torch.uint8)})

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


TARGET_ATTENTION = ("sdpa", "flex")


@torch.no_grad()
def target_features(model, batch: dict, aux_layers, attn: str = "sdpa") -> dict:
    """The target over a packed (B, T) batch, each sample attending only to itself: aux, final, argmax.
    attn: "sdpa", a dense same-sample causal mask; "flex", a block mask of it (TrainConfig.target_attn)."""
    ids, seg, pos = batch["input_ids"].long(), batch["segment_ids"], batch["position_ids"]
    B, T = ids.shape
    model.setup_caches(B, T)
    visible = causal_segment_mask_mod(seg)  # key ki seen from query qi: ki <= qi in qi's sample
    if attn == "flex":  # over the cache's first T slots
        mask = broadcast_block_mask(visible, B, T, T, ids.device)
    else:
        n = torch.arange(T, device=ids.device)
        mask = torch.zeros(B, 1, T, model.max_len, dtype=torch.bool, device=ids.device)  # the cache may be longer than T
        mask[..., :T] = visible(torch.arange(B, device=ids.device)[:, None, None], None, n[:, None], n)[:, None]
    out = model(ids, torch.arange(T, device=ids.device), mask, pos, capture=aux_layers)
    # the (tokens, V) logits a chunk at a time, whatever B is
    argmax = torch.cat([model.greedy(h) for h in out.hidden.flatten(0, 1).split(1024)]).view(B, T)
    return {"aux": out.aux, "final": out.hidden, "argmax": argmax}


def compiled_or_eager(model, batch: dict, aux_layers, attn: str) -> dict:
    """target_features; if the compiled pass (TrainConfig.target_compile) fails to build or run, say so and go on
    eager for the rest of the run (the same features, slower) rather than lose a long job to a compiler error."""
    try:
        return target_features(model, batch, aux_layers, attn)
    except Exception as e:  # torch._dynamo / inductor errors come in many classes
        if not model.long_compiled or isinstance(e, torch.OutOfMemoryError):
            raise
        first = (str(e).splitlines() or [""])[0][:200]
        print(f"warning: the compiled target pass failed ({type(e).__name__}: {first}); training goes on with the eager"
              " pass (drop --target-compile to skip the attempt)", flush=True)
        model.uncompile_long()
        return target_features(model, batch, aux_layers, attn)


# --------------------------------------------------------------------------- objective


def scored(segment_ids: torch.Tensor, loss_mask: torch.Tensor, depth: int) -> torch.Tensor:
    """(depth, B, T) bool: step j scores row t against the target at t+1+j (which predicts token
    t+2+j) when t, t+1+j and t+2+j lie in one sample and token t+2+j is an assistant token."""
    B, T = segment_ids.shape
    out = torch.zeros(depth, B, T, dtype=torch.bool, device=segment_ids.device)
    for j in range(min(depth, T - 2)):
        n, s = T - 2 - j, segment_ids
        out[j, :, :n] = (s[:, :n] == s[:, 1 + j:T - 1]) & (s[:, 1 + j:T - 1] == s[:, 2 + j:]) & loss_mask[:, 2 + j:]
    return out


def target_logp(head: torch.Tensor, final: torch.Tensor) -> torch.Tensor:
    """The target's log-probs over the draft vocab: final states (n, H) through the frozen head (Vd, H) -> (n, Vd) fp32."""
    return F.log_softmax((final.to(head.dtype) @ head.T).float(), dim=-1)


def target_table(head: torch.Tensor, final: torch.Tensor, rows: torch.Tensor, chunk: int | None, limit_mb: int):
    """How the scored rows find their target log-probs: (log_p, index), log_p(index[i]) the (Vd,) log-probs
    of target row rows[i]. Every step is scored against rows of the same (B*T) set, so, when the (rows, Vd)
    fp32 matrix fits in limit_mb, each row's log-probs are computed once per pack, `chunk` rows at a time,
    and kept; beyond, each chunk of each step recomputes its own inside its checkpoint (bounded memory)."""
    need, index = torch.unique(rows, return_inverse=True)  # sorted distinct target rows
    if len(need) * head.shape[0] * 4 > limit_mb * 2**20:
        return (lambda r: target_logp(head, final[r])), rows
    with torch.no_grad():
        table = torch.cat([target_logp(head, f) for f in final[need].split(chunk or max(len(need), 1))])  # (rows, Vd)
    return (lambda i: table[i]), index


def kl_terms(q: torch.Tensor, log_p: torch.Tensor):
    """Forward KL(target || draft) of each row from draft logits q (n, Vd) fp32 and target log-probs
    log_p (n, Vd), and the draft's greedy ids: (n,), (n,)."""
    # the soft cross-entropy minus the target's entropy (same gradient, 0 when matched)
    return (log_p.exp() * (log_p - F.log_softmax(q, dim=-1))).sum(-1), q.argmax(-1)


@functools.cache
def compiled_kl_terms():
    """kl_terms is a few passes over (n, Vd) fp32 each way (log_softmax, exp, products, sum, argmax);
    inductor fuses them forward and backward. Default dynamic: the second chunk size seen makes the row
    count dynamic (one recompile), while Vd stays a constant."""
    return torch.compile(kl_terms)


def overlap_terms(q: torch.Tensor, log_p: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Each row's chance that one token drawn from the draft at T=1 is kept by speculative sampling
    (x ~ q kept with probability min(1, p(x)/q(x))): sum over the draft vocab of min(p, q), p the target's
    whole-vocab probabilities of the draft tokens: log_p (renormalised over the draft vocab) times mass
    (the target's probability on the draft vocab). Draft logits q (n, Vd), log_p (n, Vd), mass (n,) -> (n,)."""
    return torch.minimum(log_p.exp() * mass[:, None], F.softmax(q.float(), dim=-1)).sum(-1)


@torch.no_grad()
def vocab_mass(full_head: torch.Tensor, draft_ids: torch.Tensor, final: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The target's probability on the draft vocab (its target ids draft_ids, (Vd,)) at each target row in rows
    (N,) -> (N,) fp32 (1 when the draft vocab is the whole vocab); full_head (V, H). Each distinct row once, at
    most ~256 MB of (rows, V) fp32 logits at a time."""
    need, index = torch.unique(rows, return_inverse=True)
    per, parts = max(1, (256 << 20) // (4 * full_head.shape[0])), []
    for f in final[need].split(per):
        logits = (f.to(full_head.dtype) @ full_head.T).float()
        parts.append(torch.logsumexp(logits[:, draft_ids], -1) - torch.logsumexp(logits, -1))
    if not parts:
        return torch.ones(0, device=final.device)
    return torch.cat(parts).exp()[index]


def chunk_kl(drafter: Eagle3Drafter, hidden: torch.Tensor, log_p, index: torch.Tensor, compiled: bool,
             mass: torch.Tensor | None = None):
    """kl_terms for n draft outputs hidden (n, H) against the target log-probs log_p(index) (n, Vd); with
    mass (n,) (evaluation), each row's T=1 acceptance (overlap_terms) as a third output."""
    q = drafter.logits(hidden)  # (n, Vd)
    with torch.no_grad():
        target = log_p(index)
    kl, ids = (compiled_kl_terms() if compiled else kl_terms)(q, target)
    if mass is None:
        return kl, ids
    return kl, ids, overlap_terms(q.detach(), target, mass)


def step_kl(drafter: Eagle3Drafter, hidden: torch.Tensor, log_p, index: torch.Tensor, chunk: int | None, compiled: bool,
            mass: torch.Tensor | None = None):
    """chunk_kl over all n rows of a step; past `chunk` rows (None or 0: never), `chunk` at a time under
    activation checkpointing, so backward recomputes each chunk's (chunk, Vd) logits instead of keeping them."""
    if not chunk or len(hidden) <= chunk:
        return chunk_kl(drafter, hidden, log_p, index, compiled, mass)
    pieces = zip(hidden.split(chunk), index.split(chunk), mass.split(chunk) if mass is not None else repeat(None))
    if torch.is_grad_enabled():
        parts = [checkpoint(chunk_kl, drafter, h, log_p, i, compiled, m, use_reentrant=False, preserve_rng_state=False)
                 for h, i, m in pieces]
    else:  # evaluation: no graph keeps a chunk alive
        parts = [chunk_kl(drafter, h, log_p, i, compiled, m) for h, i, m in pieces]
    return tuple(torch.cat(column) for column in zip(*parts))


def ttt_loss(drafter: Eagle3Drafter, head: torch.Tensor, batch: dict, depth: int, chunk_tokens: int | None = None, *,
             target_cache_mb: int = 4096, attn_impl: str = "auto", compile_loss: bool | None = None,
             step_decay: float = STEP_DECAY, full_head: torch.Tensor | None = None):
    """Weighted TTT loss plus per-step (loss_j, acc_j, count_j) over a packed (B, T) batch; loss_j
    is the mean over the step's scored tokens in all B rows. head: (Vd, H) target rows. chunk_tokens
    bounds the scored tokens whose (n, Vd) logits exist at once (step_kl); target_cache_mb the target's
    log-probs kept for the whole pack (target_table). attn_impl goes to Eagle3Drafter.ttt; compile_loss
    (None: on CUDA) runs kl_terms compiled. Step j's loss weighs step_decay**j. With full_head, the
    target's whole (V, H) head, and outside autograd (evaluation), each step's stats also carry overlap_j,
    the mean chance a T=1 draft token is kept (overlap_terms): (loss_j, acc_j, count_j, overlap_j)."""
    ids = batch["input_ids"].long()
    dtype = drafter.fc.weight.dtype
    compiled = ids.is_cuda if compile_loss is None else compile_loss
    outs = drafter.ttt(ids, batch["aux"].to(dtype), depth, batch["position_ids"], batch["segment_ids"], attn_impl)
    where = scored(batch["segment_ids"], batch["loss_mask"].bool(), depth).flatten(1)  # (depth, B*T)
    hit = where.nonzero()  # (N, 2): (step, flat row), steps in order
    counts = torch.bincount(hit[:, 0], minlength=depth).tolist()
    nxt = hit[:, 1] + 1 + hit[:, 0]  # (N,) the target rows they are scored against, never in another batch row (scored())
    final, argmax = batch["final"].flatten(0, 1), batch["argmax"].long().flatten()  # (B*T, H), (B*T,)
    log_p, index = target_table(head, final, nxt, chunk_tokens, target_cache_mb)
    mass = None  # with full_head in evaluation: the target's probability on the draft vocab at each scored row
    if full_head is not None and not torch.is_grad_enabled():
        mass = vocab_mass(full_head, drafter.target_ids(), final, nxt)
    total, losses, accs, overlaps = 0.0, [], [], []
    masses = mass.split(counts) if mass is not None else repeat(None)
    for j, (h, r, n, i, m) in enumerate(zip(outs, *(t.split(counts) for t in (hit[:, 1], nxt, index)), masses)):
        if not len(r):
            for column in (losses, accs, overlaps):
                column.append(torch.zeros((), device=ids.device))
            continue
        kl, pred, *overlap = step_kl(drafter, h.flatten(0, 1)[r], log_p, i, chunk_tokens, compiled, m)  # (n,), (n,)
        loss_j = kl.mean()
        total = total + step_decay**j * loss_j
        losses.append(loss_j.detach())
        accs.append((drafter.to_target(pred) == argmax[n]).float().mean())
        if overlap:
            overlaps.append(overlap[0].mean())
    columns = [losses, accs] + ([overlaps] if mass is not None else [])
    values = torch.stack([torch.stack(c) for c in columns]).tolist()  # one host sync for all steps
    return total, [(values[0][j], values[1][j], counts[j], *(v[j] for v in values[2:])) for j in range(len(losses))]


def accept_length(accs: list[float]) -> float:
    """Simulated accept length 1 + sum_k prod_{i<=k} acc_i."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= a
        tau += run
    return tau


def summarize(stats: list[list[tuple]]) -> dict:
    """Per-pack per-step (loss_j, acc_j, count_j[, overlap_j]) -> token-weighted means per step, the simulated
    accept length, and with overlaps (evaluation) accept_length_t1: the same chain at T=1, each step kept
    with its mean overlap (teacher-forced on the data's own text, as acc_j is)."""
    depth = len(stats[0])
    n = [max(sum(s[j][2] for s in stats), 1) for j in range(depth)]

    def mean(c: int) -> list[float]:  # column c's token-weighted mean at each step
        return [sum(s[j][c] * s[j][2] for s in stats) / n[j] for j in range(depth)]

    out = {"loss": mean(0), "acc": mean(1)}
    out["accept_length"] = accept_length(out["acc"])
    if len(stats[0][0]) > 3:
        out["overlap"] = mean(3)
        out["accept_length_t1"] = accept_length(out["overlap"])
    return out


class TTTObjective(nn.Module):
    """What DDP / FSDP wrap (their hooks run around forward): packed batch -> (loss, stats).
    batch None stands in for a rank with no pack left in a step; like a pack with no scored
    token it gives a zero loss over every trainable weight, so that backward's collectives line up.
    options: ttt_loss's keyword options (target_cache_mb, attn_impl, compile_loss, step_decay, full_head)."""

    def __init__(self, drafter: Eagle3Drafter, head: torch.Tensor, depth: int, chunk_tokens: int | None = None, **options):
        super().__init__()
        self.drafter, self.head, self.depth = drafter, head, depth  # head: frozen (Vd, H), not a weight
        self.chunk_tokens, self.options = chunk_tokens, options

    def forward(self, batch: dict | None, depth: int | None = None):
        loss, stats = (ttt_loss(self.drafter, self.head, batch, depth or self.depth, self.chunk_tokens, **self.options)
                       if batch is not None else (0.0, []))
        if not torch.is_tensor(loss):
            loss = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        return loss, stats


def train_step(model, params, opt, packs: list, cfg: TrainConfig, world: World, featurize) -> list:
    """One optimizer step over this step's k global packs (the same list on every rank). Rank r
    trains on packs r, r+W, ...; each pack's loss is weighted W/k, so after backward averages the
    gradient over the W ranks, it is the mean over the k packs of the per-pack gradient, whatever
    W and grad_accum are. Returns every pack's stats, in pack order, on every rank."""
    k, mine = len(packs), list(range(world.rank, len(packs), world.size))
    slots = cfg.grad_accum if world.size > 1 else len(mine)  # ranks must agree on the number of backwards
    opt.zero_grad(set_to_none=True)
    done = []
    for a in range(slots):
        i = mine[a] if a < len(mine) else None
        with sync_gradients(model, a == slots - 1):
            with autocast(world.device):
                loss, stats = model(featurize(pack(packs[i], world.device, pack_shape(cfg))) if i is not None else None)
            (loss * (world.size / k)).backward()
        if i is not None:
            done.append((i, stats))
    stats = [s for _, s in sorted(gather(world, done))]
    if any(n for s in stats for _, _, n in s):  # as in one process: no scored token, no update
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
    return stats


@torch.no_grad()
def evaluate(model, data, indices, cfg: TrainConfig, featurize, world: World) -> dict:
    """Held-out metrics, the packs spread over the ranks like in training (FSDP needs every rank
    in every forward, so ranks that run out pass None)."""
    if not indices:
        return {}
    packs = [p for _, p in batches(data, indices, cfg.batch_tokens, cfg.rows_per_pack)]
    model.eval()
    mine = []
    for i in range(world.rank, math.ceil(len(packs) / world.size) * world.size, world.size):
        with autocast(world.device):
            _, stats = model(featurize(pack(packs[i], world.device, pack_shape(cfg))) if i < len(packs) else None,
                             depth=cfg.eval_depth)
        if i < len(packs):
            mine.append((i, stats))
    model.train()
    return summarize([s for _, s in sorted(gather(world, mine))])


def score(model, data, eval_idx, extra: dict, cfg: TrainConfig, featurize, world: World) -> dict:
    """{"eval": held-out metrics} and each extra set's under its name ("eval_data", "eval_data_sampled")."""
    out = {"eval": evaluate(model, data, eval_idx, cfg, featurize, world)}
    for name, dataset in extra.items():
        out[name] = evaluate(model, dataset, list(range(len(dataset))), cfg, featurize, world)
    return out


def autocast(device: str):
    """bf16 matmuls with fp32 master weights on CUDA; plain fp32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()


class StepProfile:
    """torch.profiler around `count` training steps from step `first`; after the last one writes `path`: wall
    time, summed device-kernel time (how busy the accelerator was), and the top kernels and host ops."""

    def __init__(self, path: Path, first: int, count: int):
        self.path, self.first, self.count = path, first, count
        self.device: dict = {}  # kernel -> summed microseconds over the profiled steps
        self.host: dict = {}  # host op -> summed self microseconds
        self.wall: list[float] = []

    @contextmanager
    def around(self, step: int):
        if not self.first <= step < self.first + self.count:
            yield
            return
        from torch.profiler import ProfilerActivity, profile
        cuda = torch.cuda.is_available()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            yield
            if cuda:
                torch.cuda.synchronize()
        self.wall.append(time.perf_counter() - t)
        for e in prof.key_averages():
            self.device[e.key] = self.device.get(e.key, 0) + e.self_device_time_total
            self.host[e.key] = self.host.get(e.key, 0) + e.self_cpu_time_total
        if step == self.first + self.count - 1:
            n = len(self.wall)

            def top(d):
                return {k[:90]: round(v / 1e3 / n, 3) for k, v in sorted(d.items(), key=lambda x: -x[1])[:30] if v}
            self.path.write_text(json.dumps({
                "steps": n, "from_step": self.first, "wall_ms_per_step": round(1e3 * sum(self.wall) / n, 2),
                "device_kernel_ms_per_step": round(sum(self.device.values()) / 1e3 / n, 2),
                "top_device_ms_per_step": top(self.device), "top_host_self_ms_per_step": top(self.host)}, indent=1))


# --------------------------------------------------------------------------- state


def lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


def save_checkpoint(folder: Path, drafter, opt, sched, state: dict, world: World):
    """Unsharded weights and optimizer state (gathered on every rank), written by rank 0 atomically."""
    weights, optimizer = full_state_dict(drafter), full_optimizer_state(opt)
    if world.main:
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(tmp / "model.safetensors"))
        torch.save({"optimizer": optimizer, "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), **state},
                   tmp / "state.pt")
        if folder.exists():
            old = folder.with_name(folder.name + ".old")
            folder.rename(old)
            tmp.rename(folder)
            for f in old.iterdir():
                f.unlink()
            old.rmdir()
        else:
            tmp.rename(folder)
    barrier(world)


def load_checkpoint(folder: Path, opt, sched, packs_per_step: int, rows_per_pack: int) -> dict:
    """Optimizer, scheduler and RNG (the weights were loaded before parallelize); returns the rest."""
    # older checkpoints: one pack a step (before #6), one row a pack
    state = {"packs_per_step": 1, "rows_per_pack": 1, **torch.load(folder / "state.pt", weights_only=True)}
    if state["packs_per_step"] != packs_per_step:
        raise ValueError(f"{folder} was written with {state['packs_per_step']} packs per step (processes x grad_accum), "
                         f"this run takes {packs_per_step}; resume with the same product")
    if state["rows_per_pack"] != rows_per_pack:
        raise ValueError(f"{folder} was written with rows_per_pack {state['rows_per_pack']}, not {rows_per_pack}: "
                         "another schedule; resume with the same value")
    load_optimizer_state(opt, state.pop("optimizer"))
    sched.load_state_dict(state.pop("scheduler"))
    torch.set_rng_state(state.pop("rng"))
    return state


class Scalars:
    """TensorBoard scalars under <out>/tb, written by rank 0 when tensorboard is installed; on
    other ranks, or without it, every call does nothing. A run resumed at `step` hides the
    events that the interrupted one logged past it."""

    def __init__(self, out: Path, world: World, step: int):
        self.writer = None
        if not world.main:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            print("tensorboard is not installed (pip install 'draftsmith[tb]'): no TensorBoard logs")
            return
        self.writer = SummaryWriter(str(out / "tb"), purge_step=step + 1 if step else None)

    def add(self, tag: str, metrics: dict, step: int):
        """Lists (loss, acc) become one curve per TTT step: tag/loss_0, tag/loss_1, ..."""
        if self.writer is None:
            return
        for name, value in metrics.items():
            for j, v in (enumerate(value) if isinstance(value, list) else [(None, value)]):
                self.writer.add_scalar(f"{tag}/{name}" + (f"_{j}" if j is not None else ""), v, step)

    def flush(self):
        if self.writer is not None:
            self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()


# --------------------------------------------------------------------------- entry point


def build_drafter(cfg: TrainConfig, target, data, train_idx: list[int], aux: tuple[int, ...], device: str | None = None):
    """(drafter, its draft vocab's share of the training tokens, the training tokens' counts per target id)."""
    args = target.model.args
    counts = count_tokens((data[i] for i in train_idx), args.vocab_size)
    if cfg.init:
        return (*init_drafter(cfg.init, target, aux, counts, device or cfg.device), counts)
    vocab = build_vocab(counts, min(cfg.draft_vocab_size, args.vocab_size))
    torch.manual_seed(cfg.seed)
    dcfg = DraftConfig.from_target(args, len(vocab.d2t), aux)
    drafter = Eagle3Drafter(replace(dcfg, intermediate_size=cfg.draft_intermediate_size or dcfg.intermediate_size))
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    drafter.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    if cfg.init_head_from_target:
        drafter.init_from_target(target.model)
    return drafter.to(device or cfg.device), vocab.coverage, counts


def init_drafter(path: str, target, aux: tuple[int, ...], counts: torch.Tensor, device: str):
    """A drafter trained earlier, to train further; it must fit this target and these aux layers."""
    drafter = load_any(path, target.model.embed_tokens.weight.detach().float().cpu()).float()
    drafter.cfg.check_target(target.model.args, f"--init {path}")
    if drafter.cfg.aux_layer_ids != tuple(aux):
        raise ValueError(f"--init {path} fuses aux layers {list(drafter.cfg.aux_layer_ids)}, the training data {list(aux)}: "
                         "extract (or --aux-layers) with the drafter's layers")
    drafter.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    coverage = float(counts[drafter.t2d.cpu()].sum() / max(1, counts.sum()))
    return drafter.to(device), coverage


def load_data(config: TrainConfig, target):
    """(dataset, aux layer ids, featurize): offline shards as stored, online the target per pack."""
    if config.online:
        data = Conversations(config.data, target.tokenizer, config.max_length)
        aux = tuple(config.aux_layers or target.model.args.default_aux_layers())
        if config.target_compile:
            target.model.compile_long()
        return data, aux, lambda batch: {**batch, **compiled_or_eager(target.model, batch, aux, config.target_attn)}
    data = HiddenStates(config.data)
    if data.manifest.get("hidden_size") != target.model.args.hidden_size:
        raise ValueError(f"{config.data} was extracted from a target of hidden size {data.manifest.get('hidden_size')}, "
                         f"not {config.target} ({target.model.args.hidden_size})")
    return data, tuple(data.manifest["aux_layer_ids"]), lambda batch: batch


def load_eval_data(config: TrainConfig, target, aux: tuple[int, ...]) -> dict:
    """The extra evaluation sets by name ("eval_data", "eval_data_sampled"; those given): read like the
    training data, and fed the same features."""
    sets = {}
    for name in ("eval_data", "eval_data_sampled"):
        path = getattr(config, name)
        if not path:
            continue
        if config.online:
            sets[name] = Conversations(path, target.tokenizer, config.max_length)
            continue
        sets[name] = HiddenStates(path)
        if tuple(sets[name].manifest["aux_layer_ids"]) != tuple(aux):
            raise ValueError(f"--{name.replace('_', '-')} {path} holds aux layers {sets[name].manifest['aux_layer_ids']}, "
                             f"the training data {list(aux)}: extract both with the same --aux-layers")
    return sets


def unsharded(drafter: Eagle3Drafter, config: TrainConfig, world: World) -> Eagle3Drafter:
    """The drafter with plain full weights, for save_trained (collective under FSDP)."""
    if world.size == 1 or config.parallel == "ddp":
        return drafter
    plain = Eagle3Drafter(drafter.cfg)
    plain.load_state_dict(full_state_dict(drafter))
    return plain


def run(config: TrainConfig) -> TrainResult:
    world = init_world(config.device)  # one process unless launched by torchrun
    try:
        return train(config, world)
    finally:
        close(world)


def train(config: TrainConfig, world: World) -> TrainResult:
    t0 = time.perf_counter()
    out, device = Path(config.out), world.device
    out.mkdir(parents=True, exist_ok=True)
    if config.lr is None:
        config = replace(config, lr=1e-4 if config.init else 1e-3)
    if world.main:
        write_config(out, "train", config)
    target = load_target(config.target, device, dtype_of(config.target_dtype))
    data, aux, featurize = load_data(config, target)
    train_idx, eval_idx = split(data.ids, config.eval_fraction, config.seed)
    extra = load_eval_data(config, target, aux)
    drafter, coverage, counts = build_drafter(config, target, data, train_idx, aux, device)
    head = target.model.lm_head.weight[drafter.target_ids()].detach()
    ckpt = out / "checkpoint"
    resuming = (ckpt / "state.pt").exists()
    if resuming:
        drafter.load_state_dict(load_file(str(ckpt / "model.safetensors")))
    objective = TTTObjective(drafter, head, config.ttt_depth, config.loss_chunk_tokens, target_cache_mb=config.target_cache_mb,
                             attn_impl=config.attn_impl, compile_loss=config.compile_loss, step_decay=config.step_decay,
                             full_head=target.model.lm_head.weight.detach())  # evaluation's T=1 acceptance
    model = parallelize(objective, config.parallel, world)
    params = [p for p in drafter.parameters() if p.requires_grad]  # after parallelize: FSDP swaps them
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    per_step = world.size * config.grad_accum
    steps_per_epoch = math.ceil(sum(1 for _ in batches(data, train_idx, config.batch_tokens, config.rows_per_pack)) / per_step)
    total = config.schedule_steps or steps_per_epoch * config.epochs
    epochs = math.ceil(total / steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, max(1, int(total * config.warmup_ratio))))
    state = {"step": 0, "epoch": 0, "cursor": 0, "packs_per_step": per_step, "rows_per_pack": config.rows_per_pack}
    if resuming:
        state = load_checkpoint(ckpt, opt, sched, per_step, config.rows_per_pack)
        if world.main:
            print(f"resumed from {ckpt} at step {state['step']} (epoch {state['epoch']}, sample {state['cursor']})")
    log = open(out / "metrics.jsonl" if world.main else os.devnull, "a")  # only rank 0 writes files
    tb = Scalars(out, world, state["step"])
    bar = Progress(total, "train", unit="step") if world.main else None
    if bar:
        bar.update(state["step"])
    model.train()
    limit = min(config.max_steps or total, total)
    loop_seconds = 0.0
    profiler = StepProfile(out / "profile.json", config.profile_from, config.profile_steps if world.main else 0)

    def out_of_time() -> bool:  # every rank stops at the same step: rank 0's clock decides
        return config.max_seconds is not None and gather(world, [time.perf_counter() - t0 > config.max_seconds])[0]

    timed_out, last_eval = False, None  # (step, scores) of the last evaluation
    while state["epoch"] < epochs and state["step"] < limit and not timed_out:
        order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed + state["epoch"]))]
        for cursor, packs in steps(data, order, config.batch_tokens, state["cursor"], per_step, config.rows_per_pack):
            if state["step"] >= limit or timed_out:
                break
            t_step = time.perf_counter()
            with profiler.around(state["step"]):
                stats = train_step(model, params, opt, packs, config, world, featurize)
            sched.step()
            state.update(step=state["step"] + 1, cursor=cursor)
            seconds, tokens = time.perf_counter() - t_step, sum(pack_tokens(p) for p in packs)
            loop_seconds += seconds
            s = summarize(stats)
            log.write(json.dumps({"step": state["step"], "lr": sched.get_last_lr()[0], **s, "tokens": tokens,
                                  "seconds": round(seconds, 4)}) + "\n")
            tb.add("train", {**s, "lr": sched.get_last_lr()[0], "tokens_per_s": tokens / seconds}, state["step"])
            if bar:
                bar.update(1, tokens=tokens, loss=s["loss"][0], acc0=s["acc"][0], tau=s["accept_length"])
            if state["step"] % config.save_every == 0:
                log.flush()
                tb.flush()
                save_checkpoint(ckpt, drafter, opt, sched, state, world)
            timed_out = out_of_time()  # after a step: every call makes progress
        else:
            state.update(epoch=state["epoch"] + 1, cursor=0)
            last_eval = (state["step"], score(model, data, eval_idx, extra, config, featurize, world))
            log.write(json.dumps({"epoch": state["epoch"], **last_eval[1]}) + "\n")
            for tag, metrics in last_eval[1].items():
                tb.add(tag, metrics, state["step"])
                if world.main:
                    print(f"epoch {state['epoch']}: {'held-out' if tag == 'eval' else getattr(config, tag)} acc "
                          f"{[round(a, 3) for a in metrics.get('acc', [])]} accept length {metrics.get('accept_length', float('nan')):.2f}"
                          f" (T=1: {metrics.get('accept_length_t1', float('nan')):.2f})")
    if bar:
        bar.close()
    log.close()
    save_checkpoint(ckpt, drafter, opt, sched, state, world)
    if last_eval is None or last_eval[0] != state["step"]:  # else the last epoch's scores are the final model's
        last_eval = (state["step"], score(model, data, eval_idx, extra, config, featurize, world))
        for tag, metrics in last_eval[1].items():
            tb.add(tag, metrics, state["step"])
    scores = last_eval[1]
    final = {**scores["eval"], **{name: metrics for name, metrics in scores.items() if name != "eval"}}
    tb.close()
    plain = unsharded(drafter, config, world)
    if world.main:
        save_trained(plain.eval(), out / "drafter", {"path": target.path, "spec": config.target, "hf_config": target.hf_config},
                     counts)
        (out / "eval.json").write_text(json.dumps(final, indent=2))
    barrier(world)
    return TrainResult(str(out), state["step"], time.perf_counter() - t0, final, coverage, loop_seconds)
