"""DAPO dynamic sampling on top of TRL's GRPOTrainer (TRL has none: trl#3708).

A group whose completions all score (nearly) the same has no advantage to learn from; with
group-scaled advantages, one whose scores differ only by noise is worse, since the noise is blown up
to unit size. ``DynamicSamplingGRPOTrainer`` drops every group whose weighted total reward (before
scaling) has a std below ``grpo.dynamic_sampling.min_std`` and refills the batch with groups
generated from fresh prompts, for at most ``max_rounds`` extra rounds per generation.

How it is built (every choice is about keeping TRL's own step intact):

- Scoring: each round is one call of TRL's own rollout step (``trl_generate_and_score``), so
  generation, the reward pool, advantages (per group), logps and TRL's metrics are TRL's. The
  gathered rewards of all ranks are captured from TRL's reward calculation (``gathered_rewards``);
  both are TRL private methods, reached only through ``pipeline.seams.trl_seams.GenerateAndScoreHooks``
  (the override must be a method of the trainer's class). Every rank therefore computes the same
  keep/drop decision and the same number of refill rounds, which matters because generation and
  the reward gather are collective.
- Fresh prompts: an extra draw over the train dataset from ``numpy.random.default_rng([seed,
  global_step, round])``, skipping prompts already in this step; all ranks draw the same list and
  each takes its own slice. The draw depends only on the step, so a resumed run draws the same
  refills, and TRL's sampler (the main data order) is not touched.
- Assembly: after the last round every rank gathers all ranks' rows (``gather_object``), takes the
  kept groups (the original batch's first, then refills in round order) and its own share of them,
  dealt round-robin so short steps spread their padding evenly. Groups may straddle ranks in the
  original batch (TRL allows it); refill rounds give each rank whole groups.
- Short step (``max_rounds`` exhausted, or every group constant): the batch is PADDED to its
  usual size, not shrunk, so every rank runs the same forward/backward passes and gathers. Padding
  rows have ``completion_mask`` 0 and advantage 0: they add no token to the loss.
  Token-normalised losses (``dapo``, ``bnpo``, ``cispo``) are then exactly the loss of the kept
  rows, because ``num_items_in_batch`` is recounted over real tokens. Sequence-mean losses
  (``grpo``, ``sapo``, ``dr_grpo``, ``luspo``) divide by the row count, so the kept rows'
  advantages are scaled by rows / kept rows (exact for the policy term when steps_per_generation is
  1; in expectation over TRL's shuffle otherwise; a ``beta`` KL term stays diluted). The step is
  logged with ``dynamic_sampling/short_step`` 1 and the run continues; with no kept group at all
  the step's policy gradient is zero.
- Advantages: TRL's per-round advantages are kept (group scaling does not depend on other groups);
  with ``scale_rewards: batch`` they are recomputed over the trained rows.
- Adaptive length cap, evaluation: refill rounds generate with the step's cap; TRL's completion
  metrics (``completions/clipped_ratio``, which the cap reads) average over every round generated.
  Evaluation (eval mode, and the project's Evaluator) never goes through dynamic sampling.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import numpy as np
import torch
from accelerate.utils import gather_object
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from pipeline.seams.trl_seams import GenerateAndScoreHooks

SEQUENCE_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")
METRIC = "dynamic_sampling/"


def group_std(total: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Per-group std of the weighted total reward (NaN where a group has fewer than 2 scored rows)."""
    return nanstd(total.view(-1, num_generations), dim=1)


def keep_mask(total: torch.Tensor, num_generations: int, min_std: float) -> torch.Tensor:
    """True for groups worth training on: std >= min_std (NaN std, i.e. unscorable, is dropped)."""
    std = group_std(total, num_generations)
    return torch.nan_to_num(std, nan=-1.0) >= min_std


def _row_key(row: dict) -> str:
    return str(row["id"]) if "id" in row else json.dumps(row["prompt"], sort_keys=True, default=str)


def _cat_padded(parts: list[torch.Tensor], left: bool, value: float) -> torch.Tensor:
    """Concatenate row tensors whose second dimension differs, padding on the left or the right."""
    if parts[0].dim() == 1:
        return torch.cat(parts)
    width = max(p.size(1) for p in parts)
    out = []
    for p in parts:
        gap = width - p.size(1)
        pad = p.new_full((p.size(0), gap, *p.shape[2:]), value)
        out.append(torch.cat([pad, p] if left else [p, pad], dim=1))
    return torch.cat(out)


class DynamicSamplingGRPOTrainer(GenerateAndScoreHooks, GRPOTrainer):
    """GRPOTrainer whose training batches contain only groups with reward std >= min_std."""

    def __init__(self, *args, dynamic_sampling, **kwargs):
        super().__init__(*args, **kwargs)
        self.ds = dynamic_sampling
        self._ds_keys: list[str] | None = None
        # One entry per generation: the prompt keys of the batch, each round's refills and what was trained.
        self.dynamic_sampling_trace: list[dict[str, Any]] = []

    def _total_reward(self) -> torch.Tensor:
        """The weighted total per row, before any scaling, as TRL sums it (NaN if unscorable)."""
        r = self.gathered_rewards
        total = (r * self.reward_weights.to(r.device).unsqueeze(0)).nansum(dim=1)
        total[torch.isnan(r).all(dim=1)] = torch.nan
        return total.float().cpu()

    def _refill_rows(self, n_total: int, exclude: set[str], round_idx: int) -> list[int]:
        """n_total dataset indices not in `exclude`, the same on every rank and after a resume."""
        ds = self.train_dataset
        if self._ds_keys is None:
            cols = ds.column_names
            self._ds_keys = [str(x) for x in ds["id"]] if "id" in cols else [_row_key(r) for r in ds]
        rng = np.random.default_rng([int(self.args.seed), int(self.state.global_step), round_idx])
        order = rng.permutation(len(ds)).tolist()
        fresh = [i for i in order if self._ds_keys[i] not in exclude][:n_total]
        while len(fresh) < n_total:  # a dataset smaller than what one step asks for: repeats are allowed
            fresh += order[: n_total - len(fresh)]
        return fresh

    def generate_and_score(self, inputs):
        if not self.model.training or not self.ds.enabled:
            return self.trl_generate_and_score(inputs)
        G, P, rank = self.num_generations, self.accelerator.num_processes, self.accelerator.process_index
        min_std = self.ds.min_std

        out = self.trl_generate_and_score(inputs)
        rounds = [(out, self._total_reward(), len(inputs))]
        keep = [keep_mask(rounds[0][1], G, min_std)]
        n_groups = keep[0].numel()
        needed = n_groups - int(keep[0].sum())
        batch_keys = gather_object([_row_key(x) for x in inputs])
        exclude = set(batch_keys)
        trace = {"step": self.state.global_step, "batch": batch_keys[::G], "refills": [], "kept": []}
        generated, dropped = n_groups, n_groups - int(keep[0].sum())
        t0 = time.perf_counter()
        r = 0
        while needed > 0 and r < self.ds.max_rounds:
            r += 1
            per_rank = math.ceil(math.ceil(self.ds.oversample * needed) / P)
            idx = self._refill_rows(per_rank * P, exclude, r)
            keys = [self._ds_keys[i] for i in idx]
            exclude.update(keys)
            trace["refills"].append(keys)
            mine = [self.train_dataset[i] for i in idx[rank * per_rank : (rank + 1) * per_rank]]
            refill_inputs = [dict(row) for row in mine for _ in range(G)]
            o = self.trl_generate_and_score(refill_inputs)
            rounds.append((o, self._total_reward(), len(refill_inputs)))
            k = keep_mask(rounds[-1][1], G, min_std)
            keep.append(k)
            generated += k.numel()
            dropped += k.numel() - int(k.sum())
            needed -= min(needed, int(k.sum()))
        extra_seconds = time.perf_counter() - t0 if r else 0.0

        final = self._assemble(rounds, keep, n_groups, trace)
        kept_total = sum(int(k.sum()) for k in keep)  # surplus kept refills (beyond the batch) count as kept
        missing = n_groups - len(trace["kept"])
        for name, value in (("dropped_groups", float(dropped)), ("rounds", float(r)),
                            ("frac_kept", kept_total / generated), ("extra_generation_seconds", extra_seconds),
                            ("short_step", float(missing > 0)), ("missing_groups", float(missing))):
            self.log_train_metric(METRIC + name, value)
        if missing and self.accelerator.is_main_process:
            print(f"[dynamic_sampling] step {self.state.global_step + 1}: {missing} of {n_groups} groups missing after "
                  f"{r} extra round(s) (std < {min_std}); training short on the kept groups")
        trace["rounds"], trace["missing"] = r, missing
        self.dynamic_sampling_trace.append(trace)
        return final

    def _assemble(self, rounds, keep, n_groups: int, trace: dict) -> dict[str, Any]:
        """This rank's share of the kept groups (all ranks' rows gathered), padded to the usual size."""
        G, P, rank = self.num_generations, self.accelerator.num_processes, self.accelerator.process_index
        device = self.accelerator.device
        first, local_n = rounds[0][0], rounds[0][2]
        row_keys = [k for k, v in first.items() if torch.is_tensor(v) and v.dim() >= 1 and v.size(0) == local_n]
        mine = [{k: o[k].detach().cpu() for k in row_keys} for o, _, _ in rounds]
        everyone = gather_object([mine])  # [rank][round][key] -> tensor
        pool, total, offsets, off = {}, [], [], 0
        for ri in range(len(rounds)):
            offsets.append(off)
            off += rounds[ri][1].numel()
            total.append(rounds[ri][1])
        pad_id = self.trl_pad_token_id
        for k in row_keys:
            parts = [everyone[p][ri][k] for ri in range(len(rounds)) for p in range(P)]
            pool[k] = _cat_padded(parts, left=k.startswith("prompt"), value=pad_id if k.endswith("_ids") else 0)
        total = torch.cat(total)

        kept_groups = [(ri, g) for ri, k in enumerate(keep) for g in k.nonzero().flatten().tolist()][:n_groups]
        trace["kept"] = kept_groups
        stds = [group_std(t, G) for _, t, _ in rounds]
        trace["trained_std"] = [float(stds[ri][g]) for ri, g in kept_groups]
        real = [offsets[ri] + g * G + j for ri, g in kept_groups for j in range(G)]
        rows_total = n_groups * G
        local_rows = rows_total // P
        mine_real = real[rank::P]
        n_pad = local_rows - len(mine_real)
        index = torch.tensor(mine_real + [0] * n_pad, dtype=torch.long)
        out = {k: pool[k].index_select(0, index).clone() for k in row_keys}
        if self.scale_rewards == "batch" and real:
            centered = total - torch.nanmean(total.view(-1, G), dim=1).repeat_interleave(G)
            adv = centered / (nanstd(total[real]) + 1e-4)
            out["advantages"] = torch.nan_to_num(adv.index_select(0, index), nan=0.0).to(out["advantages"].dtype)
        if n_pad:
            out["completion_mask"][len(mine_real):] = 0
            out["advantages"][len(mine_real):] = 0
            if real and self.loss_type in SEQUENCE_MEAN_LOSSES:
                out["advantages"] = out["advantages"] * (rows_total / len(real))
        masks = pool["completion_mask"] * pool["tool_mask"] if "tool_mask" in pool else pool["completion_mask"]
        num_items = masks[torch.tensor(real, dtype=torch.long)].sum() if real else torch.tensor(0)
        result = {k: out[k].to(device) if k in out else v for k, v in first.items()}  # TRL's key order
        result["num_items_in_batch"] = num_items.to(device)
        return result
