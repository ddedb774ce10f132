"""`tokensampler bench --contention N`: the busy processes really take a core while on and none
while off, and the bench times every arm quiet and loaded in the same rounds."""

from __future__ import annotations

import io
import json
import os
import time

from tokensampler.tools import bench
from tokensampler.tools.contention import BusyProcesses

SMALL = (bench.BenchCase("small_topp", 3, 2000, {"temperature": 0.8, "top_p": 0.9}),)
TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def test_busy_processes_spin_only_while_on():
    with BusyProcesses(2) as load:
        assert load.alive == 2
        pids = load.pids
        time.sleep(0.1)  # started, off: stopped
        idle_start = sum(_cpu_seconds(pid) for pid in pids)
        time.sleep(0.6)
        idle = sum(_cpu_seconds(pid) for pid in pids) - idle_start
        load.on()
        busy_start = sum(_cpu_seconds(pid) for pid in pids)
        time.sleep(1.0)
        busy = sum(_cpu_seconds(pid) for pid in pids) - busy_start
        load.off()
    assert idle < 0.05, idle  # off: stopped, no CPU at all
    # on: two spinners for 1 s get up to 2 CPU s on two idle cores; even beside a loaded CI job (other
    # processes on both cores) they get a fair share, far above what a stopped process gets (0)
    assert busy > 0.25, busy
    assert load.alive == 0  # joined on exit


def test_bench_times_each_arm_quiet_and_loaded(tmp_path):
    path = tmp_path / "out.json"
    (result,) = bench.run_bench(matrix=SMALL, rounds=2, json_path=str(path), log=io.StringIO(), contention=1)
    report = result["contention"]
    assert report["processes"] == 1
    assert set(report["median_ms"]) == set(result["median_ms"]) == {"floor", "sort_pipeline", "tokensampler"}
    assert all(len(v) == 2 for v in report["runs_ms"].values())
    for name, ratio in report["ratio"].items():
        assert ratio == report["median_ms"][name] / result["median_ms"][name]
    table = bench.format_table([result])
    assert "ts loaded / quiet" in table and f"{report['ratio']['tokensampler']:.2f}x" in table
    assert "floor loaded / quiet" in table and table.rstrip().endswith(
        f"| {report['ratio']['floor']:.2f}x | {result['reference_rows_equal']}/{result['rows']} |")
    assert json.loads(path.read_text())["contention"] == 1


def test_quiet_bench_has_no_contention_columns():
    (result,) = bench.run_bench(matrix=SMALL, rounds=1, log=io.StringIO())
    assert "contention" not in result and "loaded" not in bench.format_table([result])


class _RecordingLoad:
    """A load that records whether it was on at each timed call (what `time_arms_contended` owes)."""

    n = 1

    def __init__(self) -> None:
        self.is_on = False
        self.calls: list[tuple[str, bool]] = []

    def on(self) -> None:
        self.is_on = True

    def off(self) -> None:
        self.is_on = False


def test_loaded_rounds_run_while_the_load_is_on_and_alternate_with_quiet_ones():
    load = _RecordingLoad()
    arms = {name: (lambda name=name: load.calls.append((name, load.is_on))) for name in ("a", "b")}
    quiet, loaded = bench.time_arms_contended(arms, 3, bench.torch.device("cpu"), load)
    assert all(len(v) == 3 for v in (*quiet.values(), *loaded.values()))
    timed = load.calls[2:]  # after one warm-up call per arm (quiet)
    ab = [("a", False), ("b", False), ("a", True), ("b", True)]
    ba = [("b", False), ("a", False), ("b", True), ("a", True)]
    assert timed == ab + ba + ab  # the order rotated from round to round
    assert not load.is_on


def test_the_arms_order_rotates_from_round_to_round():
    """Each arm follows each other one equally often: round r starts at arm r mod n."""
    calls = []
    arms = {name: (lambda n=name: calls.append(n)) for name in "abc"}
    bench.time_arms(arms, 3, bench.torch.device("cpu"), warmup=0)
    assert "".join(calls) == "abcbcacab"
