"""Small pieces every stage uses: the progress bar, resolved-config files, dtype names."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm


class Progress:
    """A tqdm bar over items that also shows a token rate (items, rate, ETA, tok/s)."""

    def __init__(self, total: int, desc: str, unit: str = "it"):
        self.bar = tqdm(total=total, desc=desc, unit=unit, dynamic_ncols=True, mininterval=1.0)
        self.t0, self.tokens = time.perf_counter(), 0

    @property
    def total(self):
        return self.bar.total

    @total.setter
    def total(self, n: int):
        self.bar.total = n
        self.bar.refresh()

    def update(self, n: int = 1, tokens: int = 0, **metrics):
        self.tokens += tokens
        post = {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in metrics.items()}
        if self.tokens:
            post["tok/s"] = f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.1f}"
        if post:
            self.bar.set_postfix(post, refresh=False)
        self.bar.update(n)

    def close(self):
        self.bar.close()


def write_config(folder: str | Path, stage: str, config) -> Path:
    """Every output folder gets the resolved config of the stage that wrote it."""
    path = Path(folder) / f"{stage}_config.json"
    path.write_text(json.dumps({"stage": stage, **asdict(config)}, indent=2, default=str))
    return path


def write_result(folder: str | Path, stage: str, config, result) -> Path:
    """A stage's result as {stage}.json, with its resolved config beside it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder, stage, config)
    path = folder / f"{stage}.json"
    path.write_text(json.dumps(asdict(result), indent=2))
    return path


def rows_table(rows: list[tuple[str, str]]) -> str:
    """Two aligned columns: the reports stages print."""
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)


def dtype_of(name: str) -> torch.dtype:
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in dtypes:
        raise ValueError(f"dtype {name!r} is not one of {sorted(dtypes)}")
    return dtypes[name]
