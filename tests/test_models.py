"""The builtin tiny model: random, broad at the start, and able to become certain through its layers;
builtin models are cached under their builder's revision."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from colora.models.base import TINY_SHAPE, load_base_model, load_tokenizer


def test_tiny_model_samples_broadly_but_can_put_almost_all_mass_on_one_token(tiny_model_dir):
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    tok = load_tokenizer(tiny_model_dir)
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 37 mod 2?"}], add_generation_prompt=True,
                                  tokenize=False)
    x = torch.tensor([tok(ids, add_special_tokens=False).input_ids])
    with torch.no_grad():
        logp = model(x).logits[0].log_softmax(-1)  # [positions, vocab]
    entropy = -(logp.exp() * logp).sum(-1)
    assert entropy.min() > 4.0, entropy  # random sampling still reaches most tokens (ln 512 = 6.24)
    # The LoRA layers move the hidden state before the final RMSNorm; whatever they do, what reaches
    # the tied output embedding has norm sqrt(hidden) (times the norm's weight, ones). Aimed at one
    # token's embedding, that must give the token nearly all the mass, or no policy can be learned.
    emb = model.get_output_embeddings().weight  # [vocab, hidden]
    emb = emb[emb.norm(dim=-1) > 0]  # the pad token's row is zeros
    assert torch.equal(model.model.norm.weight, torch.ones(TINY_SHAPE["hidden_size"]))
    h = emb / emb.norm(dim=-1, keepdim=True) * TINY_SHAPE["hidden_size"] ** 0.5  # [vocab, hidden]
    p_self = (h @ emb.T).softmax(-1).diagonal()
    assert p_self.median() > 0.99 and len(p_self) >= 500, (p_self.median(), len(p_self))


def test_builtin_tiny_is_cached_under_its_builders_revision(tmp_path, monkeypatch):
    from colora.run.preflight import BUILTIN_MODELS, resolve_model

    monkeypatch.setenv("COLORA_HOME", str(tmp_path))
    stale = tmp_path / "models" / "tiny"  # a cache an earlier builder made: never served
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    got = resolve_model("builtin:tiny", log=lambda s: None)
    assert got == tmp_path / "models" / BUILTIN_MODELS["tiny"] and got != stale
    assert json.loads((got / "config.json").read_text())["initializer_range"] == TINY_SHAPE["initializer_range"]
    mtime = (got / "config.json").stat().st_mtime_ns
    assert resolve_model("builtin:tiny", log=lambda s: None) == got  # built once
    assert (got / "config.json").stat().st_mtime_ns == mtime


def test_a_builtin_build_that_loses_the_race_serves_the_winners_folder(tmp_path, monkeypatch):
    """Two processes (a timeslice arm's tenants) building one builtin model at once: the one whose
    rename comes second finds the folder the other finished, and serves it."""
    from colora.run import preflight

    monkeypatch.setenv("COLORA_HOME", str(tmp_path))
    out = tmp_path / "models" / preflight.BUILTIN_MODELS["tiny"]
    build = preflight.build_tiny

    def racing(tmp, complete=True):
        build(tmp)
        out.mkdir(parents=True)  # the other process's rename lands first
        (out / ("config.json" if complete else "partial")).write_text("{}")

    monkeypatch.setattr(preflight, "build_tiny", racing)
    assert preflight.resolve_model("builtin:tiny", log=lambda s: None) == out
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # our own build is gone
    shutil.rmtree(out)
    monkeypatch.setattr(preflight, "build_tiny", lambda tmp: racing(tmp, complete=False))
    with pytest.raises(OSError):  # what stands there is no model: the error is not hidden
        preflight.resolve_model("builtin:tiny", log=lambda s: None)
    assert [p.name for p in out.parent.iterdir()] == [out.name]


# The published models' parameter counts (Hugging Face's model pages and checkpoints). Qwen3-1.7B's
# checkpoint holds its tied LM head as a second copy of the embedding, and its published count includes
# it: 2,031,739,904 is its state dict's sum, 1,720,574,976 + 151,936 x 2,048. Qwen3-4B's and Qwen3-8B's
# count each parameter once.
PUBLISHED = {"qwen3-1.7b-shape": ("state_dict", 2_031_739_904), "qwen3-4b-shape": ("parameters", 4_022_468_096),
             "qwen3-8b-shape": ("parameters", 8_190_735_360)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_qwen3_shapes_have_the_published_models_parameters(name):
    """transformers' Qwen3ForCausalLM of each shape, on the meta device (no memory), has the published
    model's count, and ModelShape's arithmetic (the memory planner's) and the streamed writer's tensors
    agree with it, name for name and shape for shape."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from colora.models.qwen3_shapes import QWEN3_SHAPES, shape_of, tensors

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_SHAPES[name]))
    params = sum(p.numel() for p in model.parameters())  # a tied matrix once
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    how, published = PUBLISHED[name]
    assert (params if how == "parameters" else sum(torch.Size(s).numel() for s in state.values())) == published
    assert shape_of(QWEN3_SHAPES[name]).parameters() == params
    written = dict(tensors(QWEN3_SHAPES[name]))
    assert written == {k: s for k, s in state.items() if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert shape_of(QWEN3_SHAPES[name]).weight_bytes() == 2 * sum(torch.Size(s).numel() for s in written.values())


def test_an_8b_build_holds_one_shard_of_at_most_2_gib_at_a_time():
    """The 8B model's 16.4 GB of bf16 weights are drawn and written shard by shard: the largest shard (what
    the build holds in host memory at once, besides one tensor's draw) is under SHARD_BYTES, and the
    shards are every tensor once, in order. Arithmetic only: nothing is allocated."""
    from colora.models.qwen3_shapes import QWEN3_SHAPES, SHARD_BYTES, shards, tensors

    config = QWEN3_SHAPES["qwen3-8b-shape"]
    plan = shards(config)
    sizes = [2 * sum(torch.Size(s).numel() for _, s in shard) for shard in plan]
    assert [t for shard in plan for t in shard] == tensors(config)
    assert max(sizes) <= SHARD_BYTES < 3 << 30 and sum(sizes) == 16_381_470_720 and len(plan) == 8
    assert max(2 * torch.Size(s).numel() for _, s in tensors(config)) == 151936 * 4096 * 2  # the embedding


MINI = dict(vocab_size=512, head_dim=16, max_position_embeddings=256, rope_theta=1e6, rms_norm_eps=1e-6,
            initializer_range=0.02, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_qwen3_written_shard_by_shard_loads_as_transformers_model(tmp_path, tied):
    """A small Qwen3 through the same writer, in shards of 40 kB: transformers loads every weight (none
    missing, none unexpected), in bf16, drawn N(0, 0.02) with RMSNorms at 1; the same seed writes the same
    weights and another seed others."""
    from transformers import AutoModelForCausalLM

    from colora.models.base import load_tokenizer
    from colora.models.qwen3_shapes import build_random_qwen3, shape_of

    config = dict(MINI, tie_word_embeddings=tied)
    out = build_random_qwen3(tmp_path / "a", config, seed=3, shard_bytes=40_000)
    assert len(list(out.glob("model-*.safetensors"))) > 3
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.dtype == torch.bfloat16 and model.config.tie_word_embeddings == tied
    assert sum(p.numel() for p in model.parameters()) == shape_of(config).parameters()
    up = model.model.layers[1].mlp.up_proj.weight.float()
    assert abs(up.std().item() - 0.02) < 0.002 and torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert load_tokenizer(out).eos_token == "<|im_end|>"
    again = AutoModelForCausalLM.from_pretrained(build_random_qwen3(tmp_path / "b", config, seed=3, shard_bytes=40_000))
    other = AutoModelForCausalLM.from_pretrained(build_random_qwen3(tmp_path / "c", config, seed=4))
    assert torch.equal(again.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
    assert not torch.equal(other.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)


def test_model_shape_reads_a_directory_as_the_model_and_its_adapters_are(tiny_model_dir):
    """ModelShape from config.json counts the loaded model's parameters and a LoRA adapter's (the bank's,
    for any rank and modules); Qwen3-0.6B's KV is 112 KiB a token in bf16 (28 layers x 8 KV heads x 128 x 2)."""
    from colora.models.qwen3_shapes import ALL_SHAPES, shape_of
    from colora.models.shape import ModelShape
    from colora.training.lora import AdapterBank, inject_lora

    shape = ModelShape.from_dir(tiny_model_dir)
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    assert shape.parameters() == sum(p.numel() for p in model.parameters()) and shape.dtype_bytes == 4
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    for rank, modules in ((4, ("q_proj", "v_proj", "down_proj")), (16, tuple(shape.projections()))):
        job = bank.add_job(f"r{rank}", rank, 8.0, modules, 0)
        assert shape.lora_parameters(rank, modules) == sum(p.numel() for p in job.parameters())
    assert shape_of(ALL_SHAPES["qwen3-0.6b-shape"]).kv_bytes_per_token() == 112 * 1024


@pytest.mark.parametrize("name", ["qwen3-1.7b-shape", "qwen3-4b-shape", "qwen3-8b-shape"])
def test_the_bigger_qwen3_shapes_are_builtins_built_once_from_their_published_config(tmp_path, monkeypatch, name):
    from colora.models.qwen3_shapes import QWEN3_SHAPES
    from colora.run import preflight

    monkeypatch.setenv("COLORA_HOME", str(tmp_path))
    built = []

    def build(out, config):  # a stand-in: the real build writes 3-16 GB of random weights
        built.append(config)
        (out / "config.json").write_text(json.dumps(config))

    monkeypatch.setattr(preflight, "build_random_qwen3", build)
    got = preflight.resolve_model(f"builtin:{name}", log=lambda s: None)
    assert got == tmp_path / "models" / name and built == [QWEN3_SHAPES[name]]
    assert preflight.resolve_model(f"builtin:{name}", log=lambda s: None) == got and len(built) == 1
