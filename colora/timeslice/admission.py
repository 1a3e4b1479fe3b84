"""Memory admission for the time-slicing arm's policy `memory`: what each tenant takes, and what they share.

Under `timeslice.park = "memory"` the tenants are co-resident on one GPU (clients of one MPS daemon the arm
starts) and the broker admits a tenant while its peak fits beside the resident tenants' peaks
(colora/timeslice/broker.py). This module sizes them before any tenant starts:

- `budget_bytes`: the memory the tenants share, `timeslice.memory_gib` or the GPU's whole memory (read
  through NVML: the arm's process makes no CUDA context);
- `tenant_plan`: a tenant's engine share and its peak. The share is run/memory.py's plan for the tenant's
  own jobs on the card as if it were alone (its engine's weights, LoRA slots, working memory and KV for
  its largest group's sequences); the peak adds its trainer at the config's micro-batch (weights, adapters'
  state, a pass, its CUDA context) and, for a full-parameter tenant, the gradient, AdamW moments and fp32
  masters (colora/training/full.py `state_bytes`). The trainer's micro-batch must be set: planned, a
  tenant would take whatever is free when it starts, which is the other tenants' to take.

Each tenant registers with its planned peak and reports what it measures (colora/timeslice/tenant.py): the
trainer's peak reserved memory after its start and after every training step, plus its engine's share.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from colora.config import Config, ConfigError
from colora.tenancy import is_full

GIB = 1 << 30


@dataclass(frozen=True)
class TenantMemory:
    share: float  # the tenant's engine.gpu_memory_utilization
    peak_bytes: int  # its engine and trainer together while resident


def budget_bytes(cfg: Config, device: str) -> int:
    """The device memory the tenants share under `memory`: timeslice.memory_gib, or the GPU's total."""
    if cfg.timeslice.memory_gib:
        return int(cfg.timeslice.memory_gib * GIB)
    if device != "cuda":
        raise ConfigError("timeslice.memory_gib (0) must be set for timeslice.park = \"memory\" without a GPU "
                          "(0 means the GPU's memory, and there is none to read)")
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
    finally:
        pynvml.nvmlShutdown()


def tenant_plan(tenant: Config, shape, total: int, dtype_bytes: int) -> TenantMemory:
    """The tenant's engine share and peak (the module's docstring). `tenant`: its config (tenant_config's,
    trainer.micro_batch_tokens set); `shape`: the model's ModelShape; `total`: the card's bytes."""
    from colora.run.memory import DeviceMemory, plan
    from colora.training.full import state_bytes

    if not tenant.trainer.micro_batch_tokens:
        raise ConfigError("trainer.micro_batch_tokens (0) must be set for timeslice.park = \"memory\": planned, "
                          "each tenant would take the memory free when it starts, which is the others' to share")
    alone = DeviceMemory("the card, as if the tenant's alone", total, total)
    slots = 1 if tenant.experiment.arm == "dedicated" else tenant.engine.max_loras or len(tenant.jobs)
    p = plan(tenant, shape, alone, slots, dtype_bytes)
    extra = state_bytes(shape.parameters(), dtype_bytes) - shape.weight_bytes(dtype_bytes) if is_full(tenant) else 0
    return TenantMemory(p.gpu_memory_utilization, p.engine + p.trainer + extra)


def plan_tenants(configs: list[Config], model_dir: str | Path, total: int, dtype: str) -> list[TenantMemory]:
    """`tenant_plan` of each tenant config, for the model in `model_dir` in `dtype`."""
    from colora.models.shape import ModelShape

    shape = ModelShape.from_dir(model_dir)
    size = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    return [tenant_plan(c, shape, total, size) for c in configs]


def with_share(tenant: Config, share: float) -> Config:
    """The tenant's config with its engine's planned share."""
    return dataclasses.replace(tenant, engine=dataclasses.replace(tenant.engine, gpu_memory_utilization=share))
