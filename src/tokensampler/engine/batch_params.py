"""`BatchSamplingParams`: the columnar form of `SamplingParams` that engines hand over, and its helpers.

Every field of `SamplingParams` is either one value for every lane (a scalar) or a `list` with one
entry per lane; `None` (alone or in a list) means the field's default. Sequence fields
(`allowed_token_ids`, `stop_token_ids`, `stop`) are per lane when given as a list of sequences (or
Nones), `bad_words_token_ids` and `dry_sequence_breakers` when given as a list whose entries are
sequences of sequences (or Nones), `logit_bias` when given as a list of mappings (or Nones). A list
of strings is one `stop` for every lane. The helpers pad, clamp, broadcast, split,
scatter and slice these columns; `to_requests` turns lanes back into validated `SamplingParams`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Mapping
from typing import Any, Callable, Collection, Sequence

from ..core.checks import as_list, check_int, check_slots
from ..core.errors import InvalidSamplingParams
from ..core.params import SamplingParams

FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
SEQUENCE_FIELDS = ("allowed_token_ids", "stop_token_ids", "stop")
NESTED_FIELDS = ("bad_words_token_ids", "dry_sequence_breakers")  # a sequence of sequences per lane
MAPPING_FIELDS = ("logit_bias",)
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
# The lane that pads a batch: greedy (the cheapest step), every other field at its default.
PADDING_LANE: dict[str, Any] = {**_DEFAULTS, "temperature": 0.0}
# Range clamps applied by `format_sampling_params` (values outside are mapped to the nearest end).
_CLAMPS = {"top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "presence_penalty": (-2.0, 2.0),
           "frequency_penalty": (-2.0, 2.0)}


def _is_per_lane(name: str, value: Any) -> bool:
    if not isinstance(value, list):
        return False
    if name in SEQUENCE_FIELDS:
        return bool(value) and all(v is None or isinstance(v, (list, tuple)) for v in value)
    if name in NESTED_FIELDS:
        return bool(value) and all(v is None or (isinstance(v, (list, tuple))
                                                 and all(isinstance(w, (list, tuple)) for w in v)) for v in value)
    if name in MAPPING_FIELDS:
        return all(v is None or isinstance(v, Mapping) for v in value)
    return True


@dataclasses.dataclass
class BatchSamplingParams:
    """The fields of `SamplingParams`, each a scalar (every lane) or a list (one entry per lane)."""

    temperature: Any = None
    top_k: Any = None
    top_p: Any = None
    min_p: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    seed: Any = None
    logprobs: Any = None
    logit_bias: Any = None
    allowed_token_ids: Any = None
    min_tokens: Any = None
    stop_token_ids: Any = None
    max_tokens: Any = None
    n: Any = None
    bad_words_token_ids: Any = None
    stop: Any = None
    ignore_eos: Any = None
    dynatemp_range: Any = None
    dynatemp_exponent: Any = None
    top_n_sigma: Any = None
    typical_p: Any = None
    epsilon_cutoff: Any = None
    eta_cutoff: Any = None
    xtc_probability: Any = None
    xtc_threshold: Any = None
    dry_multiplier: Any = None
    dry_base: Any = None
    dry_allowed_length: Any = None
    dry_penalty_last_n: Any = None
    dry_sequence_breakers: Any = None
    mirostat_tau: Any = None
    mirostat_eta: Any = None

    @classmethod
    def from_requests(cls, requests: Sequence[SamplingParams]) -> "BatchSamplingParams":
        """One lane per request, every field a list."""
        for request in requests:
            if not isinstance(request, SamplingParams):
                raise InvalidSamplingParams("requests", request, "a sequence of SamplingParams")
        columns = {name: [getattr(r, name) for r in requests] for name in FIELDS}
        columns["logit_bias"] = [None if b is None else dict(b) for b in columns["logit_bias"]]
        return cls(**columns)

    def per_lane_fields(self) -> list[str]:
        """The fields given as one entry per lane."""
        return [name for name in FIELDS if _is_per_lane(name, getattr(self, name))]

    def num_lanes(self) -> int | None:
        """The common length of the per-lane lists; None when every field is a scalar.

        Raises `InvalidSamplingParams` when two lists have different lengths.
        """
        lanes: int | None = None
        for name in self.per_lane_fields():
            length = len(getattr(self, name))
            if lanes is None:
                lanes = length
            elif length != lanes:
                raise InvalidSamplingParams(name, f"{length} lanes", f"{lanes} lanes, like the other lists")
        return lanes

    def lane(self, index: int, per_lane: Collection[str] | None = None) -> dict[str, Any]:
        """The raw field values of lane `index` (scalars replicated; None = the field's default).
        `per_lane`: `per_lane_fields()` when the caller already has it (a loop over the lanes
        computes it once: finding it reads every lane)."""
        per_lane = set(self.per_lane_fields()) if per_lane is None else per_lane
        return {name: (getattr(self, name)[index] if name in per_lane else getattr(self, name)) for name in FIELDS}

    def to_requests(self, num_lanes: int | None = None) -> list[SamplingParams]:
        """Validated `SamplingParams`, one per lane. `num_lanes` is needed when every field is a
        scalar and, when given, must match the lists' length."""
        lanes = self.num_lanes()
        if num_lanes is not None and lanes is not None and num_lanes != lanes:
            raise InvalidSamplingParams("num_lanes", num_lanes, f"{lanes}, the length of the per-lane lists")
        lanes = lanes if lanes is not None else num_lanes
        if lanes is None:
            raise InvalidSamplingParams("num_lanes", None, "an int when every field is a scalar")
        per_lane = set(self.per_lane_fields())
        return [_make_params(self.lane(b, per_lane)) for b in range(lanes)]


def _make_params(values: dict[str, Any]) -> SamplingParams:
    kwargs = {name: value for name, value in values.items() if value is not None}
    for name in SEQUENCE_FIELDS:
        if name in kwargs and isinstance(kwargs[name], list):  # anything else: SamplingParams checks it
            kwargs[name] = tuple(kwargs[name])
    return SamplingParams(**kwargs)


def as_batch_params(params: Any) -> BatchSamplingParams:
    """A `BatchSamplingParams` from itself or from a duck-typed object with the same attributes."""
    if isinstance(params, BatchSamplingParams):
        return params
    if isinstance(params, SamplingParams):
        return BatchSamplingParams(**{name: getattr(params, name) for name in FIELDS})
    if all(hasattr(params, name) for name in ("temperature", "top_k", "top_p")):
        return BatchSamplingParams(**{name: getattr(params, name, None) for name in FIELDS})
    raise InvalidSamplingParams("params", params, "a BatchSamplingParams (or an object with its fields)")


def _replace(params: BatchSamplingParams, **columns: Any) -> BatchSamplingParams:
    return dataclasses.replace(params, **columns)


def _format_value(name: str, value: Any, vocab_size: int | None) -> Any:
    """The neutral encoding of one field value: None -> default, -1 sentinels -> off, clamps."""
    if value is None:
        return _DEFAULTS[name]
    if name == "stop" and isinstance(value, str):
        return (value,)
    if name in SEQUENCE_FIELDS + NESTED_FIELDS and not isinstance(value, (list, tuple)) \
            or name in MAPPING_FIELDS and not isinstance(value, Mapping):
        return value  # not a container of the field's kind: left for SamplingParams to reject, naming the field
    if name in SEQUENCE_FIELDS:
        return tuple(value)
    if name in NESTED_FIELDS:
        return tuple(tuple(word) if isinstance(word, (list, tuple)) else word for word in value)
    if name in MAPPING_FIELDS:
        return dict(value) or None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value  # left for SamplingParams to reject with the field's allowed range
    if isinstance(value, float) and math.isnan(value):
        raise InvalidSamplingParams(name, value, "a number, not NaN")
    if name == "top_k":
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            return 0  # -1 (vLLM's off) and any k >= V keep every id
        return value
    if name == "seed" and value == -1:
        return None
    if name == "top_p" and value <= 0.0:
        raise InvalidSamplingParams("top_p", value, "a float in (0, 1] (values above 1 are clamped to 1)")
    if name in _CLAMPS:
        low, high = _CLAMPS[name]
        return float(min(max(value, low), high))
    if name in ("temperature", "repetition_penalty"):
        return float(value)
    return value


def _format_lane(values: dict[str, Any], vocab_size: int | None) -> dict[str, Any]:
    lane = {name: _format_value(name, values[name], vocab_size) for name in FIELDS}
    if isinstance(lane["temperature"], float) and lane["temperature"] == 0.0:
        # greedy ignores min-p, top-k and top-p: one encoding for every greedy lane
        lane.update(top_k=0, top_p=1.0, min_p=0.0)
    return lane


def format_sampling_params(params: Any, max_batch_size: int, *, vocab_size: int | None = None) -> BatchSamplingParams:
    """Pad to `max_batch_size` lanes, every field a list, in the encoding the sampler uses.

    None -> the field's default; top_k -1 (or >= vocab_size, when given) -> 0 (off); seed -1 -> None;
    top_p and min_p clamped to [0, 1] (top_p 0 is still an error), presence and frequency to [-2, 2];
    greedy lanes (temperature 0) get top_k 0, top_p 1, min_p 0 (they ignore them); padding lanes are
    greedy with every other field at its default. Idempotent. Every lane is validated.
    """
    return _columns(_format_rows(params, max_batch_size, vocab_size)[0])


def format_requests(params: Any, max_batch_size: int, *, vocab_size: int | None = None) -> list[SamplingParams]:
    """`format_sampling_params(params, max_batch_size, vocab_size=...).to_requests()`, the same
    `SamplingParams` and the same errors, with each lane built once (the validation is the build)
    whenever every formatted column reads back as one entry per lane (a scalar container of
    another kind, such as a set of stop ids, reads back as one value for every lane: then the
    columns are read back, as `to_requests` does)."""
    rows, requests = _format_rows(params, max_batch_size, vocab_size)
    if all(_is_per_lane(name, [row[name] for row in rows]) for name in _CONTAINER_FIELDS):
        return requests  # every other field's list is one entry per lane
    return _columns(rows).to_requests()


def _columns(rows: list[dict[str, Any]]) -> BatchSamplingParams:
    return BatchSamplingParams(**{name: [row[name] for row in rows] for name in FIELDS})


# Lanes that differ only in their seed format and validate alike: a burst of admissions (the
# same few parameter sets, a seed each) formats and validates each set once. The key holds every
# value but the seed with its exact type (1, 1.0 and True are three keys), containers as tuples
# of exact ints or strings; a lane the key cannot represent exactly, or whose containers hold more
# than `_KEY_ENTRIES` entries (the cache's memory stays small), is formatted by itself.
_SEED = FIELDS.index("seed")
_CONTAINER_FIELDS = SEQUENCE_FIELDS + NESTED_FIELDS + MAPPING_FIELDS
_CONTAINERS = tuple(FIELDS.index(name) for name in _CONTAINER_FIELDS)
_LANE_CACHE: dict[tuple, tuple[dict[str, Any], SamplingParams]] = {}
_LANE_CACHE_SIZE = 4096
_KEY_ENTRIES = 256  # a container with more entries (a long allowed list) is not kept as a key


def _exact(values: Any, kinds: tuple[type, ...]) -> tuple | None:
    """`values` (a list or tuple of at most `_KEY_ENTRIES`) as a tuple when every entry's type is
    exactly one of `kinds`."""
    if type(values) not in (list, tuple) or len(values) > _KEY_ENTRIES or not all(type(v) in kinds for v in values):
        return None
    return tuple(values)


def _container_key(name: str, value: Any) -> Any:
    """The key of one container field's value; `_NO_KEY` when it has none (an unusual kind)."""
    if value is None or (name == "stop" and type(value) is str):
        return value
    if name in NESTED_FIELDS:
        words = _exact(value, (list, tuple))
        if words is None:
            return _NO_KEY
        exact = tuple(_exact(word, (int,)) for word in words)
        if None in exact or sum(map(len, exact)) > _KEY_ENTRIES:
            return _NO_KEY
        return "nested", exact
    if name in MAPPING_FIELDS:
        if not isinstance(value, Mapping) or len(value) > _KEY_ENTRIES:
            return _NO_KEY
        items = tuple((key, type(bias), bias) for key, bias in value.items())
        exact = all(type(key) is int and type(bias) in (int, float) for key, _, bias in items)
        return ("mapping", items) if exact else _NO_KEY
    exact = _exact(value, (str,) if name == "stop" else (int,))
    return _NO_KEY if exact is None else ("sequence", exact)


_NO_KEY = object()


def _lane_key(raw: tuple, vocab_size: int | None) -> tuple | None:
    """The cache key of a lane's raw values (`FIELDS` order), None when it has none."""
    parts = list(raw)
    parts[_SEED] = None
    for index, name in zip(_CONTAINERS, _CONTAINER_FIELDS):
        value = parts[index]
        if value is None or (type(value) is tuple and not value):
            continue  # the common lane: nothing to represent
        parts[index] = _container_key(name, value)
        if parts[index] is _NO_KEY:
            return None
    return vocab_size, tuple(parts), tuple(map(type, parts))


def _format_and_validate(raw: tuple, vocab_size: int | None) -> tuple[dict[str, Any], SamplingParams]:
    """One lane's formatted row and validated `SamplingParams`, cached by `_lane_key`."""
    key = _lane_key(raw, vocab_size)
    cached = None if key is None else _LANE_CACHE.get(key)
    if cached is None:
        row = _format_lane(dict(zip(FIELDS, raw)), vocab_size)
        request = _make_params(row)  # validate now, naming the field
        if key is not None:
            if len(_LANE_CACHE) >= _LANE_CACHE_SIZE:
                _LANE_CACHE.clear()
            _LANE_CACHE[key] = (row, request)
        return row, request
    row, request = cached
    seed = _format_value("seed", raw[_SEED], vocab_size)
    if seed is not request.seed:
        request = request.with_seed(seed)  # the seed checked alone: the rest is the cached lane's
    row = {**row, "seed": seed}
    if row["logit_bias"] is not None:
        row["logit_bias"] = dict(row["logit_bias"])  # each lane's own (the caller may edit it)
    return row, request


def _format_rows(params: Any, max_batch_size: int, vocab_size: int | None
                 ) -> tuple[list[dict[str, Any]], list[SamplingParams]]:
    """The formatted lanes of `format_sampling_params` and their validated `SamplingParams`: one
    pass over the lanes, each lane read in O(fields) (the per-lane fields are found once)."""
    check_int("max_batch_size", max_batch_size, 1)
    batch = as_batch_params(params)
    lanes = batch.num_lanes()
    lanes = max_batch_size if lanes is None else lanes
    if lanes > max_batch_size:
        raise InvalidSamplingParams("params", f"{lanes} lanes", f"at most max_batch_size={max_batch_size} lanes")
    per_lane = set(batch.per_lane_fields())
    columns = [getattr(batch, name) if name in per_lane else itertools.repeat(getattr(batch, name))
               for name in FIELDS]
    rows, requests = [], []
    for raw in itertools.islice(zip(*columns), lanes):
        row, request = _format_and_validate(raw, vocab_size)
        rows.append(row)
        requests.append(request)
    padding = _padding_params()
    for _ in range(max_batch_size - lanes):
        rows.append(dict(PADDING_LANE))
        requests.append(padding)
    return rows, requests


@functools.cache
def _padding_params() -> SamplingParams:
    return _make_params(PADDING_LANE)


def broadcast_sampling_params(params: Any, idx: int, slot_len: int) -> BatchSamplingParams:
    """Lane `idx` of `params` repeated over `slot_len` lanes (every field a list)."""
    batch = as_batch_params(params)
    lanes = batch.num_lanes()
    check_int("idx", idx, 0, None if lanes is None else lanes - 1, allowed=f"a lane in [0, {lanes})")
    check_int("slot_len", slot_len, 1)
    lane = batch.lane(idx)
    return BatchSamplingParams(**{name: [lane[name]] * slot_len for name in FIELDS})


def chunk_sampling_params(params: Any, sampling_dp: int) -> list[BatchSamplingParams]:
    """Split into `sampling_dp` groups: each list into equal consecutive parts, scalars replicated."""
    batch = as_batch_params(params)
    check_int("sampling_dp", sampling_dp, 1)
    lanes = batch.num_lanes()
    if lanes is None:
        return [_replace(batch) for _ in range(sampling_dp)]
    if lanes % sampling_dp:
        raise InvalidSamplingParams("params", f"{lanes} lanes", f"a multiple of sampling_dp={sampling_dp}")
    size = lanes // sampling_dp
    return [slice_sampling_params(batch, g * size, (g + 1) * size) for g in range(sampling_dp)]


def slice_sampling_params(params: Any, start: int, stop: int) -> BatchSamplingParams:
    """Lanes [start, stop) of every list; scalars kept."""
    batch = as_batch_params(params)
    lanes = batch.num_lanes()
    for name, value in (("start", start), ("stop", stop)):
        check_int(name, value, 0, lanes, allowed=f"an int in [0, {lanes if lanes is not None else 'inf'}]")
    if stop < start:
        raise InvalidSamplingParams("stop", stop, f"an int >= start={start}")
    return _replace(batch, **{name: getattr(batch, name)[start:stop] for name in batch.per_lane_fields()})


def scatter_sampling_params_to_slots(params: Any, empty_slots: Sequence[int], slot_len: int, *,
                                     base: Any = None) -> BatchSamplingParams:
    """Request-ordered lanes placed at their slots: lane i goes to slot `empty_slots[i]`.

    Every other slot takes its lane of `base` (e.g. the cached full-batch parameters, so live
    decodes keep theirs) or, without `base`, the padding lane. Returns `slot_len` lanes.
    """
    batch = as_batch_params(params)
    check_int("slot_len", slot_len, 1)
    slots = check_slots("empty_slots", empty_slots, slot_len)
    lanes = batch.num_lanes()
    if lanes is not None and lanes != len(slots):
        raise InvalidSamplingParams("params", f"{lanes} lanes", f"one lane per empty slot ({len(slots)})")
    if base is not None:
        base_batch = as_batch_params(base)
        if base_batch.num_lanes() not in (None, slot_len):
            raise InvalidSamplingParams("base", f"{base_batch.num_lanes()} lanes", f"{slot_len} lanes")
        base_fields = set(base_batch.per_lane_fields())
        columns = {name: (list(getattr(base_batch, name)) if name in base_fields
                          else [getattr(base_batch, name)] * slot_len) for name in FIELDS}
    else:
        columns = {name: [PADDING_LANE[name]] * slot_len for name in FIELDS}
    per_lane = set(batch.per_lane_fields())
    for i, slot in enumerate(slots):
        for name, value in batch.lane(i, per_lane).items():
            columns[name][slot] = value
    return BatchSamplingParams(**columns)


def lanes_by_slot(chunks: Any, occupied: Sequence[bool], sampling_dp: int, max_batch_size: int,
                  make_requests: Callable[[BatchSamplingParams, int], list[SamplingParams]]
                  ) -> dict[int, SamplingParams]:
    """slot -> parameters for every occupied slot a lane of `chunks` (one `BatchSamplingParams` per
    sampling group; a group's lane b is slot g * max_batch_size + b) covers, validated by
    `make_requests(batch, lanes)`."""
    chunk_list = [chunks] if isinstance(chunks, BatchSamplingParams) else as_list(
        "chunks", chunks, f"a BatchSamplingParams, or a sequence of them with one per sampling group ({sampling_dp})")
    if len(chunk_list) != sampling_dp:
        raise InvalidSamplingParams("chunks", f"{len(chunk_list)} chunks", f"one per sampling group ({sampling_dp})")
    given = {}
    for group, chunk in enumerate(chunk_list):
        batch = as_batch_params(chunk)
        lanes = batch.num_lanes()
        requests = make_requests(batch, max_batch_size)
        for lane in range(max_batch_size if lanes is None else lanes):
            slot = group * max_batch_size + lane
            if occupied[slot]:
                given[slot] = requests[lane]
    return given
