"""The worker's side of in-memory adapter sync: colora's extension of vLLM's worker, in vLLM's
engine-core process (`worker_extension_cls`, colora/engine/adapters.py's EXTENSION).

It maps a job's shared-memory segment (written by the trainer's side, colora/training/export.py), copies
the version it holds to the engine's device in one copy, checking the version in the segment's header
before and after, builds the adapter with vLLM's `LoRAModel.from_lora_tensors` and adds it through
vLLM's own add path under the name and id the engine's client gives it, pinned in vLLM's CPU cache of
adapters (it has no path to be reloaded from). Every vLLM-internal name this
relies on is listed in colora/engine/adapters.py's docstring.
"""

from __future__ import annotations

import torch

from colora.engine.adapters import HEADER, TESTED_VLLM, _vllm_version, in_memory_path, memory_unsupported


class AdapterSync:
    """The worker extension vLLM mixes into its worker class (`worker_extension_cls`)."""

    def colora_adapter_sync(self) -> str:
        """'' once this worker runs the extension in a vLLM it is written against, else why not."""
        return memory_unsupported()

    def colora_add_loras(self, items: list) -> list[str]:
        """items: [lora_name, lora_int_id, spec, id to remove or -1]; per item '' or why it failed."""
        out = []
        for lora_name, lora_int_id, spec, old in items:
            try:
                if not _add_lora(self, lora_name, lora_int_id, spec):
                    out.append(f"{lora_name}: vLLM's add_adapter refused it")
                    continue
            except Exception as e:  # noqa: BLE001  (one refused version must not hide the others' results)
                out.append(f"{lora_name}: {type(e).__name__}: {e}")
                continue
            if old >= 0:
                self.remove_lora(old)  # the worker's own remove path, as LLMEngine.remove_lora reaches it
            out.append("")
        return out

    def colora_release_segment(self, job: str) -> None:
        self.__dict__.get("_colora_segments", {}).pop(job, None)


def _read(worker, spec: dict, device) -> dict[str, torch.Tensor]:
    """The segment's tensors, copied to `device` in one copy: PEFT name -> tensor."""
    segments = worker.__dict__.setdefault("_colora_segments", {})  # job -> (file, its bytes, mapped)
    size = HEADER + spec["nbytes"]
    seg = segments.get(spec["job"])
    if seg is None or seg[0] != spec["path"] or seg[1].numel() != size:
        seg = segments[spec["job"]] = (spec["path"], torch.from_file(spec["path"], shared=True, size=size,
                                                                     dtype=torch.uint8))
    held = seg[1][:HEADER].view(torch.int64)
    want = spec["version"]
    if int(held[0]) != want:
        raise RuntimeError(f"{spec['job']}: the shared segment holds version {int(held[0])}, not {want}")
    data = seg[1][HEADER:].to(device, copy=True)  # synchronous: the bytes are the worker's once it returns
    if int(held[0]) != want:
        raise RuntimeError(f"{spec['job']}: version {want} was overwritten while the engine read it")
    flat = data.view(getattr(torch, spec["dtype"]))
    sizes = [int(torch.Size(s).numel()) for s in spec["shapes"]]
    if sum(sizes) != flat.numel():
        raise ValueError(f"{spec['job']}: the shapes hold {sum(sizes)} elements, the segment {flat.numel()}")
    return {n: t.view(s) for n, t, s in zip(spec["names"], flat.split(sizes), spec["shapes"], strict=True)}


def _add_lora(worker, lora_name: str, lora_int_id: int, spec: dict) -> bool:
    """Build the adapter from its segment and add it the way vLLM's LRUCacheWorkerLoRAManager adds one
    it loads from disk: its add path runs as ever, with this adapter for what its `_load_adapter`
    reads (the same config checks, eviction and activation)."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.request import LoRARequest

    mapper_method = TESTED_VLLM[_vllm_version()[1]]  # the worker refused other versions at the start
    mgr = worker.model_runner.lora_manager
    manager = mgr._adapter_manager
    if lora_int_id in mgr.list_adapters():
        raise ValueError(f"LoRA id {lora_int_id} is loaded already: every adapter version needs an id of its own")
    # What vLLM's disk loader refuses: a module the model has no LoRA layer for (from tensors vLLM
    # would drop it silently, and serve an adapter other than the trainer's).
    expected = {m for s in manager.supported_lora_modules for m in manager.packed_modules_mapping.get(s, [s])}
    unexpected = sorted(set(spec["config"]["target_modules"]) - expected)
    if unexpected:
        raise ValueError(f"{lora_name}: vLLM has no LoRA layer for {unexpected} (it has {sorted(expected)})")

    def load(_request) -> object:
        peft = PEFTHelper.from_dict({**spec["config"], "vllm_max_position_embeddings": mgr.max_position_embeddings})
        peft.validate_legal(mgr.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        if mapper is not None:
            mapper = getattr(mapper, mapper_method)()
        return mgr._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_int_id, tensors=_read(worker, spec, mgr.device), peft_helper=peft,
            device=str(mgr.device), dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper, skip_prefixes=getattr(model, "lora_skip_prefixes", None))

    mgr._load_adapter = load
    try:
        if not mgr.add_adapter(LoRARequest(lora_name, lora_int_id, in_memory_path(lora_name))):
            return False
    finally:
        del mgr._load_adapter
    # Never evicted from vLLM's CPU cache: it cannot be reloaded from a path, and a step that cannot load
    # a request's adapter kills the engine core. Only the CPU cache: a pin in the GPU slots would hold a
    # slot that other adapters need. Removing the adapter unpins it.
    manager._pin_lora_in_cpu_cache(lora_int_id)
    return True
