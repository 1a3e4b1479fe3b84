"""What a full pass of Python's cyclic collector costs in a trainer process, and with the set-up's
objects frozen (colora/heap.py). Runs on the CPU (the tiny model, two jobs, two steps):

    .venv/bin/python reports/h200/thirteenth/gc_probe_cpu.py > reports/h200/thirteenth/gc_probe_cpu.txt
"""

import gc
import platform
import statistics
import tempfile
import time

import torch

from colora.bench_trainer import _rollouts
from colora.config import JobConfig, TrainerConfig
from colora.heap import frozen_heap
from colora.lora import AdapterBank, inject_lora
from colora.models import build_tiny, load_base_model
from colora.trainer import MultiJobTrainer


def full_pass_ms(n=5):
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


with tempfile.TemporaryDirectory() as d:
    model = load_base_model(build_tiny(f"{d}/tiny", seed=0), torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    jobs = {n: JobConfig(name=n, task="addition", lora_rank=8, lora_alpha=16.0, max_new_tokens=16) for n in ("a", "b")}
    for n, j in jobs.items():
        bank.add_job(n, 8, 16.0, j.target_modules, 0, 1e-4)
    trainer = MultiJobTrainer(model, bank, TrainerConfig(micro_batch_tokens=512), jobs, pad_id=0)
    for step in range(2):
        trainer.step(_rollouts(list(jobs), 4, 8, 16, model.config.vocab_size, step))
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}")
    print(f"objects the collector tracks: {len(gc.get_objects())}")
    print(f"full collection, median of 5: {full_pass_ms():.2f} ms")
    with frozen_heap():
        print(f"frozen: {gc.get_freeze_count()} objects; full collection, median of 5: {full_pass_ms():.3f} ms")
