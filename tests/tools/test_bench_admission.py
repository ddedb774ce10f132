"""`tokensampler bench --admission`: the admission report's rows, table and JSON, on small sizes."""

import json

from tokensampler.tools import bench_admission, cli


def test_the_report_has_a_row_per_size_and_a_table():
    report = bench_admission.run_admission_bench(rounds=2, sizes=(1, 4))
    assert [row["requests"] for row in report["results"]] == [1, 4] and report["rounds"] == 2
    for row in report["results"]:
        assert row["lanes"] == row["requests"] and len(row["runs_ms"]) == 2 and row["median_ms"] > 0
    table = bench_admission.format_admission_table(report)
    assert "| 1 |" in table and "| 4 |" in table and "for 4x" in table
    assert bench_admission.ADMISSION_SIZES == (1, 32, 256, 1024)


def test_the_command_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    real = bench_admission.run_admission_bench
    monkeypatch.setattr(bench_admission, "run_admission_bench",
                        lambda rounds=None, quick=False, contention=0: real(rounds=rounds, quick=quick, sizes=(1, 2),
                                                                            contention=contention))
    path = tmp_path / "admission.json"
    assert cli.main(["bench", "--admission", "--rounds", "1", "--json", str(path)]) == 0
    assert "requests = lanes" in capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert [row["requests"] for row in payload["admission"]["results"]] == [1, 2] and "machine" in payload


def test_no_case_with_admission(capsys):
    assert cli.main(["bench", "--admission", "--case", "greedy"]) == cli.USAGE_ERROR
    assert "--case" in capsys.readouterr().err


def test_quick_reports_admission_beside_the_matrix(monkeypatch, capsys):
    real = bench_admission.run_admission_bench
    monkeypatch.setattr(bench_admission, "run_admission_bench",
                        lambda rounds=None, quick=False: real(rounds=1, quick=quick, sizes=(1,)))
    seen = {}

    def run_bench(extra=None, **kwargs):
        seen.update(extra=extra, **kwargs)
        return []

    monkeypatch.setattr(cli.bench, "run_bench", run_bench)
    assert cli.main(["bench", "--quick"]) == 0
    assert [row["requests"] for row in seen["extra"]["admission"]["results"]] == [1]
    assert "requests = lanes" in capsys.readouterr().out
    assert cli.main(["bench", "--quick", "--case", "greedy"]) == 0 and seen["extra"] is None


def test_contention_times_each_round_beside_busy_processes_too(capsys):
    report = bench_admission.run_admission_bench(rounds=2, sizes=(1, 4), contention=1)
    assert report["contention"] == 1
    for row in report["results"]:
        assert len(row["contended_runs_ms"]) == 2 and len(row["runs_ms"]) == 2
        assert row["contention_ratio"] == row["contended_median_ms"] / row["median_ms"]
    table = bench_admission.format_admission_table(report)
    assert "contended / quiet" in table and table.count("x |") == 2 + 1  # two ratios, one growth
    assert cli.main(["bench", "--admission", "--contention", "-1"]) == cli.USAGE_ERROR
    assert "--contention" in capsys.readouterr().err
