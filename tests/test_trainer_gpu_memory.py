"""The GPU memory a trainer arranges and records: its caching allocator's settings (colora/models/base.py) and
its peaks in a run's summary and the arms report (colora/record/summary.py, colora/studies/report_md.py)."""

import pytest
import torch

from colora.models.base import ALLOC_ENV, TRAINER_ALLOCATOR, load_base_model, trainer_allocator


def test_a_gpu_trainer_takes_expandable_segments_unless_the_user_set_the_allocator():
    assert trainer_allocator("cuda", {}) == TRAINER_ALLOCATOR == "expandable_segments:True"
    assert trainer_allocator(torch.device("cuda", 0), {"PYTORCH_CUDA_ALLOC_CONF": ""}) == TRAINER_ALLOCATOR
    assert trainer_allocator("cuda:0", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is None
    assert trainer_allocator("cuda", {"PYTORCH_ALLOC_CONF": "expandable_segments:False"}) is None
    assert trainer_allocator("cpu", {}) is None


def test_a_cpu_trainer_leaves_the_allocator_alone(tiny_model_dir, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    assert calls == [] and not any(p.requires_grad for p in model.parameters())


def test_the_trainers_peaks_are_kept_per_run_merged_over_parts_and_shown():
    from colora.cluster.dedicated import _largest
    from colora.record.summary import trainer_gpu_view
    from colora.studies.report_md import _peak

    assert trainer_gpu_view("cpu") == (None, None)
    parts = [{"allocated": 40.5, "reserved": 52.0}, None, {"allocated": 44.25, "reserved": 47.0}]
    assert _largest(parts) == {"allocated": 44.25, "reserved": 52.0}
    assert _largest([None, None]) is None
    assert _peak(_largest(parts)) == "44.2 / 52.0" and _peak(None) == "-"


@pytest.mark.gpu
def test_a_gpu_trainers_weights_sit_in_expandable_segments(tiny_model_dir, monkeypatch):
    """On a GPU, load_base_model sets the allocator before the weights arrive: every segment that holds
    one of them is an expandable one (the caching allocator's own snapshot says so)."""
    for key in ALLOC_ENV:
        monkeypatch.delenv(key, raising=False)
    model = load_base_model(tiny_model_dir, torch.bfloat16, "cuda")
    segments = torch.cuda.memory_snapshot()

    def segment(ptr: int) -> dict:
        return next(s for s in segments if s["address"] <= ptr < s["address"] + s["total_size"])

    held = [segment(p.data_ptr()) for p in model.parameters()]
    assert held and all(s["is_expandable"] for s in held), [(s["address"], s.get("is_expandable")) for s in held]
