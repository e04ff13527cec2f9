"""The reward pool splits judge batches across actors between GRPO groups, never inside one."""

from __future__ import annotations

import itertools

import pytest

from pipeline.config import load_config
from rewards.judge import LLMJudge
from tests.test_judge import build_tiny_lm, grouped

pytestmark = pytest.mark.slow  # real Ray actors: two judges and a scorer start (~1 min on 2 busy cores)


@pytest.fixture(scope="module")
def tiny_llm_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("pool-judge"), "left")


def _stats(pool) -> list[dict]:
    import ray

    return ray.get([a.stats.remote() for a in pool.judges])


def test_two_judge_actors_never_split_a_group(ray_local, tiny_llm_path):
    from pipeline.scoring.pool import start_pool, stop_pool

    cfg = load_config(None, [
        "judge.backend=llm", f"judge.model={tiny_llm_path}", "judge.num_actors=2", "judge.cpus_per_actor=0.5",
        "judge.max_input_tokens=160",
    ])
    local = LLMJudge.from_pretrained(str(tiny_llm_path), max_input_tokens=160, share_prefix=False)
    pool = start_pool(cfg)
    try:
        for sizes in ([3, 6, 2, 5], [1, 1, 7, 1], [5, 4], [16], [2] * 5):
            q, r, c = grouped(sizes, seed=len(sizes))
            before = [s["scored"] for s in _stats(pool)]
            got = pool.run(pool.judge(q, r, c))
            per_actor = [s["scored"] - b for s, b in zip(_stats(pool), before)]
            boundaries = set(itertools.accumulate(sizes, initial=0))
            assert sum(per_actor) == len(q) and per_actor[0] in boundaries, (sizes, per_actor)
            if len(sizes) > 1:  # both actors work, as evenly as the groups allow
                assert min(per_actor) > 0, (sizes, per_actor)
            # in order, and the same scores as one unshared judge on the whole batch
            assert max(abs(x - y) for x, y in zip(got, local.score(q, r, c))) < 1e-4
        # [3, 6, 2, 5]: an even cut (8) would split the second group; the nearest group boundary is 9
        before = [s["scored"] for s in _stats(pool)]
        pool.run(pool.judge(*grouped([3, 6, 2, 5])))
        assert [s["scored"] - b for s, b in zip(_stats(pool), before)] == [9, 7]
    finally:
        stop_pool(pool)
