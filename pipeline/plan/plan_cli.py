"""`synth-grpo plan`: the planner's table, its num_generations sweep and the largest settings that fit."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pipeline.config import RunConfig
from pipeline.errors import cli_error
from pipeline.plan.formulas import GIB, HEADROOM, PHASE, estimate, human_count, peak_total
from pipeline.plan.gpus import GPU_PRESETS, detect_gpu_gib, gpu_preset
from pipeline.plan.memory import (MemoryPlan, batch_for_generations, fits_gpu, max_completion_length_ceiling,
                                  max_generations, plan_inputs, plan_run)
from pipeline.plan.shapes import PlanError


def format_plan(plan: MemoryPlan, gpu_name: str | None = None) -> str:
    i = plan.inputs
    lines = [
        f"model: {i['model']} ({i['shape_source']}): {human_count(i['params'])} params, {human_count(i['trainable'])} trainable",
        f"per GPU: {i['batch']} completions/micro-batch, num_generations {i['num_generations']}, prompt {i['prompt_len']} + "
        f"completion {i['completion_len']} tokens, {'bf16' if i['wbytes'] == 2 else 'fp32'}, ZeRO-{i['zero_stage']} over "
        f"{i['num_gpus']} GPU(s), gradient checkpointing {'on' if i['grad_ckpt'] else 'off'}",
        "",
        f"{'component':<22}{'GiB':>8}  {'phase':<11}basis",
    ]
    for name, gib in plan.components.items():
        phase = PHASE.get(name, "always")
        mark = "" if phase in ("always", plan.peak_phase) else " (not at peak)"
        lines.append(f"{name:<22}{gib:8.2f}  {phase:<11}{plan.details.get(name, '')}{mark}")
    lines.append("-" * 72)
    where = f"{gpu_name} " if gpu_name else ""
    if plan.gpu_gib is None:
        lines.append(f"{'total':<22}{plan.total_gib:8.2f}  peak in the {plan.peak_phase} phase; no GPU given (--gpu or --gpu-mem)")
    else:
        verdict = "fits" if plan.fits else "DOES NOT FIT"
        lines.append(f"{'total':<22}{plan.total_gib:8.2f}  of {where}{plan.gpu_gib:.1f} GiB: {verdict} "
                     f"({HEADROOM:.0%} headroom); peak in the {plan.peak_phase} phase")
    return "\n".join(lines + [f"note: {n}" for n in plan.notes])


def _sweep(cfg: RunConfig, gpu_gib: float | None, num_gpus: int | None, fused: bool) -> str:
    x = dataclasses.replace(plan_inputs(cfg, gpu_gib, num_gpus), fused_logits=fused)
    prompts = x.batch * x.num_gpus * x.steps_per_generation // x.num_generations
    rows = [f"num_generations sweep ({prompts} prompts per generation round kept; per-device batch scales with it):",
            f"{'G':>5}{'batch':>7}{'total GiB':>11}  fits"]
    for g in sorted({2, 4, 8, 16, 32, 64, x.num_generations}):
        b = batch_for_generations(x, g, x.num_generations, x.batch)
        y = dataclasses.replace(x, num_generations=g, batch=b)
        c, _, phase = estimate(y)
        fit = "-" if gpu_gib is None else ("yes" if fits_gpu(y) else "no")
        rows.append(f"{g:>5}{b:>7}{peak_total(c, phase) / GIB:>11.2f}  {fit}" + ("  <- config" if g == x.num_generations else ""))
    rows.append("(at a fixed per-device batch, num_generations only changes how many prompts share a round: memory is unchanged)")
    return "\n".join(rows)


def plan_cli(cfg: RunConfig, args: Any) -> int:
    """`synth-grpo plan`: print the table (or JSON); exit 2 on an unknown GPU or model shape."""
    try:
        if args.num_gpus is not None and args.num_gpus < 1:
            raise PlanError(f"--num-gpus {args.num_gpus}: must be >= 1")
        gpu_name = None
        if args.gpu:
            gpu_name, gpu_gib = gpu_preset(args.gpu)
        elif args.gpu_mem is not None:
            if args.gpu_mem <= 0:
                raise PlanError(f"--gpu-mem {args.gpu_mem}: must be > 0 GiB")
            gpu_gib = float(args.gpu_mem)
        else:
            gpu_gib = detect_gpu_gib()
            gpu_name = "this GPU" if gpu_gib else None
        plan = plan_run(cfg, gpu_gib, args.num_gpus)
    except PlanError as e:
        return cli_error("plan", e)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
        return 0
    print(format_plan(plan, gpu_name))
    print()
    print(_sweep(cfg, gpu_gib, args.num_gpus, plan.inputs["fused_logits"]))
    if plan.gpu_gib is not None:
        x = plan_inputs(cfg, plan.gpu_gib, args.num_gpus)
        g = plan.max_num_generations
        at = f" (per-device batch {batch_for_generations(x, g, x.num_generations, x.batch)})" if g else ""
        print(f"largest num_generations that fits: {g}{at}; largest completion length at the config's batch: "
              f"{max_completion_length_ceiling(cfg, plan.gpu_gib, args.num_gpus)}")
    else:
        fitting = [f"{p}: {max_generations(dataclasses.replace(plan_inputs(cfg, gib, args.num_gpus), gpu_gib=gib))}"
                   for p, (_, gib) in GPU_PRESETS.items()]
        print("largest num_generations per preset: " + ", ".join(fitting))
    return 0
