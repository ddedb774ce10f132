"""Old import path of the vocabulary split's public names (`tokensampler.parallel`; the split step is
`tokensampler.backends.split`; see docs/distributed.md)."""

from .core.errors import SplitMismatch
from .parallel.agreement import call_key
from .parallel.groups import SamplingDP, sampling_dp
from .parallel.transport import Exchange, TorchExchange, as_exchange

__all__ = ["Exchange", "SamplingDP", "SplitMismatch", "TorchExchange", "as_exchange", "call_key", "sampling_dp"]
