"""Old import path of `tokensampler.engine.batch_params` (re-exported here)."""

from .engine.batch_params import (
                                  FIELDS,
                                  MAPPING_FIELDS,
                                  PADDING_LANE,
                                  SEQUENCE_FIELDS,
                                  BatchSamplingParams,
                                  as_batch_params,
                                  broadcast_sampling_params,
                                  chunk_sampling_params,
                                  format_sampling_params,
                                  scatter_sampling_params_to_slots,
                                  slice_sampling_params,
)

__all__ = ["FIELDS", "MAPPING_FIELDS", "PADDING_LANE", "SEQUENCE_FIELDS", "BatchSamplingParams", "as_batch_params",
           "broadcast_sampling_params", "chunk_sampling_params", "format_sampling_params",
           "scatter_sampling_params_to_slots", "slice_sampling_params"]
