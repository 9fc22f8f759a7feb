"""The consumer: connects, reads the slot, hands each stage its work, flushes, confirms.

``compose`` builds the real parts from a config (:func:`build_consumer`); ``loop`` runs them
(``stream`` → ``batching`` → ``sink``, through ``flow``), with ``server`` for the ledger database
beside the stream; what it decides by policy lives in the stages' own pure objects.
"""

from ledger_cdc.batching import SessionCache
from ledger_cdc.consumer.compose import build_consumer
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
    "build_consumer",
    "count_unfolded",
]
