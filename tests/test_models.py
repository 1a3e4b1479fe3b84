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
