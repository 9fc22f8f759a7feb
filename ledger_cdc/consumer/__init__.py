"""The consumer: connects, reads the slot, hands each stage its work, flushes, confirms.

``loop`` wires the stages (``stream`` → ``fold`` → ``sink``); what it decides by policy lives in
the stages' own pure objects.
"""

from ledger_cdc.batching import SessionCache
from ledger_cdc.consumer.config import ConsumerConfig
from ledger_cdc.consumer.loop import Consumer
from ledger_cdc.consumer.metrics import Metrics
from ledger_cdc.consumer.resync import count_unfolded
from ledger_cdc.names import HEARTBEAT_PREFIX

__all__ = [
    "HEARTBEAT_PREFIX",
    "Consumer",
    "ConsumerConfig",
    "Metrics",
    "SessionCache",
    "count_unfolded",
]
