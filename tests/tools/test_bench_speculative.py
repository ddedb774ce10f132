"""`tokensampler bench --speculative` on small cases: the match check, the table, the vLLM note."""

import io
import json

import pytest

from tokensampler.tools import bench_speculative as bs
from tokensampler.tools import cli

SMALL = (bs.SpeculativeCase("speculative_match", 3, 2, 1500, "match", bs.TARGET),
         bs.SpeculativeCase("speculative_rejection", 3, 2, 1500, "rejection", bs.TARGET))


def test_small_speculative_bench_checks_match_mode_and_writes_json(tmp_path):
    path = tmp_path / "spec.json"
    results = bs.run_bench(matrix=SMALL, rounds=1, json_path=str(path), log=io.StringIO(), against="vllm")
    assert [r["case"] for r in results] == ["speculative_match", "speculative_rejection"]
    match, rejection = results
    assert match["rows_equal"] == match["rows"] == 3
    assert all(r["ids_valid"] for r in results)
    assert {"tokensampler", "plain_steps"} <= set(match["median_ms"])
    assert 1.0 <= rejection["mean_emitted"]["tokensampler"] <= 3.0
    table = bs.format_table(results)
    assert "| speculative_match (B=3, K=2, V=1500) |" in table and "3/3" in table
    if "vllm" not in match["median_ms"]:
        assert "vLLM column omitted" in table  # the peer is omitted with a note, never silently
    assert len(json.loads(path.read_text())["results"]) == 2


def test_the_bench_rows_are_the_issue_rows():
    assert [(c.name, c.batch, c.drafts, c.vocab, c.mode) for c in bs.SPECULATIVE_CASES] == [
        ("speculative_match", 32, 4, 151936, "match"), ("speculative_rejection", 32, 4, 151936, "rejection")]
    assert bs.is_speculative_case("speculative_match") and not bs.is_speculative_case("greedy")


def test_unknown_speculative_case_is_rejected():
    with pytest.raises(ValueError, match="not speculative cases"):
        bs.run_bench(cases=["greedy"], log=io.StringIO())
    with pytest.raises(SystemExit):
        cli.main(["bench", "--speculative", "--rounds", "x"])
