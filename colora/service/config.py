"""The Tinker service's options (`ServeConfig`) and its API-key file.

The key file is TOML, one table mapping each key to its tenant:

    # colora serve --api-keys keys.toml
    [keys]
    "tml-4f1c..." = "alice"
    "tml-9a0e..." = "alice"     # a tenant may have several keys
    "tml-77b2..." = "bob"

A tenant sees and changes only its own sessions, models, samplers and checkpoints. With
`allow_any_key`, a `tml-` key that the file does not list is a tenant of its own (named by a hash of
the key, so keys never reach the disk).
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

_TENANT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ServeConfigError(ValueError):
    """An invalid option or key file; the message names the option, the value and what is accepted."""


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

    def __post_init__(self):
        for name in ("heartbeat_timeout_s", "poll_hold_s", "future_ttl_s"):
            if not getattr(self, name) > 0:
                raise ServeConfigError(f"{name} ({getattr(self, name)}) must be positive")
        for name in ("max_request_bytes", "max_datums", "max_num_samples", "fwdbwd_max_chunk_len"):
            if int(getattr(self, name)) < 1:
                raise ServeConfigError(f"{name} ({getattr(self, name)}) must be at least 1")
        if self.batch_window_s < 0:
            raise ServeConfigError(f"batch_window_s ({self.batch_window_s}) must be 0 or more")
        for key, tenant in self.api_keys.items():
            _check_key(key, "api_keys")
            if not _TENANT.match(tenant):
                raise ServeConfigError(f"api_keys: tenant {tenant!r} of a key must be 1-64 letters, digits, "
                                       "'_', '-' or '.'")
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


def _check_key(key: object, where: str) -> None:
    if not isinstance(key, str) or not key.startswith("tml-") or len(key) < 8:
        raise ServeConfigError(f"{where}: key {str(key)[:8]!r}... must be a string starting with 'tml-' and at "
                               "least 8 characters (the SDK refuses other keys)")


def load_api_keys(path: str | Path) -> dict[str, str]:
    """key -> tenant from a key file (module docstring); errors name the file and the entry."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ServeConfigError(f"--api-keys: {p} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ServeConfigError(f"--api-keys: {p} is not valid TOML ({e})") from None
    unknown = set(data) - {"keys"}
    if unknown:
        raise ServeConfigError(f"{p}: unknown table(s) {sorted(unknown)}; the file has one table, [keys]")
    keys = data.get("keys")
    if not isinstance(keys, dict) or not keys:
        raise ServeConfigError(f"{p}: [keys] must map each key to its tenant, e.g. \"tml-...\" = \"alice\"")
    for key, tenant in keys.items():
        _check_key(key, str(p))
        if not isinstance(tenant, str):
            raise ServeConfigError(f"{p}: the tenant of key {key[:8]!r}... must be a string, not {tenant!r}")
    return dict(keys)
