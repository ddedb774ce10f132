"""Engines that sample with tokensampler through their own extension points (`vllm`: a vLLM plugin)."""
