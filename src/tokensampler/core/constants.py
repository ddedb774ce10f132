"""Constants shared by every implementation of the definition (docs/semantics.md)."""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
POS_INF = float("inf")

INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1
POSITION_LIMIT = 2**32  # positions and streams are 32-bit words of the noise key
LOGIT_BIAS_LIMIT = 100.0  # bias values are clamped to [-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]

LOGITS_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
