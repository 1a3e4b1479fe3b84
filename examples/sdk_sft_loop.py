"""A training loop of your own against `colora serve`, through the official Tinker SDK: a LoRA learns three
sentences by cross-entropy, then samples from the weights it reached.

    colora serve --model /data/models/tiny --api-keys keys.toml --out runs/serve --port 8000 &
    TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=tml-... MODEL=/data/models/tiny python examples/sdk_sft_loop.py

Needs only `tinker` (0.38) on the client; MODEL is the served model's directory, which must exist on the client
too (the SDK loads the tokenizer by that name). tests/test_service_corun.py runs it against the real backend.
"""

import os

import tinker
from tinker import types

MODEL = os.environ["MODEL"]
TEXTS = ["the cat sat on the mat", "a dog ran in the park", "one two three four five"]


def datum(tokenizer, text: str) -> types.Datum:
    """Position i of the input predicts token i + 1: every token but the first is a target of weight 1."""
    ids = tokenizer.encode(text)
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})


with tinker.ServiceClient() as service:
    trainer = service.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    tokenizer = trainer.get_tokenizer()
    batch = [datum(tokenizer, t) for t in TEXTS]
    for step in range(8):
        # both requests go out at once; the server runs them in order, in cycles shared with other clients
        fb = trainer.forward_backward(batch, "cross_entropy")
        opt = trainer.optim_step(types.AdamParams(learning_rate=2e-2))
        loss = fb.result().metrics["loss:sum"] / sum(len(d.loss_fn_inputs["weights"].data) for d in batch)
        opt.result()
        print(f"step {step}: loss {loss:.3f} per token", flush=True)
    sampler = trainer.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer.encode("the cat"))
    out = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=8, seed=1)).result()
    print("sample:", repr(tokenizer.decode(list(out.sequences[0].tokens))))
