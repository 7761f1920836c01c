"""Where a greedy tree cycle's kernels go, counted on the CPU: SmolLM2-135M's shape (30 layers, random
weights, fp32, fused), a drafter of the matching shape, an 8x6x48 tree. Every aten op that is not a
view is counted once, which is about one kernel each on CUDA when nothing is compiled. Phases: the
drafting step, the target's 49-row pass, the KV commit (torch path: a gather and a scatter per k and
v buffer a layer) and the rest of the verify step (logits, acceptance, drafter catch-up). On the H200
a kernel in a CUDA graph costs ~2-6 us however little it does (h200-decode.json), so these counts are
what the verify step pays beyond the target's pass. The Triton engine moves the commit into one
launch (kernels.SlotMover) and the rest is compiled with the drafter (decode.verify_cycle).

    python benchmarks/cycle_ops.py [--out benchmarks/results/logs/tree-cycle-ops-cpu.json]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from draftsmith.bench import git_commit  # noqa: E402
from draftsmith.decode import TreeSpec, draft_greedy, tree_mask, verify_greedy  # noqa: E402
from draftsmith.draft import DraftConfig, Eagle3Drafter  # noqa: E402
from draftsmith.target import Transformer  # noqa: E402
from h200_run import SMOLLM2  # noqa: E402

VIEWS = ("view", "expand", "unsqueeze", "slice", "select", "reshape", "alias", "aten.t.", "transpose", "permute",
         "squeeze", "as_strided", "detach", "split", "chunk", "unbind", "lift_fresh")


class OpCount(TorchDispatchMode):
    """Aten ops dispatched inside the block, views apart."""

    def __init__(self):
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if not any(v in name for v in VIEWS):
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def counted(fn) -> OpCount:
    with torch.no_grad(), OpCount() as c:
        fn()
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", default="8,6,48", help="topk,steps,tokens")
    ap.add_argument("--out")
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Transformer(SMOLLM2).eval().optimize()
    drafter = Eagle3Drafter(DraftConfig.from_target(SMOLLM2, 32000)).eval().optimize()
    model.setup_caches(1, 512)
    drafter.setup_caches(1, 512)
    spec = TreeSpec(*(int(v) for v in a.spec.split(",")))
    draft, verify = draft_greedy(drafter, spec), verify_greedy(model, drafter, spec)
    h, pos = torch.randn(1, 1, SMOLLM2.hidden_size), torch.tensor([100])
    with torch.no_grad():
        tree = draft(h, pos)
    n = spec.nodes + 1
    D = min(spec.steps, spec.nodes)
    phases = {
        "draft": counted(lambda: draft(h, pos)),
        "verify_step": counted(lambda: verify(torch.tensor([5]), tree.tokens, tree.parents, tree.depth, pos)),
        "target_pass": counted(lambda: model(torch.zeros(1, n, dtype=torch.long), pos + torch.arange(n),
                                             tree_mask(torch.eye(n, dtype=torch.bool), pos, model.max_len), None,
                                             capture=drafter.cfg.aux_layer_ids)),
        "commit": counted(lambda: model.commit(pos + 1 + torch.arange(D), pos + 1 + torch.arange(D))),
    }
    res = {"command": "python " + " ".join(sys.argv), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"),
           "shape": "SmolLM2-135M (30 layers), random weights, fp32, fused, eager", "spec_topk_steps_tokens": a.spec,
           "non_view_aten_ops": {k: c.total for k, c in phases.items()}}
    ops = res["non_view_aten_ops"]
    # the tree's ancestors and mask, logits, acceptance, the drafter's catch-up, bookkeeping
    ops["verify_rest"] = ops["verify_step"] - ops["target_pass"] - ops["commit"]
    res["commit_top_ops"] = dict(sorted(phases["commit"].ops.items(), key=lambda kv: -kv[1])[:4])
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
