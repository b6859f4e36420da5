"""Data-parallel calibration: each rank takes a contiguous share of the calibration sequences, accumulates its float64
sums locally, and the sums and weights are all-reduced before any eigendecomposition (a sum of sums: the single-process
result up to float64 round-off). NCCL on GPUs, gloo on CPU. Ranks come from torchrun's environment, or from `launch`,
which starts N local processes with that same environment (what `--nproc N` does).
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import InputError
from .targets import SecondMoment


@dataclass(frozen=True)
class DataParallel:
    rank: int
    world: int
    local_rank: int
    local_world: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, ids: Tensor) -> Tensor:
        """This rank's contiguous share of the sequences [N, T] (shares differ in size by at most one)."""
        if ids.shape[0] < self.world:
            raise InputError(f"{ids.shape[0]} calibration sequences cannot be split over {self.world} processes",
                             "raise --tokens or lower the number of processes")
        return torch.tensor_split(ids, self.world)[self.rank]

    def reduce(self, moment: SecondMoment) -> SecondMoment:
        """A new SecondMoment holding the sum over ranks of `moment` (which is left as it was: it is a checkpoint)."""
        device = _comm_device()
        flat = torch.cat([moment.sums.flatten(), moment.weights.flatten()]).to(device, torch.float64)
        dist.all_reduce(flat)
        flat = flat.to(moment.sums.device)
        n = moment.sums.numel()
        return type(moment)(flat[:n].view_as(moment.sums).clone(), flat[n:].view_as(moment.weights).clone())

    def layers(self, num_layers: int) -> list[int]:
        """The layers whose held-out capture, eigendecomposition and clip search this rank runs: round-robin, so the
        shares differ by at most one layer and every rank gets early and late layers alike."""
        return list(range(self.rank, num_layers, self.world))

    def gather_layers(self, t: Tensor) -> Tensor:
        """`t` [L, ...] holds this rank's layers (zeros in the others'): the whole tensor, on every rank. A sum over
        ranks where exactly one is non-zero per element, so the values are the owners' bit for bit."""
        flat = t.contiguous().to(_comm_device())
        dist.all_reduce(flat)
        return flat.to(t.device)

    def barrier(self) -> None:
        dist.barrier()


def _comm_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def in_distributed_env() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def from_env(device: str) -> DataParallel | None:
    """Join the process group torchrun (or `launch`) described in the environment; None for a single process.
    `device`: the --device option; a GPU run pins each process to GPU LOCAL_RANK and uses NCCL, else gloo."""
    if not in_distributed_env():
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    use_gpu = device != "cpu" and torch.cuda.is_available()
    if use_gpu:
        if local_rank >= torch.cuda.device_count():
            raise InputError(f"process {local_rank} on this node has no GPU ({torch.cuda.device_count()} visible)",
                             "start at most one process per GPU")
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when first imported (which
        # building a transformers model does): imported after the group exists, those defaults keep the group alive
        # past destroy_process_group, and gloo's threads are then torn down at interpreter exit, where a rank can
        # abort ("terminate called without an active exception"). Imported first, the defaults hold None.
        importlib.import_module("torch.distributed.nn.functional")  # not `import torch.…`: that would make `torch` a
        # local name of this whole function, unbound at its first use above

        dist.init_process_group("nccl" if use_gpu else "gloo", device_id=torch.device("cuda", local_rank)
                                if use_gpu else None)
    return DataParallel(rank, world, local_rank, local_world)


def rank_device(dp: DataParallel, device: str) -> str:
    """The --device value a rank uses: its own GPU on a GPU run, else what was asked."""
    if device != "cpu" and torch.cuda.is_available():
        return f"cuda:{dp.local_rank}"
    return device


def shutdown(finished: bool = True) -> None:
    """Leave the process group. After a finished run every rank first waits for the others: a gloo rank that tears
    its group down while a peer still holds the connection can abort at interpreter exit ("terminate called without
    an active exception"). After a failure, leave at once (a barrier would wait for a rank that may never come)."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, args: list[str]) -> int:
    """Run `python -m oscar_zoo ARGS` as `nproc` local ranks (torchrun's environment variables, a free port on
    127.0.0.1) and return the first failing rank's exit code, else 0. A failed rank stops the others, which would
    otherwise wait forever in a collective. Plain subprocesses rather than torch.distributed.run: the ranks' own exit
    codes (2 for bad input, …) reach the caller, and nothing re-imports the CLI's __main__."""
    port = _free_port()
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, "-m", "oscar_zoo", *args], env=env))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    p.wait()
                return failed[0]
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    except BaseException:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        raise


def without_option(args: list[str], name: str) -> list[str]:
    """`args` without `name VALUE` / `name=VALUE` (the --nproc the ranks must not see)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(f"{name}="):
            out.append(a)
    return out
