"""The offline tools (`doctor`, `compare`, `plan`) read files anyone may have written: a live run's
half-written line, a hand edit, a folder from someone else. A seeded generator (deterministic; no
hypothesis in the environment) crafts run folders and model config.json files and runs each tool
in process through `pipeline.cli.main.main`: no traceback, exit 0 or 2, bounded output, and no input
that only the CLI's last-resort guard caught (every problem is named by the reader that met it).

Plotting costs ~0.1 s a figure, so every 8th case draws its plots and the others write none; the
extreme values that matter for drawing are drawn in ``test_extreme_values_are_drawn_or_left_out``.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import string
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.report import compare as compare_mod
from pipeline.report import plots
from pipeline.cli.main import main

REPO = Path(__file__).resolve().parents[1]
CASES = 200  # per tool (the "Done when")
RENDER_EVERY = 8
MAX_OUTPUT = 1 << 20  # stdout + stderr of one call
MAX_WRITTEN = 4 << 20  # report/table and plots of one call
GUARD = "this is a bug of synth-grpo's reader"  # cli.main's last resort

KEYS = ["reward", "reward_std", "entropy", "loss", "frac_reward_zero_std", "completions/clipped_ratio",
        "completions/mean_length", "completions/max_length", "clip_ratio/region_mean", "clip_ratio/low_mean",
        "clip_ratio/high_mean", "generation/max_completion_length", "rewards/judge/mean", "rewards/rouge_l/mean",
        "eval/score", "entropy_coef", "train_runtime", "learning_rate"]
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{b}: &{b} [{','.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))


# ---------------------------------------------------------------- the generator


def junk(rng: random.Random, depth: int = 0):
    """A JSON/YAML value of a wrong or absurd kind."""
    kind = rng.randrange(14 if depth < 3 else 10)
    if kind == 0:
        return 10 ** rng.choice([19, 309, 400, 1000])  # beyond int64, beyond a float
    if kind == 1:
        return -(10 ** 400)
    if kind == 2:
        return rng.choice([math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, -0.0])
    if kind == 3:
        return "".join(rng.choice(string.printable + "|`\u00e9\u2028\ufffd") for _ in range(rng.choice([0, 3, 40, 3000])))
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return rng.randint(-5, 5)
    if kind == 6:
        return rng.uniform(-1e6, 1e6)
    if kind == 7:
        return "nan"
    if kind == 8:
        return rng.choice(["12", "1e-5", "", " ", "step"])
    if kind == 9:
        return rng.random()
    if kind == 10:
        return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 11:
        return {rng.choice(KEYS + ["x", "", "a" * 200]): junk(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 12:
        return deep_list(rng.choice([50, 2000]))
    return {"nested": {"deeper": [junk(rng, depth + 1)]}}


def deep_list(n: int):
    v: list = []
    for _ in range(n):
        v = [v]
    return v


def dumps(v) -> str:
    try:
        return json.dumps(v)
    except (ValueError, RecursionError):
        return "[" * 5000


def broken_line(rng: random.Random) -> bytes:
    kind = rng.randrange(9)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    if kind == 1:
        return b'{"step": 3, "reward": '  # a live run's half-written last line
    if kind == 2:
        return b"[" * 100_000
    if kind == 3:
        return b'{"step": ' + b"9" * 5000 + b"}"
    if kind == 4:
        return b"NaN"
    if kind == 5:
        return b'{"step": 1, "reward": NaN, "entropy": Infinity, "loss": -Infinity}'
    if kind == 6:
        return '{"step": 2, "reward": 0.5, "note": "\u00e9"}'.encode("latin-1")
    if kind == 7:
        return b"[1, 2, 3]"
    return b'"just a string"'


def metric_row(rng: random.Random, step: int) -> dict:
    bad = rng.random() < 0.15
    row = {k: (junk(rng) if bad and rng.random() < 0.5 else rng.uniform(0, 2))
           for k in rng.sample(KEYS, rng.randrange(1, len(KEYS)))}
    if rng.random() < 0.9:
        row["step"] = junk(rng) if rng.random() < 0.1 else step
    return row


def jsonl(rng: random.Random, rows, broken: float) -> bytes:
    lines = []
    for r in rows:
        lines.append(broken_line(rng) if rng.random() < broken else dumps(r).encode())
    tail = b"" if rng.random() < 0.2 else b"\n"
    return b"\n".join(lines) + tail


def metrics_file(rng: random.Random) -> bytes | None:
    kind = rng.randrange(12)
    if kind == 0:
        return None  # missing
    if kind == 1:
        return b""
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
    n = rng.choice([1, 2, 5, 30, 80])
    return jsonl(rng, [metric_row(rng, i) for i in range(n)], rng.choice([0.0, 0.05, 0.3, 1.0]))


def eval_file(rng: random.Random) -> bytes | None:
    if rng.random() < 0.3:
        return None
    rows = []
    for i in range(rng.randrange(1, 12)):
        r = {"step": rng.choice([0, 0, 10, 10]), "prompt": f"q{i % 3}", "sample": i // 3, "completion": "a | b",
             "reference": "r", "ended_with_eos": True, "scores": {"rouge_l": rng.random(), "judge": rng.random()},
             "score": rng.random()}
        for _ in range(rng.randrange(3)):
            field = rng.choice(list(r))
            if rng.random() < 0.3:
                del r[field]
            else:
                r[field] = junk(rng)
        rows.append(r)
    return jsonl(rng, rows, rng.choice([0.0, 0.2]))


def config_file(rng: random.Random) -> bytes | None:
    kind = rng.randrange(12)
    if kind == 0:
        return None
    if kind == 1:
        return ALIAS_BOMB.encode()
    if kind == 2:
        return b"generation: &g\n  max_completion_length: 8\n  self: *g\n"  # recursive
    if kind == 3:
        return b"optimization: {learning_rate: \xff\xfe}\n"  # not UTF-8
    if kind == 4:
        return b"[" * 3000 + b"]" * 3000
    if kind == 5:
        return b"optimization:\n  max_steps: " + b"9" * 5000 + b"\n"
    if kind == 6:
        return b"generation: [unclosed\n"
    if kind == 7:
        return rng.choice([b"", b"- 1\n- 2\n", b"just text\n", b"~\n"])
    cfg = {"generation": {"max_completion_length": rng.choice([160, "adaptive", junk(rng)]),
                          "length_schedule": rng.choice([[[0, 64], [10, 128]], junk(rng), [[junk(rng), junk(rng)]]]),
                          "num_generations": rng.choice([4, junk(rng)])},
           "optimization": {"max_steps": rng.choice([30, 10 ** 400, junk(rng)]), "learning_rate": junk(rng),
                            "gradient_accumulation_steps": rng.choice([1, junk(rng)])},
           "logging": {"logging_steps": rng.choice([1, 0, junk(rng)])},
           "grpo": {"num_iterations": rng.choice([1, junk(rng)])},
           "output": {"run_name": "x"}}
    for _ in range(rng.randrange(3)):
        cfg[rng.choice(["judge", "x" * 300, "data"])] = junk(rng)
    try:
        return yaml.safe_dump(cfg, allow_unicode=True).encode("utf-8", errors="surrogatepass")
    except (yaml.YAMLError, RecursionError):
        return b"generation: {max_completion_length: 8}\n"


def model_config(rng: random.Random) -> bytes | None:
    kind = rng.randrange(14)
    if kind == 0:
        return None  # a folder without config.json
    if kind == 1:
        return b""
    if kind == 2:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 500)))
    if kind == 3:
        return b"[" * 100_000
    if kind == 4:
        return b'{"hidden_size": 64, "num_attention_heads": '  # truncated
    if kind == 5:
        return json.dumps(junk(rng)).encode() if rng.random() < 0.5 else b"[1, 2]"
    if kind == 6:
        return b'{"model_type": "llama", "hidden_size": NaN, "intermediate_size": Infinity}'
    d = {"model_type": rng.choice(["llama", "qwen2", "mistral", "nonsense", 7]), "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": rng.choice([True, False])}
    for _ in range(rng.randrange(3)):
        d[rng.choice(list(d) + ["head_dim", "text_config", "attention_bias"])] = rng.choice(
            [0, -1, 10 ** 400, 2 ** 40, 64.5, "64", None, True, [64], {"a": 1}, junk(rng)])
    if rng.random() < 0.1:
        del d[rng.choice(list(d))]
    return dumps(d).encode()


def write(path: Path, data: bytes | None) -> None:
    if data is not None:
        path.write_bytes(data)


def run_folder(rng: random.Random, d: Path) -> Path:
    d.mkdir(parents=True)
    write(d / "metrics.jsonl", metrics_file(rng))
    write(d / "eval_samples.jsonl", eval_file(rng))
    write(d / "config.yaml", config_file(rng))
    write(d / "events.jsonl", jsonl(rng, [{"event": junk(rng), "time": junk(rng)} for _ in range(3)], 0.3))
    write(d / "health.json", rng.choice([b"", b"{", dumps(junk(rng)).encode(), b"[]"]))
    return d


# ---------------------------------------------------------------- running the tools


def call(argv: list[str]) -> tuple[int, str]:
    """`synth-grpo ARGV` in process: (exit code, stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue()


def written_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file() and p.suffix in (".md", ".png"))


def check(argv: list[str], output_dirs: list[Path], case: int) -> int:
    rc, text = call(argv)
    what = f"case {case}: synth-grpo {' '.join(argv)}\n{text[-2000:]}"
    assert rc in (0, 2), what
    assert "Traceback" not in text and GUARD not in text, what
    assert len(text) < MAX_OUTPUT, what
    for d in output_dirs:
        assert written_bytes(d) < MAX_WRITTEN, what
    if rc == 2:  # the line naming what was wrong
        assert any(line.startswith(f"synth-grpo {argv[0]}: ") for line in text.splitlines()), what
    return rc


@pytest.fixture
def fast_plots(monkeypatch):
    """Plots only in every RENDER_EVERY-th case (see the module docstring)."""
    state = {"render": True}
    real_run, real_families = plots.plot_run, compare_mod.plot_families
    monkeypatch.setattr(plots, "plot_run", lambda *a, **k: real_run(*a, **k) if state["render"] else {})
    monkeypatch.setattr(compare_mod, "plot_families", lambda *a, **k: real_families(*a, **k) if state["render"] else {})
    return state


def test_doctor_fuzz(tmp_path, fast_plots):
    rng = random.Random(2701)
    codes = []
    for i in range(CASES):
        fast_plots["render"] = i % RENDER_EVERY == 0
        d = run_folder(rng, tmp_path / f"run{i}")
        codes.append(check(["doctor", str(d)] + (["--json"] if i % 3 == 0 else []), [d], i))
    assert codes.count(0) >= CASES // 4 and codes.count(2) >= CASES // 10  # both paths exercised


def test_compare_fuzz(tmp_path, fast_plots):
    rng = random.Random(2702)
    codes = []
    for i in range(CASES):
        fast_plots["render"] = i % RENDER_EVERY == 0
        runs = [run_folder(rng, tmp_path / f"c{i}" / f"run{k}") for k in range(rng.choice([1, 2]))]
        out = tmp_path / f"c{i}" / "out"
        codes.append(check(["compare", *map(str, runs), "--out", str(out)], [out], i))
    assert codes.count(0) >= CASES // 20 and codes.count(2) >= CASES // 4


def test_plan_fuzz(tmp_path):
    rng = random.Random(2703)
    codes = []
    for i in range(CASES):
        d = tmp_path / f"model{i}"
        d.mkdir()
        write(d / "config.json", model_config(rng))
        argv = ["plan", "--set", f"model.name_or_path={d}", "--gpu-mem", "80"] + (["--json"] if i % 2 else [])
        codes.append(check(argv, [], i))
    assert codes.count(0) >= CASES // 10 and codes.count(2) >= CASES // 2


# ---------------------------------------------------------------- the measured cases, as a user meets them


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_measured_cases_via_subprocess(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": i, "reward": 0.1 * i, "entropy": 1.0} for i in range(12)]
    lines = [json.dumps(r) for r in rows] + ['{"step": ' + "9" * 400 + ', "reward": 1}', '{"step": 13, "rew']
    (run / "metrics.jsonl").write_text("\n".join(lines))  # a 400-digit step; a half-written last line
    (run / "eval_samples.jsonl").write_text(
        json.dumps({"step": 0, "prompt": "q", "scores": {}, "score": "high"}) + "\n"
        + json.dumps({"step": 0, "prompt": "q", "scores": {}}) + "\n")
    (run / "config.yaml").write_bytes(b"generation: {max_completion_length: \xff}\n")
    p = _cli("doctor", str(run))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    err = p.stderr
    assert f"{run / 'metrics.jsonl'}: skipped 1 broken lines (lines 14)" in err
    assert "skipped 1 rows whose step is not a whole number" in err and "(lines 13)" in err
    assert f"{run / 'eval_samples.jsonl'}: skipped 2 rows that are no answer: 2 with no valid score (lines 1, 2)" in err
    assert f"{run / 'config.yaml'}: not UTF-8 text (byte 36" in err

    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (other / "config.yaml").write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 700
    out = tmp_path / "cmp"
    p = _cli("compare", str(run), str(other), "--out", str(out))
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert (out / "compare.md").stat().st_size < 20_000

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64, "num_attention_heads": ')
    p = _cli("plan", "--set", f"model.name_or_path={model}", "--gpu-mem", "80")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.startswith(f"synth-grpo plan: {model / 'config.json'}: not valid JSON"), p.stderr
    (model / "config.json").write_text(json.dumps({"hidden_size": 10 ** 400, "intermediate_size": 8, "num_hidden_layers": 1,
                                                   "num_attention_heads": 1, "vocab_size": 8}))
    rc, text = call(["plan", "--set", f"model.name_or_path={model}", "--gpu-mem", "80"])
    assert rc == 2 and "hidden_size is 1000000" in text and "expected a whole number from 1 to 131072" in text


def test_config_alias_bomb_recursion_and_deep_brackets_are_refused_at_once(tmp_path):
    """A run folder's config.yaml is read like a config (pipeline.config.read_yaml): no alias (the run's
    own writer never writes one; a 600-byte bomb expands to billions of nodes), no self-reference,
    brackets at most 100 deep; each refused with one line naming the file, in well under a second."""
    from pipeline.report.run_reader import read_config

    cases = {"a.yaml": ALIAS_BOMB, "b.yaml": "x: &x [1, 2]\ny: *x\n", "c.yaml": "generation: &g\n  self: *g\n",
             "d.yaml": "a: " + "[" * 3000 + "]" * 3000 + "\n"}
    for name, text in cases.items():
        (tmp_path / name).write_text(text)
        t0 = time.monotonic()
        cfg, why = read_config(tmp_path / name)
        assert cfg is None and why.startswith(f"{tmp_path / name}: not valid YAML"), (name, why)
        assert time.monotonic() - t0 < 1, name
    assert "aliases (*name) are not supported" in read_config(tmp_path / "b.yaml")[1]
    assert "brackets nested 3000 deep" in read_config(tmp_path / "d.yaml")[1]
    (tmp_path / "e.yaml").write_text("x: [1, [2, {a: 3}]]\n")
    assert read_config(tmp_path / "e.yaml") == ({"x": [1, [2, {"a": 3}]]}, None)


def test_reports_and_plots_replace_a_planted_symlink(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "reward": i / 10, "entropy": 1.0}) for i in range(12)))
    os.symlink(outside, run / "report.md")
    os.symlink(outside, run / "reward.png")
    out = tmp_path / "cmp"
    out.mkdir()
    os.symlink(outside, out / "reward.png")
    os.symlink(outside, out / "compare.md")
    assert call(["doctor", str(run)])[0] == 0
    assert call(["compare", str(run), "--out", str(out)])[0] == 0
    assert outside.read_text() == "precious"
    for p in (run / "report.md", run / "reward.png", out / "reward.png", out / "compare.md"):
        assert not p.is_symlink() and p.stat().st_size > 0
    assert (run / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert not [p for p in (*run.iterdir(), *out.iterdir()) if p.name.endswith(".tmp")]  # no temporary file left


def test_extreme_values_are_drawn_or_left_out(tmp_path):
    """Finite but absurd values (1e308, steps up to 2**53, one point) render; beyond plots.PLOT_BOUND
    they are left out of the plots but kept in the tables."""
    rows = [{"step": s, "reward": v, "reward_std": abs(v), "entropy": v, "completions/clipped_ratio": v,
             "completions/max_length": v, "generation/max_completion_length": v, "clip_ratio/region_mean": v,
             "rewards/judge/mean": v, "eval/score": v}
            for s, v in ((0, 1e308), (1, -1e308), (2, 0.5), (2 ** 52, 1e99), (2 ** 53, 5e-324))]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (run / "config.yaml").write_text("generation: {max_completion_length: 1.0e+300, length_schedule: [[0, 1.0e+300], [3, 64]]}\n")
    rc, text = call(["doctor", str(run)])
    assert rc == 0 and "Traceback" not in text, text
    assert all((run / f"{n}.png").read_bytes()[:4] == b"\x89PNG" for n in ("reward", "entropy", "length", "clip_ratio"))
    rc, text = call(["compare", str(run), "--out", str(tmp_path / "cmp")])
    assert rc == 0, text
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "| `reward` | run | 1e+308 | 1e+308 (0) | 4.941e-324 (9007199254740992) |" in md


def test_thousands_of_reward_keys_stay_a_small_report(tmp_path):
    """A hand-made log with 3,000 reward components and a 100 kB key: the doctor tracks the first 32
    (of at most 100 characters), plots 12, and its report stays small."""
    row = {f"rewards/c{k}/mean": 0.5 for k in range(3000)}
    row["rewards/" + "x" * 100_000 + "/mean"] = 0.5
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": i, "reward": i / 10, **row}) for i in range(12)))
    rc, text = call(["doctor", str(run)])
    assert rc == 0 and len(text) < 10_000, text
    report = (run / "report.md").read_text()
    assert len(report) < 20_000 and report.count("| `rewards/c") == 32
