"""Stage 3, train: an EAGLE-3 drafter with training-time test (TTT) on extracted hidden states.

Offline, the hidden states come from extract's shards; online (`--online`, `--data` is
generate's answers.jsonl) the frozen target runs in the loop on each packed batch, so nothing
touches the disk. Per step, samples are packed into one row of `batch_tokens` (no padding), the drafter is
unrolled `ttt_depth` steps (draft.py), and each step's output is scored against the target's
own distribution over the draft vocab, recomputed from the stored final hidden state with the
frozen target head (REFERENCE.md §2):

    loss = sum_j 0.8^j * KL(softmax(z_target[t+1+j] | draft vocab) || q_j[t])  on assistant tokens

acc_j is agreement with the target's greedy token and the simulated accept length is
1 + sum_k prod_{i<=k} acc_i. Checkpoints hold model, optimizer, scheduler, step, data
position and RNG state, written atomically; rerunning the same command resumes exactly.

    python -m draftsmith train --target smollm2-135m --data runs/hs --out runs/draft
"""

from __future__ import annotations

import json
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draftsmith.common import Progress, dtype_of, write_config
from draftsmith.data import encode_conversation
from draftsmith.draft import DraftConfig, Eagle3Drafter
from draftsmith.export import save_trained
from draftsmith.extract import HiddenStates, read_conversations
from draftsmith.target import load_target
from draftsmith.vocab import build_vocab, count_tokens

STEP_DECAY = 0.8


@dataclass(frozen=True)
class TrainConfig:
    target: str
    data: str  # extract's output folder; with online, generate's answers.jsonl
    out: str
    online: bool = False  # run the target in the loop instead of reading extracted shards
    aux_layers: tuple[int, ...] | None = None  # online only; offline they come from the shards
    max_length: int = 2048  # online only: conversations are truncated to this many tokens
    draft_vocab_size: int = 32000  # capped at the target vocab
    ttt_depth: int = 7
    epochs: int = 1
    lr: float = 1e-4
    warmup_ratio: float = 0.015
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    batch_tokens: int = 4096  # packed tokens per optimizer step
    eval_fraction: float = 0.05
    save_every: int = 100  # optimizer steps between checkpoints
    init_head_from_target: bool = True
    seed: int = 0
    max_steps: int | None = None  # stop early (the schedule still spans all epochs)
    schedule_steps: int | None = None  # train exactly this many steps (epochs repeat as needed), schedule included
    device: str = "cpu"
    target_dtype: str = "float32"  # online: the target's compute dtype

    def __post_init__(self):
        if self.ttt_depth < 1 or self.epochs < 1 or self.batch_tokens < 16:
            raise ValueError("need ttt_depth >= 1, epochs >= 1, batch_tokens >= 16")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError("eval_fraction must be in [0, 1)")


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
    and online conversations split and shuffle identically."""
    canon = sorted(range(len(ids)), key=lambda i: ids[i])
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed)).tolist()
    k = int(len(ids) * eval_fraction) if len(ids) > 1 else 0
    return [canon[i] for i in sorted(order[k:])], [canon[i] for i in sorted(order[:k])]


def pack(samples: list[dict], device) -> dict:
    """Concatenate samples into one (1, T) row with segment and position ids."""
    cat = {k: torch.cat([s[k] for s in samples])[None].to(device) for k in samples[0]}
    cat["segment_ids"] = torch.cat([torch.full((len(s["input_ids"]),), i) for i, s in enumerate(samples)])[None].to(device)
    cat["position_ids"] = torch.cat([torch.arange(len(s["input_ids"])) for s in samples])[None].to(device)
    return cat


def batches(data: HiddenStates, indices: list[int], batch_tokens: int, start: int = 0):
    """Greedy packing in the given order; yields (next cursor, packed samples)."""
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


@torch.no_grad()
def target_features(model, batch: dict, aux_layers) -> dict:
    """The target over a packed row, each sample attending only to itself: aux, final, argmax."""
    ids, seg, pos = batch["input_ids"].long(), batch["segment_ids"], batch["position_ids"]
    T = ids.shape[1]
    model.setup_caches(1, T)
    mask = torch.zeros(T, model.max_len, dtype=torch.bool, device=ids.device)  # the cache may be longer than T
    mask[:, :T] = (seg[0][:, None] == seg[0][None, :]) & torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
    out = model(ids, torch.arange(T, device=ids.device), mask[None, None], pos, capture=aux_layers)
    argmax = torch.cat([model.logits(h).argmax(-1) for h in out.hidden.split(1024, dim=1)], dim=1)
    return {"aux": out.aux, "final": out.hidden, "argmax": argmax}


# --------------------------------------------------------------------------- objective


def ttt_loss(drafter: Eagle3Drafter, head: torch.Tensor, batch: dict, depth: int):
    """Weighted TTT loss plus per-step (loss_j, acc_j, count_j). head: (Vd, H) target rows."""
    ids = batch["input_ids"].long()
    T = ids.shape[1]
    dtype = drafter.fc.weight.dtype
    outs = drafter.ttt(ids, batch["aux"].to(dtype), depth, batch["position_ids"], batch["segment_ids"])
    with torch.no_grad():
        target_logits = (batch["final"].to(head.dtype) @ head.T).float()  # (1, T, Vd)
    seg, mask, argmax = batch["segment_ids"], batch["loss_mask"].bool(), batch["argmax"].long()
    total, stats = 0.0, []
    for j, h in enumerate(outs):
        n = T - 1 - j  # row t is scored against the target at t+1+j, which predicts token t+2+j
        if n <= 1:
            stats.append((0.0, 0.0, 0))
            continue
        nxt = torch.arange(1 + j, T, device=ids.device)
        rows = torch.arange(n, device=ids.device)
        pred_tok = torch.clamp(nxt + 1, max=T - 1)
        valid = (seg[0, rows] == seg[0, nxt]) & (seg[0, pred_tok] == seg[0, nxt]) & (nxt + 1 < T) & mask[0, pred_tok]
        if not valid.any():
            stats.append((0.0, 0.0, 0))
            continue
        q = drafter.logits(h[0, rows[valid]])  # (n', Vd)
        log_p = F.log_softmax(target_logits[0, nxt[valid]], dim=-1)
        # forward KL: the soft cross-entropy minus the target's entropy (same gradient, 0 when matched)
        loss_j = (log_p.exp() * (log_p - F.log_softmax(q, dim=-1))).sum(-1).mean()
        with torch.no_grad():
            acc = (drafter.to_target(q.argmax(-1)) == argmax[0, nxt[valid]]).float().mean()
        total = total + STEP_DECAY**j * loss_j
        stats.append((float(loss_j.detach()), float(acc), int(valid.sum())))
    return total, stats


def accept_length(accs: list[float]) -> float:
    """Simulated accept length 1 + sum_k prod_{i<=k} acc_i."""
    tau, run = 1.0, 1.0
    for a in accs:
        run *= a
        tau += run
    return tau


def summarize(stats: list[list[tuple]]) -> dict:
    depth = len(stats[0])
    loss, acc = [], []
    for j in range(depth):
        n = sum(s[j][2] for s in stats)
        loss.append(sum(s[j][0] * s[j][2] for s in stats) / max(n, 1))
        acc.append(sum(s[j][1] * s[j][2] for s in stats) / max(n, 1))
    return {"loss": loss, "acc": acc, "accept_length": accept_length(acc)}


@torch.no_grad()
def evaluate(drafter, head, data, indices, cfg: TrainConfig, featurize) -> dict:
    if not indices:
        return {}
    drafter.eval()
    stats = []
    for _, g in batches(data, indices, cfg.batch_tokens):
        with autocast(cfg.device):
            stats.append(ttt_loss(drafter, head, featurize(pack(g, cfg.device)), cfg.ttt_depth)[1])
    drafter.train()
    return summarize(stats)


def autocast(device: str):
    """bf16 matmuls with fp32 master weights on CUDA; plain fp32 on the CPU."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else nullcontext()


# --------------------------------------------------------------------------- state


def lr_lambda(total: int, warmup: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return f


def save_checkpoint(folder: Path, drafter, opt, sched, state: dict):
    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(tmp / "model.safetensors"))
    torch.save({"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "rng": torch.get_rng_state(), **state},
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


def load_checkpoint(folder: Path, drafter, opt, sched) -> dict:
    drafter.load_state_dict(load_file(str(folder / "model.safetensors")))
    state = torch.load(folder / "state.pt", weights_only=True)
    opt.load_state_dict(state.pop("optimizer"))
    sched.load_state_dict(state.pop("scheduler"))
    torch.set_rng_state(state.pop("rng"))
    return state


# --------------------------------------------------------------------------- entry point


def build_drafter(cfg: TrainConfig, target, data, train_idx: list[int], aux: tuple[int, ...]):
    args = target.model.args
    vocab = build_vocab(count_tokens((data[i] for i in train_idx), args.vocab_size), min(cfg.draft_vocab_size, args.vocab_size))
    torch.manual_seed(cfg.seed)
    drafter = Eagle3Drafter(DraftConfig.from_target(args, len(vocab.d2t), aux))
    drafter.set_vocab(vocab.d2t, vocab.t2d)
    drafter.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight)
    if cfg.init_head_from_target:
        drafter.init_from_target(target.model)
    return drafter.to(cfg.device), vocab.coverage


def run(config: TrainConfig) -> TrainResult:
    t0 = time.perf_counter()
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    write_config(out, "train", config)
    target = load_target(config.target, config.device, dtype_of(config.target_dtype))
    if config.online:
        data = Conversations(config.data, target.tokenizer, config.max_length)
        aux = tuple(config.aux_layers or target.model.args.default_aux_layers())

        def featurize(batch):
            return {**batch, **target_features(target.model, batch, aux)}
    else:
        data = HiddenStates(config.data)
        if data.manifest.get("hidden_size") != target.model.args.hidden_size:
            raise ValueError(f"{config.data} was extracted from a target of hidden size {data.manifest.get('hidden_size')}, "
                             f"not {config.target} ({target.model.args.hidden_size})")
        aux = tuple(data.manifest["aux_layer_ids"])

        def featurize(batch):
            return batch
    train_idx, eval_idx = split(data.ids, config.eval_fraction, config.seed)
    drafter, coverage = build_drafter(config, target, data, train_idx, aux)
    head = target.model.lm_head.weight[drafter.to_target(torch.arange(drafter.cfg.draft_vocab_size, device=config.device))].detach()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))
    steps_per_epoch = sum(1 for _ in batches(data, train_idx, config.batch_tokens))
    total = config.schedule_steps or steps_per_epoch * config.epochs
    epochs = math.ceil(total / steps_per_epoch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(total, max(1, int(total * config.warmup_ratio))))
    ckpt = out / "checkpoint"
    state = {"step": 0, "epoch": 0, "cursor": 0}
    if (ckpt / "state.pt").exists():
        state = load_checkpoint(ckpt, drafter, opt, sched)
        print(f"resumed from {ckpt} at step {state['step']} (epoch {state['epoch']}, sample {state['cursor']})")
    log = open(out / "metrics.jsonl", "a")
    bar = Progress(total, "train", unit="step")
    bar.update(state["step"])
    drafter.train()
    limit = min(config.max_steps or total, total)
    loop_seconds = 0.0
    while state["epoch"] < epochs and state["step"] < limit:
        order = [train_idx[i] for i in torch.randperm(len(train_idx), generator=torch.Generator().manual_seed(config.seed + state["epoch"]))]
        for cursor, group in batches(data, order, config.batch_tokens, state["cursor"]):
            if state["step"] >= limit:
                break
            t_step = time.perf_counter()
            with autocast(config.device):
                loss, stats = ttt_loss(drafter, head, featurize(pack(group, config.device)), config.ttt_depth)
            opt.zero_grad(set_to_none=True)
            if torch.is_tensor(loss):
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
                opt.step()
            sched.step()
            state.update(step=state["step"] + 1, cursor=cursor)
            loop_seconds += time.perf_counter() - t_step
            s = summarize([stats])
            log.write(json.dumps({"step": state["step"], "lr": sched.get_last_lr()[0], **s}) + "\n")
            bar.update(1, tokens=sum(len(g["input_ids"]) for g in group), loss=s["loss"][0], acc0=s["acc"][0],
                       tau=s["accept_length"])
            if state["step"] % config.save_every == 0:
                log.flush()
                save_checkpoint(ckpt, drafter, opt, sched, state)
        else:
            metrics = evaluate(drafter, head, data, eval_idx, config, featurize)
            state.update(epoch=state["epoch"] + 1, cursor=0)
            log.write(json.dumps({"epoch": state["epoch"], "eval": metrics}) + "\n")
            print(f"epoch {state['epoch']}: held-out acc {[round(a, 3) for a in metrics.get('acc', [])]} "
                  f"accept length {metrics.get('accept_length', float('nan')):.2f}")
    bar.close()
    log.close()
    save_checkpoint(ckpt, drafter, opt, sched, state)
    final = evaluate(drafter, head, data, eval_idx, config, featurize)
    save_trained(drafter.eval(), out / "drafter", {"path": target.path, "spec": config.target, "hf_config": target.hf_config})
    (out / "eval.json").write_text(json.dumps(final, indent=2))
    return TrainResult(str(out), state["step"], time.perf_counter() - t0, final, coverage, loop_seconds)
