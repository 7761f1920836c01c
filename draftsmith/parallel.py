"""Data parallelism for train, applied from outside the model (torchtitan style).

`init_world` joins the process group that `torchrun` describes (nccl on CUDA, one GPU per
LOCAL_RANK; gloo on the CPU), `parallelize` wraps the training objective in DDP or FSDP2
(`fully_shard`), and the `full_*` / `load_*` helpers move weights and optimizer state between
that wrapped form and the plain single-process form that checkpoints hold, so a checkpoint
written by N processes resumes in M. With one process every helper is the identity.

    torchrun --nproc-per-node 8 -m draftsmith train --device cuda --parallel fsdp ...
"""

from __future__ import annotations

import inspect
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    device: str = "cpu"
    owns_group: bool = False  # this process group was started by init_world, so close() ends it

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_world(device: str) -> World:
    """One process: World(device=device). Under torchrun (WORLD_SIZE > 1): join the group, and on
    CUDA take the GPU of this process's LOCAL_RANK whatever index `device` names."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device)
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return World(dist.get_rank(), dist.get_world_size(), device, owns)


def close(world: World):
    if world.owns_group:
        dist.destroy_process_group()


def barrier(world: World):
    if world.size > 1:
        dist.barrier()


def gather(world: World, items: list) -> list:
    """Every rank's items, concatenated in rank order, on every rank."""
    if world.size == 1:
        return items
    parts = [None] * world.size
    dist.all_gather_object(parts, items)
    return [x for p in parts for x in p]


def parallelize(model: nn.Module, parallel: str, world: World) -> nn.Module:
    """DDP replicates the weights and averages gradients; FSDP2 shards weights, gradients and
    optimizer state across ranks. Both average gradients over ranks in backward."""
    if world.size == 1:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [torch.device(world.device).index] if world.device.startswith("cuda") else None
        # buffers (d2t, t2d, rotary tables) are equal on every rank and never change: no broadcast per
        # forward (the flag was renamed in torch 2.13)
        new = "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
        return DistributedDataParallel(model, device_ids=ids, **{"forward_sync_buffers" if new else "broadcast_buffers": False})
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # one layer: a single FSDP unit around the whole objective is the natural granularity
    return fully_shard(model, mesh=init_device_mesh(torch.device(world.device).type, (world.size,)))


def sync_gradients(model: nn.Module, sync: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of an accumulated step."""
    if hasattr(model, "no_sync"):  # DDP
        return nullcontext() if sync else model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return nullcontext()


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on the CPU (collective under FSDP: call on every rank)."""
    return {k: _full(v).detach().cpu().contiguous() for k, v in module.state_dict().items()}


def full_optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """opt.state_dict() with sharded moments gathered: the format of a one-process run."""
    sd = opt.state_dict()
    sd["state"] = {i: {k: _full(v) for k, v in s.items()} for i, s in sd["state"].items()}
    return sd


def load_optimizer_state(opt: torch.optim.Optimizer, sd: dict):
    """Load a one-process optimizer state; under FSDP each moment is re-sharded like its parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in opt.param_groups for p in g["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        if isinstance(p, DTensor):
            s = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements) if v.shape == p.shape else v
                 for k, v in s.items()}
        state[i] = s
    opt.load_state_dict({**sd, "state": state})
