"""The decode engine: plain greedy decoding and EAGLE-3 chain speculation on one static cache.

Reads top to bottom: sample -> generate_batch (many prompts, for regenerating training data)
-> prefill -> decode_plain -> draft_chain -> verify_chain -> decode_chain -> (lossless sampling)
-> draft_tree -> verify_tree -> decode_tree_sampled -> tree_loop (host-driven trees) -> draft_greedy
-> verify_greedy, verify_sampled, verify_top (one verify_cycle each) -> draft_sampled
-> speculation_cycles (the device-resident loop of decode_chain and decode_tree) -> decode_tree
(EAGLE-2 style trees resident on the device: top-k expansion, rerank by cumulative draft
probability, verify the best N nodes in one target pass under a tree attention mask).
Both paths run the same target forward (static KV cache, explicit slots), so a speed
comparison between them measures speculation and nothing else, and at temperature 0 the
speculative output must equal the plain output token for token.

Cache convention (batch 1): target slots [0, pos) hold the accepted tokens; `pending` is the
last accepted token, whose logits are not computed yet. The drafter's row r reads
(target features at r, token r+1) and writes its slot r, so its last row predicts the token
after `pending`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from draftsmith.cudagraph import Graphs, eager
from draftsmith.draft import Eagle3Drafter
from draftsmith.target import TargetOutput, Transformer


@dataclass
class Generation:
    tokens: list[int]  # new tokens, ending at the first EOS or max_new
    seconds: float  # wall time from the start of prefill to the last token
    prefill_seconds: float = 0.0
    accept_lengths: list[int] = field(default_factory=list)  # per verification cycle, bonus token included
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def finish(tokens: list[int], max_new: int, eos_ids: tuple[int, ...]) -> tuple[list[int], bool]:
    """Cut at the first EOS (kept) and at max_new; say whether generation is over."""
    for i, t in enumerate(tokens[:max_new]):
        if t in eos_ids:
            return tokens[: i + 1], True
    return tokens[:max_new], len(tokens) >= max_new


def sample(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> torch.Tensor:
    """(B, V) logits -> (B,) tokens: argmax at temperature 0, else nucleus sampling."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(probs(logits, temperature, top_p), 1, generator=generator).squeeze(-1)


def gumbel_keys(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """log p plus Gumbel noise -log(-log u), u uniform in [0, 1): the argmax over the last dim is an
    exact sample from p, the top k a sample of k without replacement in draw order (Gumbel-max,
    Gumbel-top-k). Tokens of probability 0 key -inf whatever u is, so they are never chosen."""
    u = u.clamp(min=torch.finfo(u.dtype).tiny)
    return torch.where(p > 0, p.log() - (-u.log()).log(), float("-inf"))


def gumbel_sample(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B, V) distributions, (B, V) uniforms -> (B,) tokens drawn from p. The randomness is an input,
    so a CUDA graph can run this with uniforms the host drew from the caller's generator (a captured
    graph cannot draw from a user torch.Generator)."""
    return gumbel_keys(p, u).argmax(-1)


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new: int, eos_ids=(), temperature: float = 0.0,
                   top_p: float = 1.0, generator=None, slot_window: int | None = None,
                   compact_at: float | None = None) -> list[list[int]]:
    """Answer several prompts at once: left-padded into one static cache, each row with its own
    rotary positions and a mask that hides its padding. On the CPU finished rows leave the batch at
    once. On CUDA the decode step is a CUDA graph for the batch's size; tokens stay on the device,
    finished rows run on (their tokens after EOS are cut) and the host looks every `CHECK_EVERY`
    steps, compacting the batch once at most `compact_at` of it (default COMPACT_AT) is still live.
    Sampling (temperature > 0) draws each step's token with gumbel_sample from uniforms the host
    draws from `generator` into the step's input (a captured graph cannot draw from a user
    generator), so a sampled batch runs the same captured steps as a greedy one. Each step attends
    over the cache's first slots only, up to the next multiple of `slot_window` (default SLOT_WINDOW;
    0: every slot) past the one it writes, a graph per window: early steps of a batch read less of
    its cache than late ones."""
    dev = model.embed_tokens.weight.device
    graphed = dev.type == "cuda"
    graphs = Graphs(graphed)
    sampled = temperature > 0
    B, L = len(prompts), max(len(p) for p in prompts)
    model.setup_caches(B, L + max_new)
    pad = torch.tensor([L - len(p) for p in prompts], device=dev)  # (B,)
    tokens = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=dev)  # (B, L)
    slots = torch.arange(model.max_len, device=dev)  # the cache may be longer than L + max_new
    eos = torch.tensor(sorted(eos_ids) or [-1], device=dev)

    window = SLOT_WINDOW if slot_window is None else slot_window
    if window < 0:
        raise ValueError(f"slot_window must be >= 0 (0: attend over every cache slot), got {slot_window}")
    compact = COMPACT_AT if compact_at is None else compact_at
    if not 0 < compact < 1:
        raise ValueError(f"compact_at must be in (0, 1): the live share of a batch at which it is compacted, got {compact_at}")

    def width(last: int) -> int:  # the slots a step that writes up to slot `last` attends over
        return model.max_len if window == 0 else min(model.max_len, (last // window + 1) * window)

    @functools.cache  # one step function a window, made once (the decode loop asks for it every step)
    def step(S):  # the step over the first S slots -> fn((B, T) tokens at slots pos, uniforms (B, V) (empty: greedy)) -> (B,)
        s = slots[:S]

        def fn(tokens, pos, pad, u):
            # a padding query sees only itself (no row is fully masked); real queries never see padding
            mask = (s[None, None, :] <= pos[None, :, None]) & ((s[None, None, :] >= pad[:, None, None])
                                                               | (s[None, None, :] == pos[None, :, None]))
            rope = (pos[None, :] - pad[:, None]).clamp(min=0)  # (B, T)
            logits = model.logits(model(tokens, pos, mask[:, None], rope).hidden[:, -1])
            return gumbel_sample(probs(logits, temperature, top_p), u) if sampled else logits.argmax(-1)
        return fn

    noise = torch.empty(B if sampled else 0, model.args.vocab_size if sampled else 0, device=dev)

    def uniforms(n):  # this step's uniforms for n rows (none when greedy)
        return noise[:n].uniform_(generator=generator) if sampled else noise

    rows = list(range(B))  # which prompt each batch row holds
    answers: list[list[int]] = [[] for _ in prompts]
    history = torch.zeros(B, max_new, dtype=torch.long, device=dev)  # tokens of the rows still in the batch
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    nxt = step(width(L - 1))(tokens, torch.arange(L, device=dev), pad, uniforms(B))  # prefill
    pos = torch.tensor([L], device=dev)
    for i in range(max_new):
        history[:, i] = nxt
        done |= torch.isin(nxt, eos)
        if i == max_new - 1 or (i + 1) % (CHECK_EVERY if graphed else 1) == 0:
            finished = done.tolist()
            live = len(rows) - sum(finished)
            if i == max_new - 1 or live <= (int(len(rows) * compact) if graphed else len(rows) - 1):
                last = i == max_new - 1
                keep = [j for j, f in enumerate(finished) if not f and not last]
                leave = [j for j, f in enumerate(finished) if f or last]
                for j, toks in zip(leave, history[leave, : i + 1].tolist()):
                    answers[rows[j]] = cut_at_eos(toks, eos_ids)
                if not keep:
                    break
                index = torch.tensor(keep, device=dev)
                rows, pad, history, done, nxt = [rows[j] for j in keep], pad[index], history[index], done[index], nxt[index]
                model.keep_rows(index)
                graphs.clear()  # its graphs read the caches keep_rows just replaced
        S = width(L + i)  # this step writes slot L + i
        nxt = graphs(("gen", len(rows), S), step(S), nxt[:, None], pos, pad, uniforms(len(rows)))
        pos += 1
    return answers


CHECK_EVERY = 16  # decode steps between host checks for finished rows (CUDA)
COMPACT_AT = 0.5  # live share of a batch at which generate_batch compacts it (CUDA: a cache copy and new graphs)
# generate_batch's attention windows: a step reads the cache up to the next multiple of this past its slot,
# not all L + max_new slots (a 1,024-row batch's cache is ~24 GB at SmolLM2's shape and 1,024 slots).
SLOT_WINDOW = 128


def cut_at_eos(tokens: list[int], eos_ids) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[: i + 1]
    return tokens


def prompt_slots(graphs: Graphs, T: int) -> int:
    """Cache slots run_prompt writes for a prompt of T tokens: T rounded up to whole prefill passes."""
    c = graphs.prefill_chunk
    return -(-T // c) * c if c else T


def cache_slots(module, graphs: Graphs, T: int, need: int) -> int:
    """KV cache slots for a prompt of T tokens and `need` slots of decoding: also room for the padding of
    the prompt's last prefill pass (run_prompt, draft_prompt), unless that would pass the position limit
    of `module` (the target or the drafter)."""
    if not graphs.prefill_chunk:  # one eager pass: nothing to pad (and no config read)
        return need
    padded = prompt_slots(graphs, T)
    limit = (module.args if hasattr(module, "args") else module.cfg).max_position_embeddings
    return max(need, padded) if padded <= limit else need


def in_passes(graphs: Graphs, key, fn, T: int, *rows: torch.Tensor) -> list:
    """fn(*row chunks, start) over the T rows of `rows` (each (1, T, ...)) in passes of
    graphs.prefill_chunk rows, each a replay of the graph captured under `key`; the last pass is padded
    with copies of the last row. fn returns a tuple of (1, chunk, ...) tensors (or None): the passes'
    outputs, joined and cut back to T rows."""
    c = graphs.prefill_chunk
    padded = prompt_slots(graphs, T)
    rows = [torch.cat([r, r[:, -1:].expand(r.shape[0], padded - T, *r.shape[2:])], dim=1) for r in rows]
    starts = torch.arange(0, padded, c, device=rows[0].device)  # made on the device: no host copy a pass
    parts = [[t.clone() if t is not None else None for t in graphs(key, fn, *(r[:, i:i + c] for r in rows), starts[i // c:i // c + 1])]
             for i in range(0, padded, c)]  # each replay overwrites the graph's outputs: keep a copy
    return [torch.cat(col, dim=1)[:, :T] if col[0] is not None else None for col in zip(*parts)]


@torch.no_grad()
def run_prompt(model: Transformer, prompt: torch.Tensor, capture=(), graphs: Graphs | None = None):
    """The target over the prompt (1, T) into cache slots 0..T-1 -> TargetOutput (1, T, ...). With
    graphs.prefill_chunk (CUDA graphs: cudagraph.PREFILL_CHUNK) in passes of that many tokens, each a
    replay of one captured graph: an eager pass over a long prompt launches ~15 kernels a layer from
    Python (SmolLM2: ~19 ms a prompt on an H100, logs/h100-bench-triton-3ff982a.json) and meets a new
    attention plan at each new length. The last pass is padded with copies of the last token: its pad
    rows write slots past the prompt, which decoding overwrites before any query reads them (as it does
    a chain's rejected rows), and never reach the output. One eager pass where the cache has no room for
    the padding (cache_slots sizes it)."""
    graphs = graphs or eager()
    T, dev, c = prompt.shape[1], prompt.device, graphs.prefill_chunk
    if not c or prompt_slots(graphs, T) > model.max_len:
        return model(prompt, torch.arange(T, device=dev), capture=capture)

    def chunk(tokens, start):  # (1, c) tokens at slots start..start+c-1
        out = model(tokens, start + torch.arange(c, device=dev), capture=capture)
        return out.hidden, out.aux

    key = ("prefill", c, tuple(capture), id(model), model.max_len)  # a graph bakes in the cache buffers
    return TargetOutput(*in_passes(graphs, key, chunk, T, prompt))


@torch.no_grad()
def draft_prompt(drafter: Eagle3Drafter, prompt: torch.Tensor, first: torch.Tensor, aux: torch.Tensor,
                 graphs: Graphs | None = None) -> torch.Tensor:
    """The drafter over a prompt's rows into its cache slots 0..T-1: prompt (1, T), first (1,) the new
    token that follows it, aux (1, T, 3Ht) the target's features over the prompt; row r reads features r
    and token r + 1 (the last row the new token). Returns the last row's output (1, 1, H), which the
    first drafting step reads. Under CUDA graphs in padded passes like run_prompt (its pad rows write
    drafter slots that drafting overwrites before reading): an eager pass at a new prompt length builds
    new attention plans, 71 ms for the drafter against 0.46 ms captured on an H100
    (logs/chain-cycle-h100-d95a7d6.json)."""
    graphs = graphs or eager()
    tokens = torch.cat([prompt[0, 1:], first])[None]
    T, dev, c = tokens.shape[1], tokens.device, graphs.prefill_chunk
    if not c or prompt_slots(graphs, T) > drafter.max_len:
        return drafter(tokens, drafter.fuse(aux), torch.arange(T, device=dev))[:, -1:]

    def chunk(toks, feats, start):
        return (drafter(toks, drafter.fuse(feats), start + torch.arange(c, device=dev)),)

    key = ("draft_prompt", c, id(drafter), drafter.max_len)
    return in_passes(graphs, key, chunk, T, tokens, aux)[0][:, -1:]


@torch.no_grad()
def prefill(model: Transformer, prompt: torch.Tensor, capture=(), temperature: float = 0.0, top_p: float = 1.0,
            generator=None, graphs: Graphs | None = None):
    """prompt: (1, T). Returns the first new token (greedy, or sampled at temperature > 0) and the
    target's output over the prompt (run_prompt: in captured passes where `graphs` says so)."""
    out = run_prompt(model, prompt, capture, graphs)
    return next_token(model, out.hidden[:, -1], temperature, top_p, generator), out  # (1,), TargetOutput


def next_token(model: Transformer, hidden: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0, generator=None):
    """The token after hidden (B, H): the greedy one in the lm_head's own pass (Transformer.greedy), else sampled."""
    if temperature == 0:
        return model.greedy(hidden)
    return sample(model.logits(hidden), temperature, top_p, generator)


def target_step(model: Transformer, capture=()):
    """The target over tokens (1, T) at slots pos..pos+T-1 -> (greedy token after each, aux)."""
    def step(tokens, pos):
        out = model(tokens, pass_slots(pos, tokens.shape[1]), capture=capture)
        return model.greedy(out.hidden[0]), out.aux
    return step


def next_token_step(model: Transformer, temperature: float = 0.0, top_p: float = 1.0, generator=None):
    """The target over tokens (1, T) at slots pos..pos+T-1 -> (1,) the token after them. Plain decoding's
    step; at temperature 0 its graph (key ("plain", 1)) is the one greedy_agreement replays. Given
    uniforms u (1, V) it samples with them (gumbel_sample) instead of drawing from `generator`."""
    def step(tokens, pos, u=None):
        h = model(tokens, pass_slots(pos, tokens.shape[1])).hidden
        if u is not None and temperature > 0:
            return gumbel_sample(probs(model.logits(h[:, -1]), temperature, top_p), u)
        return next_token(model, h[:, -1], temperature, top_p, generator)
    return step


def pass_slots(pos: torch.Tensor, T: int) -> torch.Tensor:
    """Slots pos .. pos + T - 1 of a T-token pass from pos (1,): pos itself for one token (no kernels in a step)."""
    return pos if T == 1 else pos + torch.arange(T, device=pos.device)


@torch.no_grad()
def decode_plain(model: Transformer, prompt: torch.Tensor, max_new: int, eos_ids=(), graphs: Graphs | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, generator=None) -> Generation:
    """One target step per token, greedy or sampled (temperature > 0), graph-captured when `graphs` is
    enabled. The step feeds itself (its token and position stay on the device), so captured steps run
    back to back and the host looks at the tokens every CHECK_EVERY steps; eager, after each one.
    Sampling: a captured step cannot draw from `generator`, so before each block of steps the host
    draws one row of uniforms per step into a buffer the graph reads; a counter on the device picks
    the step's row and gumbel_sample turns it into an exact sample from probs()."""
    graphs = graphs or eager()
    dev = prompt.device
    T = prompt.shape[1]
    model.setup_caches(1, cache_slots(model, graphs, T, T + max_new + 1))
    step = next_token_step(model, temperature, top_p, generator)
    sampled, every = temperature > 0, CHECK_EVERY if graphs.enabled else 1

    def advance(tok, pos, out, noise, row):  # tok (1, 1) at slot pos -> out[pos] = the token after it
        u = None
        if sampled:
            u = noise.index_select(0, row)  # (1, V) this step's uniforms
            row.add_(1)
        nxt = step(tok, pos, u)
        out.index_copy_(0, pos, nxt)
        tok.copy_(nxt[None])
        pos.add_(1)

    sync(dev)
    t0 = time.perf_counter()
    tok = prefill(model, prompt, (), temperature, top_p, generator, graphs)[0]
    sync(dev)
    t_prefill = time.perf_counter() - t0
    # a graph bakes in the model, its cache buffers and the sampling settings (not the generator)
    key = ("plain_loop", id(model), model.max_len) + ((temperature, top_p) if sampled else ())
    noise = torch.zeros(every if sampled else 0, model.args.vocab_size, device=dev)  # (every, V)
    _, _, buf, noise, row = graphs.start(key, advance, tok[None], torch.tensor([T], device=dev),
                                         torch.zeros(model.max_len, dtype=torch.long, device=dev), noise,
                                         torch.zeros(1, dtype=torch.long, device=dev))
    out, done = finish([int(tok)], max_new, eos_ids)
    while not done:
        n = min(every, max_new - len(out))
        if sampled:  # fresh uniforms for the block's n steps, from the caller's generator
            noise[:n].uniform_(generator=generator)
            row.zero_()
        for _ in range(n):
            graphs.replay(key)
        start = T + len(out) - 1
        out, done = finish(out + buf[start : start + n].tolist(), max_new, eos_ids)
    sync(dev)
    return Generation(out, time.perf_counter() - t0, t_prefill)


@torch.no_grad()
def greedy_agreement(model: Transformer, prompt: torch.Tensor, tokens: list[int], graphs: Graphs | None = None) -> int:
    """How many of `tokens` (an output for `prompt`) are what plain greedy decoding picks after the
    same prefix, fed through the same one-token step decode_plain uses. In fp32 a lossless
    decoder scores len(tokens); in bf16, where a k-token verify pass rounds differently from a
    one-token step, this counts the near-tie flips themselves rather than everything after the first."""
    graphs = graphs or eager()
    dev = prompt.device
    T = prompt.shape[1]
    model.setup_caches(1, cache_slots(model, graphs, T, T + len(tokens) + 1))
    step = next_token_step(model)
    best = [int(prefill(model, prompt, graphs=graphs)[0])]  # the prompt's pass as decode_plain runs it
    pos = torch.tensor([T], device=dev)
    feed = torch.tensor(tokens, device=dev)
    for i in range(len(tokens) - 1):
        best.append(int(graphs(("plain", 1), step, feed[i : i + 1][None], pos)))
        pos += 1
    return sum(a == b for a, b in zip(best, tokens))


def draft_chain(drafter: Eagle3Drafter, k: int):
    """k greedy draft tokens after the pending token at slot pos. h: (1, 1, H), the drafter's output
    for row pos-1. Step i runs at slot pos-1+i (RoPE position t+j in training). All on the device."""
    def chain(h, pos):
        drafts = []
        for i in range(k):
            tok = drafter.to_target(drafter.logits(h[:, -1]).argmax(-1))  # (1,)
            drafts.append(tok)
            if i + 1 < k:
                h = drafter(tok[None], h, pos + i)
        return torch.cat(drafts)  # (k,)
    return chain


def drafter_rows(drafter: Eagle3Drafter):
    """Drafter catch-up over verified rows: tokens (1, R), target aux (1, R, 3Ht) at slots pos.."""
    def rows(tokens, aux, pos):
        return drafter(tokens, drafter.fuse(aux), pos + torch.arange(tokens.shape[1], device=pos.device))
    return rows


def verify_chain(model: Transformer, drafter: Eagle3Drafter, k: int):
    """A chain cycle's verify as one fixed-shape device step (a CUDA graph a k): the target over
    [pending, drafts] at slots pos..pos+k, its greedy tokens, acceptance and the drafter catch-up.
    verify(pending (1,), drafts (k,), pos (1,)) -> (out (k+2,): n, then the target's k+1 greedy tokens,
    of which the first n+1 are the new ones; h (1, 1, H) for the next draft; the next pending token
    (1,); the next pos (1,)). The catch-up runs k+1 rows whatever n is, over the target's greedy tokens:
    up to row n they are the accepted tokens (an accepted draft is the target's greedy token), and rows
    past n write drafter slots pos+n+1.. that the next cycle rewrites before reading. The rejected
    rows' target KV lies past the next pos likewise, so a chain needs no commit."""
    capture = drafter.cfg.aux_layer_ids

    def after(best, drafts, aux, pos):  # compiled like the drafting steps: eager it is ~10 small kernels
        n = (best[:-1] == drafts).int().cumprod(0).sum().reshape(1)  # (1,) leading drafts the target agrees with
        h = drafter(best[None], drafter.fuse(aux), pos + torch.arange(k + 1, device=pos.device))  # (1, k+1, H)
        return n, h[:, n], best[n]  # a (1,) index: no host read
    after = drafter.compiled(after)

    def verify(pending, drafts, pos):
        out = model(torch.cat([pending, drafts])[None], pos + torch.arange(k + 1, device=pos.device), capture=capture)
        best = model.greedy(out.hidden[0])  # (k+1,) outside the compiled part, as plain decoding's
        n, h, bonus = after(best, drafts, out.aux, pos)
        return torch.cat([n, best]), h, bonus, pos + n + 1
    return verify


@torch.no_grad()
def decode_chain(model: Transformer, drafter: Eagle3Drafter, prompt: torch.Tensor, max_new: int, k: int,
                 eos_ids=(), graphs: Graphs | None = None) -> Generation:
    """EAGLE-3 chain speculation at temperature 0, resident on the device as decode_tree is: a cycle is
    two fixed-shape steps, draft_chain's k drafts then verify_chain's k+1-token verify with acceptance
    and the drafter catch-up (CUDA graphs when `graphs` is enabled), and one host read of the new
    tokens, queued so that the next cycle's draft runs while the host waits (speculation_cycles).
    draft_seconds and verify_seconds are the two steps' spans on the device timeline on the cycles
    timed_cycle picks, scaled to all cycles; verify_seconds includes the catch-up."""
    graphs = graphs or eager()
    dev = prompt.device
    T = prompt.shape[1]
    model.setup_caches(1, cache_slots(model, graphs, T, T + max_new + 2 * k + 2))
    drafter.setup_caches(1, cache_slots(drafter, graphs, T, T + max_new + 2 * k + 2))
    chain, verify = drafter.compiled(draft_chain(drafter, k)), verify_chain(model, drafter, k)
    keys = (id(model), model.max_len, id(drafter), drafter.max_len)  # a graph bakes in modules and cache buffers
    sync(dev)
    t0 = time.perf_counter()
    pending, first = prefill(model, prompt, drafter.cfg.aux_layer_ids, graphs=graphs)
    h = draft_prompt(drafter, prompt, pending, first.aux, graphs)
    sync(dev)
    gen = Generation([int(pending)], 0.0, time.perf_counter() - t0)
    pos = torch.tensor([T], device=dev)

    def draft_next():
        return graphs(("chain", k, *keys), chain, h, pos)

    def verify_next(drafts):
        nonlocal h, pending, pos
        out, h, pending, pos = graphs(("chain-verify", k, *keys), verify, pending, drafts, pos)
        return out

    speculation_cycles(gen, dev, max_new, eos_ids, draft_next, verify_next)
    gen.seconds = time.perf_counter() - t0
    return gen


# --------------------------------------------------------------------------- lossless sampling


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0) -> torch.Tensor:
    """The sampling distribution sample() draws from: softmax(logits / T), nucleus-truncated."""
    p = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        sorted_p = sorted_p.masked_fill(sorted_p.cumsum(-1) - sorted_p > top_p, 0.0)
        p = torch.zeros_like(p).scatter(-1, order, sorted_p)
        p = p / p.sum(-1, keepdim=True)
    return p


def speculative_accept(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, generator=None) -> tuple[int, torch.Tensor]:
    """Leviathan et al.: accept draft i with probability min(1, p_i(x)/q_i(x)); at the first
    rejection sample from norm(max(0, p_i - q_i)); if all k pass, sample the bonus from p_k.
    p: (k+1, V) target distributions, q: (k, V) draft distributions (in target ids), drafts: (k,).
    Returns (accepted count n, the token that follows them)."""
    k = len(drafts)
    px = p[torch.arange(k), drafts]  # (k,)
    qx = q[torch.arange(k), drafts]
    u = torch.rand(k, generator=generator, device=p.device)
    ok = (u * qx < px).int()  # u < p/q without dividing by a zero q; never accepts where p is 0
    n = int(ok.cumprod(0).sum())
    if n == k:
        return n, torch.multinomial(p[k], 1, generator=generator)
    return n, torch.multinomial(residual(p[n], q[n]), 1, generator=generator)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): the distribution to sample from once a draft from q was rejected."""
    left = (p - q).clamp(min=0)
    total = left.sum()
    return left / total if total > 0 else p  # p == q exactly: any sample from p is right


@torch.no_grad()
def decode_chain_sampled(model: Transformer, drafter: Eagle3Drafter, prompt: torch.Tensor, max_new: int, k: int,
                         temperature: float, top_p: float = 1.0, eos_ids=(), generator=None) -> Generation:
    """Chain speculation at temperature > 0 whose output is distributed exactly as the target's own
    sampling (same temperature and top-p): drafts are sampled from the drafter's distribution and
    accepted or corrected by speculative_accept. The host-driven reference (eager, a sync per cycle):
    bench runs a sampled chain of k as decode_tree_sampled with TreeSpec(1, k, k, "sample"), the same
    rule on the device-resident cycle."""
    dev = prompt.device
    T = prompt.shape[1]
    V = model.args.vocab_size
    capture = drafter.cfg.aux_layer_ids
    model.setup_caches(1, T + max_new + 2 * k + 2)
    drafter.setup_caches(1, T + max_new + 2 * k + 2)
    draft_ids = drafter.target_ids()
    rows = drafter_rows(drafter)
    sync(dev)
    t0 = time.perf_counter()
    pending, out = prefill(model, prompt, capture, temperature, top_p, generator)
    h = draft_prompt(drafter, prompt, pending, out.aux)
    gen = Generation([int(pending)], 0.0, time.perf_counter() - t0)
    pos = torch.tensor([T], device=dev)
    while not finish(gen.tokens, max_new, eos_ids)[1]:
        t1 = time.perf_counter()
        q = torch.zeros(k, V, device=dev)
        drafts = []
        for i in range(k):
            qd = probs(drafter.logits(h[:, -1]), temperature, top_p)[0]  # (Vd,)
            q[i, draft_ids] = qd
            tok = draft_ids[torch.multinomial(qd, 1, generator=generator)]
            drafts.append(tok)
            if i + 1 < k:
                h = drafter(tok[None], h, pos + i)
        drafts = torch.cat(drafts)
        t2 = time.perf_counter()
        seq = torch.cat([pending, drafts])[None]
        out = model(seq, pos + torch.arange(k + 1, device=dev), capture=capture)
        p = probs(model.logits(out.hidden[0]), temperature, top_p)  # (k+1, V)
        n, nxt = speculative_accept(p, q, drafts, generator)
        gen.draft_seconds += t2 - t1
        gen.verify_seconds += time.perf_counter() - t2
        accepted = torch.cat([drafts[:n], nxt])
        gen.tokens.extend(accepted.tolist())
        gen.accept_lengths.append(n + 1)
        h = rows(torch.cat([accepted, drafts[n:]])[None], out.aux, pos)[:, n : n + 1]
        pending, pos = nxt, pos + n + 1
    sync(dev)
    gen.tokens = finish(gen.tokens, max_new, eos_ids)[0]
    gen.seconds = time.perf_counter() - t0
    return gen


# --------------------------------------------------------------------------- tree speculation


TREE_DRAWS = ("auto", "top", "sample")
# "auto" drafts "top" below this temperature and "sample" from it on. Accept length of SmolLM2 with the
# shipped drafter, 8x6x48 tree, 8 MT-bench prompts (CPU, benchmarks/results/tree-draws-cpu.json): top / sample
# 2.77 / 2.59 at T=0.6, 2.40 / 2.41 at T=0.8, 2.06 / 2.19 at T=1; top's cycle is the cheaper (the greedy draft).
TOP_BELOW = 0.9


@dataclass(frozen=True)
class TreeSpec:
    topk: int = 4  # children kept per expanded node, and nodes expanded per level
    steps: int = 5  # draft depth
    num_draft_tokens: int = 16  # tree nodes verified per cycle (the root, i.e. the pending token, not counted)
    # at temperature > 0 (at 0 both are EAGLE-2's greedy tree): "top" drafts the greedy tree and the target
    # samples its own token at every node, the walk following matches; "sample" draws children without
    # replacement from the drafter and verifies them by recursive rejection sampling. Both are lossless;
    # "auto" picks by temperature (TOP_BELOW).
    draws: str = "auto"

    def __post_init__(self):
        if self.topk < 1 or self.steps < 1 or self.num_draft_tokens < 1:
            raise ValueError("topk, steps and num_draft_tokens must be >= 1")
        if self.draws not in TREE_DRAWS:
            raise ValueError(f"tree draws (bench --tree-draws) must be one of {', '.join(TREE_DRAWS)}, not {self.draws!r}")

    def draws_at(self, temperature: float) -> str:
        """How children are drafted at this temperature: "top" (always at 0) or "sample"."""
        if temperature <= 0 or self.draws == "top" or (self.draws == "auto" and temperature < TOP_BELOW):
            return "top"
        return "sample"

    @property
    def nodes(self) -> int:
        """Nodes verified per cycle: num_draft_tokens, or every drafted candidate when there are fewer
        (topk children of the root, then topk children of each of topk nodes per further level)."""
        return min(self.num_draft_tokens, self.topk + (self.steps - 1) * self.topk ** 2)


@dataclass
class DraftTree:
    tokens: torch.Tensor  # (N,) target ids on the device, parents before children, siblings in draft order
    parents: torch.Tensor  # (N,) index of the parent node; -1 for children of the root
    depth: torch.Tensor  # (N,) 1 for children of the root; parents and depth on the CPU (draft_tree), the device (draft_greedy)
    q: torch.Tensor | None = None  # sampled trees: (N+1, V) root first, the q each node's children were drawn from

    def ancestors(self) -> torch.Tensor:
        """(N+1, N+1) bool, root at index 0: entry [i, j] when j is i or an ancestor of i."""
        return ancestors(self.parents, int(self.depth.max()))

    def children(self) -> list[list[int]]:
        """Children of each node (root 0, node i at i + 1), in draft order."""
        kids: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            kids[p + 1].append(i + 1)
        return kids


def ancestors(parents: torch.Tensor, rounds: int) -> torch.Tensor:
    """(N+1, N+1) bool, root at index 0: entry [i, j] when j is i or an ancestor of i. parents: (N,)
    node index of each node's parent, -1 for the root's children; rounds: at least the tree's depth.
    Each round a row takes in its parent's row: fixed shapes, no host work, on parents' device."""
    up = torch.cat([parents.new_zeros(1), parents + 1])  # (N+1,) the parent's row; the root is its own parent
    anc = torch.eye(len(up), dtype=torch.bool, device=parents.device)
    for _ in range(rounds):
        anc = anc | anc[up]
    return anc


def masked_step(net, capture=None, head=None):
    """A target (capture given) or drafter pass at explicit slots under an explicit mask. The target's
    step returns head(logits), greedy tokens by default, and the captured aux."""
    if capture is None:
        return lambda tokens, hidden, slots, mask, rope: net(tokens, hidden, slots, mask, rope)
    head = head or (lambda logits: logits.argmax(-1))

    def step(tokens, slots, mask, rope):
        out = net(tokens, slots, mask, rope, capture=capture)
        return head(net.logits(out.hidden[0])), out.aux
    return step


def expand_greedy(logits: torch.Tensor, parent_score: torch.Tensor, k: int):
    """EAGLE-2: each row's k likeliest children, scored by cumulative draft log-probability.
    logits: (F, Vd), parent_score: (F,) -> scores (F, k), draft ids (F, k), no q."""
    score, ids = (parent_score[:, None] + torch.log_softmax(logits, -1)).topk(k, dim=-1)
    return score, ids, None


def expand_sampled(logits: torch.Tensor, parent_score: torch.Tensor, k: int, temperature: float, top_p: float,
                   generator=None):
    """Each row's k children sampled without replacement from q = probs(logits) by Gumbel-top-k (the
    order of the perturbed keys is the sampling order). A child's score is its parent's plus the log
    of the largest q among tokens not drawn before it, so it never reads the child's own token (see
    sampled_order); children past q's support score -inf and do not exist.
    logits: (F, Vd), parent_score: (F,) -> scores (F, k), draft ids (F, k), q (F, Vd)."""
    q = probs(logits, temperature, top_p)
    score, ids = children_sampled(q, parent_score, k, torch.rand(q.shape, generator=generator, device=q.device))
    return score, ids, q


def children_sampled(q: torch.Tensor, parent_score: torch.Tensor, k: int, u: torch.Tensor):
    """expand_sampled's draw and scores from given uniforms u (F, Vd), with fixed shapes and no host
    work (so inside a graph too): q (F, Vd), parent_score (F,) -> scores (F, k), draft ids (F, k)."""
    keys, ids = gumbel_keys(q, u).topk(k, dim=-1)  # (F, k) in draw order
    left, best = q.clone(), []
    for i in range(k):
        best.append(left.amax(-1))
        left = left.scatter(-1, ids[:, i : i + 1], 0.0)
    score = (parent_score[:, None] + torch.stack(best, -1).log()).cummin(-1).values  # exact monotonicity
    return score.masked_fill(keys.isneginf(), float("-inf")), ids


def sampled_order(score: list[float], nodes: range, parents: list[int], depth: list[int], rank: list[int]) -> list[int]:
    """The existing nodes among `nodes`, best first: score, then shallower, then lexicographic rank path.

    Why selecting by this order keeps sampled verification lossless: rejection sampling over a node's
    children is exact only if trying its i-th drawn child is decided independently of that child's
    token and of what was drawn after it, given the children drawn before. Scores never read a
    node's own token (expand_sampled) and never increase from parent to child or from a child to
    its next sibling, so every node comes after its ancestors and elder siblings here, and whether
    it is expanded (best K of its level) or verified (best N) depends only on the nodes before it,
    never on its own token or on its subtree or younger siblings. Hence the verified children of
    each node are a prefix of its draw order whose length never depends on their tokens. A prefix
    alone is not enough: with EAGLE-2's score, log q(x), whether x is tried would depend on x."""
    def path(i):
        out = []
        while i >= 0:
            out.append(rank[i])
            i = parents[i]
        return out[::-1]
    live = [i for i in nodes if score[i - nodes.start] > float("-inf")]
    return sorted(live, key=lambda i: (-score[i - nodes.start], depth[i], path(i)))


@torch.no_grad()
def draft_tree(drafter: Eagle3Drafter, last_hidden: torch.Tensor, pos: int, spec: TreeSpec,
               graphs: Graphs | None = None, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> DraftTree:
    """Expand `topk` children of the best `topk` nodes per level for `spec.steps` levels, then keep the
    `num_draft_tokens` nodes of highest cumulative draft log-probability (an ancestor never scores
    below its descendants, so the kept set is a tree). Frontier nodes of level d use drafter slots
    pos + (d-2)*topk + i and RoPE position pos-2+d. Bookkeeping stays on the host; the device
    sees one drafter pass per level. At temperature > 0 children are sampled (expand_sampled),
    nodes are ranked by sampled_order, and the tree carries the q each node's children came from."""
    graphs = graphs or eager()
    dev, K, S = last_hidden.device, spec.topk, drafter.max_len
    sampled = temperature > 0
    step = masked_step(drafter)

    def expand(h, parent_score):  # drafter outputs (F, H) -> child scores, draft ids (F, K), q (F, Vd) or None
        if sampled:
            return expand_sampled(drafter.logits(h), parent_score, K, temperature, top_p, generator)
        return expand_greedy(drafter.logits(h), parent_score, K)

    def best(first: int, n: int) -> list[int]:  # the n best nodes from index `first` on
        score = torch.cat(score_chunks)[first:]
        if sampled:
            return sampled_order(score.tolist(), range(first, len(parents)), parents, depth, rank)[:n]
        return (first + score.topk(min(n, len(score))).indices).tolist()

    score, ids, q = expand(last_hidden[:, -1], torch.zeros(1, device=dev))
    tok_chunks, score_chunks = [drafter.to_target(ids[0])], [score[0]]
    parents, depth, rank = [-1] * K, [1] * K, list(range(K))
    q_of = {-1: q[0]} if sampled else {}
    frontier = best(0, K) if sampled else list(range(K))
    hidden, slot_of = last_hidden.expand(1, len(frontier), -1), {}
    prefix = torch.arange(S) < pos
    for d in range(2, spec.steps + 1):
        F_ = len(frontier)
        slots = [pos + (d - 2) * K + i for i in range(F_)]
        slot_of.update(zip(frontier, slots))
        mask = prefix.expand(F_, S).clone()
        for i, f in enumerate(frontier):
            node = f
            while node >= 0:  # the node itself and its ancestors (all of them were frontier nodes)
                mask[i, slot_of[node]] = True
                node = parents[node]
        all_tokens = torch.cat(tok_chunks)
        fr = torch.tensor(frontier, device=dev)
        h = graphs(("dtree", F_, id(drafter), S), step, all_tokens[fr][None], hidden, torch.tensor(slots, device=dev),
                   mask[None, None].to(dev), torch.full((1, F_), pos - 2 + d, device=dev))
        score, ids, q = expand(h[0], torch.cat(score_chunks)[fr])
        base = len(parents)
        tok_chunks.append(drafter.to_target(ids.flatten()))
        score_chunks.append(score.flatten())
        parents += [f for f in frontier for _ in range(K)]
        depth += [d] * (F_ * K)
        rank += list(range(K)) * F_
        q_of.update(zip(frontier, q) if sampled else ())
        frontier = best(base, K)
        hidden = h[:, torch.tensor([(f - base) // K for f in frontier], device=dev)]
    keep = best(0, spec.num_draft_tokens)
    kept = set(keep)
    keep = [i for i in keep if all(a in kept for a in _ancestry(parents, i))]  # greedy ties could break closure
    keep.sort(key=lambda i: (depth[i], i))  # siblings stay in draft order
    index = {old: new for new, old in enumerate(keep)}
    tree = DraftTree(torch.cat(tok_chunks)[torch.tensor(keep, device=dev)],
                     torch.tensor([index.get(parents[i], -1) for i in keep]), torch.tensor([depth[i] for i in keep]))
    if sampled:
        draft_ids = drafter.target_ids()
        tree.q = torch.zeros(len(keep) + 1, drafter.cfg.vocab_size, device=dev)
        for row, node in enumerate([-1] + keep):
            if node in q_of:
                tree.q[row, draft_ids] = q_of[node]
    return tree


def _ancestry(parents: list[int], i: int) -> list[int]:
    out, p = [], parents[i]
    while p >= 0:
        out.append(p)
        p = parents[p]
    return out


def accept_tree_greedy(best: torch.Tensor, tree: DraftTree) -> tuple[list[int], torch.Tensor]:
    """Follow the target's greedy choices down the tree. best: (N+1,) target argmax at root and nodes.
    Returns (accepted path as node indices, root 0, the token after it)."""
    best_ = best.tolist()
    children: dict[int, dict[int, int]] = {}
    for i, (p, t) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        children.setdefault(p + 1, {}).setdefault(t, i + 1)
    path, cur = [], 0
    while best_[cur] in children.get(cur, {}):
        cur = children[cur][best_[cur]]
        path.append(cur)
    return path, best[cur : cur + 1]


def accept_tree_sampled(p: torch.Tensor, tree: DraftTree, generator=None) -> tuple[list[int], torch.Tensor]:
    """Recursive rejection sampling (multi-draft speculative sampling without replacement).
    p: (N+1, V) target distributions at the root and at each node. At a node, starting from r = its p,
    try the children in draft order: child x_i was drawn from q_i (q without the elder siblings,
    renormalised) and is accepted with probability min(1, r(x_i) / q_i(x_i)); on rejection
    r <- norm(max(0, r - q_i)), which is 0 at x_i. Descend into the first accepted child; when none
    is, the next token is sampled from r. Same return as accept_tree_greedy."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    u = torch.rand(len(tokens) + 1, generator=generator, device=p.device)  # every node is tried at most once
    path, cur = [], 0
    while True:
        r, q = p[cur], tree.q[cur]
        for c in kids[cur]:
            x = tokens[c - 1]
            if bool(u[c] * q[x] < r[x]):
                break
            r = residual(r, q)
            q = q.clone()
            q[x] = 0.0
            q = q / q.sum()
        else:
            return path, torch.multinomial(r, 1, generator=generator)
        path.append(c)
        cur = c


@torch.no_grad()
def verify_tree(model: Transformer, pending: torch.Tensor, tree: DraftTree, pos: int, capture,
                graphs: Graphs | None = None, temperature: float = 0.0, top_p: float = 1.0, generator=None):
    """One target pass over [pending, tree nodes] at slots pos..pos+N under the tree mask; a greedy walk
    from the root; at temperature > 0 the same walk over tokens the target samples at every node for a
    tree drafted as at T=0 (no q), else accept_tree_sampled. The accepted path is moved to slots
    pos+1..pos+n. Returns (n, the token after the path, aux rows of root + path, path tokens)."""
    graphs = graphs or eager()
    dev = pending.device
    n_nodes = len(tree.parents) + 1
    seq = torch.cat([pending, tree.tokens])[None]  # (1, N+1)
    mask = torch.zeros(n_nodes, model.max_len, dtype=torch.bool)
    mask[:, :pos] = True
    mask[:, pos : pos + n_nodes] = tree.ancestors()
    rope = pos + torch.cat([torch.zeros(1, dtype=torch.long), tree.depth])[None]
    sampled = temperature > 0
    head = (lambda logits: probs(logits, temperature, top_p)) if sampled else None
    # a graph bakes in the model, its cache buffers (mask width), the aux layers and the head
    key = ("tree", n_nodes, id(model), model.max_len, tuple(capture)) + (("p", temperature, top_p) if sampled else ())
    out, aux = graphs(key, masked_step(model, capture, head), seq, torch.arange(pos, pos + n_nodes, device=dev),
                      mask[None, None].to(dev), rope.to(dev))
    if not sampled:
        path, nxt = accept_tree_greedy(out, tree)
    elif tree.q is None:  # drafted as at T=0 (draws="top"): the target samples its own token at every node
        path, nxt = accept_tree_greedy(gumbel_sample(out, torch.rand(out.shape, generator=generator, device=dev)), tree)
    else:
        path, nxt = accept_tree_sampled(out, tree, generator)
    if path:
        model.commit(pos + torch.tensor(path, device=dev), torch.arange(pos + 1, pos + 1 + len(path), device=dev))
    rows = torch.tensor([0] + path, device=dev)
    return len(path), nxt.clone(), aux[:, rows], seq[0, rows[1:]]


@torch.no_grad()
def decode_tree_sampled(model: Transformer, drafter: Eagle3Drafter, prompt: torch.Tensor, max_new: int, tree: TreeSpec,
                        temperature: float, top_p: float = 1.0, eos_ids=(), generator=None,
                        graphs: Graphs | None = None) -> Generation:
    """Tree speculation at temperature > 0 whose output is distributed exactly as the target's own
    sampling (same temperature and top-p), by tree.draws: "top", the greedy tree with the target's own
    draw at every node (draft_greedy, verify_top); "sample", children sampled without replacement from
    the drafter, nodes ranked so that selection never reads a node's own token, recursive rejection
    sampling down the tree (draft_sampled, verify_sampled). decode_tree's device-resident cycle (one
    host read a cycle, uniforms drawn from `generator` outside the steps); tree_loop is the host-driven
    reference."""
    return decode_tree(model, drafter, prompt, max_new, tree, eos_ids, graphs, temperature, top_p, generator)


def tree_loop(model: Transformer, drafter: Eagle3Drafter, prompt: torch.Tensor, max_new: int, spec: TreeSpec, eos_ids,
              graphs: Graphs, temperature: float = 0.0, top_p: float = 1.0, generator=None) -> Generation:
    """The host-driven tree loop: draft a tree, verify it, commit the accepted path, catch the drafter
    up on it. The host reference for decode_tree: at temperature 0 the same trees and output (ties
    aside), at temperature > 0 the same sampling rules (spec.draws)."""
    dev = prompt.device
    T = prompt.shape[1]
    capture = drafter.cfg.aux_layer_ids
    sampling = dict(temperature=temperature, top_p=top_p, generator=generator)
    drafting = sampling if spec.draws_at(temperature) == "sample" else dict(sampling, temperature=0.0)
    model.setup_caches(1, cache_slots(model, graphs, T, T + max_new + spec.num_draft_tokens + 2))
    drafter.setup_caches(1, cache_slots(drafter, graphs, T, T + max_new + spec.steps * spec.topk + 2))
    sync(dev)
    t0 = time.perf_counter()
    pending, first = prefill(model, prompt, capture, **sampling, graphs=graphs)
    h = draft_prompt(drafter, prompt, pending, first.aux, graphs)
    sync(dev)
    gen = Generation([int(pending)], 0.0, time.perf_counter() - t0)
    pos = T
    while not finish(gen.tokens, max_new, eos_ids)[1]:
        t1 = time.perf_counter()
        tree = draft_tree(drafter, h[:, -1:], pos, spec, graphs, **drafting)
        sync(dev)
        t2 = time.perf_counter()
        n, bonus, aux, path_tokens = verify_tree(model, pending, tree, pos, capture, graphs, **sampling)
        gen.draft_seconds += t2 - t1
        gen.verify_seconds += time.perf_counter() - t2
        accepted = torch.cat([path_tokens, bonus])
        gen.tokens.extend(accepted.tolist())
        gen.accept_lengths.append(n + 1)
        h = drafter(accepted[None], drafter.fuse(aux), torch.arange(pos, pos + n + 1, device=dev))
        pending, pos = bonus, pos + n + 1
    sync(dev)
    gen.tokens = finish(gen.tokens, max_new, eos_ids)[0]
    gen.seconds = time.perf_counter() - t0
    return gen


# --------------------------------------------------------------------------- greedy trees on the device


def tree_mask(anc: torch.Tensor, pos: torch.Tensor, max_len: int) -> torch.Tensor:
    """(1, 1, R, max_len) bool for R queries over a cache whose slots before pos hold the accepted
    prefix and whose slots pos..pos+W-1 hold a tree: a query sees the prefix and the tree slots its
    row of anc (R, W) marks. Later slots hold stale or scratch entries and stay hidden."""
    off = torch.arange(max_len, device=anc.device) - pos  # (S,) slot offsets from pos
    tree = anc[:, off.clamp(0, anc.shape[1] - 1)] & (off >= 0) & (off < anc.shape[1])  # (R, S)
    return ((off < 0) | tree)[None, None]


def draft_greedy(drafter: Eagle3Drafter, spec: TreeSpec):
    """draft_tree at temperature 0 as one fixed-shape device step, so a CUDA graph per spec: draft(h
    (1, 1, H), pos (1,)) -> DraftTree of spec.nodes nodes, every field on the device. h is the
    drafter's output for the row before the pending token (at slot pos). Same slots, RoPE positions,
    expansion and ranking as draft_tree; only ties may break differently."""
    K, steps, keep = spec.topk, spec.steps, spec.nodes
    W = (steps - 1) * K  # drafter tree slots pos..pos+W-1: frontier node i of level d writes pos + (d-2)*K + i

    def draft(h, pos):
        dev = h.device
        rows, cols = torch.arange(K, device=dev)[:, None], torch.arange(W, device=dev)
        score, ids = torch.log_softmax(drafter.logits(h[:, -1]), -1)[0].topk(K)  # (K,) the root's children
        tok = drafter.to_target(ids)
        scores, tokens = [score], [tok]
        parents, depths = [torch.full((K,), -1, device=dev)], [torch.ones(K, dtype=torch.long, device=dev)]
        # the frontier, the K nodes of depth d-1 that level d expands (best first): their candidate ids,
        # scores and tokens (score, tok), the drafter output each reads, the tree slots each attends to
        # (its ancestors' and its own)
        front, hidden, seen = torch.arange(K, device=dev), h.expand(1, K, -1), cols == rows  # (K,), (1, K, H), (K, W)
        for d in range(2, steps + 1):
            out = drafter(tok[None], hidden, pos + (d - 2) * K + rows[:, 0], tree_mask(seen, pos, drafter.max_len),
                          (pos - 2 + d).expand(1, K))  # (1, K, H)
            logp = torch.log_softmax(drafter.logits(out[0]), -1)  # (K, Vd)
            score, ids = (score[:, None] + logp).topk(K, dim=-1)  # (K, K): frontier node i's children in row i
            score, tok = score.flatten(), drafter.to_target(ids.flatten())  # (K*K,)
            scores.append(score)
            tokens.append(tok)
            parents.append(front[:, None].expand(K, K).flatten())
            depths.append(torch.full((K * K,), d, device=dev))
            top = score.topk(K).indices  # (K,) the next frontier
            front, score, tok = K + (d - 2) * K * K + top, score[top], tok[top]
            hidden, seen = out[:, top // K], seen[top // K] | (cols == (d - 1) * K + rows)
        score, parent = torch.cat(scores), torch.cat(parents)  # (C,) candidates in (depth, index) order
        # The best `keep` by cumulative log-probability. A child never scores above its parent (its
        # log-softmax is <= 0, and float addition is monotone) but ties it when its probability rounds
        # to 1; the stable sort then ranks the earlier candidate, the parent, first, so no node is kept
        # without its parent. Sorting the kept ids restores (depth, index) order: parents first.
        chosen = score.sort(descending=True, stable=True).indices[:keep].sort().values  # (N,)
        row = torch.full_like(parent, -1).scatter(0, chosen, torch.arange(keep, device=dev))  # candidate -> node
        up = parent[chosen]
        return DraftTree(torch.cat(tokens)[chosen], torch.where(up >= 0, row[up.clamp(min=0)], -1), torch.cat(depths)[chosen])
    return draft


def accept_on_device(best: torch.Tensor, tree: DraftTree, anc: torch.Tensor, depth: int):
    """accept_tree_greedy with fixed shapes. A node is accepted when its token is the target's choice
    at its parent and its parent is accepted, i.e. when every node from the root to it matches;
    siblings carry distinct tokens, so the accepted nodes form a path. best: (N+1,) target argmax at
    root and nodes, anc: ancestors(tree.parents, depth) -> n (1,), the path's length, and rows (depth+1,):
    the root (0), then the path's node rows (node i is row i+1) by depth, 0 past its end."""
    ok = torch.cat([best.new_ones(1, dtype=torch.bool), tree.tokens == best[tree.parents + 1]])  # (N+1,)
    accepted = ~(anc & ~ok).any(-1)  # (N+1,)
    level = torch.cat([tree.depth.new_zeros(1), tree.depth])  # (N+1,)
    at = accepted & (level == torch.arange(1, depth + 1, device=best.device)[:, None])  # (depth, N+1) at most one per depth
    return accepted.sum(0, keepdim=True) - 1, torch.cat([level.new_zeros(1), at.int().argmax(-1)])


def verify_greedy(model: Transformer, drafter: Eagle3Drafter, spec: TreeSpec):
    """verify_tree at temperature 0, the commit and the drafter catch-up as one fixed-shape device
    step (a CUDA graph per spec): verify(pending (1,), tokens, parents, depth (N,) each, pos (1,)) ->
    (out (D+2,): n, then the n+1 new tokens padded to D+1; h (1, 1, H) for the next draft; the next
    pending token (1,); the next pos (1,)). D is the deepest a tree of spec can be."""
    D = min(spec.steps, spec.nodes)

    def accept(hidden, tree, anc):
        best = model.greedy(hidden)  # (N+1,)
        n, rows = accept_on_device(best, tree, anc, D)  # (1,), (D+1,)
        return n, rows, best[rows[n]]  # the bonus: the target's token after the deepest accepted node
    return verify_cycle(model, drafter, spec, accept)


def verify_sampled(model: Transformer, drafter: Eagle3Drafter, spec: TreeSpec, temperature: float, top_p: float = 1.0):
    """verify_tree at temperature > 0 as one fixed-shape device step, like verify_greedy: verify(pending,
    tokens, parents, depth, pos, rank, exists, qrow, q, u_nodes, u_vocab) with draft_sampled's tree and
    uniforms the caller drew (u_nodes (N+1,), u_vocab (V,)); acceptance by accept_sampled_on_device."""
    D, K = min(spec.steps, spec.nodes), spec.topk

    def accept(hidden, tree, anc, rank, exists, qrow, q, u_nodes, u_vocab):
        p = probs(model.logits(hidden), temperature, top_p)  # (N+1, V)
        draft_ids = drafter.target_ids()
        return accept_sampled_on_device(p, tree, rank, exists, qrow, q, draft_ids, u_nodes, u_vocab, D, K)
    return verify_cycle(model, drafter, spec, accept)


def verify_top(model: Transformer, drafter: Eagle3Drafter, spec: TreeSpec, temperature: float, top_p: float = 1.0):
    """verify_tree at temperature > 0 for draft_greedy's tree (TreeSpec.draws "top") as one fixed-shape
    device step: verify(pending, tokens, parents, depth, pos, u (N+1, V) uniforms). The target draws its
    own token at the root and at every node (gumbel_sample) and the walk follows the draws down the tree
    as accept_on_device follows argmaxes. Lossless with no rejection rule: the tree is a function of the
    prefix alone, each token emitted is the target's own draw given the tokens before it, and the nodes
    of a path draw from independent uniforms. A node's children pass with the target's probability
    of their tokens (the mass the top-k covers), whatever the drafter's probabilities were."""
    D = min(spec.steps, spec.nodes)

    def accept(hidden, tree, anc, u):
        draw = gumbel_sample(probs(model.logits(hidden), temperature, top_p), u)  # (N+1,)
        n, rows = accept_on_device(draw, tree, anc, D)
        return n, rows, draw[rows[n]]
    return verify_cycle(model, drafter, spec, accept)


def verify_cycle(model: Transformer, drafter: Eagle3Drafter, spec: TreeSpec, accept):
    """The target's pass over [pending, tree], acceptance, KV commit and drafter catch-up as one
    fixed-shape step. accept(hidden (N+1, H), tree, anc, *extra) -> (n (1,), rows (D+1,), bonus (1,)).
    What follows the target's pass but the commit (acceptance, with the logits, and the catch-up) is
    compiled like the drafting steps (Eagle3Drafter.optimize): eager, it and the tree mask are ~100
    small kernels a cycle at SmolLM2's shape (logs/tree-cycle-ops-cpu.json)."""
    D, capture = min(spec.steps, spec.nodes), drafter.cfg.aux_layer_ids

    def after(hidden, aux, seq, tokens, parents, depth, anc, pos, *extra):
        n, rows, bonus = accept(hidden, DraftTree(tokens, parents, depth), anc, *extra)
        new = torch.cat([seq[rows[1:]], bonus]).scatter(0, n, bonus)  # (D+1,) path tokens, bonus at n, junk after
        # Drafter catch-up, D+1 rows whatever n is: row j reads (features of the node at depth j, the
        # token after it) at drafter slot pos+j. Rows past n write slots pos+n+1..pos+D, which come
        # after the next cycle's prefix: hidden from its drafting (tree_mask) and rewritten by its
        # catch-up before anything reads them; causal, the rows up to n never see them.
        h = drafter(new[None], drafter.fuse(aux[:, rows]), pos + torch.arange(D + 1, device=pos.device))  # (1, D+1, H)
        return n, rows, bonus, new, h[:, n]
    after = drafter.compiled(after)

    def verify(pending, tokens, parents, depth, pos, *extra):
        dev = tokens.device
        seq = torch.cat([pending, tokens])  # (N+1,) the pending token is the root
        anc = ancestors(parents, D)  # (N+1, N+1)
        rope = pos + torch.cat([depth.new_zeros(1), depth])  # a node's position is its depth after pending
        out = model(seq[None], pos + torch.arange(len(seq), device=dev), tree_mask(anc, pos, model.max_len), rope[None],
                    capture=capture)
        n, rows, bonus, new, h = after(out.hidden[0], out.aux, seq, tokens, parents, depth, anc, pos, *extra)
        # The accepted path's KV to slots pos+1..pos+n. The copy has D rows whatever n is: rows past the
        # path copy a slot onto itself, and those slots (> pos+n) are scratch the next verify rewrites.
        dst = pos + 1 + torch.arange(D, device=dev)  # (D,)
        model.commit(torch.where(dst <= pos + n, pos + rows[1:], dst), dst)
        return torch.cat([n, new]), h, bonus, pos + n + 1
    return verify


def accept_sampled_on_device(p, tree: DraftTree, rank, exists, qrow, q, draft_ids, u_nodes, u_vocab, depth: int, k: int):
    """accept_tree_sampled with fixed shapes: accept_sampled_chain for a chain (k 1), else accept_sampled_walk."""
    if k == 1:
        return accept_sampled_chain(p, tree, exists, qrow, q, draft_ids, u_nodes, u_vocab, depth)
    return accept_sampled_walk(p, tree, rank, exists, qrow, q, draft_ids, u_nodes, u_vocab, depth, k)


def accept_sampled_walk(p, tree: DraftTree, rank, exists, qrow, q, draft_ids, u_nodes, u_vocab, depth: int, k: int):
    """accept_tree_sampled with fixed shapes (depth levels of k sibling tries, every branch computed and
    selected with where), so it runs inside a graph. p: (N+1, V) target distributions at root and nodes;
    rank (N,): a node's place in its parent's draw order (the kept children of a node are a prefix of
    it); exists (N,): drawn at all (a draw can run out of support); qrow (N,): the row of q (R, Vd) its
    children were drawn from (-1: none), the root's is row 0; u_nodes (N+1,), u_vocab (V,): uniforms.
    -> n (1,), rows (depth+1,) as accept_on_device's, the next token (1,) drawn from the final r."""
    N1, V = p.shape
    dev = p.device
    node = torch.arange(1, N1, device=dev)
    kids = torch.full((N1, k), -1, dtype=torch.long, device=dev)
    kids = kids.index_put((tree.parents + 1, rank), torch.where(exists, node, -1))  # (N+1, k) children by draw order
    tok = torch.cat([tree.tokens.new_zeros(1), tree.tokens])  # (N+1,) a node row's token
    qrow = torch.cat([qrow.new_zeros(1), qrow]).clamp(min=0)  # (N+1,)
    # the walk's state as 1-element tensors: indexing with a 0-dim tensor would read it on the host
    cur = torch.zeros(1, dtype=torch.long, device=dev)
    alive = torch.ones(1, dtype=torch.bool, device=dev)
    r_stop, rows = p[0], [cur]
    for _ in range(depth):
        r = p[cur][0]  # (V,)
        qd = torch.zeros(V, device=dev, dtype=p.dtype).index_copy(0, draft_ids, q[qrow[cur]][0].to(p.dtype))
        took = torch.full((1,), -1, dtype=torch.long, device=dev)
        for i in range(k):
            c = kids[cur, i]  # (1,)
            tried = alive & (c >= 0) & (took < 0)
            x = tok[c.clamp(min=0)]
            ok = tried & (u_nodes[c.clamp(min=0)] * qd[x] < r[x])
            took = torch.where(ok, c, took)
            no = tried & ~ok
            left = (r - qd).clamp(min=0)
            total = left.sum()
            r = torch.where(no & (total > 0), left / total.clamp(min=torch.finfo(p.dtype).tiny), r)
            q2 = qd.scatter(0, x, 0.0)
            qd = torch.where(no, q2 / q2.sum().clamp(min=torch.finfo(p.dtype).tiny), qd)
        down = alive & (took >= 0)
        r_stop = torch.where(alive & ~down, r, r_stop)
        cur = torch.where(down, took, cur)
        rows.append(torch.where(down, took, 0))
        alive = down
    r_stop = torch.where(alive, p[cur][0], r_stop)  # a node at full depth has no children: the walk stops there
    rows = torch.cat(rows)  # (depth+1,)
    n = (rows[1:] > 0).sum(0, keepdim=True)
    return n, rows, gumbel_sample(r_stop[None], u_vocab[None])


def accept_sampled_chain(p, tree: DraftTree, exists, qrow, q, draft_ids, u_nodes, u_vocab, depth: int):
    """accept_sampled_walk for a chain (topk 1: a node has at most one child). With no siblings a depth's
    test reads only its own node and its parent's p and q, so every depth is tested at once and the walk ends
    at the first rejection: the same few ops at any depth, where the loop adds ~20 a depth before compiling
    (compiled, the 1x2x2 T=1 cycle 1.108 against 1.134 ms on an H100, logs/h100-tree-cycle-t1-c7018a5.json).
    Same uniforms, same answer."""
    V, dev = p.shape[1], p.device
    at = exists & (tree.depth == torch.arange(1, depth + 1, device=dev)[:, None])  # (depth, N) one node a depth at most
    has = at.any(-1)  # (depth,) a node was drawn at that depth
    node = at.int().argmax(-1) + 1  # (depth,) row of the node at each depth (junk where has is false)
    parent = torch.cat([node.new_zeros(1), node[:-1]])  # (depth,) its parent's row: the node a depth up, or the root
    qrow = torch.cat([qrow.new_zeros(1), qrow]).clamp(min=0)  # (N+1,)
    qd = torch.zeros(depth, V, device=dev, dtype=p.dtype).index_copy(1, draft_ids, q[qrow[parent]].to(p.dtype))
    x = tree.tokens[node - 1]  # (depth,)
    ok = has & (u_nodes[node] * qd[torch.arange(depth, device=dev), x] < p[parent, x])  # (depth,)
    kept = ok.int().cumprod(0)  # (depth,) 1 up to the first rejection
    n = kept.sum(0, keepdim=True)  # (1,)
    rows = torch.cat([node.new_zeros(1), node * kept])  # (depth+1,)
    # the next token: from p at the last accepted node, or, where the node below it was drawn and rejected, from
    # the residual norm(max(0, p - q)) of that test (p == q exactly leaves nothing: p itself)
    i = n.clamp(max=depth - 1)  # (1,) the depth index tested after the last accepted node
    base = p[rows[n]][0]  # (V,)
    left = (base - qd[i][0]).clamp(min=0)
    total = left.sum()
    rejected = (n < depth) & has[i] & (total > 0)  # (1,)
    r_stop = torch.where(rejected, left / total.clamp(min=torch.finfo(p.dtype).tiny), base)
    return n, rows, gumbel_sample(r_stop[None], u_vocab[None])


def draft_sampled(drafter: Eagle3Drafter, spec: TreeSpec, temperature: float, top_p: float = 1.0):
    """draft_tree at temperature > 0 as one fixed-shape device step: draft(h (1, 1, H), pos (1,), u (steps, K, Vd)
    uniforms) -> (tree, rank, exists, qrow, q). As draft_greedy, with children drawn without replacement by
    children_sampled and every choice a stable sort by score over candidates in (depth, frontier order, draw
    order): an ancestor and an elder sibling score at least as high as a node and come before it, so the
    ranking never reads a node's own token (sampled_order's argument; ties between unrelated nodes may
    break differently from it, which does not change that). q stacks the distributions children were drawn
    from: row 0 the root's, row 1 + (d-1)K + i that of frontier node i of depth d."""
    K, steps, keep = spec.topk, spec.steps, spec.nodes
    W = (steps - 1) * K

    def draft(h, pos, u):
        dev = h.device
        rows, cols = torch.arange(K, device=dev)[:, None], torch.arange(W, device=dev)
        q = probs(drafter.logits(h[:, -1]), temperature, top_p)  # (1, Vd)
        score, ids = children_sampled(q, torch.zeros(1, device=dev), K, u[0, :1])
        score, tok = score[0], drafter.to_target(ids[0])  # (K,) the root's children in draw order
        qs, scores, tokens = [q], [score], [tok]
        parents, depths = [torch.full((K,), -1, device=dev)], [torch.ones(K, dtype=torch.long, device=dev)]
        ranks, own = [torch.arange(K, device=dev)], []  # own: (candidate, q row) of each expanded node
        # the frontier (candidate ids, scores, tokens): level 1's is all K children in draw order (their
        # scores never increase along it, so this is their stable order by score too)
        front, fscore, ftok = torch.arange(K, device=dev), score, tok
        hidden, seen = h.expand(1, K, -1), cols == rows  # (1, K, H), (K, W)
        for d in range(2, steps + 1):
            own.append((front, 1 + (d - 2) * K + rows[:, 0]))
            out = drafter(ftok[None], hidden, pos + (d - 2) * K + rows[:, 0], tree_mask(seen, pos, drafter.max_len),
                          (pos - 2 + d).expand(1, K))  # (1, K, H)
            q = probs(drafter.logits(out[0]), temperature, top_p)  # (K, Vd)
            score, ids = children_sampled(q, fscore, K, u[d - 1])  # (K, K): frontier node i's children in row i
            score, tok = score.flatten(), drafter.to_target(ids.flatten())
            qs.append(q)
            scores.append(score)
            tokens.append(tok)
            parents.append(front[:, None].expand(K, K).flatten())
            depths.append(torch.full((K * K,), d, device=dev))
            ranks.append(torch.arange(K, device=dev).repeat(K))
            top = score.sort(descending=True, stable=True).indices[:K]  # the next frontier
            front, fscore, ftok = K + (d - 2) * K * K + top, score[top], tok[top]
            hidden, seen = out[:, top // K], seen[top // K] | (cols == (d - 1) * K + rows)
        score, parent = torch.cat(scores), torch.cat(parents)  # (C,) candidates in (depth, index) order
        qrow = torch.full_like(parent, -1)
        for cand, row in own:
            qrow = qrow.scatter(0, cand, row)
        chosen = score.sort(descending=True, stable=True).indices[:keep].sort().values  # (N,) parents first
        index = torch.full_like(parent, -1).scatter(0, chosen, torch.arange(keep, device=dev))  # candidate -> node
        up = parent[chosen]
        tree = DraftTree(torch.cat(tokens)[chosen], torch.where(up >= 0, index[up.clamp(min=0)], -1), torch.cat(depths)[chosen])
        return tree, torch.cat(ranks)[chosen], score[chosen] > float("-inf"), qrow[chosen], torch.cat(qs)
    return draft


# Cycles of which one has its draft and verify spans timed, by device type. On CUDA a cycle's three
# timing events cost ~80 us of host time: chain cycles of 1.47 ms timed against 1.38 ms untimed on an H100
# (random SmolLM2-shaped target, logs/chain-cycle-h100-d95a7d6.json), so one cycle in 8 is timed and the
# totals scaled to all cycles (scale_spans). The CPU's host clock costs nothing: every cycle.
TIME_EVERY = {"cuda": 8}


def timed_cycle(device: torch.device, cycle: int) -> bool:
    return cycle % TIME_EVERY.get(device.type, 1) == 0


def mark(device: torch.device, on: bool = True):
    """A point on the device's timeline that costs no sync: a recorded CUDA event, whose time is read
    after a later sync, or the host clock on the CPU (synchronous). None on an untimed cycle (on=False)."""
    if not on:
        return None
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(a, b) -> float:
    if a is None:
        return 0.0
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3


def scale_spans(gen: Generation, timed: int):
    """gen's draft and verify totals, summed over `timed` of its cycles, scaled to all of them."""
    cycles = len(gen.accept_lengths)
    if 0 < timed < cycles:
        gen.draft_seconds *= cycles / timed
        gen.verify_seconds *= cycles / timed


def speculation_cycles(gen: Generation, dev: torch.device, max_new: int, eos_ids, draft, verify):
    """The device-resident speculation loop of decode_chain and decode_tree, run until gen is done.
    draft() queues a cycle's draft step and returns what verify needs; verify(drafted) queues the verify
    step (which leaves the next draft's inputs on the device) and returns out, a fixed-size (n, then the
    new tokens padded). A cycle's one sync is the host's read of out: a copy queued behind the verify,
    with the next cycle's draft queued before the host waits for it, so the device drafts while the host
    handles the tokens (a draft queued after the last cycle is discarded). On the cycles timed_cycle
    picks the two steps' spans are added to gen from CUDA events read after that sync, and the totals
    are scaled to all cycles (scale_spans)."""
    def draft_marked(on):
        start = mark(dev, on)
        return draft(), start, mark(dev, on)

    on, timed = True, 0  # whether the cycle in flight is timed, how many were
    drafted, d0, d1 = draft_marked(on)
    host = None  # out's copy on the host, pinned on CUDA so that the copy is asynchronous
    landed = torch.cuda.Event() if dev.type == "cuda" else None  # recorded behind each cycle's copy of its tokens
    done = finish(gen.tokens, max_new, eos_ids)[1]
    while not done:
        out = verify(drafted)
        v1 = mark(dev, on)
        if host is None:
            host = torch.empty(out.shape, dtype=out.dtype, pin_memory=dev.type == "cuda")
        host.copy_(out, non_blocking=True)
        if landed is not None:
            landed.record()
        following = timed_cycle(dev, len(gen.accept_lengths) + 1)
        drafted, *span = draft_marked(following)  # the next cycle's draft runs while the host reads this one's tokens
        if landed is not None:
            landed.synchronize()
        n, *new = host.tolist()
        gen.tokens += new[: n + 1]
        gen.accept_lengths.append(n + 1)
        gen.draft_seconds += elapsed(d0, d1)
        gen.verify_seconds += elapsed(d1, v1)
        timed += on
        (d0, d1), on = span, following
        gen.tokens, done = finish(gen.tokens, max_new, eos_ids)
    sync(dev)
    scale_spans(gen, timed)


@torch.no_grad()
def decode_tree(model: Transformer, drafter: Eagle3Drafter, prompt: torch.Tensor, max_new: int, spec: TreeSpec,
                eos_ids=(), graphs: Graphs | None = None, temperature: float = 0.0, top_p: float = 1.0,
                generator=None) -> Generation:
    """EAGLE-2 style tree speculation, resident on the device. A cycle is two fixed-shape steps,
    draft_greedy then verify_greedy (at temperature > 0 draft_greedy then verify_top, or draft_sampled
    then verify_sampled, by spec.draws_at(temperature), with the uniforms they use drawn from
    `generator` just before; CUDA graphs when `graphs` is enabled), and one host read of the accepted
    tokens, the cycle's only sync, with the next draft queued before it (speculation_cycles).
    draft_seconds and verify_seconds are the two steps' spans on the device timeline on the cycles
    timed_cycle picks, scaled to all cycles (scale_spans); verify_seconds includes the commit and the
    drafter catch-up."""
    graphs = graphs or eager()
    dev, T = prompt.device, prompt.shape[1]
    model.setup_caches(1, cache_slots(model, graphs, T, T + max_new + spec.num_draft_tokens + 2))
    drafter.setup_caches(1, cache_slots(drafter, graphs, T, T + max_new + spec.steps * spec.topk + 2))
    sampled = temperature > 0
    drawn = spec.draws_at(temperature) == "sample"  # children drawn from the drafter, which needs uniforms
    if drawn:
        draft = drafter.compiled(draft_sampled(drafter, spec, temperature, top_p))
        verify = verify_sampled(model, drafter, spec, temperature, top_p)
    else:
        draft = drafter.compiled(draft_greedy(drafter, spec))
        verify = verify_top(model, drafter, spec, temperature, top_p) if sampled else verify_greedy(model, drafter, spec)
    # a graph bakes in its modules, their cache buffers (replaced only when they grow) and the sampling settings
    how = ("sampled", temperature, top_p) if sampled else ()
    keys = (("tree-draft", spec, id(drafter), drafter.max_len, *how),
            ("tree-verify", spec, id(model), model.max_len, id(drafter), drafter.max_len, *how))
    u_shape = (spec.steps, spec.topk, drafter.cfg.draft_vocab_size)
    sync(dev)
    t0 = time.perf_counter()
    pending, first = prefill(model, prompt, drafter.cfg.aux_layer_ids, temperature, top_p, generator, graphs)
    h = draft_prompt(drafter, prompt, pending, first.aux, graphs)
    sync(dev)
    gen = Generation([int(pending)], 0.0, time.perf_counter() - t0)
    pos = torch.tensor([T], device=dev)

    def draft_next():  # -> the tree (with the sampled tree's extra fields)
        if drawn:
            return graphs(keys[0], draft, h, pos, torch.rand(u_shape, generator=generator, device=dev))
        return (graphs(keys[0], draft, h, pos),)

    def verify_next(tree):
        nonlocal h, pending, pos
        extra = ()
        if drawn:  # rank, exists, qrow, q, then the acceptance's uniforms
            extra = (*tree[1:], torch.rand(spec.nodes + 1, generator=generator, device=dev),
                     torch.rand(model.args.vocab_size, generator=generator, device=dev))
        elif sampled:  # the uniforms of the target's own draw at every node
            extra = (torch.rand(spec.nodes + 1, model.args.vocab_size, generator=generator, device=dev),)
        t = tree[0]
        out, h, pending, pos = graphs(keys[1], verify, pending, t.tokens, t.parents, t.depth, pos, *extra)
        return out

    speculation_cycles(gen, dev, max_new, eos_ids, draft_next, verify_next)
    gen.seconds = time.perf_counter() - t0
    return gen
