"""Random weights of known shapes: what GPU benchmarks build instead of carrying a
checkpoint. The DeepSeek-V4 ones must be transformers' model too (the benchmark's
reference side loads the same dictionary)."""

import pytest
import torch

from formcast.engine.config import DeepseekV4Config
from formcast.engine.loading import build_model
from formcast.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from formcast.engine.models.shapes import DEEPSEEK_V4_SHAPES, random_deepseek_v4_weights


def test_deepseek_v4_tiny_weights_are_seeded_and_transformers_computes_the_same_logits():
    transformers = pytest.importorskip("transformers")
    shape = DEEPSEEK_V4_SHAPES["deepseek-v4-tiny"]
    weights = random_deepseek_v4_weights(shape, seed=3)
    again = random_deepseek_v4_weights(shape, seed=3)
    other = random_deepseek_v4_weights(shape, seed=4)
    assert weights.keys() == again.keys() == other.keys()
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert not torch.equal(weights["lm_head.weight"], other["lm_head.weight"])

    ours = build_model(DeepseekV4Config.from_dict(shape), weights, device=torch.device("cpu"),
                       dtype=torch.float32)
    config = transformers.DeepseekV4Config(**shape)
    config._attn_implementation = "eager"
    ref = transformers.DeepseekV4ForCausalLM(config).eval()
    ref.load_state_dict(weights, strict=True)   # the same names, every tensor given

    # (40 tokens: 10 compressed entries on CSA layers against a top-8; where the top-k
    # falls among entries of equal score, transformers' torch.topk may break the tie
    # either way, ours always to the earlier entry)
    ids = torch.randint(0, shape["vocab_size"], (40,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0].float()
        state = ours.new_state()
        got = ours.logits(ours(ids, torch.arange(len(ids)), [state], [len(ids)])).float()
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std().item() > 0.5          # not a flat distribution: argmax is decided


def test_deepseek_v4_shapes_parse_and_the_small_one_has_its_documented_size():
    for name, shape in DEEPSEEK_V4_SHAPES.items():
        config = DeepseekV4Config.from_dict(shape)
        assert config.vocab_size == 49152, name   # SmolLM2's tokenizer drives them
    with torch.device("meta"):
        small = DeepseekV4ForCausalLM(DeepseekV4Config.from_dict(DEEPSEEK_V4_SHAPES["deepseek-v4-small"]))
    total = sum(p.numel() for p in small.state_dict().values())
    assert 330e6 < total < 350e6, total


def test_random_weights_with_mtp_add_the_mtp_layer():
    shape = DEEPSEEK_V4_SHAPES["deepseek-v4-tiny"]
    plain = random_deepseek_v4_weights(shape, seed=0)
    mtp = random_deepseek_v4_weights(shape, seed=0, with_mtp=True)
    extra = set(mtp) - set(plain)
    assert extra and all(k.startswith("mtp.0.") for k in extra)
    model = build_model(DeepseekV4Config.from_dict(shape), mtp, device=torch.device("cpu"),
                        dtype=torch.float32)
    assert model.mtp is not None


def run_benchmark(script: str, gguf, tmp_path, *args: str) -> str:
    """The stdout of ``benchmarks/<script>`` run with our tokenizer's files (saved
    from ``gguf`` under ``tmp_path``) and ``args``; its failure fails the test."""
    import subprocess
    import sys
    from pathlib import Path

    from formcast.engine.tokenizer_files import cached_gguf_tokenizer

    cached_gguf_tokenizer(gguf).save_pretrained(str(tmp_path / "tok"))
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, str(root / "benchmarks" / script), "--tokenizer-dir",
         str(tmp_path / "tok"), *args], capture_output=True, text=True, timeout=600, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_gpu_benchmark_runs_a_deepseek_v4_shape_on_the_cpu(tmp_path, smollm2_gguf):
    # the benchmark's own smoke mode: both sides built from the same random weights
    import json

    pytest.importorskip("transformers")
    out = run_benchmark("gpu_throughput.py", smollm2_gguf, tmp_path, "--device", "cpu",
                        "--shape", "deepseek-v4-tiny", "--batch-sizes", "2",
                        "--constrained-batch-sizes", "2", "--tokens", "8")
    assert "shape=deepseek-v4-tiny" in out and "has no DeepSeek-V4" not in out
    ratio_rows = [line.split() for line in out.splitlines() if line.strip().startswith("2 ")]
    assert len(ratio_rows) == 2 and ratio_rows[0][-1].endswith("x")   # [1] and [2] rows
    assert json.loads(out.strip().splitlines()[-1]) == {"done": True}


@pytest.mark.slow
def test_host_overhead_times_a_stubbed_pipeline_on_the_cpu(tmp_path, smollm2_gguf):
    # the host's share of a pipelined step, forward stubbed: a line per batch size
    # with both sides' microseconds, their ratio and the picks taken and refused (a
    # batch of 8, whose first tokens go in flight, and the "mixed" picks' refusals)
    import re

    out = run_benchmark("host_overhead.py", smollm2_gguf, tmp_path, "--batch-sizes", "8",
                        "--tokens", "40", "--reps", "1", "--picks", "mixed")
    free, json_, ratio, picks, refused, steps, ms = map(float, re.search(
        r"^ +8 +(\d+) +(\d+) +([0-9.]+) +(\d+) +(\d+) +(\d+) +([0-9.]+)$", out, re.M).groups())
    assert free > 0 and json_ > 0 and ratio == pytest.approx(json_ / free, rel=0.02)
    assert picks > 0 and 0 < refused < picks
    assert steps >= 39 and ms == pytest.approx(json_ * steps / 1e3, rel=0.02)


@pytest.mark.slow
def test_host_overhead_compares_a_switch_in_one_process(tmp_path, smollm2_gguf):
    # --tuning: sides A and B alternate, a line each, then B's JSON time over A's. Here
    # B turns premasking off (the stub's mixed picks break the grammar after a
    # closing quote, which turns it on in A): B refuses those picks too, A only the
    # quotes that are themselves refused ('"]' where the schema wants a comma)
    import re

    out = run_benchmark("host_overhead.py", smollm2_gguf, tmp_path, "--batch-sizes", "16",
                        "--tokens", "64", "--reps", "2", "--picks", "mixed", "--closing", "40",
                        "--tuning", "premask_after=2")
    sides = {side: list(map(float, rest)) for side, *rest in re.findall(
        r"^ +16 (A|B) +(\d+) +(\d+) +([0-9.]+) +(\d+) +(\d+) +(\d+) +([0-9.]+)$", out, re.M)}
    assert set(sides) == {"A", "B"}
    refused, steps = ({side: row[k] for side, row in sides.items()} for k in (4, 5))
    assert refused["A"] < refused["B"] and steps["A"] <= steps["B"]
    ratio = float(re.search(r"^ +16 B/A json ms ([0-9.]+)$", out, re.M).group(1))
    assert ratio == pytest.approx(sides["B"][6] / sides["A"][6], rel=0.02)


@pytest.mark.slow
def test_step_series_splits_a_constrained_run_on_the_cpu(tmp_path, smollm2_gguf):
    # the benchmark's smoke mode: each side's totals, the first steps one by one
    # with their masked rows, the json/free line whose extra time adds up, and
    # where each step's time went
    import re

    out = run_benchmark("step_series.py", smollm2_gguf, tmp_path, "--device", "cpu", "--shape",
                        "deepseek-v4-tiny", "--batch-sizes", "2", "--tokens", "8", "--runs", "1",
                        "--opening", "3", "--show", "4", "--tail", "2", "--parts")
    totals = {side: float(ms) for side, ms in
              re.findall(r"batch +2 (free|json): total +([0-9.]+) ms", out)}
    assert set(totals) == {"free", "json"}
    steps = re.findall(r"step us/masked: (.*)", out)
    assert len(steps) == 2 and all(re.fullmatch(r"(\d+/\d+ ?){1,4}", s.strip()) for s in steps)
    tails = re.findall(r"last 2 steps us/masked: (.*)", out)
    assert len(tails) == 2 and all(re.fullmatch(r"\d+/\d+ \d+/\d+", t.strip()) for t in tails)
    ratio, extra, last = re.search(r"json/free tokens/s ([0-9.]+); extra time (-?[0-9.]+) ms, "
                                   r"of which .*, the last 2 (-?[0-9.]+) ms", out).groups()
    assert float(ratio) == pytest.approx(totals["free"] / totals["json"], rel=0.01, abs=0.002)
    assert float(extra) == pytest.approx(totals["json"] - totals["free"], abs=0.2)
    ends = [sum(int(c.split("/")[0]) for c in t.split()) / 1e3 for t in tails]
    assert float(last) == pytest.approx(ends[1] - ends[0], abs=0.2)
    # --parts: each side's host parts over the opening and after it; the ordinary
    # steps' forward and sampling took time (no device timing on the CPU)
    assert re.findall(r"(free|json) parts: device idle before forwards 0\.00 ms", out) == \
        ["free", "json"]
    assert out.count("none timed (no CUDA)") == 2
    rows = re.findall(r"(opening|after) host us/step \( *[0-9.]+ ms idle\) (.*)", out)
    assert [label for label, _ in rows].count("opening") == 2
    header = re.search(r"^ +(take_begin .*)$", out, re.M).group(1).split()
    for label, row in rows:
        cells = dict(zip(header, map(int, row.split()), strict=True))
        assert cells["execute"] > 0
        # (the opening's prefill samples the ordinary way; later steps may all verify
        # drafts instead, as the measured step times schedule them)
        assert cells["sample_and"] > 0 or label == "after"


@pytest.mark.slow
def test_engine_ab_compares_two_variants_on_the_cpu(tmp_path, smollm2_gguf):
    # the benchmark's smoke mode: a line per workload with both sides' tokens/s and
    # their ratio, the sides' JSON/free line; a switch that changes the tokens is
    # said to (masks at every step do not: they give the same picks; nor does a
    # tuning knob), and one that names nothing is refused before any work
    import re

    out = run_benchmark("engine_ab.py", smollm2_gguf, tmp_path, "--device", "cpu",
                        "--shape", "deepseek-v4-tiny", "--batch-sizes", "2", "--tokens", "4",
                        "--runs", "1", "--config", "unmasked_greedy=False")
    rows = re.findall(r"^ +2 +(free|json) +([0-9]+) \( *([0-9]+)\) +([0-9]+) \( *([0-9]+)\) "
                      r"+([0-9.]+) \(([0-9.]+)\)$", out, re.M)
    assert [r[0] for r in rows] == ["free", "json"]
    for _, a, _, b, _, ratio, _ in rows:
        # (the ratio is of unrounded figures: within the rounding of the printed ones)
        low, high = (int(b) - 0.5) / (int(a) + 0.5), (int(b) + 0.5) / max(int(a) - 0.5, 0.5)
        assert int(a) > 0 and int(b) > 0 and low * 0.98 - 0.002 <= float(ratio) <= high * 1.02 + 0.002
    assert re.search(r"^ +2 json/free +A [0-9.]+ \([0-9.]+\) +B [0-9.]+ \([0-9.]+\)$", out, re.M)
    assert "(outputs differ)" not in out
    out = run_benchmark("engine_ab.py", smollm2_gguf, tmp_path, "--device", "cpu",
                        "--shape", "deepseek-v4-tiny", "--batch-sizes", "2", "--tokens", "4",
                        "--runs", "1", "--workloads", "free", "--tuning", "detok_chore_tokens=None")
    assert "B: detok_chore_tokens=None" in out and "(outputs differ)" not in out
    with pytest.raises(AssertionError, match="no field 'no_such_switch'"):
        run_benchmark("engine_ab.py", smollm2_gguf, tmp_path, "--device", "cpu",
                      "--tuning", "no_such_switch=1")
