"""Old import path of the Triton backend, `tokensampler.backends.triton` (re-exported here)."""

from ..backends import triton as _triton
from ..backends.triton import *  # noqa: F401,F403 - the old path re-exports the backend's public names

__all__ = list(_triton.__all__)
