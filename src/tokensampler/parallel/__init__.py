"""torch.distributed plumbing of a vocabulary split: the transport, the group layouts and the one
agreement mechanism every public call goes through. No sampling math here."""

from .agreement import Agreement, call_key
from .groups import SamplingDP, sampling_dp
from .transport import Exchange, ThreadExchange, ThreadHub, TorchExchange, as_exchange

__all__ = ["Agreement", "Exchange", "SamplingDP", "ThreadExchange", "ThreadHub", "TorchExchange", "as_exchange",
           "call_key", "sampling_dp"]
