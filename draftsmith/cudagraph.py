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


class Graphs:
    def __init__(self, enabled: bool):
        self.enabled = enabled
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

    @staticmethod
    def capture(fn, inputs):
        static_in = [x.clone() for x in inputs]
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
