"""What one sample request costs on `colora serve`'s HTTP path and in its engine, apart from decoding: the official
SDK's `sample` of one token against the fake backend (the protocol alone) and the co-runner (vLLM), one at a
time, many at once, and as one request of many samples; and the engine's own cost of n one-sample requests
against one request of n (colora/engine/sampling.py).

    python -m colora.bench.serve_requests [--model builtin:tiny] [--requests 64] [--corun] [--out DIR]

Per request: the wall time of a round trip one at a time (median, p90: the SDK's asample POST, the server's
future, the retrieve_future that waits for it, the answer's protobuf); with `--requests` sent at once, the wall
time per request and the CPU seconds per request of the server's process (HTTP, parsing, futures, long polls;
the co-runner's engine runs in processes of its own, counted apart), of its engine's processes, and of the client
(the SDK); the same for one request of `--requests` samples. The engine part starts a vLLM engine in this
process (--corun) and times `submit` and the whole generation of one-token samples, n requests against one of n.
Every sample asks one token: what is left is the requests' cost. Writes DIR/report.json and DIR/report.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from colora.bench.serve import PY, Server, free_port
from colora.record.runlog import write_report
from colora.run.preflight import resolve_model

KEY = "tml-colora-bench-requests"


def _cpu(procs) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def http_costs(url: str, server_pid: int, model: str, n: int) -> dict:
    """The SDK against the server at `url` (module docstring)."""
    import psutil
    import tinker
    from tinker import types

    server = psutil.Process(server_pid)
    engine = server.children(recursive=True)  # the co-runner's engine processes; none for the fake backend
    me = psutil.Process()
    out = {}
    with tinker.ServiceClient(base_url=url, api_key=KEY) as svc:
        s = svc.create_sampling_client(base_model=model).result()
        prompt = types.ModelInput.from_ints([5, 6, 7, 8, 9, 10, 11, 12])

        def params(seed: int):
            return types.SamplingParams(max_tokens=1, seed=seed, stop=[])

        for i in range(8):  # warm: connections, the engine's first steps
            s.sample(prompt, 1, params(i)).result()
        rt = []
        for i in range(n):
            t0 = time.perf_counter()
            s.sample(prompt, 1, params(i)).result()
            rt.append(time.perf_counter() - t0)
        out["one_at_a_time_ms"] = {"median": 1e3 * statistics.median(rt), "p90": 1e3 * sorted(rt)[int(0.9 * len(rt))]}
        for label, send in (("at_once", lambda: [f.result() for f in [s.sample(prompt, 1, params(i))
                                                                      for i in range(n)]]),
                            ("grouped", lambda: s.sample(prompt, n, params(0)).result())):
            c0, e0, m0, t0 = _cpu([server]), _cpu(engine), _cpu([me]), time.perf_counter()
            send()
            wall = time.perf_counter() - t0
            out[label] = {"wall_ms_per_sample": 1e3 * wall / n, "server_cpu_ms_per_sample": 1e3 * (_cpu([server]) - c0) / n,
                          "engine_cpu_ms_per_sample": 1e3 * (_cpu(engine) - e0) / n if engine else None,
                          "client_cpu_ms_per_sample": 1e3 * (_cpu([me]) - m0) / n}
    return out


def engine_costs(model_dir: str, n: int, rounds: int = 5) -> dict:
    """A vLLM engine in this process: `submit` of n one-sample requests against one request of n, and the whole
    one-token generation of each (medians over `rounds`)."""
    from colora.config import EngineConfig
    from colora.engine.rollout import RolloutEngine
    from colora.engine.sampling import GenRequest, samples

    eng = RolloutEngine(model_dir, EngineConfig(gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=True),
                        max_loras=1, max_lora_rank=8, dtype="float32", seed=0, device="cpu")
    out = {}
    try:
        req = GenRequest(None, tuple(range(5, 13)), 1, 1.0, seed=1, ignore_eos=True, tag="p")
        for grouped in (False, True, False, True):  # twice each: the first of each warms
            sub, gen = [], []
            for k in range(rounds):
                reqs = samples(req, n, grouped)
                t0 = time.perf_counter()
                eng.submit(("r", grouped, k), reqs)
                t1 = time.perf_counter()
                while not eng.poll():
                    pass
                gen.append(time.perf_counter() - t0)
                sub.append(t1 - t0)
            out["grouped" if grouped else "one_sample_requests"] = {
                "submit_ms": 1e3 * statistics.median(sub), "generate_ms": 1e3 * statistics.median(gen)}
    finally:
        eng.close()
    return out


def to_markdown(r: dict) -> str:
    n = r["requests"]
    lines = [f"```\n{r['command']}\n```", "", f"{r['device']}; {n} one-token samples; ms per sample.", "",
             "| backend | one at a time (median / p90 round trip) | at once: wall / server CPU / engine CPU / client CPU "
             f"| one request of {n}: wall / server CPU / engine CPU / client CPU |", "|---|---|---|---|"]
    f = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for name, h in r["http"].items():
        a, g = h["at_once"], h["grouped"]
        lines.append(f"| {name} | {f(h['one_at_a_time_ms']['median'])} / {f(h['one_at_a_time_ms']['p90'])} | "
                     f"{f(a['wall_ms_per_sample'])} / {f(a['server_cpu_ms_per_sample'])} / "
                     f"{f(a['engine_cpu_ms_per_sample'])} / {f(a['client_cpu_ms_per_sample'])} | "
                     f"{f(g['wall_ms_per_sample'])} / {f(g['server_cpu_ms_per_sample'])} / "
                     f"{f(g['engine_cpu_ms_per_sample'])} / {f(g['client_cpu_ms_per_sample'])} |")
    if r.get("engine"):
        e = r["engine"]
        lines += ["", "| the engine alone | submit ms | one-token generation ms |", "|---|---|---|",
                  f"| {n} one-sample requests | {f(e['one_sample_requests']['submit_ms'])} | "
                  f"{f(e['one_sample_requests']['generate_ms'])} |",
                  f"| one request of {n} (vLLM's n) | {f(e['grouped']['submit_ms'])} | {f(e['grouped']['generate_ms'])} |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m colora.bench.serve_requests", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:tiny", help="the served model (default builtin:tiny)")
    p.add_argument("--requests", type=int, default=64, help="samples sent at once, and in one request (default 64)")
    p.add_argument("--corun", action="store_true", help="also the co-runner backend (vLLM) and the engine alone")
    p.add_argument("--out", default="runs/bench/serve_requests")
    args = p.parse_args(argv)
    if not 1 <= args.requests <= 128:
        p.error(f"--requests ({args.requests}) must be from 1 to 128 (an asample's most)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(resolve_model(args.model))
    import platform

    r = {"command": "python -m colora.bench.serve_requests " + " ".join(argv), "requests": args.requests,
         "device": platform.processor() or "cpu", "http": {}}
    backends = [("fake", ["--fake"])] + ([("co-runner", ["--device", "cpu", "--engine", "enforce_eager=true",
                                                         "--engine", "max_model_len=512", "--max-lora-rank", "8"])]
                                         if args.corun else [])
    for name, flags in backends:
        port = free_port()
        cmd = [*PY, "-m", "colora.service", "--model", model, "--out", str(out / f"server-{name}"), "--any-key",
               "--port", str(port), *flags]
        server = Server(cmd, out / f"server-{name}.log", f"http://127.0.0.1:{port}", 900)
        try:
            r["http"][name] = http_costs(server.url, server.proc.pid, model, args.requests)
        finally:
            server.stop()
        print(f"{name}: {json.dumps(r['http'][name])}", flush=True)
    if args.corun:
        r["engine"] = engine_costs(model, args.requests)
    md = to_markdown(r)
    write_report(str(out / "report"), r, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
