"""`TorchStepConfig`: the tunables of the torch step (routes, block sizes, caps), validated and frozen.

The defaults are what the bench measured fastest on a 2-core AVX2 machine within the memory bound
of one float32 logits buffer (docs/cpu-fast-path.md). Every value changes only speed and memory,
never a token: tests set extreme values to force each route (`Sampler(step_config=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...core.checks import check_bool, check_int
from ...core.errors import InvalidSamplingParams


@dataclass(frozen=True)
class TorchStepConfig:
    """Routes and sizes of the torch step.

    direct_route: float32 batches with nothing to remove or add before temperature (except
      penalties) are read in place from the caller's logits; False sends them to the block route.
    fused_route: such batches with sampled rows (and no full-row stage) run steps 6-11 of each row
      in one C++ pass (`fused`) where the sampler compiles and the pass is loaded; False: the
      torch operations' routes.
    block_elements: logits per row block of the block route (rows per block = this // V, at least 1).
    masked_block_elements: the same for batches with a token bitmask (12 rows at V = 152k, as
      unmasked: the block is the step's held workspace, 0.38 fp32 logits buffers at B = 32; 17-row
      blocks, two at B = 32, measured ~9% faster and held 0.53).
    flat_block_elements: the same for calls the probe found too flat for a candidate list (their
      rows take the dense route, whose p buffer is as large as the block: 7 rows at V = 152k, the
      block and the buffer 0.44 fp32 logits buffers at B = 32; 12-row blocks measured ~15% faster
      and held 0.75).
    single_thread_elements: a call over at most this many logits (B x V) runs on one torch thread,
      where the process lets a library change the count (`core.threads`): one row of a 248k
      vocabulary took the same time on one thread as on two, and beside a busy process 1.0x its
      quiet time against 6-7x on two (threads waiting for a core); 0: never.
    greedy_single_thread_elements: the same for a call whose rows are all greedy (one read of the
      logits: at B = 32, V = 152k 0.85 ms on one thread against 0.51 ms on two, and beside a busy
      process 1.07x its quiet time against 1.8-4.9x on two); 0: never.
    wait_free_rows: the C++ passes (the fused route's rows, the penalties' cells) share a call's rows
      between the calling thread and helper threads of their own that sleep between calls, the caller
      never waiting for a helper that lost its core (it computes that row itself:
      docs/cpu-fast-path.md), where the process lets a library change torch's thread count
      (`core.threads`); else, or False, they run in one torch parallel region (inside vLLM's CPU
      worker, whose threads are bound to cores and spin between its regions).
    candidate_cap: the longest candidate list per row before a row takes the dense route (0: every
      sampled row takes it).
    top_p_head: the sorted prefix of a candidate list searched first for the top-p crossing.
    top_p_head_chunks: for top-p rows with too many winnable ids for a list, the ids at or above the
      n-th largest maximum of 64-id chunks are listed first (the kept set is often small even then).
    column_chunk: elements per column chunk of the eager full-row passes (bounds temporaries).
    histogram_bins: bins of the histogram top-p search.
    dense_block: elements per column block of the dense route's noise pass.
    dense_bracket_cap: most ids per row scanned inside a dense top-p bracket before the histogram.
    dense_sample_stride: one id in this many is read to place the dense route's candidate thresholds.
    dense_threshold_offsets: sample positions around the estimated top-p crossing (dense route).
    dense_proxy_column: the candidate column above which the dense race bound is sought.
    """

    direct_route: bool = True
    fused_route: bool = True
    block_elements: int = 7 << 18  # 12 rows at V = 152k
    masked_block_elements: int = 7 << 18  # 12 rows at V = 152k
    flat_block_elements: int = 17 << 16  # 7 rows at V = 152k
    single_thread_elements: int = 1 << 18  # one row of up to 262,144 ids
    greedy_single_thread_elements: int = 1 << 23  # 32 rows of up to 262,144 ids
    wait_free_rows: bool = True
    candidate_cap: int = 16384
    top_p_head: int = 64
    top_p_head_chunks: int = 256
    column_chunk: int = 1 << 16
    histogram_bins: int = 4096
    dense_block: int = 1 << 18
    dense_bracket_cap: int = 16384
    dense_sample_stride: int = 64
    dense_threshold_offsets: tuple[int, ...] = field(default=(-64, -16, 0, 16, 64))
    dense_proxy_column: int = 1

    def __post_init__(self) -> None:
        check_bool("TorchStepConfig.direct_route", self.direct_route)
        check_bool("TorchStepConfig.fused_route", self.fused_route)
        check_bool("TorchStepConfig.wait_free_rows", self.wait_free_rows)
        for name in ("block_elements", "masked_block_elements", "flat_block_elements", "top_p_head",
                     "top_p_head_chunks", "column_chunk", "histogram_bins", "dense_block", "dense_sample_stride"):
            check_int(f"TorchStepConfig.{name}", getattr(self, name), 1)
        for name in ("candidate_cap", "dense_bracket_cap", "single_thread_elements", "greedy_single_thread_elements"):
            check_int(f"TorchStepConfig.{name}", getattr(self, name), 0)
        offsets = self.dense_threshold_offsets
        if not isinstance(offsets, tuple) or not offsets or any(isinstance(o, bool) or not isinstance(o, int)
                                                                  for o in offsets):
            raise InvalidSamplingParams("TorchStepConfig.dense_threshold_offsets", offsets, "a non-empty tuple of ints")
        check_int("TorchStepConfig.dense_proxy_column", self.dense_proxy_column, 0, self.dense_thresholds - 1)

    @property
    def dense_thresholds(self) -> int:
        """Candidate thresholds per row of the dense route: +inf, the offsets, the threshold so far."""
        return len(self.dense_threshold_offsets) + 2


DEFAULT = TorchStepConfig()
