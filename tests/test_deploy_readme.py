"""README's "Deploy" section names only commands the deployment tests run or render.

Each `sh` block line and each inline `helm install` / `jaxserve serve` / `kustomize edit`
command of the section is matched to the test that covers it: the Compose file and its
profiles (test_deploy_compose.py), the rendered overlays (test_deploy_kubernetes.py), the
rule files promtool runs (test_deploy_monitoring.py). A command none covers fails here.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from jaxserve.entrypoints.cli import parse_serve_args

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parent.parent
HEADING = "## Deploy: Compose, Kubernetes, dashboard"
OVERLAYS = {"cpu", "gpu", "multi-host"}
RULE_FILES = {"check": "deploy/prometheus/jaxserve-rules.yml",
              "test": "deploy/prometheus/jaxserve-rules.test.yml"}


def deploy_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(HEADING)
    end = text.find("\n## ", start + len(HEADING))
    return text[start:end if end > 0 else None]


def shell_commands(section: str) -> list[list[str]]:
    """The words of each command in the section's ```sh blocks, leading VAR=value dropped."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", section, re.S):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
                words.pop(0)
            if words:
                commands.append(words)
    return commands


def test_every_shell_command_of_the_deploy_section_is_covered():
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    profiles = {p for service in compose["services"].values()
                for p in service.get("profiles", [])}
    commands = shell_commands(deploy_section())
    seen = set()
    for words in commands:
        match words:
            case ["docker", "compose", "-f", "deploy/compose.yaml", "--profile", profile,
                  "up", "-d"]:
                assert profile in profiles, words
                seen.add("compose")
            case ["kubectl", "apply", "-k", path]:
                overlay = path.removeprefix("deploy/kubernetes/overlays/")
                assert overlay in OVERLAYS and (ROOT / path).is_dir(), words
                seen.add(f"overlay {overlay}")
            case ["promtool", ("check" | "test") as what, "rules", path]:
                assert path == RULE_FILES[what], words
                seen.add(f"promtool {what}")
            case _:
                pytest.fail(f"README's Deploy section runs a command no test covers: {words}")
    assert seen == {"compose", "overlay cpu", "overlay gpu", "overlay multi-host",
                    "promtool check", "promtool test"}


def test_inline_commands_match_the_manifests():
    prose = re.sub(r"```.*?```", "", deploy_section(), flags=re.S)
    section = " ".join(prose.split())                      # inline code may wrap lines
    spans = re.findall(r"`([^`]+)`", section)
    [helm] = [s for s in spans if s.startswith("helm install")]
    values = shlex.split(helm)[shlex.split(helm).index("-f") + 1]
    assert (ROOT / values).is_file()
    [edit] = [s for s in spans if s.startswith("kustomize edit set image")]
    name = edit.split()[-1].split("=")[0]
    for overlay in OVERLAYS:
        kustomization = yaml.safe_load(
            (ROOT / "deploy" / "kubernetes" / "overlays" / overlay /
             "kustomization.yaml").read_text())
        assert [image["name"] for image in kustomization["images"]] == [name]

    [serve] = [s for s in spans if s.startswith("jaxserve serve $(MODEL)")]
    flags = shlex.split(serve)[3:]
    lws = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "overlays" / "multi-host" /
                          "leaderworkerset.yaml").read_text())
    [leader] = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"]
    pairs = dict(zip(leader["args"][1::2], leader["args"][2::2], strict=False))
    assert dict(zip(flags[::2], flags[1::2], strict=True)).items() <= pairs.items()
    parse_serve_args(["org/model"] + [re.sub(r"\$\(\w+\)", "1", f) for f in flags])
