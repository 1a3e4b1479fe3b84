"""colora's Tinker service: the Tinker API (as the official `tinker` SDK 0.38 speaks it) in front of a
`Backend` that trains every tenant's LoRA adapters in shared cycles and samples from them.

    python -m colora.service --fake --model DIR --any-key --out runs/serve     # the protocol, on a fake model

`colora/service/app.py` holds the routes, `colora/service/service.py` the sessions, models, samplers and
tenancy, `colora/service/scheduler.py` the trainer thread, `colora/service/backend.py` the interface a
backend implements and `colora/service/fake.py` a small one for tests. docs/serving.md describes it.
"""
