"""ZeRO-2 Adam state saved by one group size and loaded by another through pipeline.training.elastic.reshard.

Run as ``python -m tests.zero_reshard PHASE WORLD WORKDIR PORT`` (by tests/test_elastic_reshard.py):
spawns WORLD gloo ranks of a real DeepSpeed ZeRO-2 engine on a small model with a frozen layer (as
LoRA's base). ``save``: three AdamW steps, then a checkpoint in WORKDIR/ckpt (HF's layout: ``latest``
+ ``global_stepN/``) and each parameter's whole Adam state as the engine holds it
(``safe_get_full_optimizer_state``) in WORKDIR/saved.pt. ``load``: reshard the checkpoint (each node's
local rank 0 converts it) and load it with ``checkpoint.load_universal``; writes WORKDIR/loaded-WORLD.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

STATES = ("exp_avg", "exp_avg_sq")


def model():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10), torch.nn.Tanh(),
                              torch.nn.Linear(10, 3))
    net[0].requires_grad_(False)  # a frozen base, as under LoRA: no optimizer state, not in the partitions
    return net


def rank_main(rank: int, world: int, phase: str, workdir: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from pipeline.seams.deepspeed_seams import skip_shm_allreduce_build
    from pipeline.training.elastic import reshard

    skip_shm_allreduce_build()  # as a ZeRO worker does (worker.train_loop_per_worker)
    deepspeed.init_distributed(dist_backend="gloo")
    net = model()
    universal = workdir / "universal"
    failed = reshard(workdir / "ckpt", universal, local_rank=rank) if phase == "load" else None
    assert failed is None, failed
    params = [p for p in net.parameters() if p.requires_grad]
    # 6 ranks' worth of samples per step whatever the size, as the pipeline keeps samples per step constant
    config = {"train_micro_batch_size_per_gpu": 6 // world, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              **({"checkpoint": {"load_universal": True}} if phase == "load" else {})}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=params, config=config,
                                      optimizer=torch.optim.AdamW(params, lr=0.05, weight_decay=0.01))
    if phase == "save":
        g = torch.Generator().manual_seed(1 + rank)
        for _ in range(3):
            x = torch.randn(6 // world, 6, generator=g)
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(str(workdir / "ckpt"), tag="global_step3", exclude_frozen_parameters=True)
    else:
        engine.load_checkpoint(str(universal), load_optimizer_states=True, load_lr_scheduler_states=False,
                               load_module_strict=False)
    state = {name: {"fp32": safe_get_full_fp32_param(p),
                    **{s: safe_get_full_optimizer_state(p, s) for s in STATES}}
             for name, p in engine.module.named_parameters() if p.requires_grad}  # collectives: every rank
    if rank == 0:
        torch.save(state, workdir / {"save": "saved.pt", "load": f"loaded-{world}.pt"}[phase])
    deepspeed.comm.barrier()


def main(phase: str, world: int, workdir: Path, port: int) -> None:
    import torch.multiprocessing as mp

    mp.spawn(rank_main, args=(world, phase, workdir, port), nprocs=world, join=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]))
