"""The Tinker service's options (`ServeConfig`), its per-tenant limits (`Limits`) and its API-key file.

The key file is TOML. `[keys]` maps each key to its tenant; `[admin]` lists the keys that may read the
whole server's statistics; `[limits]` sets every tenant's limits and `[limits.<tenant>]` one tenant's
(each key optional; what is not set keeps its default, below in `Limits`):

    # colora serve --api-keys keys.toml
    [keys]
    "tml-4f1c..." = "alice"
    "tml-9a0e..." = "alice"     # a tenant may have several keys
    "tml-77b2..." = "bob"

    [admin]
    keys = ["tml-ops-..."]      # an admin key not in [keys] reads statistics only

    [limits]
    models = 4
    disk_bytes = 20_000_000_000

    [limits.bob]
    models = 16

A tenant sees and changes only its own sessions, models, samplers and checkpoints. With
`allow_any_key`, a `tml-` key that the file does not list is a tenant of its own (named by a hash of
the key, so keys never reach the disk), with the `[limits]` of every tenant.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ServeConfigError(ValueError):
    """An invalid option or key file; the message names the option, the value and what is accepted."""


@dataclass(frozen=True)
class Limits:
    """One tenant's limits. A request beyond a quota (what a tenant holds) is refused with 403, one
    beyond a backlog (what waits to run) with 429, which the SDK retries; each refusal names the limit,
    its value and the tenant's count. The defaults suit one GPU shared by a handful of tenants."""

    sessions: int = 16  # live sessions (each SDK ServiceClient is one)
    models: int = 8  # live training models: each an adapter, its gradient and AdamW state on the GPU
    samplers: int = 64  # live sampling sessions (an ephemeral one per save_weights_and_get_sampling_client)
    checkpoints: int = 1000  # checkpoints on disk (weights, sampler_weights and exports, of every model)
    disk_bytes: int = 50 << 30  # bytes of checkpoints on disk
    pending_requests: int = 512  # a model's requests accepted and not yet run
    pending_bytes: int = 1 << 30  # the bodies of all the tenant's requests accepted and not yet run
    pending_samples: int = 2048  # asample requests in flight (the SDK sends up to 2000 at once)
    seq_window: int = 1024  # a model accepts seq_ids up to the one it runs next plus this
    # stable_reinforce's records of sampled sequences (colora/service/records.py): past either bound the
    # least recently used go
    recorded_sequences: int = 1 << 15  # sequences sampled with record_stability_info, held for training
    recorded_bytes: int = 256 << 20  # bytes of those records' tokens and log-probs

    def __post_init__(self):
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ServeConfigError(f"limits.{f.name} ({v!r}) must be a whole number of at least 1")


@dataclass(frozen=True)
class ServeConfig:
    """How `colora serve` runs. Every limit's error names it; the defaults suit one GPU."""

    out: Path  # checkpoints (per tenant), stats.jsonl and the server's records
    api_keys: dict[str, str] = field(default_factory=dict)  # key -> tenant
    allow_any_key: bool = False  # a `tml-` key not in api_keys is a tenant of its own
    heartbeat_timeout_s: float = 300.0  # a session silent this long is ended and its models freed
    poll_hold_s: float = 25.0  # retrieve_future holds a poll this long, then answers 408 (SDK clients wait 45 s)
    max_request_bytes: int = 64 << 20  # a request body's limit, before and after zstd decompression
    max_datums: int = 4096  # datums in one forward_backward request
    max_num_samples: int = 128  # num_samples of one asample
    fwdbwd_max_chunk_len: int = 1024  # the SDK splits a forward_backward into requests of at most this many datums
    batch_window_s: float = 0.005  # the trainer waits this long after new work, so concurrent requests share a cycle
    future_ttl_s: float = 3600.0  # a finished future's result is kept this long for (re)polls
    admin_keys: frozenset[str] = frozenset()  # keys that may read the whole server's statistics
    limits: Limits = Limits()  # every tenant's limits ...
    tenant_limits: Mapping[str, Limits] = field(default_factory=dict)  # ... but these tenants'
    keep_samplers: int = 2  # ephemeral samplers kept per model: older ones are released once idle
    keep_checkpoints: int = 3  # unnamed (automatic) save_weights checkpoints kept per model
    cycle_datums: int = 1024  # a model's forward datums in one trainer cycle (its first request always runs)
    cycle_tokens: int = 131072  # a model's forward tokens in one trainer cycle; the rest wait for the next
    full_models: int = 0  # live full-parameter models (create_model without lora_config); 0: LoRA only

    def __post_init__(self):
        for name in ("heartbeat_timeout_s", "poll_hold_s", "future_ttl_s"):
            if not getattr(self, name) > 0:
                raise ServeConfigError(f"{name} ({getattr(self, name)}) must be positive")
        for name in ("max_request_bytes", "max_datums", "max_num_samples", "fwdbwd_max_chunk_len", "keep_samplers",
                     "keep_checkpoints", "cycle_datums", "cycle_tokens"):
            if int(getattr(self, name)) < 1:
                raise ServeConfigError(f"{name} ({getattr(self, name)}) must be at least 1")
        if isinstance(self.full_models, bool) or not isinstance(self.full_models, int) or self.full_models < 0:
            raise ServeConfigError(f"full_models ({self.full_models!r}) must be a whole number, 0 or more (0: the "
                                   "server trains LoRA adapters only)")
        if self.batch_window_s < 0:
            raise ServeConfigError(f"batch_window_s ({self.batch_window_s}) must be 0 or more")
        for key, tenant in self.api_keys.items():
            _check_key(key, "api_keys")
            if not _TENANT.match(tenant):
                raise ServeConfigError(f"api_keys: tenant {tenant!r} of a key must be 1-64 letters, digits, "
                                       "'_', '-' or '.'")
        for key in self.admin_keys:
            _check_key(key, "admin keys")
        for tenant in self.tenant_limits:
            if not _TENANT.match(tenant):
                raise ServeConfigError(f"limits.{tenant}: {tenant!r} is not a tenant name (1-64 letters, digits, "
                                       "'_', '-' or '.')")
        if not self.api_keys and not self.allow_any_key:
            raise ServeConfigError("no API keys: give a key file (--api-keys FILE) or allow any `tml-` key "
                                   "as its own tenant (--any-key)")

    def tenant_of(self, key: str | None) -> str | None:
        """The key's tenant, or None when the key is not accepted."""
        if not key:
            return None
        if key in self.api_keys:
            return self.api_keys[key]
        if self.allow_any_key and key.startswith("tml-") and len(key) > 4:
            return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        return None

    def is_admin(self, key: str | None) -> bool:
        return bool(key) and key in self.admin_keys

    def limits_of(self, tenant: str) -> Limits:
        return self.tenant_limits.get(tenant, self.limits)


def _check_key(key: object, where: str) -> None:
    if not isinstance(key, str) or not key.startswith("tml-") or len(key) < 8:
        raise ServeConfigError(f"{where}: key {str(key)[:8]!r}... must be a string starting with 'tml-' and at "
                               "least 8 characters (the SDK refuses other keys)")


@dataclass(frozen=True)
class KeyFile:
    """What a key file holds (module docstring)."""

    keys: dict[str, str]  # key -> tenant
    admin_keys: frozenset[str] = frozenset()
    limits: Limits = Limits()
    tenant_limits: dict[str, Limits] = field(default_factory=dict)


def load_key_file(path: str | Path) -> KeyFile:
    """The key file at `path` (module docstring); errors name the file, the entry and what is accepted."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ServeConfigError(f"--api-keys: {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ServeConfigError(f"--api-keys: {p} is not valid TOML ({e})") from None
    unknown = set(data) - {"keys", "admin", "limits"}
    if unknown:
        raise ServeConfigError(f"{p}: unknown table(s) {sorted(unknown)}; the file has [keys], [admin] and [limits]")
    keys = data.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise ServeConfigError(f"{p}: [keys] must map each key to its tenant, e.g. \"tml-...\" = \"alice\"")
    for key, tenant in keys.items():
        _check_key(key, str(p))
        if not isinstance(tenant, str):
            raise ServeConfigError(f"{p}: the tenant of key {key[:8]!r}... must be a string, not {tenant!r}")
    admin = data.get("admin", {})
    if not isinstance(admin, dict) or set(admin) - {"keys"} or not isinstance(admin.get("keys", []), list):
        raise ServeConfigError(f"{p}: [admin] has one entry, keys = [\"tml-...\", ...]")
    for key in admin.get("keys", []):
        _check_key(key, f"{p}: [admin] keys")
    table = data.get("limits", {})
    defaults = _limits({k: v for k, v in table.items() if not isinstance(v, dict)}, Limits(), f"{p}: [limits]")
    tenants = {t: _limits(v, defaults, f"{p}: [limits.{t}]") for t, v in table.items() if isinstance(v, dict)}
    return KeyFile(dict(keys), frozenset(admin.get("keys", [])), defaults, tenants)


def _limits(raw: dict, base: Limits, where: str) -> Limits:
    names = [f.name for f in fields(Limits)]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise ServeConfigError(f"{where}: unknown limit(s) {unknown}; accepted: {', '.join(names)} (or a "
                               "[limits.<tenant>] table)")
    try:
        return replace(base, **raw)
    except ServeConfigError as e:
        raise ServeConfigError(f"{where}: {e}") from None


def load_api_keys(path: str | Path) -> dict[str, str]:
    """key -> tenant from a key file (module docstring); errors name the file and the entry."""
    return load_key_file(path).keys
