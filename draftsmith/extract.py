"""Stage 2, extract: the target's hidden states for every training conversation, to disk.

For each conversation (from `generate`'s answers.jsonl, or any JSONL of {"conversations": [...]})
the target runs once over the chat-templated tokens and we keep, per token:
  aux     (3H, bf16)  outputs of the three aux layers (REFERENCE.md §1: 1, N//2-1, N-4)
  final   (H,  bf16)  the final normed hidden state: training recomputes the target's logits
                      over the draft vocab with the frozen head instead of storing V floats
  argmax  (int32)     the target's greedy next token, for honest acc_j / accept-length metrics
plus input_ids and the assistant loss mask. Samples go into safetensors shards with a
manifest; a shard is renamed into place before the manifest names it, so a crash costs at most
the shard in progress and a rerun resumes after the last finished one. `--estimate` prints the
disk needed and writes nothing.

    python -m draftsmith extract --target smollm2-135m --data runs/gen/answers.jsonl --out runs/hs
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from draftsmith.common import Progress, dtype_of, write_config
from draftsmith.data import encode_conversation
from draftsmith.target import load_target

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class ExtractConfig:
    target: str
    data: str  # JSONL with a "conversations" list of {role, content} per line
    out: str
    max_length: int = 2048  # longer conversations are truncated
    batch_tokens: int = 8192  # padded tokens per forward pass
    shard_samples: int = 256
    aux_layers: tuple[int, ...] | None = None  # default (1, N//2-1, N-4)
    estimate: bool = False
    device: str = "cpu"
    dtype: str = "float32"  # compute dtype
    store_dtype: str = "bfloat16"

    def __post_init__(self):
        if self.max_length < 4 or self.batch_tokens < self.max_length:
            raise ValueError("need max_length >= 4 and batch_tokens >= max_length")


@dataclass
class ExtractResult:
    out: str
    samples: int
    tokens: int
    bytes: int
    seconds: float
    estimate_only: bool = False


def read_conversations(path: str) -> list[tuple[str, list[dict]]]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "conversations" not in rec:
                raise ValueError(f"{path} line {n + 1}: no 'conversations' field; give generate's answers.jsonl")
            rows.append((str(rec.get("id", n)), rec["conversations"]))
    if not rows:
        raise ValueError(f"{path} holds no conversations")
    return rows


def bytes_per_token(hidden: int, store_dtype: torch.dtype) -> int:
    return 4 * hidden * torch.finfo(store_dtype).bits // 8 + 4 + 1 + 4


def load_manifest(out: Path) -> dict:
    path = out / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {"shards": []}


def write_shard(out: Path, manifest: dict, index: int, samples: list[dict]):
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    tensors = {
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
        **{k: torch.cat([s[k] for s in samples]) for k in ("input_ids", "loss_mask", "aux", "final", "argmax")},
    }
    name = f"shard-{index:05d}.safetensors"
    tmp = out / (name + ".tmp")
    save_file(tensors, str(tmp))
    tmp.rename(out / name)
    manifest["shards"].append({"file": name, "ids": [s["id"] for s in samples], "tokens": int(lengths.sum())})
    (out / (MANIFEST + ".tmp")).write_text(json.dumps(manifest))
    (out / (MANIFEST + ".tmp")).rename(out / MANIFEST)


@torch.no_grad()
def capture(model, batch: list[tuple[str, list[int], list[int]]], aux_layers, store) -> list[dict]:
    """One right-padded forward over a batch of (id, ids, mask); per-sample tensors on the CPU."""
    dev = model.embed_tokens.weight.device
    L = max(len(ids) for _, ids, _ in batch)
    tokens = torch.tensor([ids + [0] * (L - len(ids)) for _, ids, _ in batch], device=dev)  # (B, L)
    model.setup_caches(len(batch), L)
    out = model(tokens, torch.arange(L, device=dev), capture=aux_layers)
    argmax = torch.cat([model.logits(h).argmax(-1) for h in out.hidden.split(1024, dim=1)], dim=1)  # (B, L)
    rows = []
    for b, (sid, ids, mask) in enumerate(batch):
        n = len(ids)
        rows.append({
            "id": sid,
            "input_ids": torch.tensor(ids, dtype=torch.int32),
            "loss_mask": torch.tensor(mask, dtype=torch.uint8),
            "aux": out.aux[b, :n].to(store).cpu(),
            "final": out.hidden[b, :n].to(store).cpu(),
            "argmax": argmax[b, :n].to(torch.int32).cpu(),
        })
    return rows


def run(config: ExtractConfig) -> ExtractResult:
    t0 = time.perf_counter()
    out = Path(config.out)
    target = load_target(config.target, config.device, dtype_of(config.dtype))
    args = target.model.args
    aux_layers = tuple(config.aux_layers or args.default_aux_layers())
    encoded = []
    for sid, conv in read_conversations(config.data):
        enc = encode_conversation(target.tokenizer, conv)
        if sum(enc.loss_mask[: config.max_length]):
            encoded.append((sid, enc.input_ids[: config.max_length], enc.loss_mask[: config.max_length]))
    store = dtype_of(config.store_dtype)
    tokens = sum(len(e[1]) for e in encoded)
    need = tokens * bytes_per_token(args.hidden_size, store)
    if config.estimate:
        print(f"{len(encoded)} samples, {tokens} tokens: {need / 2**20:.1f} MiB of hidden states "
              f"({bytes_per_token(args.hidden_size, store)} bytes/token, aux layers {aux_layers})")
        return ExtractResult(str(out), len(encoded), tokens, need, time.perf_counter() - t0, True)
    out.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out).free
    if need > free:
        raise OSError(f"extract needs {need / 2**30:.2f} GiB but {out} has {free / 2**30:.2f} GiB free; "
                      "free space, use --max-length, or train online")
    write_config(out, "extract", config)
    manifest = load_manifest(out)
    if manifest["shards"] and manifest.get("aux_layer_ids") != list(aux_layers):
        raise ValueError(f"{out} holds shards for aux layers {manifest.get('aux_layer_ids')}, not {aux_layers}; use a new --out")
    manifest.update(target=target.path, hidden_size=args.hidden_size, aux_layer_ids=list(aux_layers),
                    vocab_size=args.vocab_size, num_layers=args.num_layers)
    done = {i for s in manifest["shards"] for i in s["ids"]}
    todo = [e for e in encoded if e[0] not in done]
    bar = Progress(len(todo), "extract", unit="sample")
    pending: list[dict] = []
    todo_sorted = sorted(todo, key=lambda e: len(e[1]))
    i = 0
    while i < len(todo_sorted):
        j = i + 1  # grow the batch while its padded size stays within batch_tokens
        while j < len(todo_sorted) and (j + 1 - i) * len(todo_sorted[j][1]) <= config.batch_tokens:
            j += 1
        batch = todo_sorted[i:j]
        pending += capture(target.model, batch, aux_layers, store)
        bar.update(len(batch), tokens=sum(len(b[1]) for b in batch))
        while len(pending) >= config.shard_samples:
            write_shard(out, manifest, len(manifest["shards"]), pending[: config.shard_samples])
            pending = pending[config.shard_samples:]
        i = j
    if pending:
        write_shard(out, manifest, len(manifest["shards"]), pending)
    bar.close()
    total = sum(s["tokens"] for s in manifest["shards"])
    return ExtractResult(str(out), sum(len(s["ids"]) for s in manifest["shards"]), total,
                         sum((out / s["file"]).stat().st_size for s in manifest["shards"]), time.perf_counter() - t0)


class HiddenStates:
    """Random access to extracted samples: index -> dict of tensors. Shards are read on first use
    and kept, since training visits them in random order every epoch."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.manifest = load_manifest(self.folder)
        if not self.manifest["shards"]:
            hint = ("; to train on answers without extracting, run train with --online" if self.folder.is_file()
                    else "; run extract first")
            raise FileNotFoundError(f"{folder} has no extracted shards ({MANIFEST} missing or empty){hint}")
        self.index = [(s, k) for s, shard in enumerate(self.manifest["shards"]) for k in range(len(shard["ids"]))]
        self.ids = [i for shard in self.manifest["shards"] for i in shard["ids"]]
        self._shards: dict[int, dict] = {}

    def __len__(self):
        return len(self.index)

    def shard(self, s: int) -> dict:
        if s not in self._shards:
            self._shards[s] = load_file(str(self.folder / self.manifest["shards"][s]["file"]))
        return self._shards[s]

    def __getitem__(self, i: int) -> dict:
        s, k = self.index[i]
        t = self.shard(s)
        a, b = int(t["offsets"][k]), int(t["offsets"][k + 1])
        return {name: t[name][a:b] for name in ("input_ids", "loss_mask", "aux", "final", "argmax")}
