"""Random-weight models of the Qwen3 sizes users train (1.7B, 4B, 8B), written shard by shard.

    experiment.model = "builtin:qwen3-8b-shape"    # built once into colora's model cache by build_random_qwen3

Each has the published model's shape (config.json of Qwen/Qwen3-1.7B, -4B, -8B: widths, layers, heads,
vocabulary 151,936, rope theta 1e6, a 40,960-token context, the LM head tied to the embedding up to 4B
and untied at 8B), random weights and the word-level tokenizer of the 0.6B-shaped model
(colora/models/base.py): for throughput only, its workloads set response lengths themselves.

Building an 8B model must not need its 16 GB of weights (32 GB in fp32) in host memory at once, so the
weights are never a model object: each tensor is drawn straight into bf16 from a generator seeded by the
build's seed and the tensor's name, tensors are gathered into shards of at most `SHARD_BYTES`, and each
shard is written (safetensors) and freed before the next is drawn; an index maps every name to its
shard, as Hugging Face's sharded checkpoints do. The host holds one shard at a time (or one tensor larger
than a shard) and safetensors' serialised copy of it: about twice the largest shard, some 4.3 GB for the 8B
(measured: the 0.6B shape in shards of 256 MiB, its 311 MB embedding a shard alone, grew the process by
0.68 GB, the tokenizer included). The draw is Qwen3's own initialisation (every matrix
N(0, initializer_range = 0.02), every RMSNorm weight 1), not the same numbers transformers' global RNG
would give; tests/test_models.py loads a small build with transformers and checks the names, shapes and
parameter counts against `Qwen3ForCausalLM` on the meta device.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from colora.models.base import QWEN3_06B_SHAPE, build_word_level_tokenizer
from colora.models.shape import ModelShape
from colora.seeding import derive_seed

_COMMON = dict(vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
               rms_norm_eps=1e-6, initializer_range=0.02)
# config.json of Qwen/Qwen3-1.7B, Qwen3-4B and Qwen3-8B (the widths, layers, heads and tying)
QWEN3_SHAPES = {
    "qwen3-1.7b-shape": dict(_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                             num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-4b-shape": dict(_COMMON, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-8b-shape": dict(_COMMON, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                           num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
SHARD_BYTES = 2 << 30  # the most a shard holds; a build holds about twice this (the module's docstring)


def shape_of(config: dict) -> ModelShape:
    """The ModelShape of one of QWEN3_SHAPES (or QWEN3_06B_SHAPE), in bf16."""
    return ModelShape.from_config({**config, "model_type": "qwen3", "dtype": "bfloat16"})


def tensors(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every weight of a Qwen3ForCausalLM of `config` as its checkpoint names it, with its shape, in order."""
    s = shape_of(config)
    out = [("model.embed_tokens.weight", (s.vocab, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        for name, (d_in, d_out) in s.projections().items():
            group = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            out.append((f"{p}{group}.{name}.weight", (d_out, d_in)))
        out += [(f"{p}self_attn.q_norm.weight", (s.head_dim,)), (f"{p}self_attn.k_norm.weight", (s.head_dim,)),
                (f"{p}input_layernorm.weight", (s.hidden,)), (f"{p}post_attention_layernorm.weight", (s.hidden,))]
    out.append(("model.norm.weight", (s.hidden,)))
    if not s.tied:
        out.append(("lm_head.weight", (s.vocab, s.hidden)))
    return out


def shards(config: dict, shard_bytes: int = SHARD_BYTES, dtype_bytes: int = 2) -> list[list[tuple[str, tuple]]]:
    """The tensors in shards of at most `shard_bytes` each (a tensor larger than that is a shard alone),
    in order: what `build_random_qwen3` holds in host memory at once is one of these."""
    out: list[list] = [[]]
    used = 0
    for name, shape in tensors(config):
        size = dtype_bytes * int(torch.Size(shape).numel())
        if out[-1] and used + size > shard_bytes:
            out.append([])
            used = 0
        out[-1].append((name, shape))
        used += size
    return out


def _draw(name: str, shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    if len(shape) == 1:  # an RMSNorm's weight
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(derive_seed(seed, "weights", name))
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0.0, std, generator=g)


def _shard_tensors(shard: list[tuple[str, tuple]], std: float, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for name, shape in shard:
        yield name, _draw(name, shape, std, seed)


def build_random_qwen3(out: str | Path, config: dict, seed: int = 0, shard_bytes: int = SHARD_BYTES) -> Path:
    """A Hugging Face directory of a random-weight Qwen3 of `config` (one of QWEN3_SHAPES, or any Qwen3
    config dict), bf16, written shard by shard (the module's docstring); returns `out`."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, Qwen3Config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_word_level_tokenizer(config["vocab_size"])
    cfg = Qwen3Config(**config, bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.dtype = "bfloat16"
    plan = shards(config, shard_bytes)
    weight_map, total = {}, 0
    for k, shard in enumerate(plan):
        fname = f"model-{k + 1:05d}-of-{len(plan):05d}.safetensors"
        held = dict(_shard_tensors(shard, config.get("initializer_range", 0.02), seed))
        save_file(held, str(out / fname), metadata={"format": "pt"})
        for name, t in held.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        del held
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).save_pretrained(out)
    return out


ALL_SHAPES = {"qwen3-0.6b-shape": QWEN3_06B_SHAPE, **QWEN3_SHAPES}
