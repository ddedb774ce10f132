"""The shape of the package: no import cycle (lazy and TYPE_CHECKING imports counted), few modules
at the top, the import contracts and the lint rules of pyproject.toml, and the names of the public
import paths."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "tokensampler"


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Every elementary cycle's first occurrence found by a depth-first search (empty: acyclic)."""
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(target) == 1:
                cycles.append(stack[stack.index(target):] + [target])
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = 2

    for module in sorted(graph.modules):
        if module not in state:
            visit(module)
    return cycles


def test_no_import_cycle_counting_lazy_and_type_checking_imports():
    graph = grimp.build_graph("tokensampler", include_external_packages=False, exclude_type_checking_imports=False)
    assert len(graph.modules) > 40
    assert import_cycles(graph) == []


def test_the_cycle_finder_sees_a_cycle():
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    assert import_cycles(graph) == []
    graph.add_import(importer="a.z", imported="a.x")
    assert import_cycles(graph) == [["a.x", "a.y", "a.z", "a.x"]]


def test_at_most_ten_modules_directly_under_the_package():
    modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(modules) <= 10, modules


def test_import_contracts_hold():
    lint_imports = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([lint_imports, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "broken" in done.stdout and " 0 broken" in done.stdout


def test_ruff_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    done = subprocess.run([ruff, "check", "src", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]


PUBLIC_PATHS = {
    "tokensampler": ["Sampler", "sample", "SamplingParams", "SamplerOutput", "LogprobsOutput", "InvalidSamplingParams",
                     "InvalidRequest", "GenerationDefaults", "load_generation_defaults", "resolve_request",
                     "SamplingGenerator", "StaleSamplingState", "BatchSamplingParams", "SeedManager",
                     "format_sampling_params", "rank_local_slot_remap", "TokenSamplerError", "SplitMismatch",
                     "CompileFallbackWarning"],
    "tokensampler.engine": ["SamplingGenerator", "BatchSamplingParams", "SeedManager", "format_sampling_params",
                            "rank_local_slot_remap"],
    "tokensampler.engine.generator": ["StaleSamplingState", "TraceMismatch"],
    "tokensampler.serving": ["GenerationDefaults", "load_generation_defaults", "resolve_request"],
    "tokensampler.serving.generation_config": ["InvalidRequest", "InvalidCheckpoint"],
    "tokensampler.parallel": ["Exchange", "TorchExchange", "SamplingDP", "sampling_dp", "as_exchange"],
    "tokensampler.backends.triton": ["KernelConfig", "triton_available", "MAX_KERNEL_LOGPROBS"],
    "tokensampler.backends": ["Backends", "BackendChoice", "Step"],
    "tokensampler.backends.choice": ["BackendChoice", "resolve_names", "BACKEND_ENV", "COMPILE_ENV", "BACKENDS"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC_PATHS))
def test_public_import_paths_hold_their_names(module):
    loaded = importlib.import_module(module)
    missing = [name for name in PUBLIC_PATHS[module] if not hasattr(loaded, name)]
    assert missing == []


def test_every_error_is_a_value_error_naming_field_value_and_range():
    import tokensampler
    from tokensampler.core import errors

    for name in ("InvalidSamplingParams", "InvalidRequest", "InvalidSlotRemap", "StaleSamplingState", "TraceMismatch",
                 "SplitMismatch", "InvalidCheckpoint", "InvalidEnvironment"):
        error = getattr(errors, name)
        assert issubclass(error, tokensampler.TokenSamplerError) and issubclass(error, ValueError), name
    assert not issubclass(errors.InvalidEnvironment, errors.InvalidSamplingParams)
    assert not issubclass(errors.InvalidCheckpoint, errors.InvalidSamplingParams)
    raised = errors.InvalidSamplingParams("top_p", 2.0, "a float in (0, 1]")
    assert (raised.field, raised.value, raised.allowed) == ("top_p", 2.0, "a float in (0, 1]")
    assert str(raised) == "top_p=2.0 is invalid: allowed a float in (0, 1]"
