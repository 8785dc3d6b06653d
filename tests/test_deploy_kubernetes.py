"""deploy/kubernetes: every overlay renders (`kubectl kustomize`), validates against the
Kubernetes API schemas at a pinned version (`kubernetes-validate`, strict: unknown fields
are errors), its custom resources against their CRDs' schemas (LeaderWorkerSet,
ServiceMonitor, PrometheusRule: tests/data/schemas/crds, written by hand from the upstream
APIs; their pod templates are checked as core PodTemplateSpecs), and agrees with jaxserve:
the container args are flags `jaxserve serve` accepts, the probes hit the endpoints that
mean what each probe needs, and the drain fits inside the grace period.
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
import kubernetes_validate
import pytest
import referencing
import yaml

from jaxserve.engine.snapshot import EngineSnapshot
from jaxserve.entrypoints.cli import parse_serve_args
from jaxserve.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
CRD_SCHEMAS = Path(__file__).parent / "data" / "schemas" / "crds"
KUBERNETES_VERSION = "1.31.0"
OVERLAYS = ("cpu", "gpu", "multi-host")
IMAGE = "ghcr.io/jaxserve/jaxserve"
STARTUP_BUDGET_S = 30 * 60          # download is the init container's; load + compile here
# What LWS puts in each container's environment, for a group of `size` pods.
LWS_ENV = {"LWS_LEADER_ADDRESS": "jaxserve-0.jaxserve.default", "LWS_GROUP_SIZE": "2"}


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        hint = "kubectl not found: it renders the kustomizations (apt-get install -y kubectl)"
        if os.environ.get("CI"):
            pytest.fail(hint)
        pytest.skip(hint)
    return path


def render(directory: Path) -> list[dict]:
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(KUBERNETES / "overlays" / overlay) for overlay in OVERLAYS}


def one(docs: list[dict], kind: str, name: str = "jaxserve") -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


# -- schemas ----------------------------------------------------------------------------------------
def _kubernetes_definitions() -> referencing.Registry:
    version_dir = f"v{KUBERNETES_VERSION}-local-strict"
    path = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / version_dir
    definitions = json.loads((path / "_definitions.json").read_text())
    return referencing.Resource.from_contents(definitions) @ referencing.Registry()


def validation_errors(doc: dict) -> list[str]:
    """Why `doc` is not a valid object at KUBERNETES_VERSION ([] when it is)."""
    crd = CRD_SCHEMAS / f"{doc['kind'].lower()}.json"
    name = f"{doc['kind']}/{doc['metadata'].get('name')}"
    if crd.exists():
        schema = json.loads(crd.read_text())
        validator = jsonschema.Draft202012Validator(schema, registry=_kubernetes_definitions())
        return [f"{name}: {'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{name}: {'/'.join(map(str, exc.absolute_path))}: {exc.message}"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders_and_validates_at_the_pinned_kubernetes_version(rendered, overlay):
    docs = rendered[overlay]
    assert {d["kind"] for d in docs} >= {"Service", "PodDisruptionBudget",
                                          "HorizontalPodAutoscaler", "NetworkPolicy",
                                          "ServiceMonitor", "PrometheusRule",
                                          "PersistentVolumeClaim", "ConfigMap"}
    errors = [error for doc in docs for error in validation_errors(doc)]
    assert errors == []


def test_validation_rejects_a_wrong_field_in_core_and_custom_resources(rendered):
    deployment = copy.deepcopy(one(rendered["gpu"], "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"][
        "paht"] = "/readyz"
    assert any("paht" in e for e in validation_errors(deployment))
    lws = copy.deepcopy(one(rendered["multi-host"], "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Default"
    assert any("restartPolicy" in e for e in validation_errors(lws))
    worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
    worker["resources"]["limits"]["nvidia.com/gpu"] = [8]       # inside the pod template
    assert any("nvidia.com/gpu" in e for e in validation_errors(lws))


# -- what the manifests say about jaxserve ----------------------------------------------------------
def pod_templates(docs: list[dict]) -> list[tuple[str, dict]]:
    """(name, pod template) of every workload."""
    out = []
    for doc in docs:
        if doc["kind"] == "Deployment":
            out.append(("deployment", doc["spec"]["template"]))
        elif doc["kind"] == "LeaderWorkerSet":
            template = doc["spec"]["leaderWorkerTemplate"]
            out += [("leader", template["leaderTemplate"]), ("worker", template["workerTemplate"])]
    return out


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion in container args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in args]


def serve_config(container: dict, env: dict[str, str]) -> Any:
    return parse_serve_args(expand(container["args"], {"MODEL": "org/model", **env}))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down_and_share_the_model_cache(rendered, overlay):
    docs = rendered[overlay]
    configmaps = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
    templates = pod_templates(docs)
    assert templates
    for name, template in templates:
        pod = template["spec"]
        security = pod["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] == 1000, name
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, name
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["dshm"]["emptyDir"]["medium"] == "Memory", name
        assert volumes["model-cache"]["persistentVolumeClaim"]["claimName"] in claims, name
        [download] = pod["initContainers"]
        assert download["command"] == ["jaxserve", "download"] and \
            download["args"] == ["$(MODEL)"], name
        for container in pod["initContainers"] + pod["containers"]:
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            assert container["image"].startswith(IMAGE + ":"), name
            mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
            assert mounts["/data"] == "model-cache" and mounts["/tmp"] == "tmp", name
            for source in container["envFrom"]:
                assert source["configMapRef"]["name"] in configmaps, name
        [server] = pod["containers"]
        assert {"/dev/shm": "dshm"}.items() <= \
            {m["mountPath"]: m["name"] for m in server["volumeMounts"]}.items(), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_the_endpoints_each_needs_and_the_drain_fits_the_grace_period(rendered,
                                                                                   overlay):
    serving = [(n, t) for n, t in pod_templates(rendered[overlay]) if n != "worker"]
    assert serving
    for name, template in serving:
        [container] = template["spec"]["containers"]
        config = serve_config(container, {**LWS_ENV, "LWS_WORKER_INDEX": "0"}).server
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == config.port and ports["metrics"] == config.metrics_port, name
        startup, live, ready = (container[p] for p in ("startupProbe", "livenessProbe",
                                                       "readinessProbe"))
        assert (startup["httpGet"]["path"], live["httpGet"]["path"],
                ready["httpGet"]["path"]) == ("/readyz", "/livez", "/readyz"), name
        assert {startup["httpGet"]["port"], live["httpGet"]["port"],
                ready["httpGet"]["port"]} == {"http"}, name
        assert startup["periodSeconds"] * startup["failureThreshold"] >= STARTUP_BUDGET_S
        assert live["failureThreshold"] >= 3        # one slow answer never restarts a pod
        [_sleep, seconds] = container["lifecycle"]["preStop"]["exec"]["command"]
        assert _sleep == "sleep" and int(seconds) >= ready["periodSeconds"], name
        grace = template["spec"]["terminationGracePeriodSeconds"]
        assert grace > int(seconds) + config.shutdown_timeout, name


def test_the_gpu_overlay_asks_for_gpus_and_rolls_out_without_spare_ones(rendered):
    deployment = one(rendered["gpu"], "Deployment")
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["image"] == f"{IMAGE}:0.1.0-cuda"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0,
                                                               "maxUnavailable": 1}
    cpu = one(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in cpu["resources"]["limits"]
    assert cpu["image"] == f"{IMAGE}:0.1.0-cpu"


def test_multi_host_groups_are_one_engine_with_the_leader_as_process_zero(rendered):
    docs = rendered["multi-host"]
    assert not [d for d in docs if d["kind"] == "Deployment"]
    lws = one(docs, "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    size = template["size"]
    env = {**LWS_ENV, "LWS_GROUP_SIZE": str(size)}
    [leader] = template["leaderTemplate"]["spec"]["containers"]
    [worker] = template["workerTemplate"]["spec"]["containers"]
    lead = serve_config(leader, {**env, "LWS_WORKER_INDEX": "0"})
    follow = serve_config(worker, {**env, "LWS_WORKER_INDEX": "1"})
    coordinator_port = {p["name"]: p["containerPort"] for p in leader["ports"]}["coordinator"]
    for config, process_id in ((lead, 0), (follow, 1)):
        parallel = config.engine.parallel_config
        assert parallel.num_processes == size and parallel.process_id == process_id
        assert parallel.coordinator_address == \
            f"{LWS_ENV['LWS_LEADER_ADDRESS']}:{coordinator_port}"
        gpus = leader["resources"]["limits"]["nvidia.com/gpu"] * size
        assert parallel.tensor_parallel_size == gpus      # one engine over every device
    assert "ports" not in worker and "readinessProbe" not in worker   # workers serve no HTTP
    service = one(docs, "Service")
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    assert one(docs, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]["kind"] == \
        "LeaderWorkerSet"
    policy = one(docs, "NetworkPolicy")
    assert {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "jaxserve"}}}]} \
        in policy["spec"]["ingress"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitor_policy_and_autoscaler_name_what_exists(rendered, overlay):
    docs = rendered[overlay]
    service = one(docs, "Service")
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert service_ports == {"http", "metrics"}
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics"}
    policy = one(docs, "NetworkPolicy")
    ports = [{p["port"] for p in rule["ports"]} for rule in policy["spec"]["ingress"]
             if "ports" in rule]
    assert ports == [{"http"}, {"metrics"}]     # the gateway to the API, Prometheus to metrics

    hpa = one(docs, "HorizontalPodAutoscaler")
    [metric] = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((KUBERNETES / "prometheus-adapter" / "values.yaml").read_text())
    [rule] = adapter["rules"]["custom"]
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"]
    series = rule["seriesQuery"].split("{")[0]
    exposed = ServerMetrics("m", EngineSnapshot).render().decode()
    assert f"\n{series}{{" in exposed and re.fullmatch(rule["name"]["matches"], series)


def test_a_users_overlay_can_point_the_image_at_its_own_registry(tmp_path):
    overlay = KUBERNETES / "overlays" / "gpu"
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(overlay, tmp_path)],
        "images": [{"name": IMAGE, "newName": "registry.example.com/me/jaxserve",
                    "newTag": "dev"}]}))
    docs = render(tmp_path)
    images = {c["image"] for _, template in pod_templates(docs)
              for c in template["spec"]["initContainers"] + template["spec"]["containers"]}
    assert images == {"registry.example.com/me/jaxserve:dev"}
