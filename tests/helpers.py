"""Builders shared by tests: a native tiny target and drafters (random or stub)."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from draftsmith.draft import DraftConfig, Eagle3Drafter
from draftsmith.target import ModelArgs, TargetOutput, Transformer, hf_to_native

from conftest import make_hf_model


def tiny_native(layers: int = 4, seed: int = 0, **overrides) -> Transformer:
    hf = make_hf_model(layers=layers, seed=seed, **overrides)
    args = ModelArgs.from_hf(hf.config.to_dict())
    model = Transformer(args).eval()
    model.load_state_dict(hf_to_native(hf.state_dict()), strict=False)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def tiny_drafter(target: Transformer, draft_vocab: int | None = None, seed: int = 1) -> Eagle3Drafter:
    torch.manual_seed(seed)
    V = target.args.vocab_size
    Vd = draft_vocab or V
    cfg = DraftConfig.from_target(target.args, Vd)
    drafter = Eagle3Drafter(cfg)
    ids = torch.sort(torch.randperm(V)[:Vd]).values if Vd < V else torch.arange(V)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab(ids - torch.arange(Vd), t2d)
    drafter.init_from_target(target)
    return drafter.eval()


class OracleDrafter(Eagle3Drafter):
    """Proposes the true continuation at a fixed random share `p_right` of positions, a wrong token
    at the others: never / always / sometimes right, to exercise every acceptance path. A drafter row
    at rotary position r drafts the token at position r + 2 (the chain, tree and catch-up conventions
    alike); r travels in the row's output, so every row is right or wrong on its own, whichever row
    the decoder reads (the last of a catch-up, a padded row, a node of a tree level). Tensor ops
    only: it runs on any device and inside CUDA graphs."""

    def __init__(self, cfg: DraftConfig, oracle: list[int], p_right: float, seed: int = 0, runner_up: bool = False):
        super().__init__(cfg)
        want = torch.tensor(oracle)
        right = torch.rand(len(oracle), generator=torch.Generator().manual_seed(seed)) < p_right
        self.register_buffer("proposal", torch.where(right, want, (want + 1) % cfg.vocab_size), persistent=False)
        # runner_up: where the proposal is wrong the true token comes second, so a tree accepts paths
        # that leave its first branch (their nodes sit apart in the cache, and the commit moves them)
        self.register_buffer("runner_up", want if runner_up else None, persistent=False)

    def forward(self, tokens, hidden, input_pos, mask=None, rope_pos=None):
        out = hidden.new_zeros(tokens.shape[0], tokens.shape[1], self.cfg.hidden_size)
        out[..., 0] = input_pos[None] if rope_pos is None else rope_pos
        return out

    def logits(self, hidden):
        at = (hidden[..., 0].long() + 2).clamp(max=len(self.proposal) - 1)
        out = hidden.new_full((*hidden.shape[:-1], self.cfg.draft_vocab_size), -1e4)
        if self.runner_up is not None:
            out = out.scatter(-1, self.runner_up[at][..., None], -1.0)
        return out.scatter(-1, self.proposal[at][..., None], 0.0)


class BigramTarget:
    """A stand-in target whose next-token logits depend only on the current token: table[token]
    (V, V). The probability of a continuation is then a product of table rows, so tests can
    enumerate the exact output distribution. Masks, positions and the cache do not matter to it."""

    def __init__(self, table: torch.Tensor):
        self.table = table
        self.args = SimpleNamespace(vocab_size=table.shape[0])
        self.max_len = 0

    def setup_caches(self, batch: int, max_len: int):
        self.max_len = max(self.max_len, max_len)

    def __call__(self, tokens, input_pos, mask=None, rope_pos=None, capture=()):
        hidden = F.one_hot(tokens, self.table.shape[0]).float()  # (B, T, V)
        return TargetOutput(hidden, hidden.repeat(1, 1, 3) if capture else None)

    def logits(self, hidden):
        return hidden @ self.table

    def commit(self, src, dst):
        pass


class BigramDrafter(BigramTarget):
    """The drafter counterpart: draft logits table[token], full vocabulary."""

    def __init__(self, table: torch.Tensor):
        super().__init__(table)
        V = table.shape[0]
        self.cfg = SimpleNamespace(aux_layer_ids=(0, 1, 2), vocab_size=V, draft_vocab_size=V)

    def __call__(self, tokens, hidden, input_pos, mask=None, rope_pos=None):
        return F.one_hot(tokens, self.table.shape[0]).float()

    def fuse(self, aux):
        return aux

    def compiled(self, fn):
        return fn

    def to_target(self, ids):
        return ids

    def target_ids(self):
        return torch.arange(self.table.shape[0], device=self.table.device)


def interrupt_on_call(monkeypatch, module, name: str, call: int):
    """Make module.name raise KeyboardInterrupt (a Ctrl-C) on its `call`-th call; returns the real one."""
    real, calls = getattr(module, name), []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(module, name, interrupted)
    return real


class StubOpenAIServer:
    """A minimal OpenAI-compatible HTTP server (`/v1/chat/completions` and `/v1/completions`, token-id
    prompts included) that answers with a draftsmith Target through generate_batch: what generate's
    --server path talks to, as SGLang or vLLM would serve the same model. Use as a context manager;
    `url` is the base URL and `requests` records every body it received."""

    def __init__(self, target):
        self.target, self.requests = target, []

    def _answer(self, ids: list[int], body: dict) -> tuple[list[int], bool]:
        from draftsmith.decode import generate_batch

        gen = torch.Generator().manual_seed(int(body.get("seed") or 0))
        out = generate_batch(self.target.model, [ids], body["max_tokens"], self.target.eos_ids,
                             float(body.get("temperature", 1.0)), float(body.get("top_p", 1.0)), gen)[0]
        stop = bool(out) and out[-1] in self.target.eos_ids
        return (out[:-1] if stop else out), stop

    def reply(self, route: str, body: dict) -> dict:
        from draftsmith.data import prompt_ids

        self.requests.append((route, body))
        tok = self.target.tokenizer
        if route.endswith("/chat/completions"):
            ids = prompt_ids(tok, [m["content"] for m in body["messages"] if m["role"] == "user"])
            out, stop = self._answer(ids, body)
            choice = {"message": {"role": "assistant", "content": tok.decode(out)}}
        else:  # text completion of a string or of token ids, as the server tokenizes it
            prompt = body["prompt"]
            ids = prompt if isinstance(prompt, list) else tok(prompt)["input_ids"]
            out, stop = self._answer(ids, body)
            choice = {"text": tok.decode(out)}
        choice.update(index=0, finish_reason="stop" if stop else "length")
        usage = {"prompt_tokens": len(ids), "completion_tokens": len(out) + stop}
        return {"choices": [choice], "usage": usage}

    def __enter__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                data = json.dumps(stub.reply(self.path, body)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
