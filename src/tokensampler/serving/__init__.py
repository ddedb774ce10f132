"""Serving a model: checkpoint sampling defaults and OpenAI request resolution
(`generation_config`), a Hugging Face decode loop sampled with tokensampler (`generate`, which
imports transformers only when it runs), and grammar constraints for it (`constrained`, which
imports xgrammar only when it runs)."""

from .generation_config import GenerationDefaults, load_generation_defaults, resolve_request

__all__ = ["GenerationDefaults", "load_generation_defaults", "resolve_request"]
