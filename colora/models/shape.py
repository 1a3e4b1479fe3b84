"""A decoder's shape, as memory arithmetic reads it from a model directory's config.json.

`ModelShape` holds what sizes a model's memory on the GPU (layers, widths, heads, vocabulary, whether
the LM head is the input embedding, the weights' dtype) and what follows from it: the parameter count,
the weights' bytes, the KV cache's bytes a token, each projection's (d_in, d_out) and a LoRA adapter's
parameters. Nothing here loads weights: the memory planner (colora/run/memory.py) and the trainer's
own micro-batch sizing (colora/training/memory.py) read it, and the tests check it against
transformers' modules built on the meta device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    intermediate: int  # the MLP's gate/up width
    vocab: int
    tied: bool  # the LM head is the input embedding (one matrix)
    dtype_bytes: int = 2  # the weights' dtype as config.json names it
    qk_norm: bool = True  # a per-head RMSNorm on q and k (Qwen3), head_dim weights each
    attention_bias: bool = False

    @classmethod
    def from_config(cls, c: dict) -> ModelShape:
        """From a config.json's dict (transformers' names); a missing key raises KeyError naming it."""
        heads = int(c["num_attention_heads"])
        dtype = str(c.get("dtype") or c.get("torch_dtype") or "bfloat16")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"config.json dtype {dtype!r} is none of {', '.join(DTYPE_BYTES)}")
        return cls(layers=int(c["num_hidden_layers"]), hidden=int(c["hidden_size"]), heads=heads,
                   kv_heads=int(c.get("num_key_value_heads") or heads),
                   head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
                   intermediate=int(c["intermediate_size"]), vocab=int(c["vocab_size"]),
                   tied=bool(c.get("tie_word_embeddings", False)), dtype_bytes=DTYPE_BYTES[dtype],
                   qk_norm=str(c.get("model_type", "")).startswith("qwen3"),
                   attention_bias=bool(c.get("attention_bias", False)))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelShape:
        p = Path(path) / "config.json"
        try:
            return cls.from_config(json.loads(p.read_text()))
        except KeyError as e:
            raise ValueError(f"{p}: no {e.args[0]!r}, which sizing the model's memory needs") from None

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int]]:
        """Each adaptable linear layer of one decoder layer: name -> (d_in, d_out)."""
        h, i = self.hidden, self.intermediate
        return {"q_proj": (h, self.q_dim), "k_proj": (h, self.kv_dim), "v_proj": (h, self.kv_dim),
                "o_proj": (self.q_dim, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def parameters(self) -> int:
        """The model's parameters, each counted once (a tied LM head is the embedding)."""
        per_layer = sum(a * b for a, b in self.projections().values()) + 2 * self.hidden  # the two RMSNorms
        if self.qk_norm:
            per_layer += 2 * self.head_dim
        if self.attention_bias:
            per_layer += self.q_dim + 2 * self.kv_dim + self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + self.hidden  # + the final RMSNorm

    def weight_bytes(self, dtype_bytes: int | None = None) -> int:
        return self.parameters() * (dtype_bytes or self.dtype_bytes)

    def kv_bytes_per_token(self, dtype_bytes: int | None = None) -> int:
        """K and V of every layer for one token (vLLM's cache, in the model's dtype unless given)."""
        return 2 * self.layers * self.kv_dim * (dtype_bytes or self.dtype_bytes)

    def lora_parameters(self, rank: int, modules: tuple[str, ...]) -> int:
        """One adapter of `rank` on `modules` of every layer: A [r, d_in] and B [d_out, r] each."""
        dims = self.projections()
        return self.layers * rank * sum(dims[m][0] + dims[m][1] for m in modules)
