"""Check an EAGLE-3 draft checkpoint against its target before serving it (REFERENCE.md §1, §7).

    draftsmith check --draft runs/x/sglang --target T        # exits 1 and lists every fault

Reads an SGLang/EAGLE-format or a vLLM speculators-format folder (or our own export) and reports:
tensor names (nothing missing, nothing an engine would silently skip), shapes against the
target's hidden size and vocab, d2t (offsets into the vocab, not ids, not all zero) and t2d
(agrees with d2t), the target layer outputs each engine will feed the drafter (per the facts in
export.py's docstring) against the ones it was trained on, variant flags and which engines
implement them, and a live run: the drafter on a few chat prompts through our decode engine,
reporting how often its first draft token is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from draftsmith.export import sglang_shapes
from draftsmith.interop import (
    Foreign, InteropError, draft_config_of, read_foreign, target_embedding, to_drafter, variant_flags,
)

# flag -> engine -> support, from SGLang models/llama_eagle3.py (no flag is read: residual is always the
# un-normed state, fc has no input norm), vLLM models/llama_eagle3.py + speculators/algos.py, and
# speculators models/eagle3/config.py (where all four are defined). draftsmith implements none.
VARIANTS = {
    "norm_before_residual": {"sglang": "no", "vllm": "yes", "draftsmith": "no"},
    "norm_before_fc": {"sglang": "no", "vllm": "recent versions only", "draftsmith": "no"},
    "fc_norm": {"sglang": "no", "vllm": "version-dependent (speculators Eagle 3.1)", "draftsmith": "no"},
    "norm_output": {"sglang": "no", "vllm": "version-dependent (speculators Eagle 3.1)", "draftsmith": "no"},
}
ENGINES = {"eagle3": ("sglang", "vllm"), "speculators": ("vllm",)}  # who serves each layout
PROMPTS = ("Write a short poem about the sea.", "Explain how a transformer predicts the next token.")


class CheckError(ValueError):
    """Raised by run() when a check fails; carries the full result."""

    def __init__(self, result: "CheckResult"):
        super().__init__("check failed:\n" + "\n".join(f"  [{f.code}] {f.message}" for f in result.errors))
        self.result = result


@dataclass(frozen=True)
class CheckConfig:
    draft: str  # an exported folder (SGLang/EAGLE or speculators layout) or a speculators .safetensors file
    target: str
    live: bool = True  # run the drafter on a few prompts and report first-position acceptance
    max_new_tokens: int = 24
    min_accept: float = 0.0  # fail when first-position acceptance is below this
    raise_on_failure: bool = True  # run() raises CheckError (the CLI exits 1); False returns the result
    device: str = "cpu"

    def __post_init__(self):
        if not 0.0 <= self.min_accept <= 1.0 or self.max_new_tokens < 1:
            raise ValueError("min_accept must be in [0, 1] and max_new_tokens >= 1")


@dataclass
class Finding:
    level: str  # "error", "warning" or "info"
    code: str
    message: str


@dataclass
class CheckResult:
    ok: bool
    layout: str | None
    findings: list[Finding] = field(default_factory=list)
    engines: dict = field(default_factory=dict)  # engine -> target layer outputs it feeds the drafter
    first_accept: float | None = None  # live: share of cycles whose first draft token was accepted

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]


class Report(list):
    def add(self, level: str, code: str, message: str):
        self.append(Finding(level, code, message))


# --------------------------------------------------------------------------- static checks


def check_names(foreign: Foreign, shapes: dict, report: Report):
    known = set(shapes) | {"embed_tokens.weight"}
    missing = sorted(set(shapes) - set(foreign.tensors) - {"d2t", "t2d"})
    extra = sorted(set(foreign.tensors) - known)
    if missing:
        report.add("error", "missing_key", f"tensors missing: {missing} (an engine would serve them at random init)")
    if extra:
        report.add("error", "unexpected_key", f"tensors no engine loads into this drafter: {extra} (silently ignored or a load error)")
    if foreign.layout == "eagle3" and any(n.removeprefix("model.").startswith("layers.0.") for n in foreign.names):
        report.add("error", "sglang_skips_names", "layers.0.* names: SGLang's LlamaForCausalLMEagle3 looks up midlayer.* "
                   "and silently skips the rest (random weights served); vLLM would rename them. Write midlayer.*")
    if "embed_tokens.weight" in foreign.tensors:
        report.add("info", "own_embedding", "the checkpoint carries embed_tokens; vLLM loads it, SGLang shares the target's")


def check_target_fit(cfg, target_cfg: dict, report: Report):
    V, Ht = target_cfg["vocab_size"], target_cfg["hidden_size"]
    if cfg.vocab_size != V:
        report.add("error", "vocab", f"config vocab_size {cfg.vocab_size} != the target's vocab {V}")
    if cfg.target_hidden_size != Ht:
        report.add("error", "hidden_size", f"the drafter fuses target states of width {cfg.target_hidden_size}, "
                   f"the target's hidden size is {Ht} (fc expects {3 * cfg.target_hidden_size} inputs)")
    if cfg.hidden_size != Ht:
        report.add("warning", "hidden_size", f"draft hidden {cfg.hidden_size} != target hidden {Ht}: the shared "
                   "embedding does not fit unless the checkpoint carries its own")


def check_shapes(tensors: dict, shapes: dict, report: Report):
    wrong = {k: (tuple(t.shape), shapes[k]) for k, t in tensors.items() if k in shapes and tuple(t.shape) != shapes[k]}
    if wrong:
        report.add("error", "shape", f"shapes (file, config) disagree: {wrong}")


def check_vocab(tensors: dict, cfg, report: Report):
    V, Vd = cfg.vocab_size, cfg.draft_vocab_size
    d2t, t2d = tensors.get("d2t"), tensors.get("t2d")
    if d2t is None:
        if Vd < V:
            report.add("error", "d2t_missing", f"no d2t with a draft vocab of {Vd} < {V}: engines then treat draft ids "
                       "as target ids (offset 0) and nearly every draft token is wrong")
        return
    if d2t.dtype != torch.int64 or tuple(d2t.shape) != (Vd,):
        report.add("error", "d2t_dtype", f"d2t must be int64 [{Vd}], got {d2t.dtype} {tuple(d2t.shape)}")
        return
    if Vd < V and not d2t.any():
        report.add("error", "d2t_zero", f"d2t is all zeros with a draft vocab of {Vd} < {V}: it maps draft id i to "
                   "target id i, which is only right for the first Vd tokens")
        return
    ids = torch.arange(Vd) + d2t
    if ids.min() < 0 or ids.max() >= V or len(ids.unique()) != Vd:
        as_ids = d2t.min() >= 0 and d2t.max() < V and len(d2t.unique()) == Vd
        if as_ids:
            report.add("error", "d2t_ids", "d2t holds target ids, not offsets: engines compute draft_id + d2t[draft_id]; "
                       "store d2t = ids - arange(Vd)")
        else:
            report.add("error", "d2t_range", "draft_id + d2t[draft_id] leaves the target vocab or repeats ids")
        return
    if t2d is None:
        report.add("info", "t2d_missing", "no t2d: neither engine reads it (SGLang and vLLM skip it)")
    elif t2d.dtype != torch.bool or tuple(t2d.shape) != (V,) or not torch.equal(t2d.nonzero().squeeze(1), ids.sort().values):
        report.add("error", "t2d_mismatch", "t2d does not mark exactly the target ids that d2t maps to")


def engine_reads(config: dict, layout: str, n: int) -> dict[str, tuple[int, ...]]:
    """Target layer OUTPUTS each engine feeds the drafter (export.py docstring)."""
    default = (1, n // 2 - 1, n - 4)  # both engines: inputs of 2, N//2, N-3
    vllm_ids = config.get("eagle_aux_hidden_state_layer_ids")
    reads = {"vllm": tuple(i - 1 for i in vllm_ids) if vllm_ids else default}
    if layout == "eagle3":
        sglang_ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        reads["sglang"] = tuple(sglang_ids) if sglang_ids else default
    return reads


def check_aux(config: dict, layout: str, n: int, report: Report) -> dict:
    reads = engine_reads(config, layout, n)
    trained = tuple((config.get("draftsmith") or {}).get("aux_layer_outputs") or ())
    for engine, outs in reads.items():
        report.add("info", "aux", f"{engine} feeds the outputs of target layers {list(outs)}")
        if any(not 0 <= i <= n - 2 for i in outs):
            report.add("error", "aux_range", f"{engine} would tap outputs {list(outs)}, but a {n}-layer target only "
                       f"exposes outputs 0..{n - 2} (the stream entering the next layer)")
        elif trained and outs != trained:
            shift = {a - b for a, b in zip(outs, trained)}
            what = f"off by {shift.pop():+d} layer" if len(shift) == 1 else "different layers"
            report.add("error", "aux_mismatch", f"{engine} feeds outputs {list(outs)} but the drafter was trained on "
                       f"{list(trained)} ({what}): acceptance collapses silently")
    if not trained and len(set(reads.values())) > 1:
        report.add("error", "aux_disagree", f"the engines tap different layers: {reads}")
    return {k: list(v) for k, v in reads.items()}


def check_variants(config: dict, layout: str, report: Report):
    flags = variant_flags(config)
    if layout == "speculators" and "norm_before_residual" not in config:
        report.add("error", "variant_default", "norm_before_residual is absent: vLLM's speculators loader assumes true, "
                   "the speculators library false; write it explicitly")
    for flag, on in flags.items():
        if not on:
            continue
        support = VARIANTS[flag]
        report.add("info", "variant", f"{flag}=true; support: {support}")
        for engine in ENGINES[layout]:
            if support[engine] == "no":
                report.add("error", "variant_unsupported", f"{flag}=true is ignored by {engine}: it would serve a "
                           "different function than the one trained")
            elif support[engine] != "yes":
                report.add("warning", "variant_version", f"{flag}=true: {engine} support is {support[engine]}")


# --------------------------------------------------------------------------- live check


def live_accept(config: CheckConfig, foreign: Foreign, target_cfg: dict, embed: torch.Tensor, report: Report) -> float | None:
    from draftsmith.common import dtype_of
    from draftsmith.data import prompt_ids
    from draftsmith.decode import decode_chain
    from draftsmith.target import load_target

    try:
        drafter, _ = to_drafter(foreign, target_cfg, embed)
    except InteropError as e:
        report.add("warning", "live_skipped", f"live check skipped: {e}")
        return None
    target = load_target(config.target, config.device, dtype_of("float32"))
    drafter = drafter.to(config.device).eval()
    lengths = []
    for text in PROMPTS:
        x = torch.tensor([prompt_ids(target.tokenizer, [text])], device=config.device)
        lengths += decode_chain(target.model, drafter, x, config.max_new_tokens, 1, target.eos_ids).accept_lengths
    accept = sum(n >= 2 for n in lengths) / max(len(lengths), 1)
    report.add("info", "live", f"first draft token accepted in {accept:.0%} of {len(lengths)} cycles on {len(PROMPTS)} prompts")
    if accept < config.min_accept:
        report.add("error", "low_acceptance", f"first-position acceptance {accept:.2f} < {config.min_accept}")
    return accept


# --------------------------------------------------------------------------- entry points


def inspect(config: CheckConfig) -> CheckResult:
    """Every check; never raises for a fault in the draft (each becomes a finding)."""
    report = Report()
    target_cfg, embed = target_embedding(config.target)
    try:
        foreign = read_foreign(config.draft)
    except (InteropError, KeyError, ValueError) as e:
        report.add("error", "unreadable", str(e))
        return CheckResult(False, None, list(report))
    try:
        cfg = draft_config_of(foreign.config, foreign.layout, target_cfg)
    except (KeyError, TypeError, ValueError) as e:
        report.add("error", "config", f"config.json does not describe an EAGLE-3 drafter: {e!r}")
        return CheckResult(False, foreign.layout, list(report))
    shapes = sglang_shapes(cfg)
    check_names(foreign, shapes, report)
    check_target_fit(cfg, target_cfg, report)
    check_shapes(foreign.tensors, shapes, report)
    check_vocab(foreign.tensors, cfg, report)
    engines = check_aux(foreign.config, foreign.layout, target_cfg["num_hidden_layers"], report)
    check_variants(foreign.config, foreign.layout, report)
    accept = None
    if config.live and not any(f.level == "error" for f in report):
        accept = live_accept(config, foreign, target_cfg, embed, report)
    ok = not any(f.level == "error" for f in report)
    return CheckResult(ok, foreign.layout, list(report), engines, accept)


def run(config: CheckConfig) -> CheckResult:
    result = inspect(config)
    for f in result.findings:
        print(f"{f.level:<7} {f.code:<20} {f.message}")
    print("OK: ready to serve" if result.ok else f"FAILED: {len(result.errors)} error(s)")
    if not result.ok and config.raise_on_failure:
        raise CheckError(result)
    return result


# --------------------------------------------------------------------------- the faults it must catch
# REFERENCE.md §7's failure modes, each planted into a good export (in place) by one function;
# tests/test_check.py and benchmarks/interop.py use them to show `check` catches every one.


def _edit(folder, tensors=None, config=None):
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    if tensors:
        t = load_file(folder / "model.safetensors")
        tensors(t)
        save_file(t, folder / "model.safetensors")
    if config:
        c = json.loads((folder / "config.json").read_text())
        config(c)
        (folder / "config.json").write_text(json.dumps(c))


def _swap_t2d(t):
    on, off = t["t2d"].nonzero()[0, 0], (~t["t2d"]).nonzero()[0, 0]
    t["t2d"][on], t["t2d"][off] = False, True


def _rename_layers0(t):
    for k in [k for k in t if k.startswith("midlayer.")]:
        t["layers.0." + k.removeprefix("midlayer.")] = t.pop(k)


def _truncate(folder):
    from pathlib import Path

    f = Path(folder) / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _pickle_weights(folder):
    from pathlib import Path

    (Path(folder) / "model.safetensors").unlink()
    # an object torch.load(weights_only=True) may not rebuild: loading it would run the class's code
    torch.save({"fc.weight": Finding("error", "pickle", "not a tensor")}, Path(folder) / "pytorch_model.bin")


def _wrong_vocab(c):
    c["vocab_size"] += 10


def _shift(key, delta):
    def plant(c):
        ids = c["eagle_config"] if key == "sglang" else c
        ids["eagle_aux_hidden_state_layer_ids"] = [i + delta for i in ids["eagle_aux_hidden_state_layer_ids"]]
    return plant


FAULTS = {  # name -> (export format it is planted in, plant(folder), the finding code that must appear)
    "d2t_as_ids": ("sglang", lambda f: _edit(f, lambda t: t.update(d2t=t["d2t"] + torch.arange(len(t["d2t"])))), "d2t_ids"),
    "d2t_missing": ("sglang", lambda f: _edit(f, lambda t: t.pop("d2t")), "d2t_missing"),
    "d2t_all_zero": ("sglang", lambda f: _edit(f, lambda t: t.update(d2t=torch.zeros_like(t["d2t"]))), "d2t_zero"),
    "d2t_int32": ("sglang", lambda f: _edit(f, lambda t: t.update(d2t=t["d2t"].int())), "d2t_dtype"),
    "t2d_disagrees": ("sglang", lambda f: _edit(f, _swap_t2d), "t2d_mismatch"),
    "aux_off_by_one_sglang": ("sglang", lambda f: _edit(f, config=_shift("sglang", +1)), "aux_mismatch"),
    "aux_off_by_one_vllm": ("vllm", lambda f: _edit(f, config=_shift("vllm", -1)), "aux_mismatch"),
    "wrong_hidden_size": ("sglang", lambda f: _edit(
        f, lambda t: t.update({"fc.weight": torch.zeros(t["fc.weight"].shape[0], 288)}),
        lambda c: c.update(target_hidden_size=96)), "hidden_size"),
    "wrong_vocab": ("sglang", lambda f: _edit(
        f, lambda t: t.update(t2d=torch.cat([t["t2d"], torch.zeros(10, dtype=torch.bool)])), _wrong_vocab), "vocab"),
    "missing_key": ("sglang", lambda f: _edit(f, lambda t: t.pop("midlayer.hidden_norm.weight")), "missing_key"),
    "unexpected_key": ("sglang", lambda f: _edit(f, lambda t: t.update({"fc.bias": torch.zeros(t["fc.weight"].shape[0])})),
                       "unexpected_key"),
    "layers0_names_for_sglang": ("sglang", lambda f: _edit(f, _rename_layers0), "sglang_skips_names"),
    "truncated_file": ("sglang", _truncate, "unreadable"),
    "pickle_weights": ("sglang", _pickle_weights, "unreadable"),
    "unsupported_variant": ("sglang", lambda f: _edit(f, config=lambda c: c.update(norm_before_residual=True)),
                            "variant_unsupported"),
    "norm_before_residual_absent": ("vllm", lambda f: _edit(f, config=lambda c: c.pop("norm_before_residual")),
                                    "variant_default"),
}
