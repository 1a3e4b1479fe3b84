"""colora's Tinker service: the Tinker API (as the official `tinker` SDK 0.38 speaks it) in front of a
`Backend` that trains every tenant's LoRA adapters in shared cycles and samples from them.

    python -m colora.service --fake --model DIR --any-key --out runs/serve     # the protocol, on a fake model

docs/serving.md describes it. Its modules, from the door inwards:

| module | holds |
| --- | --- |
| cli.py, __main__.py | `colora serve`: options, key file, the backend it builds, uvicorn |
| config.py | `ServeConfig`, per-tenant `Limits`, the API-key file |
| app.py | the HTTP routes of the Tinker API, auth by X-API-Key, body limits, error answers, long polls |
| rest.py | the RestClient's routes the `tinker` CLI calls: runs, checkpoints, sessions, exports' signed URLs |
| metrics.py, status.py, status.html | `GET /metrics` (Prometheus) and the status page, scoped by key |
| schemas.py | the JSON request bodies, and their parsing into a 400 that names the field |
| wire.py, tinker_public_pb2.py | the protobuf messages <-> the backend's dataclasses (the SDK's .proto, vendored) |
| sampling.py | an asample body -> the backend's `SampleCall`, every check of its content |
| service.py | `Service`: sessions, models, training requests, tenancy, health, the reaper, the snapshot |
| checkpoints.py | `Service`'s checkpoint half: saves, exports, TTLs, the RestClient's listings and deletes |
| samplers.py | `Service`'s sampling half: sampling sessions, their release, asample |
| state.py | the records of what the service holds: `Session`, `Model`, `Sampler` |
| store.py | checkpoints and runs on disk per tenant, crash-safe writes, their usage and expiry |
| records.py | stable_reinforce: its loss, the samples recorded for it, the datums' provenance |
| usage.py | per-tenant counters of what each tenant did, for the snapshot |
| errors.py | `ApiError`, the scrubbing of server paths from messages, the operator's journal of errors |
| futures.py | the futures of accepted requests, long-polled |
| scheduler.py | the trainer thread: each model's requests in seq_id order, cycles shared across models |
| backend.py | the `Backend` interface a backend implements |
| fake.py | a small deterministic backend for tests |
| corun.py, engine_loop.py | the co-runner backend: the multi-job trainer beside one vLLM engine, the engine's thread |
| client.py, client_run.py | `colora run --server`: a config's jobs as loops over the official SDK |
"""
