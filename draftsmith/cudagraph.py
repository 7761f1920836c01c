"""CUDA graphs for the decode loop's fixed-shape steps.

At batch 1 a small model's step is hundreds of tiny kernels, and launching them from Python
costs more than running them (REFERENCE.md §5: HF generate gets ~12 tok/s on an H200 whatever
the model size). `Graphs` captures a step function once per shape key and replays it; on the
CPU it simply calls the function, so tests exercise the same code path. Graph outputs are
static buffers, overwritten by the next replay of the same key: consume them before that.
KV caches must not be reallocated while graphs that write them are alive (`clear()` first).
"""

from __future__ import annotations

import torch


PREFILL_CHUNK = 256  # prompt tokens a captured prefill pass (decode.run_prompt)


class Graphs:
    """enabled: capture (CUDA) or call (CPU). prefill_chunk: prompts run in passes of this many tokens
    (decode.run_prompt), each a replay of one captured graph; 0: in one eager pass. Default:
    PREFILL_CHUNK when enabled, else 0 (tests set it on the CPU to run the chunked path eagerly)."""

    def __init__(self, enabled: bool, prefill_chunk: int | None = None):
        self.enabled = enabled
        self.prefill_chunk = (PREFILL_CHUNK if enabled else 0) if prefill_chunk is None else prefill_chunk
        if self.prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0 (0: one eager pass), got {prefill_chunk}")
        self.entries: dict = {}

    def __call__(self, key, fn, *inputs: torch.Tensor):
        if not self.enabled:
            return fn(*inputs)
        if key not in self.entries:
            self.entries[key] = self.capture(fn, inputs)
        static_in, graph, static_out = self.entries[key]
        for buf, x in zip(static_in, inputs):
            buf.copy_(x)
        graph.replay()
        return static_out

    def start(self, key, fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """For a step that advances its own inputs in place (writes its token and position back):
        load `inputs` into the key's static buffers (capturing on first use, warm-up undone) and
        return them; replay(key) then runs the step with no host copy and no sync in between."""
        if key not in self.entries:
            static_in = [x.clone() for x in inputs]
            self.entries[key] = (static_in, self.capture(fn, static_in, clone=False)[1], None) if self.enabled \
                else (static_in, None, fn)
        static_in = self.entries[key][0]
        for buf, x in zip(static_in, inputs):
            buf.copy_(x)
        return static_in

    def replay(self, key):
        static_in, graph, fn = self.entries[key]
        if graph is None:
            fn(*static_in)
        else:
            graph.replay()

    @staticmethod
    def capture(fn, inputs, clone: bool = True):
        static_in = [x.clone() for x in inputs] if clone else list(inputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (allocator, cuBLAS handles) outside the graph
            for _ in range(2):
                fn(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fn(*static_in)
        return static_in, graph, static_out

    def clear(self):
        self.entries.clear()


def eager() -> Graphs:
    return Graphs(False)
