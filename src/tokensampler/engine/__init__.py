"""The decode contract an engine drives: `SamplingGenerator` (slots, remaps, host/device
switches), `SeedManager`, the columnar `BatchSamplingParams` and its helpers, captured steps."""
