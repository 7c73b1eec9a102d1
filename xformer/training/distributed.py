"""Data-parallel training on torch.distributed, started by torchrun:

    torchrun --nproc-per-node 2 -m xformer_cli train RECIPE --out RUN

Every process builds the same token-bucketed batch plan from the same seed. A step's
`train.accumulate_steps` batches are dealt out among the processes (process r takes batches r,
r + N, ...), so the global batch, and with it the recipe's maths, is the one a single process
trains: the gradients are summed over the processes with one all-reduce before the optimizer
step (the loss is already divided by the whole step's token count), and every process then
takes the same step. The non-finite check, gradient clipping and fp16's scaler see the summed
gradients, so the processes agree on a skip without talking about it.

Only process 0 validates and writes (checkpoints, metrics.jsonl, train.json); the others
agree with it on when to stop through one small all-reduce a step (its stop reason, and any
process's Ctrl-C / SIGTERM). An exception in one process ends it, and torchrun then stops
the others: no process waits for a peer that is gone.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from xformer.errors import RunError

# what a process may report in the per-step agreement, in the order of its code (0: none)
STOP_REASONS = ("max_steps", "max_time", "max_epochs", "patience", "interrupted")


@dataclass
class Cluster:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    started_here: bool = False  # this process created the group, so it ends it

    @property
    def writer(self) -> bool:
        """Process 0 alone writes the run's files."""
        return self.rank == 0

    def shard(self, group: list) -> list:
        """This process's batches of a step's group."""
        return group[self.rank::self.world]

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """Sum every parameter's gradient over the processes, in one all-reduce. A parameter
        no process used keeps no gradient (the optimizer skips it, as it would in one
        process); one that only some used gets zeros on the others first."""
        if self.world == 1:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        used = torch.tensor([p.grad is not None for p in params], dtype=torch.uint8, device=params[0].device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX)
        grads = []
        for p, flag in zip(params, used.tolist(), strict=True):
            if flag:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def agree(self, stop_reason: str | None, interrupted: bool, loss: torch.Tensor) -> tuple[str | None, torch.Tensor]:
        """(process 0's stop reason, or 'interrupted' when any process was signalled; the
        step's loss summed over the processes). One process: what it was given."""
        if self.world == 1:
            return ("interrupted" if interrupted else stop_reason), loss
        code = STOP_REASONS.index(stop_reason) + 1 if (self.writer and stop_reason) else 0
        device = loss.device if isinstance(loss, torch.Tensor) else None
        packed = torch.stack([torch.tensor(float(code), device=device), torch.tensor(float(interrupted), device=device),
                              torch.as_tensor(loss, dtype=torch.float32, device=device).reshape(())])
        dist.all_reduce(packed)  # sums: only process 0 reports a reason, any process an interrupt
        code, signalled, _ = packed.tolist()
        reason = "interrupted" if signalled else (STOP_REASONS[int(code) - 1] if code else None)
        return reason, packed[2]

    def from_writer(self, values: list[int], device: torch.device) -> list[int]:
        """Process 0's integers, in every process (a plan made from its clock). One process:
        what it was given."""
        if self.world == 1:
            return values
        packed = torch.tensor([float(v) if self.writer else 0.0 for v in values], dtype=torch.float64, device=device)
        dist.all_reduce(packed)
        return [int(v) for v in packed.tolist()]

    def close(self) -> None:
        if self.started_here and dist.is_initialized():
            dist.destroy_process_group()


def cluster_from_env(device: str, accumulate_steps: int, timeout_minutes: float = 30.0) -> Cluster:
    """The Cluster torchrun describes in RANK / WORLD_SIZE / LOCAL_RANK (one process without
    them): joins the process group, NCCL on CUDA and gloo on the CPU, and on CUDA puts each
    process on its own device (LOCAL_RANK)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Cluster()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if accumulate_steps % world:
        raise RunError(f"train.accumulate_steps = {accumulate_steps} with {world} processes: a step's batches "
                       f"are shared among the processes, so it must be a multiple of {world} (e.g. --set "
                       f"train.accumulate_steps={world * max(1, accumulate_steps // world)}; the global batch is "
                       "accumulate_steps batches of data.max_tokens tokens, whatever the number of processes)")
    cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(local_rank)
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes))
    return Cluster(rank=rank, world=world, local_rank=local_rank, started_here=started)
