"""Optional packages of the integration tests: skipped on a developer machine without them, a failure
under CI (`CI` set), where the README's test command installs every one of them."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def unavailable(message: str) -> None:
    """Skip the test (locally) or fail it (under CI) with `message`."""
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def need(module: str, install: str) -> ModuleType:
    """`module` imported, or the test skipped (locally) / failed (under CI) with how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        unavailable(f"{module} is not importable ({error}); install it: {install}")
        raise
