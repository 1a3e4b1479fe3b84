"""The seeds' time-slicing as colora's arm `timeslice`: a broker grants the GPU to one tenant at a time
(or, under policy `memory`, to every tenant whose memory fits), tenants park their state in host memory
between grants.

- broker.py: the broker (FIFO, park-before-grant, policies lazy / eager / never / memory, the record);
- process.py: the broker as a process of its own, `start_broker`, and `broker_status`;
- gate.py: the tenant's side, `GpuGate` (and `NullGate` for every other arm);
- parking.py: what a tenant parks: `TrainerParker`, `EngineParker`, `CudaCheckpointParker` (imports torch);
- record.py: `timeslice.jsonl` and its summary;
- protocol.py: the JSON-lines messages.

This package imports nothing heavy: the broker's process loads neither torch nor vLLM.
"""

from colora.timeslice.broker import Broker
from colora.timeslice.gate import BrokerGone, BrokerRefused, GpuGate, Grant, NullGate, Parker, ParkStats, Yielded
from colora.timeslice.process import BrokerProcess, broker_status, run_broker, start_broker
from colora.timeslice.record import read_log, summarize

__all__ = ["Broker", "BrokerGone", "BrokerProcess", "BrokerRefused", "GpuGate", "Grant", "NullGate", "ParkStats",
           "Parker", "Yielded", "broker_status", "read_log", "run_broker", "start_broker", "summarize"]
