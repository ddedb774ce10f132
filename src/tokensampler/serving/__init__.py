"""Serving a model: checkpoint sampling defaults and OpenAI request resolution
(`generation_config`), and a Hugging Face decode loop sampled with tokensampler (`generate`)."""
