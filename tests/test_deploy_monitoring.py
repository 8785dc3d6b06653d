"""The dashboard and alert rules in deploy/ checked against the code, not against a memory of it.

- `promtool check rules` and `promtool test rules`: every alert in
  deploy/prometheus/jaxserve-rules.yml fires in a unit case (and a healthy replica beside it
  does not); the PrometheusRule in deploy/kubernetes carries the same groups.
- A real Prometheus (Debian's `prometheus` package), on loopback, scrapes a live
  `jaxserve serve` (tiny random Llama, configs/tiny-test.yaml) on its --metrics-port while a
  little load runs, and every query of deploy/grafana/jaxserve.json returns a number.
  The same server shows it listens while it loads: /readyz says "loading" with a phase first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from jaxserve.engine.engine_io import EngineCoreOutput, SeqDelta
from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.load_progress import PHASES
from jaxserve.metrics import ServerMetrics
from jaxserve.outputs import RequestMetrics
from tests.test_server_fake_engine import free_port

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "jaxserve-rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "jaxserve-rules.test.yml"
PROMETHEUS_RULE = ROOT / "deploy" / "kubernetes" / "base" / "prometheusrule.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "jaxserve.json"
STARTUP_TIMEOUT_S = 300.0
QUERY_DEADLINE_S = 90.0
# Grafana's variables as the test fills them: every model and replica, a rate window that
# holds several 1 s scrapes.
DASHBOARD_VARIABLES = {"$__rate_interval": "15s", "$model_name": ".*", "$instance": ".*"}


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        hint = f"{name} not found: apt-get install -y prometheus (Debian's package ships it)"
        if os.environ.get("CI"):
            pytest.fail(hint)
        pytest.skip(hint)
    return path




def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL with the variables filled) for every target of the dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name, value in DASHBOARD_VARIABLES.items():
                expr = expr.replace(name, value)
            assert "$" not in expr, f"{panel['title']}: an unfilled variable in {expr}"
            out.append((panel["title"], expr))
    return out


# -- rules ------------------------------------------------------------------------------------------
@pytest.mark.fast
def test_alert_rules_pass_promtool_check():
    promtool = need_binary("promtool")
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.fast
def test_every_alert_fires_in_its_promtool_unit_test():
    promtool = need_binary("promtool")
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"]
              for rule in group["rules"] if "alert" in rule}
    cases = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired = {check["alertname"] for case in cases for check in case["alert_rule_test"]
             if check["exp_alerts"]}
    assert alerts == fired, f"alerts without a firing unit case: {sorted(alerts - fired)}"
    done = subprocess.run([promtool, "test", "rules", str(RULES_TEST)], capture_output=True,
                          text=True, timeout=60, cwd=RULES_TEST.parent)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.fast
def test_the_prometheusrule_carries_the_plain_rules():
    custom_resource = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert custom_resource["kind"] == "PrometheusRule"
    assert custom_resource["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


# -- a metric the dashboard needs -------------------------------------------------------------------
@pytest.mark.fast
def test_time_per_output_token_is_first_to_last_token_over_the_tokens_after_the_first():
    metrics = ServerMetrics("m", snapshot=EngineSnapshot)
    timing = RequestMetrics(arrival_time=100.0)
    timing.first_token_time = timing.first_scheduled_time = 101.0
    for step, (token_time, finished) in enumerate([(101.0, False), (101.5, False),
                                                   (103.0, True)]):
        timing.last_token_time = token_time
        if finished:
            timing.finished_time = token_time
        metrics.observe([EngineCoreOutput("r", [SeqDelta(0, [step], None,
                                                         "length" if finished else None)],
                                          finished, 0, timing)], token_time)
    hist = metrics.registry.get_sample_value
    assert hist("jaxserve:request_time_per_output_token_seconds_count",
                {"model_name": "m"}) == 1
    assert hist("jaxserve:request_time_per_output_token_seconds_sum",
                {"model_name": "m"}) == pytest.approx((103.0 - 101.0) / 2)


# -- the dashboard against a live server ------------------------------------------------------------
class Load:
    """Streams of chat and completions (sharing a prompt prefix, so the prefix cache hits)
    from a few threads until stopped."""

    PREFIX = "You are a helpful assistant that answers in one short sentence. " * 3

    def __init__(self, url: str, threads: int = 3) -> None:
        self.url = url
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.done = 0
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                        for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            turn = 0
            while not self.stop.is_set():
                turn += 1
                body = {"prompt": f"{self.PREFIX} Question {index}.{turn}:", "max_tokens": 12,
                        "stream": True, "temperature": 0}
                with client.stream("POST", "/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.errors.append(f"{response.status_code} {response.read()!r}")
                    for _ in response.iter_lines():
                        pass
                self.done += 1

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


def start_server(model_dir: Path, log_path: Path, port: int, metrics_port: int
                 ) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "jaxserve.entrypoints.cli", "serve", str(model_dir),
           "--config", str(ROOT / "configs" / "tiny-test.yaml"), "--port", str(port),
           "--metrics-port", str(metrics_port)]
    log = open(log_path, "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_loading_then_ready(url: str, proc: subprocess.Popen, log_path: Path) -> list[dict]:
    """Poll /readyz from the first moment it answers until 200; every answer's body."""
    answers: list[dict] = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"server exited:\n{log_path.read_text()[-3000:]}"
        try:
            response = httpx.get(url + "/readyz", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        answers.append(response.json())
        if response.status_code == 200:
            return answers
        time.sleep(0.05)
    raise AssertionError(f"not ready after {STARTUP_TIMEOUT_S} s:\n"
                         f"{log_path.read_text()[-3000:]}")


def start_prometheus(tmp_path: Path, target: str, port: int) -> subprocess.Popen:
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "rule_files": [str(RULES)],
              "scrape_configs": [{"job_name": "jaxserve",
                                  "static_configs": [{"targets": [target]}]}]}
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "prometheus.log", "w")  # noqa: SIM115 - the child holds it
    return subprocess.Popen(
        [need_binary("prometheus"), f"--config.file={config_path}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)


class PrometheusStarting(Exception):
    """Prometheus listens but answers 503 'Service Unavailable' until its storage is up."""


def query(prometheus: str, expr: str) -> list[dict]:
    response = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10)
    if response.status_code == 503:
        raise PrometheusStarting(response.text)
    body = response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def has_number(result: list[dict]) -> bool:
    return any(sample["value"][1] not in ("NaN", "+Inf", "-Inf") for sample in result)


def stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def test_every_dashboard_query_returns_data_from_a_real_prometheus(make_tiny_model, tmp_path):
    need_binary("prometheus")
    port, metrics_port, prometheus_port = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    prometheus_url = f"http://127.0.0.1:{prometheus_port}"
    log_path = tmp_path / "server.log"
    server = start_server(make_tiny_model("llama"), log_path, port, metrics_port)
    prometheus = load = None
    try:
        answers = wait_loading_then_ready(url, server, log_path)
        assert answers[0]["status"] == "loading" and answers[0]["phase"] in PHASES, answers[0]
        assert httpx.get(url + "/livez", timeout=5).status_code == 200
        assert b"jaxserve:num_requests_running" in \
            httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).content

        prometheus = start_prometheus(tmp_path, f"127.0.0.1:{metrics_port}", prometheus_port)
        load = Load(url)
        pending = dict.fromkeys(dashboard_queries())
        deadline = time.monotonic() + QUERY_DEADLINE_S
        while pending and time.monotonic() < deadline:
            assert prometheus.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            for title, expr in list(pending):
                try:
                    result = query(prometheus_url, expr)
                except (httpx.TransportError, PrometheusStarting):   # still starting
                    break
                pending[(title, expr)] = result
                if has_number(result):
                    del pending[(title, expr)]
            time.sleep(0.5)
        assert not load.errors, load.errors[:3]
        assert not pending, "dashboard queries without data:\n" + "\n".join(
            f"  {title}: {expr} -> {result}" for (title, expr), result in pending.items())
        rules = httpx.get(prometheus_url + "/api/v1/rules", timeout=10).json()
        assert {r["name"] for g in rules["data"]["groups"] for r in g["rules"]} >= \
            {"JaxserveWaitingButNothingRuns", "JaxserveEngineRestarted"}
    finally:
        if load is not None:
            load.finish()
        if prometheus is not None:
            stop(prometheus)
        assert stop(server) == 0, log_path.read_text()[-3000:]
