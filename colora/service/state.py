"""What the service holds for its tenants: sessions, training models and samplers (plain records; the
operations on them are colora/service/service.py's, samplers.py's and checkpoints.py's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from colora.service.backend import FullSpec, LoraSpec


@dataclass
class Session:
    id: str
    tenant: str
    last_seen: float
    ended: str | None = None  # "finished" or "expired"
    ended_at: float = 0.0
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)
    user_metadata: dict[str, Any] | None = None  # as create_session was given them
    display_name: str | None = None


@dataclass
class Model:
    id: str
    tenant: str
    session_id: str
    base_model: str
    spec: LoraSpec | FullSpec


@dataclass
class Sampler:
    id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None
    ref: Any
    model_id: str | None = None  # set for an ephemeral sampler: the model it froze
    inflight: int = 0
    closing: str = ""  # why it takes no new samples (it is released once none is in flight)
    released: bool = False
    seen: dict[int, dict] = field(default_factory=dict)  # seq_id -> the first answer, for retried POSTs
