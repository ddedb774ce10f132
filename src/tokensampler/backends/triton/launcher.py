"""`KernelStep`: runs the Triton step of `kernels.py` for a `Sampler`'s state, on buffers it owns.

Scratch and output buffers are made for the largest batch seen (or the sampler's max_slots) and
reused, the slot index is copied to the device only when the slots change, and nothing is read
back: a step is a fixed sequence of launches, so it can be captured in a CUDA graph once the same
slots have been sampled eagerly once. The tensors of the returned `SamplerOutput` are views of
these buffers: the next step overwrites them (copy what you keep, as with a CUDA graph's outputs).
"""

from __future__ import annotations

import torch

from ...core.output import LogprobsOutput, SamplerOutput
from ...core.plan import StepPlan
from ...state import SamplerState
from .config import MAX_KERNEL_LOGPROBS, MAX_SPLITS, KernelConfig
from .kernels import logprobs_kernel, prepare_kernel, select_kernel


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


class KernelStep:
    """The fused Triton step of one `Sampler`'s state: `run(logits, plan, record) -> SamplerOutput`."""

    capturable = True  # a fixed sequence of launches: no host sync, no allocation after the first step

    def __init__(self, state: SamplerState, logprobs_mode: str, config: KernelConfig | None = None) -> None:
        self.state = state
        self.logprobs_mode = logprobs_mode
        self.config = config or KernelConfig()
        self.device = state.device
        self.vocab_size = state.width
        self.capacity = 0
        self._slots: list[int] | None = None
        self._num_logprobs: list[int] | None = None
        self._programs = 1
        if self.device.type == "cuda":
            props = torch.cuda.get_device_properties(self.device)
            self._programs = 4 * props.multi_processor_count

    # ------------------------------------------------------------------ buffers
    def _reserve(self, batch: int) -> None:
        """Make the buffers for `batch` rows (once per new largest batch; never during a step)."""
        if batch <= self.capacity:
            return
        cap = max(batch, self.capacity)
        dev, vocab, cfg = self.device, self.vocab_size, self.config

        def make(shape, dtype, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=dev)

        self.index = make((cap,), torch.int64)
        self.z = make((cap, vocab), torch.float32)
        self.fstat = make((cap * MAX_SPLITS * 2,), torch.float32)
        self.istat = make((cap * MAX_SPLITS * 2,), torch.int64)
        self.tokens = make((cap,), torch.int64)
        self.valid = make((cap,), torch.bool, False)
        self.info_f = make((cap * 4,), torch.float32)
        self.info_i = make((cap * 4,), torch.int64)
        self.window_keys = make((cap * cfg.window_cap,), torch.int64)
        self.window_p = make((cap * cfg.window_cap,), torch.float32)
        self.num_logprobs = make((cap,), torch.int64, -1)
        self.token_logprobs = make((cap,), torch.float32)
        self.token_ranks = make((cap,), torch.int64)
        self.top_ids = make((cap, MAX_KERNEL_LOGPROBS), torch.int64, -1)
        self.top_logprobs = make((cap, MAX_KERNEL_LOGPROBS), torch.float32, float("-inf"))
        self.capacity = cap
        self._slots = None
        self._num_logprobs = None

    def _splits(self, batch: int) -> tuple[int, int]:
        """(programs per row, ids per program) of the prepare kernel."""
        block = self.config.prepare_block
        blocks = -(-self.vocab_size // block)
        splits = self.config.splits or _pow2_floor(max(self._programs // max(batch, 1), 1))
        splits = min(splits, _pow2_floor(blocks), MAX_SPLITS)
        chunk = -(-blocks // splits) * block
        return splits, chunk

    # ------------------------------------------------------------------ the step
    def run(self, logits: torch.Tensor, plan: StepPlan, record: torch.Tensor | None = None,
            token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Steps 1-13 for the rows of `logits` and the slots of `plan` (distinct, occupied, checked
        by the Sampler); rows where the bool [B] `record` is False are sampled but their history is
        left as it was (the kernel adds 0 there: the same launches either way). `token_bitmask`:
        int32 [B, W] (xgrammar's layout), read by the prepare kernel one word per 32 ids."""
        slots = list(plan.slots)
        batch = logits.shape[0]
        self._reserve(max(batch, 1))
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        if self._slots != slots:
            self.index[:batch].copy_(torch.tensor(slots, dtype=torch.int64))
            self._slots = slots
        st = self.state
        cfg = self.config
        launch = {"num_warps": cfg.num_warps, "enable_fp_fusion": False}
        vocab = self.vocab_size
        width = max(plan.logprobs_width, 0)
        out = SamplerOutput(self.tokens[:batch], self.valid[:batch], None)
        if plan.wants_logprobs:
            out.logprobs = LogprobsOutput(self.token_logprobs[:batch], self.token_ranks[:batch],
                                          self.top_ids[:batch, :width], self.top_logprobs[:batch, :width])
        if batch == 0:
            return out
        splits, chunk = self._splits(batch)
        has_stop = plan.min_tokens and st.stop_mask is not None
        dummy = self.z
        if token_bitmask is not None and token_bitmask.stride(1) != 1:
            token_bitmask = token_bitmask.contiguous()
        has_words = bool(plan.bad_words) and st.bad_words is not None
        num_words, word_length = st.bad_words.shape[1:] if st.bad_words is not None else (1, 1)
        recent = st.recent_tokens if st.recent_tokens is not None else self.index
        prepare_kernel[(batch, splits)](
            logits, logits.stride(0), self.index, self.z, self.fstat, self.istat,
            st.prompt_mask, st.output_counts,
            st.logit_bias if plan.logit_bias else dummy, st.allowed_mask if plan.allowed_ids else dummy,
            st.stop_mask if has_stop else dummy, st.output_len, st.min_tokens,
            st.repetition, st.frequency, st.presence,
            token_bitmask if token_bitmask is not None else self.valid,
            token_bitmask.stride(0) if token_bitmask is not None else 0,
            st.bad_words if has_words else self.index, recent, num_words, word_length, vocab, chunk,
            HAS_ALLOWED=plan.allowed_ids, HAS_STOP=bool(has_stop), HAS_BIAS=plan.logit_bias,
            HAS_PENALTIES=plan.penalties, HAS_BITMASK=token_bitmask is not None, HAS_BAD_WORDS=has_words,
            WPAD=max(2, _pow2_ceil(num_words)), LPAD=max(2, _pow2_ceil(word_length)),
            BLOCK=cfg.prepare_block, NSPLIT=splits, **launch)
        select_kernel[(batch,)](
            self.z, self.index, self.fstat, self.istat, st.temperature, st.top_k, st.top_p, st.min_p,
            st.seed, st.position, st.stream, st.output_counts, st.output_len,
            record if record is not None else self.valid, self.tokens, self.valid, self.info_f, self.info_i,
            self.window_keys, self.window_p, recent, st.history_depth, vocab,
            HAS_MIN_P=plan.min_p, HAS_TOP_K=plan.top_k, HAS_TOP_P=plan.top_p, HAS_RECORD=record is not None,
            HAS_RECENT=st.history_depth > 0, DPAD=max(2, _pow2_ceil(st.history_depth)),
            BLOCK=cfg.select_block, NSPLIT=splits, NPIV=cfg.pivots, CAP=cfg.window_cap, LBLOCK=cfg.window_block,
            **launch)
        if plan.wants_logprobs:
            if self._num_logprobs != plan.num_logprobs:
                self.num_logprobs[:batch].copy_(torch.tensor(plan.num_logprobs, dtype=torch.int64))
                self._num_logprobs = list(plan.num_logprobs)
            mode = self.logprobs_mode
            # top-N computed for N rounded up to 1, 2, 4, 8, 16 or 20 (one compiled variant each);
            # each row keeps its own N, the output shows the batch's widest
            computed = min(_pow2_ceil(width), MAX_KERNEL_LOGPROBS) if width else 0
            logprobs_kernel[(batch,)](
                logits, logits.stride(0), self.z, self.tokens, self.num_logprobs, self.info_f, self.info_i,
                self.token_logprobs, self.token_ranks, self.top_ids, self.top_logprobs,
                vocab, MAX_KERNEL_LOGPROBS,
                PROCESSED=mode.startswith("processed"), AS_LOGPROBS=mode.endswith("logprobs"),
                HAS_MIN_P=plan.min_p, WIDTH=computed, WPAD=max(2, _pow2_ceil(computed)), BLOCK=cfg.logprobs_block,
                **launch)
        return out
