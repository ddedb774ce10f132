"""The bench's pieces on small cases: logits shape, the baseline pipeline, the reference check, JSON."""

import io
import json
import math
import os

import pytest
import torch

from tokensampler.tools import bench, cli

SMALL = (
    bench.BenchCase("small_topp", 3, 2000, {"temperature": 0.8, "top_p": 0.9}),
    bench.BenchCase("small_pen", 2, 1500, {"temperature": 0.8, "top_k": 5, "repetition_penalty": 1.1,
                                           "presence_penalty": 0.5, "frequency_penalty": 0.3}, history=True),
    bench.BenchCase("small_greedy_lp", 2, 500, {"temperature": 0.0, "logprobs": 3}, flat=True),
)


def test_logits_follow_the_profile():
    logits = bench.make_logits(2, 5000, seed=3)
    assert logits.shape == (2, 5000) and logits.dtype == torch.float32
    ranked = torch.sort(logits[0], descending=True).values
    # 18 - 2.2 ln(rank) + noise: the top is near 18, rank 1000 near 18 - 2.2 ln 1000 = 2.8
    assert 17.0 < float(ranked[0]) < 21.5
    assert abs(float(ranked[999]) - (18 - 2.2 * math.log(1000))) < 1.0
    flat = torch.sort(bench.make_logits(1, 5000, flat=True, seed=3)[0], descending=True).values
    assert abs(float(flat[999]) - (18 - math.log(1000))) < 1.0
    assert torch.equal(bench.make_logits(2, 100, seed=1), bench.make_logits(2, 100, seed=1))


def test_sort_pipeline_samples_from_the_filtered_set():
    case = bench.BenchCase("k", 4, 300, {"temperature": 1.0, "top_k": 3})
    logits = bench.make_logits(4, 300, seed=5)
    gen = torch.Generator().manual_seed(0)
    top3 = torch.topk(logits, 3, dim=-1).indices
    for _ in range(20):
        token = bench.sort_pipeline_step(logits, case, None, None, gen)
        assert bool((top3 == token[:, None]).any(dim=-1).all())


def test_run_bench_checks_reference_and_writes_json(tmp_path):
    log = io.StringIO()
    path = tmp_path / "out.json"
    results = bench.run_bench(matrix=SMALL, rounds=2, json_path=str(path), log=log)
    assert [r["case"] for r in results] == [c.name for c in SMALL]
    for r in results:
        assert r["reference_rows_equal"] == r["rows"] > 0
        assert set(r["median_ms"]) == {"floor", "sort_pipeline", "tokensampler"}
        assert all(len(v) == 2 for v in r["runs_ms"].values())
    payload = json.loads(path.read_text())
    assert payload["machine"]["torch"] == torch.__version__ and len(payload["results"]) == 3
    assert payload["machine"]["omp"] == {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
                                         "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT")}
    assert "[3/3] small_greedy_lp" in log.getvalue()
    table = bench.format_table(results)
    assert table.count("\n") == 4 and "| small_pen |" in table


def test_quick_checks_a_subset_of_rows():
    results = bench.run_bench(matrix=SMALL[:1], rounds=1, quick=True, log=io.StringIO())
    assert results[0]["rows"] == min(bench.QUICK_CHECK_ROWS, SMALL[0].batch)


def test_unknown_case_is_rejected():
    with pytest.raises(ValueError, match="not in the workload matrix"):
        bench.run_bench(cases=["nope"], log=io.StringIO())
    with pytest.raises(SystemExit):
        cli.main(["bench", "--rounds", "x"])


def test_matrix_is_the_issue_matrix():
    names = [c.name for c in bench.WORKLOAD_MATRIX]
    assert names == ["greedy", "temp", "topk50", "topp0.9", "topp0.9_flat", "k20_p0.95", "minp0.05",
                     "penalties_topp", "logprobs20_topp", "B1_V248k_topp", "B128_V128k_k20_p0.95",
                     "bitmask_topp0.9"]
    by_name = {c.name: c for c in bench.WORKLOAD_MATRIX}
    assert (by_name["B1_V248k_topp"].batch, by_name["B1_V248k_topp"].vocab) == (1, 248320)
    assert by_name["penalties_topp"].history and by_name["topp0.9_flat"].flat
    masked, twin = by_name["bitmask_topp0.9"], by_name["topp0.9"]  # the same step, with and without a mask
    assert (masked.batch, masked.vocab, masked.params) == (twin.batch, twin.vocab, twin.params) == \
        (32, 151936, {"temperature": 0.8, "top_p": 0.9})
    assert masked.bitmask_allowed == 4096 and twin.bitmask_allowed == 0


def test_bitmask_case_reports_the_ratio_to_the_same_step_without_the_mask():
    from tokensampler.reference import bitmask_allowed_ids
    logits = bench.make_logits(3, 3000, seed=4)
    mask = bench.make_bitmask(logits, 200)
    allowed = bitmask_allowed_ids(mask, 3000)
    top = logits.topk(32, dim=-1).indices.tolist()
    assert mask.dtype == torch.int32 and mask.shape == (3, 94)
    assert all(len(a) == 200 and set(t) <= a for a, t in zip(allowed, top))  # the likely ids are allowed
    case = bench.BenchCase("small_mask", 3, 3000, {"temperature": 0.8, "top_p": 0.9}, bitmask_allowed=200)
    (result,) = bench.run_bench(matrix=(case,), rounds=2, log=io.StringIO())
    assert result["reference_rows_equal"] == result["rows"] == 3
    assert set(result["median_ms"]) == {"floor", "sort_pipeline", "tokensampler", "tokensampler_unmasked"}
    assert result["mask_ratio"] == result["median_ms"]["tokensampler"] / result["median_ms"]["tokensampler_unmasked"]
    assert "mask / unmasked" in bench.format_table([result])


def test_readme_usage_example_runs():
    """The README's 'Use it' example runs as written."""
    from pathlib import Path
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = text.split("## Use it", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    out = namespace["out"]
    assert out.token_ids.shape == (2,) and bool(out.valid.all())


def test_llama_cpp_cases_are_the_issue_cases():
    """`--against llama.cpp`: B=1 at V = 49,152, 151,936 and 248,320; llama.cpp's default chain, and
    top-k 20 + top-p 0.95."""
    cases = bench.workloads.LLAMA_CPP_CASES
    assert [(c.batch, c.vocab) for c in cases] == [(1, v) for v in (49152, 151936, 248320)] * 2
    default = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
    assert {c.name: c.params for c in cases} == {
        **{f"llama_default_V{v}k": default for v in (49, 151, 248)},
        **{f"k20_p0.95_V{v}k": {"temperature": 1.0, "top_k": 20, "top_p": 0.95} for v in (49, 151, 248)}}
    assert not {c.name for c in cases} & {c.name for c in bench.WORKLOAD_MATRIX}


SMALL_PEER = (bench.BenchCase("small_default", 1, 3000,
                              {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}),)


def test_against_llama_cpp_adds_its_column_when_importable(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (docs/llama-cpp.md)")
    path = tmp_path / "peer.json"
    (result,) = bench.run_bench(matrix=SMALL_PEER, rounds=2, json_path=str(path), log=io.StringIO(),
                                against="llama.cpp")
    assert set(result["median_ms"]) == {"floor", "sort_pipeline", "tokensampler", "llama.cpp", "llama.cpp_copy"}
    assert result["reference_rows_equal"] == result["rows"] == 1
    assert "| llama.cpp ms | llama.cpp / ts |" in bench.format_table([result])
    peer = json.loads(path.read_text())["peer"]
    assert peer["name"] == "llama.cpp" and peer["version"] and peer["note"] is None and "copied" in peer["step"]


def test_against_llama_cpp_is_omitted_with_a_note_when_not_importable(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    log = io.StringIO()
    (result,) = bench.run_bench(matrix=SMALL_PEER, rounds=1, log=log, against="llama.cpp")
    assert "llama.cpp" not in result["median_ms"] and "llama.cpp ms" not in bench.format_table([result])
    (note,) = [line for line in log.getvalue().splitlines() if "llama.cpp column omitted" in line]
    assert "llama_cpp is not importable" in note and "docs/llama-cpp.md" in note


def test_llama_cpp_case_names_are_known_only_with_against_llama_cpp():
    with pytest.raises(ValueError, match="not in the workload matrix"):
        bench.run_bench(cases=["llama_default_V49k"], log=io.StringIO())


def test_a_mixed_case_gives_each_row_its_own_sampler_and_matches_the_reference():
    mix = tuple({**bench.workloads.TOPP95, **extra} for extra in (*bench.workloads.FULL_ROW_SAMPLERS.values(), {}))
    case = bench.BenchCase("small_mixed", len(mix), 3000, bench.workloads.TOPP95, mix=mix)
    assert [case.sampling_params(0, row).typical_p for row in range(len(mix))].count(0.9) == 1
    assert case.sampling_params(0, len(mix)) == case.sampling_params(0, 0)  # rows cycle
    (result,) = bench.run_bench(matrix=(case,), rounds=1, log=io.StringIO())
    assert result["reference_rows_equal"] == result["rows"] == len(mix)
    names = [c.name for c in bench.workloads.SAMPLER_CASES]
    assert names[0] == "topp0.95" and names[-2:] == ["mixed_samplers_topp0.95", "dry0.8_topp0.95"]
    assert len(names) == 10


def test_a_sampler_case_times_plain_top_p_in_the_same_rounds():
    """Each sampler case (not plain top-p itself) carries a baseline arm, the plain top-p 0.95 step on
    the same logits, and reports the median over rounds of the paired ratio."""
    assert [c.baseline for c in bench.workloads.SAMPLER_CASES] == [None] + [bench.workloads.TOPP95] * 9
    case = bench.BenchCase("small_dynatemp", 4, 3000, {**bench.workloads.TOPP95, "dynatemp_range": 0.5},
                           baseline=bench.workloads.TOPP95)
    (result,) = bench.run_bench(matrix=(case,), rounds=3, log=io.StringIO())
    runs = result["runs_ms"]
    assert set(runs) == {"floor", "sort_pipeline", "tokensampler", "baseline"} and len(runs["baseline"]) == 3
    assert result["baseline_ratio"] == bench.paired_ratio(runs["tokensampler"], runs["baseline"])
    assert bench.paired_ratio([2.0, 9.0, 3.0], [1.0, 3.0, 1.0]) == 3.0  # the median of 2, 3, 3
    assert "ts / baseline (paired)" in bench.format_table([result])
