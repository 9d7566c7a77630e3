"""A tensor-parallel rank other than 0: `python -m kiln.runtime.rank_worker ARTEFACT --rank R
...`, started by rank 0's TPGroup or another node's `follow` (runtime/parallel.py). It joins
the process group, beats its heartbeat, opens its rank's graph and weights, and runs every
step rank 0 broadcasts until told to stop or rank 0 is gone. Between steps rank 0 may send
control messages: LoRA adapters to load into a slot or drop (the same slots as rank 0's)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.args import ArgError
from kiln.core import artefact as fmt
from kiln.runtime import numa
from kiln.runtime.artefact import Artefact
from kiln.runtime.model_runner import ModelRunner, freeze_startup_heap
from kiln.runtime.parallel import (
    DEFAULT_TIMEOUT_S,
    Heartbeat,
    agree,
    init_group,
    receive,
    rendezvous_store,
)
from kiln.runtime.step import StepInputs
from kiln.runtime.threads import set_threads
from kiln.terminal import configure_logging

log = logging.getLogger("kiln.parallel")


def _worker(args: argparse.Namespace) -> int:
    if args.numa_node is not None:  # before a weight is read (runtime/numa.py)
        numa.bind(args.numa_node)
    set_threads(args.threads)  # torch's and kiln's kernels alike (runtime/threads.py)
    # The target decides the device and the backend (runtime/placement.py); the pool's
    # size is rank 0's, which every rank shares.
    target = fmt.read_manifest(args.artefact)["target"]["device"]
    device = f"cuda:{args.local_rank}" if target == "cuda" else "cpu"
    init_group(
        "nccl" if target == "cuda" else "gloo", args.init_method, args.rank, args.size, args.timeout
    )
    heartbeat = Heartbeat(args.rank, rendezvous_store(args.init_method, args.timeout))
    try:
        return _serve(args, device)
    finally:
        heartbeat.stop()


def _serve(args: argparse.Namespace, device: str) -> int:
    sizes = torch.zeros(2, dtype=torch.long, device=device)  # KV pool tokens, context length
    dist.broadcast(sizes, src=0)
    # This node's `kiln serve` (rank 0, or `follow`) checked every file's checksum.
    art = Artefact.open(
        args.artefact,
        verify=False,
        trust_remote_code=args.trust_remote_code,
        rank=args.rank,
        device=device,
        mapped=not args.weight_loader_disable_mmap,
    )
    runner = ModelRunner(art, int(sizes[0]), int(sizes[1]) or None)
    runner.warm_up()
    freeze_startup_heap(collect=False)  # a full collection here would stall every step
    with torch.inference_mode():
        while (step := receive(device)) is not None:
            if isinstance(step, StepInputs):
                runner.run(step)
            else:
                agree(_control(runner, art, step, device, args.rank), device)
    dist.destroy_process_group()
    return 0


# New weights read and checked on a "check" message, copied on the "load" that follows.
_pending: dict[str, Any] = {}


def _control(
    runner: ModelRunner, art: Artefact, message: dict[str, Any], device: str, rank: int
) -> bool:
    """Do what rank 0's control message asks; False (logged) when it cannot be done here,
    which rank 0 turns into the request's error (this rank keeps serving)."""
    if "weights" in message:
        return _weights(runner, message, rank)
    from kiln.runtime.lora import AdapterSource, LoraBank, LoraError, read_adapter

    kind = message.get("lora")
    try:
        if kind == "enable":
            runner.enable_lora(LoraBank(art.graph, message["targets"], device))
        elif kind == "add" and runner.lora is not None:
            source = AdapterSource(message["name"], message["path"])
            runner.lora.add(int(message["slot"]), read_adapter(source, message["max_rank"]))
        elif kind == "remove" and runner.lora is not None:
            runner.lora.remove(int(message["slot"]))
        else:
            log.error("tensor-parallel rank: unknown control message %r", message)
            return False
    except (LoraError, OSError, KeyError, TypeError, ValueError) as e:
        log.error("tensor-parallel rank: %s", e)
        return False
    return True


def _weights(runner: ModelRunner, message: dict[str, Any], rank: int) -> bool:
    """/update_weights_from_disk on this rank (runtime/weight_update.py): "check" reads and
    checks its part of the new artefact, "load" copies it in, "drop" forgets it."""
    from kiln.runtime.weight_update import WeightUpdateError, apply_update, read_update

    what = message["weights"]
    if what == "check":
        _pending.clear()
        try:
            _pending["new"] = read_update(runner.art, Path(message["path"]), rank)
        except WeightUpdateError as e:
            log.error("tensor-parallel rank %d: new weights: %s", rank, e)
            return False
        return True
    if what == "load" and "new" in _pending:
        apply_update(runner, _pending.pop("new"))
        return True
    _pending.clear()
    return what == "drop"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kiln.runtime.rank_worker")
    p.add_argument("artefact", type=Path)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--local-rank", type=int, default=0)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=int, default=DEFAULT_TIMEOUT_S)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--numa-node", type=int)
    p.add_argument("--weight-loader-disable-mmap", action="store_true")
    args = p.parse_args(argv)
    configure_logging(os.environ.get("KILN_LOG_LEVEL", "WARNING"))
    try:
        return _worker(args)
    except ArgError as e:  # its --numa-node cannot be bound here
        log.error("tensor-parallel rank %d: %s", args.rank, e)
        return 1
    except (RuntimeError, ConnectionError) as e:  # rank 0 gone, or a collective failed
        log.error("tensor-parallel rank %d stops: %s", args.rank, e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
