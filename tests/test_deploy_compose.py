"""deploy/compose.yaml: valid against the Compose specification, and wired to what it runs.

The schema is the Compose specification's JSON schema as the `docker-compose` 1.29.2 wheel
ships it (compose/config/compose_spec.json; tests/data/schemas/README.md). No Docker daemon
runs here, so what `docker compose config` would check is checked in Python: the schema,
then the parts that must agree with jaxserve (its flags, its ports, its probes) and with the
files the services mount.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from jaxserve.entrypoints.cli import parse_serve_args

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
SCHEMA = Path(__file__).parent / "data" / "schemas" / "compose_spec.json"
_VARIABLE = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def interpolate(value: Any) -> Any:
    """Compose's `${VAR:-default}` with an empty environment: every variable its default."""
    if isinstance(value, str):
        return _VARIABLE.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


def schema_errors(document: dict) -> list[str]:
    schema = json.loads(SCHEMA.read_text())
    # The file's $schema names draft 2019-09 by a URI jsonschema does not know: say it here.
    validator = jsonschema.Draft201909Validator(schema)
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
            for e in validator.iter_errors(document)]


def test_compose_file_is_valid_against_the_compose_specification(compose):
    assert schema_errors(compose) == []


def test_the_schema_check_catches_a_wrong_field(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["jaxserve"]["restart_policy"] = "always"       # not a service field
    broken["services"]["jaxserve-cpu"]["shm_size"] = ["2gb"]          # wrong type
    errors = schema_errors(broken)
    assert any("restart_policy" in e for e in errors), errors
    assert any(e.startswith("services/jaxserve-cpu/shm_size") for e in errors), errors


@pytest.mark.parametrize("service", ["jaxserve", "jaxserve-cpu"])
def test_each_jaxserve_service_runs_flags_jaxserve_serve_accepts(compose, service):
    spec = compose["services"][service]
    config = parse_serve_args(spec["command"])
    api_port, metrics_port = config.server.port, config.server.metrics_port
    assert spec["ports"] == [f"{api_port}:{api_port}"]
    assert spec["expose"] == [str(metrics_port)]
    assert f"http://127.0.0.1:{api_port}/readyz" in " ".join(spec["healthcheck"]["test"])
    assert spec["restart"] == "unless-stopped" and spec["read_only"] is True
    assert spec["shm_size"] and "/tmp" in spec["tmpfs"]
    assert "jaxserve-data:/data" in spec["volumes"]
    grace = int(spec["stop_grace_period"].removesuffix("s"))
    assert grace > config.server.shutdown_timeout          # the drain ends before a SIGKILL


def test_the_gpu_profile_reserves_a_gpu_and_the_cpu_profile_none(compose):
    gpu, cpu = compose["services"]["jaxserve"], compose["services"]["jaxserve-cpu"]
    assert gpu["profiles"] == ["gpu"] and cpu["profiles"] == ["cpu"]
    [device] = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]
    assert "deploy" not in cpu
    assert gpu["image"].endswith("-cuda") and cpu["image"].endswith("-cpu")


def test_prometheus_scrapes_the_metrics_ports_and_grafana_gets_the_dashboard(compose):
    mounts = {}
    for name in ("prometheus", "grafana"):
        for volume in compose["services"][name]["volumes"]:
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), f"{name} mounts a missing {source}"
                mounts[target] = DEPLOY / source
    scrape = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    for service in ("jaxserve", "jaxserve-cpu"):
        port = parse_serve_args(compose["services"][service]["command"]).server.metrics_port
        assert f"{service}:{port}" in targets
    assert [Path(f).name for f in scrape["rule_files"]] == ["jaxserve-rules.yml"]
    assert "/etc/prometheus/jaxserve-rules.yml" in mounts

    provisioning = mounts["/etc/grafana/provisioning"]
    [provider] = yaml.safe_load(
        (provisioning / "dashboards" / "jaxserve.yml").read_text())["providers"]
    dashboard_path = Path(provider["options"]["path"]) / "jaxserve.json"
    assert mounts[str(dashboard_path)] == DEPLOY / "grafana" / "jaxserve.json"
    [source] = yaml.safe_load(
        (provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"].endswith(":9090")


def test_promtool_accepts_the_compose_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        hint = "promtool not found: apt-get install -y prometheus"
        if os.environ.get("CI"):
            pytest.fail(hint)
        pytest.skip(hint)
    done = subprocess.run([promtool, "check", "config",
                           str(DEPLOY / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
