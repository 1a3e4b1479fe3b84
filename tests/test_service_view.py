"""The service's view: `GET /metrics` (Prometheus), the status page and its status.json, and the page in
a real headless Chromium (colora/service/metrics.py, colora/service/status.py, colora/service/status.html).

The first tests read a stand-in with the shape of `Service.snapshot`, so every value on the wire can
be checked against the one it came from; the last ones a real server on the fake backend where two
tenants train over HTTP. The browser tests drive Chromium over its DevTools protocol on a pipe
(`--remote-debugging-pipe`: no port, no driver, no Python package) and skip only where no Chromium
binary exists (`apt-get install chromium`).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import select
import shutil
import subprocess
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from colora.service import metrics, status
from colora.service import tinker_public_pb2 as pb
from colora.service.app import ServerThread, create_app
from colora.service.config import ServeConfig
from colora.service.fake import FakeBackend

KEYS = {"tml-alice-0000": "alice", "tml-bob-00000": "bob"}
ADMIN = "tml-admin-000000"
MODEL = "fake/base/model"
A, B, OPS = {"X-API-Key": "tml-alice-0000"}, {"X-API-Key": "tml-bob-00000"}, {"X-API-Key": ADMIN}


def tenant_figures(seed: int) -> dict:
    keys = [k for k, _, _ in metrics.TENANT_COUNTERS + metrics.TENANT_GAUGES]
    return {k: seed * 100 + i for i, k in enumerate(keys)}


class StandIn:
    """What `Service.snapshot` answers, from a dict a test changes; records the scope it was asked for."""

    def __init__(self):
        self.asked: list[str | None] = []
        self.snap = {
            "tenants": {
                "alice": {**tenant_figures(1), "models_detail": [
                    {"model_id": "s1-aa:train:0", "session_id": "s1-aa", "rank": 8, "optim_steps": 3,
                     "recent_losses": [[0, None, 1.0e9], [1, 9.5, 1.0e9], [2, 7.25, 1.0e9 + 1], [3, 6.0, 1.0e9 + 2]]}]},
                "bob": {**tenant_figures(2), "models_detail": [
                    {"model_id": "s2-bb:train:0", "session_id": "s2-bb", "rank": 4, "optim_steps": 1,
                     "recent_losses": [[1, 3.5, 1.0e9]]}]},
            },
            "server": {"uptime_s": 123.5, "cycles": 40, "cycle_seconds_sum": 2.5, "last_cycle_seconds": 0.0625,
                       "cycle_models_sum": 60, "multi_model_cycles": 20, "live_sessions": 2, "live_models": 2,
                       "live_samplers": 1, "futures_pending": 5,
                       "health": {"status": "degraded", "engine_restarts": 2,
                                  "last_engine_error": "EOF from the engine",
                                  "samplers_loaded": 3, "engine_requests_in_flight": 7, "gpu_memory_bytes": 2 << 30},
                       "full_engines": {"s1-aa:train:1": {"model_id": "s1-aa:train:1", "status": "restarting",
                                                          "engine_restarts": 1, "last_engine_error": "core died"}}},
            "errors": [{"time": 1.0e9, "tenant": "alice", "route": "/api/v1/optim_step", "status": 400,
                        "category": "user", "reason": "<b>adam_params</b>: learning_rate must be positive"},
                       {"time": 1.0e9 + 5, "tenant": "bob", "route": "/api/v1/asample", "status": 404,
                        "category": "user", "reason": "sampling session 'x' not found"}],
        }

    def snapshot(self, tenant: str | None) -> dict:
        # answers every tenant whatever the scope: the routes must hold the scope themselves
        self.asked.append(tenant)
        return copy.deepcopy(self.snap)


def view_app(tmp_path, standin: StandIn):
    config = ServeConfig(out=tmp_path, api_keys=KEYS, admin_keys=frozenset({ADMIN}))
    return create_app(config, FakeBackend("fake/base/model", vocab_size=32, eos_token_id=0),
                      extra=[lambda app: metrics.install(app, service=lambda request: standin),
                             lambda app: status.install(app, service=lambda request: standin)])


@pytest.fixture
def view(tmp_path):
    standin = StandIn()
    return TestClient(view_app(tmp_path, standin)), standin


def scrape(client, key) -> dict:
    """{(family, sample name, labels): value} of a /metrics answer, parsed by prometheus_client's parser."""
    r = client.get("/metrics", headers=key)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(fam.name, fam.type, s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_of_the_admin_key_hold_every_tenant_and_the_server(view):
    client, standin = view
    got = scrape(client, OPS)
    assert standin.asked == [None]
    snap = standin.snap
    for key, name, _ in metrics.TENANT_COUNTERS:
        for t in ("alice", "bob"):
            assert got[(name, "counter", name + "_total", (("tenant", t),))] == snap["tenants"][t][key]
    for key, name, _ in metrics.TENANT_GAUGES:
        for t in ("alice", "bob"):
            assert got[(name, "gauge", name, (("tenant", t),))] == snap["tenants"][t][key]
    server, health = snap["server"], snap["server"]["health"]
    for src, specs, kind in ((server, metrics.SERVER_COUNTERS, "counter"), (server, metrics.SERVER_GAUGES, "gauge"),
                             (health, metrics.HEALTH_COUNTERS, "counter"), (health, metrics.HEALTH_GAUGES, "gauge")):
        for key, name, _ in specs:
            sample = name + "_total" if kind == "counter" else name
            assert got[(name, kind, sample, ())] == src[key], name
    states = {k[3][0][1]: v for k, v in got.items() if k[0] == "colora_engine_status"}
    assert states == {"ok": 0.0, "degraded": 1.0, "restarting": 0.0}
    full = {dict(k[3])["status"]: v for k, v in got.items() if k[0] == "colora_full_engine_status"}
    assert full == {"ok": 0.0, "degraded": 0.0, "restarting": 1.0}  # a full-parameter model's own engine
    assert got[("colora_full_engine_restarts", "counter", "colora_full_engine_restarts_total",
                (("model", "s1-aa:train:1"),))] == 1
    assert got[("colora_trainer_cycle_models", "counter", "colora_trainer_cycle_models_total", ())] == 60
    for key in ("recorded_sequences", "recorded_bytes"):  # stable_reinforce's records, bounded per tenant
        name = f"colora_tenant_{key}"
        assert got[(name, "gauge", name, (("tenant", "alice"),))] == snap["tenants"]["alice"][key]


def test_metrics_of_a_tenant_key_hold_only_its_tenant(view):
    client, standin = view
    got = scrape(client, B)
    assert standin.asked == ["bob"]
    tenants = {dict(k[3]).get("tenant") for k in got} - {None}
    assert tenants == {"bob"}
    assert got[("colora_tenant_optim_steps", "counter", "colora_tenant_optim_steps_total", (("tenant", "bob"),))] == \
        standin.snap["tenants"]["bob"]["optim_steps"]
    # of the server: its uptime and the engine's health, not the trainer's or the sessions' sums
    families = {k[0] for k in got}
    assert {"colora_uptime_seconds", "colora_engine_status", "colora_engine_restarts"} <= families
    assert not families & {"colora_trainer_cycles", "colora_live_sessions", "colora_futures_pending",
                           "colora_full_engine_status"}
    assert got[("colora_uptime_seconds", "gauge", "colora_uptime_seconds", ())] == 123.5


def test_the_view_refuses_a_missing_or_unknown_key_with_the_error_body(view):
    client, standin = view
    for path in ("/metrics", status.STATUS_JSON):
        for headers in ({}, {"X-API-Key": "tml-nobody-0000"}):
            r = client.get(path, headers=headers)
            assert r.status_code == 401
            assert r.json()["category"] == "user" and "X-API-Key" in r.json()["error"]
    assert standin.asked == []


def test_status_json_holds_the_scope_of_its_key(view):
    client, _ = view
    whole = client.get(status.STATUS_JSON, headers=OPS).json()
    assert whole["scope"] == "server" and whole["tenant"] is None
    assert sorted(whole["tenants"]) == ["alice", "bob"] and len(whole["errors"]) == 2
    mine = client.get(status.STATUS_JSON, headers=A).json()
    assert mine["scope"] == "tenant" and mine["tenant"] == "alice"
    assert list(mine["tenants"]) == ["alice"]
    assert [e["tenant"] for e in mine["errors"]] == ["alice"]
    assert set(mine["server"]) == {"uptime_s", "health"} and mine["server"]["health"]["status"] == "degraded"


def test_the_page_is_served_without_a_key_and_loads_nothing_from_elsewhere(view):
    client, _ = view
    for path in ("/", "/status"):
        r = client.get(path)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        page = r.text
        assert "api/v1/colora/status.json" in page
        assert "<link" not in page and " src=" not in page and "@import" not in page
        # the one absolute URL is SVG's namespace name, which is never fetched
        assert page.count("http://") + page.count("https://") == page.count("http://www.w3.org/2000/svg")


# -- the page in a real browser --------------------------------------------------------------------

def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Chromium:
    """A headless Chromium driven over the DevTools protocol on a pipe: the browser reads commands on its
    fd 3 and writes answers on its fd 4, each a JSON message ended by a NUL byte."""

    FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--remote-debugging-pipe"]

    def __init__(self, binary: str, profile):
        to_browser, self._w = os.pipe()
        self._r, from_browser = os.pipe()

        def at_3_and_4():  # in the child, before exec: the pipe's ends become fds 3 and 4
            a, b = (fcntl.fcntl(fd, fcntl.F_DUPFD, 10) for fd in (to_browser, from_browser))
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen([binary, *self.FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                     pass_fds=(3, 4), preexec_fn=at_3_and_4, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_browser)
        os.close(from_browser)
        self._buf, self._id, self.session = b"", 0, None

    def call(self, method: str, params: dict | None = None, timeout: float = 60.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not method.startswith(("Target.", "Browser.")):
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        end = time.monotonic() + timeout
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._id:  # events (no id) and other answers are not waited for
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer["result"]
            left = end - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"chromium did not answer {method} in {timeout} s")
            chunk = os.read(self._r, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium exited: {self.proc.stderr.read().decode()[-3000:]}")
            self._buf += chunk

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.navigate", {"url": url})

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        """The expression's value once it is truthy (the page polls every 2 s); fails after timeout."""
        end = time.monotonic() + timeout
        while True:
            value = self.js(expression)
            if value:
                return value
            assert time.monotonic() < end, \
                f"the page never showed {expression}; it shows: {self.js('document.body.innerText')}"
            time.sleep(0.2)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._w)
        os.close(self._r)


@pytest.fixture
def browser(tmp_path):
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium binary (chromium, chromium-browser, google-chrome): `apt-get install chromium` "
                    "runs the status page's browser test")
    b = Chromium(binary, tmp_path / "chromium-profile")
    yield b
    b.close()


TENANT_ROWS = "JSON.stringify([...document.querySelectorAll('#tenants tr[data-tenant]')].map(r => r.dataset.tenant))"


def model_row(model_id: str, what: str) -> str:
    return f"document.querySelector('#models tr[data-model=\"{model_id}\"]')?.dataset.{what}"


def test_the_page_in_chromium_shows_each_tenant_and_follows_new_steps(tmp_path, browser):
    standin = StandIn()
    with ServerThread(view_app(tmp_path / "out", standin)) as server:
        browser.open(f"{server.url}/status#key={ADMIN}")
        assert json.loads(browser.wait_for(f"document.querySelectorAll('#tenants tr[data-tenant]').length == 2 "
                                           f"&& {TENANT_ROWS}")) == ["alice", "bob"]
        assert browser.js("location.hash") == ""  # the key left the address bar
        assert browser.js("document.getElementById('health').textContent") == "engine degraded, 2 restarts"
        alice = "s1-aa:train:0"
        assert browser.js(model_row(alice, "steps")) == "3"  # 4 steps, the first without a loss: 3 points
        assert browser.js(f"document.querySelector('#models tr[data-model=\"{alice}\"] polyline')"
                          ".getAttribute('points').split(' ').length") == 3
        # an error's reason is shown as text, never parsed as HTML
        assert browser.js("document.querySelector('#errors tbody').innerHTML.includes('<b>')") is False
        assert "<b>adam_params</b>" in browser.js("document.querySelector('#errors tbody').textContent")

        t = standin.snap["tenants"]["alice"]  # alice's model takes a step: the page shows it without a reload
        t["optim_steps"] += 1
        t["models_detail"][0]["optim_steps"] = 4
        t["models_detail"][0]["recent_losses"].append([4, 5.5, 1.0e9 + 3])
        polls = browser.js("Number(document.body.dataset.polls)")
        assert browser.wait_for(f"{model_row(alice, 'steps')} == '4' && {model_row(alice, 'points')}") == "4"
        assert browser.js("Number(document.body.dataset.polls)") > polls
        assert browser.js("document.querySelector('#tenants tr[data-tenant=alice] td[data-k=optim_steps]')"
                          ".dataset.v") == str(t["optim_steps"])


def test_the_page_in_chromium_with_a_tenant_key_shows_only_that_tenant(tmp_path, browser):
    with ServerThread(view_app(tmp_path / "out", StandIn())) as server:
        browser.open(f"{server.url}/status#key=tml-bob-00000")
        assert json.loads(browser.wait_for(f"document.querySelectorAll('#tenants tr[data-tenant]').length "
                                           f"&& {TENANT_ROWS}")) == ["bob"]
        assert browser.js("document.getElementById('scope').textContent") == "tenant bob"
        assert browser.js("document.querySelectorAll('#errors tbody tr').length") == 1
# -- the real service: two tenants training on the fake backend ------------------------------------

def fb_body(model_id: str, seq: int, n: int = 6) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.arange(1, n + 1, dtype=np.int32).tobytes()
    for name, a in (("target_tokens", np.arange(2, n + 2, dtype=np.int64)), ("weights", np.ones(n, np.float32))):
        d.loss_fn_inputs[name].dense = a.tobytes()
        d.loss_fn_inputs[name].dtype = pb.DTYPE_INT64 if a.dtype == np.int64 else pb.DTYPE_FLOAT32
        d.loss_fn_inputs[name].shape.append(n)
    return msg.SerializeToString()


class Trainer:
    """A tenant's model on a live server, trained one step at a time over plain HTTP."""

    def __init__(self, client: httpx.Client, key: dict):
        self.c, self.key, self.seq = client, key, 0
        sid = self.post("create_session", {"tags": [], "sdk_version": "test"})["session_id"]
        self.model = self.wait(self.post("create_model", {"session_id": sid, "model_seq_id": 0,
                                                          "base_model": MODEL, "lora_config": {"rank": 4}}))["model_id"]

    def post(self, route: str, body: dict) -> dict:
        r = self.c.post(f"/api/v1/{route}", json=body, headers=self.key)
        assert r.status_code == 200, r.text
        return r.json()

    def wait(self, answer: dict) -> dict:
        r = self.post("retrieve_future", {"request_id": answer["request_id"]})
        assert "error" not in r, r
        return r

    def step(self) -> None:
        self.seq += 1
        r = self.c.post("/api/v1/forward_backward", content=fb_body(self.model, self.seq),
                        headers={**self.key, "Content-Type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        self.seq += 1
        self.wait(self.post("optim_step", {"model_id": self.model, "seq_id": self.seq,
                                           "adam_params": {"learning_rate": 0.01}}))


@pytest.fixture
def live(tmp_path):
    """A server on the fake backend with the view installed, alice's model after 2 steps and bob's after 1:
    yields (url, {tenant: Trainer})."""
    config = ServeConfig(out=tmp_path / "out", api_keys=KEYS, admin_keys=frozenset({ADMIN}), poll_hold_s=5.0)
    backend = FakeBackend(MODEL, vocab_size=32, eos_token_id=0, max_context=64, max_lora_rank=8)
    with ServerThread(create_app(config, backend, extra=[metrics.install, status.install])) as server, \
            httpx.Client(base_url=server.url, timeout=30) as c:
        trainers = {"alice": Trainer(c, A), "bob": Trainer(c, B)}
        for name, steps in (("alice", 2), ("bob", 1)):
            for _ in range(steps):
                trainers[name].step()
        yield server.url, trainers


def test_metrics_of_the_service_count_what_each_tenant_did(live):
    url, trainers = live
    with httpx.Client(base_url=url, timeout=30) as c:
        got = scrape(c, OPS)
        names = {k[0] for k in got}
        every = metrics.TENANT_COUNTERS + metrics.TENANT_GAUGES + metrics.SERVER_COUNTERS + metrics.SERVER_GAUGES
        assert {name for _, name, _ in every + metrics.HEALTH_COUNTERS + metrics.HEALTH_GAUGES} <= names
        for tenant, steps in (("alice", 2), ("bob", 1)):
            label = (("tenant", tenant),)
            assert got[("colora_tenant_optim_steps", "counter", "colora_tenant_optim_steps_total", label)] == steps
            assert got[("colora_tenant_forward_calls", "counter", "colora_tenant_forward_calls_total", label)] == steps
            tokens = ("colora_tenant_trained_tokens", "counter", "colora_tenant_trained_tokens_total", label)
            assert got[tokens] == 6 * steps  # a datum of 6 tokens a step
            assert got[("colora_tenant_models", "gauge", "colora_tenant_models", label)] == 1
            assert got[("colora_tenant_sessions", "gauge", "colora_tenant_sessions", label)] == 1
        assert got[("colora_engine_status", "gauge", "colora_engine_status", (("status", "ok"),))] == 1
        assert got[("colora_live_sessions", "gauge", "colora_live_sessions", ())] == 2
        mine = scrape(c, A)
        assert {dict(k[3]).get("tenant") for k in mine} - {None} == {"alice"}


def test_the_page_in_chromium_follows_two_tenants_training(live, browser):
    url, trainers = live
    alice = trainers["alice"].model
    browser.open(f"{url}/status#key={ADMIN}")
    assert json.loads(browser.wait_for(f"document.querySelectorAll('#tenants tr[data-tenant]').length == 2 "
                                       f"&& {TENANT_ROWS}")) == ["alice", "bob"]
    assert browser.js(model_row(alice, "steps")) == "2" and browser.js(model_row(alice, "points")) == "2"
    assert browser.js(model_row(trainers["bob"].model, "steps")) == "1"
    trainers["alice"].step()  # the page shows alice's third step and its loss without a reload
    assert browser.wait_for(f"{model_row(alice, 'steps')} == '3' && {model_row(alice, 'points')}") == "3"
    assert browser.js("document.querySelector('#tenants tr[data-tenant=alice] td[data-k=optim_steps]')"
                      ".dataset.v") == "3"
