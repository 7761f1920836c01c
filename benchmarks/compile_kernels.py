"""Compile the Triton engine's kernels for a GPU ahead of time, on a machine without one.

The engine's own launch code (Transformer.forward's layers, kernels.attention, the Head and the
SlotMover commit) runs on meta tensors of a model's shape with every kernel launch recorded instead
of run; each distinct launch is then compiled for the target with triton.compile (Triton's own ptxas,
no driver needed), its arguments specialized as the JIT specializes them on a GPU (alignment and
multiples of 16, which decide whether loops pipeline through shared memory), and its shared memory is
checked against the target's per-block limit. A kernel
that does not compile for the GPU, or asks for more shared memory than an SM has (as the fp32 tiles
once did on the H200), fails here instead of in a device session. The interpreter the CPU tests use
checks what kernels compute; this checks that they build.

    python benchmarks/compile_kernels.py --shape smollm2 --dtypes bfloat16,float32 --out compile.json
    python benchmarks/compile_kernels.py --shape llama8b --dtypes bfloat16 --tuning 'bk_max=1024'   # too big: exit 1
    python benchmarks/compile_kernels.py --shape llama8b --dtypes bfloat16 --tuning "$SWEEP"        # a sweep's grid

Exit status 1 when any launch fails to compile or exceeds the limit; the JSON lists every launch.
"""

import argparse
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("compile_kernels.py compiles for a GPU: unset TRITON_INTERPRET (the interpreter replaces the kernels)")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith import kernels  # noqa: E402
from draftsmith.decode import tree_mask  # noqa: E402
from draftsmith.target import Transformer  # noqa: E402
from h200_run import LLAMA8B, SMOLLM2, TRITON_VARIANTS, parse_sweep  # noqa: E402

SHAPES = {"smollm2": SMOLLM2, "llama8b": LLAMA8B}
SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory a block may use (H100/H200, A100)
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32",
         torch.bool: "i1"}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kw)` is recorded, not launched."""

    def __init__(self, name: str, fn, launches: list):
        self.name, self.fn, self.launches = name, fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.name, self.fn, args, kw))


def arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def specialization(value) -> tuple[str, list]:
    """(type, attributes) as Triton's JIT specializes a launch argument on a GPU: pointers 16-byte aligned
    and integers divisible by 16 get tt.divisibility (what lets loads vectorise and loops pipeline through
    shared memory, so what sets a kernel's shared memory), an integer 1 becomes a constant. A meta tensor's
    address is 0: aligned, as the caching allocator's are."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    if isinstance(value, float) or isinstance(value, bool):
        return arg_type(value), []
    kind, spec = native_specialize_impl(CUDABackend, value, False, True, True)[:2]
    if kind == "constexpr":
        return kind, []
    return arg_type(value), CUDABackend.parse_attr(spec) if spec else []


def source(fn, args: tuple, kw: dict):
    """(ASTSource, options, key) of one recorded launch, specialized as the JIT would on a GPU."""
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kw.items() if k in fn.arg_names})
    options = {k: v for k, v in kw.items() if k not in fn.arg_names}
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        v = values[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[p.name] = "constexpr", v
            continue
        signature[p.name], attrs[(i,)] = specialization(v)
        if signature[p.name] == "constexpr":
            constexprs[p.name] = v
    attrs = {k: v for k, v in attrs.items() if v}
    key = (fn.__name__, tuple(signature.items()), tuple(sorted(constexprs.items())), tuple(sorted(options.items())),
           tuple(sorted(attrs)))
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), options, key


def record(args, dtype: torch.dtype, tuning: kernels.Tuning, rows: tuple[int, ...], slots: int) -> list:
    """The kernel launches of a decode step and verify passes of `rows` tokens (a tree for the largest),
    the final norm, logits and greedy tokens, and a commit, for a model of shape `args` on meta tensors."""
    launches = []
    jitted = {n: f for n, f in vars(kernels).items() if isinstance(f, triton.runtime.jit.JITFunction)}
    saved = dict(jitted)
    for n, f in jitted.items():
        setattr(kernels, n, Recorder(n, f, launches))
    try:
        with torch.device("meta"):
            model = Transformer(args).to(dtype).eval()
        model.optimize(kernels="triton", tuning=tuning)
        model.setup_caches(1, slots)
        p0 = slots // 2
        for T in rows:
            pos = torch.arange(p0, p0 + T, device="meta")
            anc = torch.eye(T, dtype=torch.bool).tril()  # a chain's mask shape; masks are runtime data
            mask = tree_mask(anc, torch.tensor(p0), slots).to("meta")
            out = model(torch.zeros(1, T, dtype=torch.long, device="meta"), pos, mask)
            model.logits(out.hidden[0])
            model.greedy(out.hidden[0])  # the greedy token in the lm_head's pass (one launch)
        traced = torch.compiler.is_compiling
        try:  # and as torch.compile traces it (a second launch reduces)
            torch.compiler.is_compiling = lambda: True
            model.greedy(out.hidden[0])
        finally:
            torch.compiler.is_compiling = traced
        if tuning.move_slots:
            model.commit(torch.arange(p0, p0 + 4, device="meta"), torch.arange(p0 - 4, p0, device="meta"))
    finally:
        for n, f in saved.items():
            setattr(kernels, n, f)
    return launches


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--variants", default="triton_default", help=f"kernels.Tuning variants (h200_run.TRITON_VARIANTS: {','.join(TRITON_VARIANTS)})"
                    " or 'all'")
    ap.add_argument("--tuning", help="instead of --variants, kernels.Tuning fields as h200_run --sweep takes them, every"
                    " combination compiled: 'bk_max=1024' (one), 'split=64,256;ksplit=1,4' (four)")
    ap.add_argument("--rows", default="1,6,49", help="pass sizes to record (a decode step, a chain verify, a tree)")
    ap.add_argument("--slots", type=int, default=768, help="KV cache slots")
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: H100/H200)")
    ap.add_argument("--out")
    a = ap.parse_args()
    variants = list(TRITON_VARIANTS) if a.variants == "all" else a.variants.split(",")
    tunings = {v: kernels.Tuning(**TRITON_VARIANTS[v]) for v in variants}
    if a.tuning:
        grid = parse_sweep(a.tuning)
        tunings = {";".join(f"{k}={int(v)}" for k, v in zip(grid, values)): kernels.Tuning(**dict(zip(grid, values)))
                   for values in itertools.product(*grid.values())}
    target = GPUTarget("cuda", a.arch, 32)
    limit = SHARED_LIMIT.get(a.arch, 101376)
    seen, results, failed = set(), [], []
    t0 = time.perf_counter()
    for dtype_name in a.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for variant, tuning in tunings.items():
            for name, fn, args, kw in record(SHAPES[a.shape], dtype, tuning, tuple(map(int, a.rows.split(","))), a.slots):
                src, options, key = source(fn, args, kw)
                if key in seen:
                    continue
                seen.add(key)
                entry = {"kernel": name, "dtype": dtype_name, "variant": variant,
                         "constexprs": {k: v for k, v in key[2]}, "options": options}
                try:
                    compiled = triton.compile(src, target=target, options=options)
                    entry["shared_bytes"] = compiled.metadata.shared
                    entry["ok"] = compiled.metadata.shared <= limit
                    if not entry["ok"]:
                        entry["error"] = f"shared memory {compiled.metadata.shared} B > the {limit} B a block may use"
                    if options.get("launch_pdl"):  # a PDL launch must wait on the device before touching memory
                        ptx = compiled.asm["ptx"]
                        entry["griddepcontrol"] = "griddepcontrol.wait" in ptx
                        # global loads the kernel issues before it waits: only weights may be (Tuning.early_weights)
                        entry["loads_before_wait"] = len(re.findall(r"\bld\.global", ptx[: ptx.find("griddepcontrol.wait")]))
                        if not entry["griddepcontrol"]:
                            entry.update(ok=False, error="launched with PDL but never waits (griddepcontrol.wait)")
                except Exception as e:  # noqa: BLE001 - every launch is reported, the run fails at the end
                    entry.update(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
                results.append(entry)
                print(f"{'ok  ' if entry['ok'] else 'FAIL'} {name:18s} {dtype_name:8s} {variant:18s} "
                      f"shared {entry.get('shared_bytes', '-')}" + (f"  {entry['error'][:300]}" if not entry["ok"] else ""),
                      flush=True)
                if not entry["ok"]:
                    failed.append(entry)
    summary = {"shape": a.shape, "arch": a.arch, "triton": triton.__version__, "launches_compiled": len(results),
               "failed": len(failed), "seconds": round(time.perf_counter() - t0, 1), "results": results}
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
