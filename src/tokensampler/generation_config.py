"""Old import path of `tokensampler.serving.generation_config` (re-exported here)."""

from .serving.generation_config import (
                                        ACCEPTED_FIELDS,
                                        FILE_SAMPLING_KEYS,
                                        MODES,
                                        NEUTRAL_DEFAULTS,
                                        GenerationConfigError,
                                        GenerationDefaults,
                                        InvalidRequest,
                                        load_generation_defaults,
                                        resolve_request,
)

__all__ = ["ACCEPTED_FIELDS", "FILE_SAMPLING_KEYS", "MODES", "NEUTRAL_DEFAULTS", "GenerationConfigError",
           "GenerationDefaults", "InvalidRequest", "load_generation_defaults", "resolve_request"]
