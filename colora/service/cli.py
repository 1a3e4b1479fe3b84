"""`colora serve`: the Tinker API for the official SDK on one base model.

    python -m colora.service --fake --model /data/models/tiny --any-key --out runs/serve --port 8000
    python -m colora.service --model DIR --api-keys keys.toml --out runs/serve

Then, on a client: `TINKER_BASE_URL=http://HOST:PORT TINKER_API_KEY=tml-... python my_loop.py`.
`--fake` serves a small bigram model with the tokenizer of --model (colora/service/fake.py): the whole
protocol, no GPU, for tests and for trying a client. Without it the backend is colora's co-runner,
which is not wired in yet. Checkpoints go to OUT/tenants/<tenant>/, each trainer cycle to OUT/stats.jsonl.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from colora.service.backend import Backend
from colora.service.config import ServeConfig, ServeConfigError, load_api_keys


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="the base model: a Hugging Face directory (clients load its "
                   "tokenizer by this name, so give a path that exists on the clients too)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="the port (default: 8000; 0 takes a free one)")
    p.add_argument("--out", type=Path, required=True, help="checkpoints, stats.jsonl and the server's records")
    p.add_argument("--api-keys", type=Path, help="TOML file mapping each key to its tenant ([keys] \"tml-...\" = \"alice\")")
    p.add_argument("--any-key", action="store_true", help="a `tml-` key not in --api-keys is a tenant of its own")
    p.add_argument("--heartbeat-timeout", type=float, default=300.0, metavar="S",
                   help="end a session (free its models) when its heartbeats lapse this long (default: 300)")
    p.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank create_model accepts (default: 64)")
    p.add_argument("--fake", action="store_true", help="serve a fake bigram model (the protocol only; no GPU)")
    p.add_argument("--verbose", action="store_true", help="log every request")
    return p


def build_backend(args: argparse.Namespace) -> Backend:
    """The backend the flags ask for. NotImplementedError for colora's co-runner until it is wired in."""
    if not args.fake:
        raise NotImplementedError("the co-runner backend is not wired yet; run with --fake to serve the protocol "
                                  "on a fake model")
    from colora.service.fake import fake_from_model_dir

    if not (Path(args.model) / "tokenizer.json").is_file():
        raise ServeConfigError(f"--model {args.model!r} has no tokenizer.json (the fake backend uses the model's "
                               "tokenizer; build a tiny model with `colora model tiny DIR`)")
    return fake_from_model_dir(args.model, max_lora_rank=args.max_lora_rank)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = ServeConfig(out=args.out, api_keys=load_api_keys(args.api_keys) if args.api_keys else {},
                             allow_any_key=args.any_key, heartbeat_timeout_s=args.heartbeat_timeout)
        backend = build_backend(args)
    except (ServeConfigError, NotImplementedError) as e:
        print(f"colora serve: {e}", file=sys.stderr)
        return 2

    import uvicorn

    from colora.service.app import create_app

    kind = "fake backend" if args.fake else "co-runner"
    print(f"colora serve: {args.model} ({kind}) on http://{args.host}:{args.port}, out {args.out}", flush=True)
    uvicorn.run(create_app(config, backend), host=args.host, port=args.port,
                log_level="info" if args.verbose else "warning")
    return 0
