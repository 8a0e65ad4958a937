"""The code location loads, with the assets, partitions, sensors and jobs the UI should show."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from memory_pipelines.definitions import defs
from memory_pipelines.defs.memories.sensors import tenant_partitions_sensor
from memory_pipelines.resources import MemoryStoreResource

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def definitions() -> dg.Definitions:
    return defs()


DERIVED = {"memory_embeddings", "keyword_index", "subject_summaries", "team_summaries", "analytics_memories"}


def test_assets_partitions_and_checks(definitions):
    assert {key.to_user_string() for key in definitions.resolve_all_asset_keys()} == {
        "memories",
        "deletion_canary",
        "memory_deletions",
        "physical_erasure",
        "key_conversion",
        "tenant_backups",
        "memory_eval",
        "memory_drift",
        "deletion_notifications",
    } | DERIVED
    memories = definitions.resolve_assets_def("memories")
    partitions = memories.partitions_def
    assert isinstance(partitions, dg.DynamicPartitionsDefinition) and partitions.name == "tenants"
    spec = next(iter(memories.specs))
    assert spec.group_name == "memory_store"
    assert spec.owners == ["team:memory-platform"]
    assert "postgres" in spec.kinds
    assert spec.description and "source of truth" in spec.description
    assert {key.name for key in memories.check_keys} == {"store_integrity"}


def test_derived_assets_follow_memories_per_tenant_with_checks(definitions):
    graph = definitions.resolve_asset_graph()
    checks_by_asset: dict[str, set[str]] = {}
    for check_key in graph.asset_check_keys:
        checks_by_asset.setdefault(check_key.asset_key.to_user_string(), set()).add(check_key.name)
    for name in DERIVED:
        asset = definitions.resolve_assets_def(name)
        spec = next(iter(asset.specs))
        assert [dep.asset_key.to_user_string() for dep in spec.deps] == ["memories"]
        assert asset.partitions_def.name == "tenants"
        assert spec.group_name == "derived_stores" and spec.owners == ["team:memory-platform"]
        assert spec.automation_condition is not None
        assert spec.description and len(spec.description.splitlines()) == 1
        assert checks_by_asset.get(name), f"{name} has no asset check"
    assert "postgres" not in next(iter(definitions.resolve_assets_def("memory_embeddings").specs)).kinds


def test_sensors_jobs_and_resources(definitions):
    assert {sensor.name for sensor in definitions.sensors} == {
        "tenant_partitions_sensor",
        "derived_stores_automation",
        "forget_requests_sensor",
        "deletions_on_track_sensor",
        "restore_requests_sensor",
        "restored_tenants_backfill_sensor",
        "physical_erasure_sensor",
        "erasures_on_time_sensor",
        "key_conversion_sensor",
        "dead_run_workers_sensor",
        "deletion_notifications_sensor",
    }
    assert {s.name for s in definitions.schedules} == {
        "canary_drill_schedule",
        "nightly_backups",
        "retention_schedule",
        "memory_evaluation_schedule",
    }
    evaluation = definitions.resolve_assets_def("memory_eval")
    assert isinstance(evaluation.partitions_def, dg.MonthlyPartitionsDefinition)
    assert {key.name for key in evaluation.check_keys} == {"precision_target"}
    assert {key.name for key in definitions.resolve_assets_def("memory_drift").check_keys} == {"drift_target"}
    assert all(s.default_status == dg.DefaultScheduleStatus.RUNNING for s in definitions.schedules)
    retention = definitions.resolve_job_def("retention")
    assert retention.partitions_def.name == "tenants" and retention.executor_def.name == "in_process"
    assert definitions.resolve_job_def("restore").executor_def.name == "in_process"
    backups = next(iter(definitions.resolve_assets_def("tenant_backups").specs))
    assert backups.group_name == "backups" and backups.description and "shred" in backups.description
    forget = definitions.resolve_job_def("forget")
    assert forget.partitions_def.name == "tenants"
    assert forget.executor_def.name == "in_process"
    assert definitions.resolve_sensor_def("forget_requests_sensor").default_status == dg.DefaultSensorStatus.RUNNING
    erase = definitions.resolve_job_def("erase")
    assert erase.partitions_def.name == "tenants" and erase.executor_def.name == "in_process"
    conversion = definitions.resolve_job_def("convert_keys")
    assert conversion.partitions_def.name == "tenants" and conversion.executor_def.name == "in_process"
    erasure = definitions.resolve_assets_def("physical_erasure")
    assert {key.name for key in erasure.check_keys} == set()  # its check is standalone, per tenant
    assert "erasures_on_time" in {k.name for k in definitions.resolve_asset_graph().asset_check_keys}
    alerts = definitions.resolve_sensor_def("deletions_on_track_sensor")
    assert alerts.default_status == dg.DefaultSensorStatus.RUNNING and alerts.minimum_interval_seconds == 300
    assert definitions.resolve_sensor_def("derived_stores_automation").default_status == dg.DefaultSensorStatus.RUNNING
    assert definitions.resolve_sensor_def("tenant_partitions_sensor").default_status == dg.DefaultSensorStatus.RUNNING
    assert definitions.resolve_job_def("memories_snapshot").partitions_def.name == "tenants"
    assert isinstance(definitions.resources["memory_store"], MemoryStoreResource)
    assert {"chroma", "summarizer", "analytics", "backups", "judge", "notifier"} <= set(definitions.resources)
    notify = definitions.resolve_sensor_def("deletion_notifications_sensor")
    assert notify.default_status == dg.DefaultSensorStatus.RUNNING and notify.job_name == "notify"
    assert definitions.resolve_job_def("tenant_refresh") is not None


def test_every_job_runs_its_steps_in_its_worker_unless_its_config_asks_for_processes(definitions):
    for job in definitions.get_repository_def().get_all_jobs():
        [(_, chosen)] = dg.validate_run_config(job, {})["execution"].items()
        if job.executor_def.name == "in_process":
            continue
        # The default executor: its step processes each load the code location again, unless asked for.
        assert set(chosen) == {"in_process"}, (job.name, chosen)
        asked = dg.validate_run_config(job, {"execution": {"config": {"multiprocess": {"max_concurrent": 2}}}})
        assert asked["execution"]["multi_or_in_process_executor"]["multiprocess"]["max_concurrent"] == 2, job.name


def test_sensor_adds_tenants_as_partitions_and_reports_counts(store, session_settings, tenant):
    store.write(tenant_id=tenant, user_id="alice", text="sensor sees me")
    resource = MemoryStoreResource(home=str(session_settings.home))
    with dg.instance_for_test() as instance:
        context = dg.build_sensor_context(instance=instance, resources={"memory_store": resource})
        result = tenant_partitions_sensor(context)
        [request] = result.dynamic_partitions_requests
        assert tenant in request.partition_keys
        observed = {event.partition: event for event in result.asset_events}
        assert all(isinstance(event, dg.AssetMaterialization) for event in result.asset_events)
        assert observed[tenant].metadata["memories"].value == 1
        assert "sensor sees me" not in json.dumps({k: str(v) for k, v in observed[tenant].metadata.items()})

        # Unchanged tenants are not observed again on the next tick.
        instance.add_dynamic_partitions("tenants", list(request.partition_keys))
        again = tenant_partitions_sensor(
            dg.build_sensor_context(instance=instance, cursor=result.cursor, resources={"memory_store": resource})
        )
        assert tenant not in {event.partition for event in again.asset_events}
        assert not again.dynamic_partitions_requests


def test_memories_materializes_counts_into_a_postgres_instance(store, session_settings, tenant, definitions):
    store.write(tenant_id=tenant, user_id="alice", text="one")
    store.write(tenant_id=tenant, user_id="bob", text="two", do_not_sell=True)
    instance = dg.DagsterInstance.from_config(str(session_settings.dagster_home))
    assert "Postgres" in type(instance.run_storage).__name__
    instance.add_dynamic_partitions("tenants", [tenant])
    job = definitions.resolve_job_def("memories_snapshot")
    result = job.execute_in_process(
        instance=instance,
        partition_key=tenant,
        resources={"memory_store": MemoryStoreResource(home=str(session_settings.home))},
    )
    assert result.success
    [materialization] = result.asset_materializations_for_node("memories")
    metadata = materialization.metadata
    assert (metadata["memories"].value, metadata["subjects"].value, metadata["do_not_sell_memories"].value) == (2, 2, 1)
    [check] = result.get_asset_check_evaluations()
    assert check.passed
    instance.dispose()


def test_dg_check_defs_passes():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dg"), "check", "defs"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "All definitions loaded successfully" in result.stdout + result.stderr


def test_memory_deletions_is_a_tenant_graph_with_a_step_per_store_and_a_check(definitions):
    from memory_pipelines.lib.stores import registry

    deletions = definitions.resolve_assets_def("memory_deletions")
    spec = next(iter(deletions.specs))
    assert spec.group_name == "forget" and spec.kinds == {"postgres"} and spec.owners == ["team:memory-platform"]
    assert deletions.partitions_def.name == "tenants"
    assert spec.description == "What the tenant has forgotten: its deletion jobs and their proofs."
    ops = {node.name for node in deletions.node_def.nodes}
    assert ops == {"freeze", "verify", "prove"} | {f"delete_{s.name}" for s in registry.stores()}
    graph = definitions.resolve_asset_graph()
    [check] = [key for key in graph.asset_check_keys if key.asset_key == deletions.key]
    assert check.name == "deletions_on_track"
    forget = definitions.resolve_job_def("forget")
    assert [n.name for n in forget.graph.nodes if n.name == "memory_deletions"] == ["memory_deletions"]


def test_the_forget_job_says_how_to_request_and_links_a_launchpad_with_each_scope_commented(
    definitions, monkeypatch, tmp_path
):
    """Dagster renders a job's default config as YAML without comments; its launchpad opens on the YAML
    of a `config` query parameter. The description (Markdown on the job's page) shows each scope and
    links such a launchpad: each request commented out, and each one valid once uncommented."""
    import re
    from urllib.parse import parse_qs, urlsplit

    import yaml

    forget = definitions.resolve_job_def("forget")
    description = forget.description or ""
    for shown in ("scope: SUBJECT", "scope: MEMORY", "scope: TENANT", "job_ids: [del_", "confirm:", "version:"):
        assert shown in description, shown
    [link] = re.findall(r"\]\((/locations/memory_pipelines/jobs/forget/playground/setup\?[^)\s]+)\)", description)
    query = parse_qs(urlsplit(link).query)
    [text] = query["config"]
    # That launchpad has no partition picker: the tenant is the partition tag, a placeholder that fails.
    assert (query["tags[0][key]"], query["tags[0][value]"]) == (["dagster/partition"], ["TENANT"])
    for scope in ("SUBJECT", "MEMORY", "TENANT"):
        assert f"# scope: {scope}" in text
    monkeypatch.setenv("MEMORY_PIPELINES_HOME", str(tmp_path))
    # As it opens: every pending job of the tenant. Uncommented, each scope is a valid request.
    assert yaml.safe_load(text)["ops"]["memory_deletions"]["ops"]["freeze"]["config"] == {
        "job_ids": [],
        "basis": "user-request",
    }
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip().startswith("# scope: ")]
    for begin in starts:
        block = [begin]
        while block[-1] + 1 < len(lines) and re.match(r"\s+# [a-z_]+: ", lines[block[-1] + 1]):
            block.append(block[-1] + 1)
        chosen = [line.replace("# ", "", 1) if i in block else line for i, line in enumerate(lines)]
        config = yaml.safe_load("\n".join(chosen))
        assert dg.validate_run_config(forget, config), config
        fields = config["ops"]["memory_deletions"]["ops"]["freeze"]["config"]
        assert fields["scope"] in ("SUBJECT", "MEMORY", "TENANT") and len(block) >= 2


def test_definitions_load_without_preview_warnings():
    import warnings

    from memory_pipelines.definitions import build_for

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build_for.__wrapped__(())  # a build of its own: the process's may be cached already, warnings spent
    assert not [w for w in caught if issubclass(w.category, dg.PreviewWarning)]


def test_every_asset_and_job_has_a_domain_and_every_check_a_description(definitions):
    specs = list(definitions.resolve_all_asset_specs())
    assert [s.key.to_user_string() for s in specs if not s.tags.get("domain")] == []
    assert {s.tags["domain"] for s in specs} == {"memories", "derived", "forget", "backups", "evaluation"}
    jobs = [job for job in definitions.resolve_all_job_defs() if not job.name.startswith("__")]
    assert len(jobs) == 12
    assert [job.name for job in jobs if not job.tags.get("domain")] == []
    graph = definitions.resolve_asset_graph()
    assert len(graph.asset_check_keys) == 12
    undescribed = [key.name for key in graph.asset_check_keys if not (graph.get_check_spec(key).description or "")]
    assert undescribed == []


def test_evaluation_checks_are_per_month_and_name_the_mode_and_warn_band(definitions):
    from memory_pipelines.lib.evaluation.evaluator import severity

    graph = definitions.resolve_asset_graph()
    precision = graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey("memory_eval"), "precision_target"))
    drift = graph.get_check_spec(dg.AssetCheckKey(dg.AssetKey("memory_drift"), "drift_target"))
    for spec in (precision, drift):
        assert isinstance(spec.partitions_def, dg.MonthlyPartitionsDefinition)
        assert "hybrid recall mode" in spec.description and spec.metadata["mode"] == "hybrid"
    assert "WARN band 0.8 <= precision < 0.84" in precision.description
    assert precision.metadata["warn_band"] == "0.8 <= precision < 0.84"
    assert "WARN band 0.08 <= drift <= 0.1" in drift.description
    # The bands named are those the checks grade by.
    assert [severity("precision", v) for v in (0.799, 0.8, 0.839, 0.84)] == ["ERROR", "WARN", "WARN", "PASS"]
    assert [severity("drift", v) for v in (0.079, 0.08, 0.1, 0.101)] == ["PASS", "WARN", "WARN", "ERROR"]


def test_definitions_follow_the_environment_they_are_loaded_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process keeps its build (memory_pipelines/definitions.py), but the build reads the environment:
    one made before MEMORY_PIPELINES_HOME or the Chroma URL was set must not serve after."""
    from memory_pipelines.lib.infra import settings as env

    monkeypatch.delenv(env.ENV_HOME, raising=False)
    monkeypatch.delenv(env.ENV_CHROMA_URL, raising=False)
    unset = dict(defs().resources or {})
    monkeypatch.setenv(env.ENV_HOME, "/srv/memories")
    monkeypatch.setenv(env.ENV_CHROMA_URL, "http://chroma.internal:8000")
    chosen = dict(defs().resources or {})
    assert (unset["memory_store"].home, unset["chroma"].url) == (env.DEFAULT_HOME, None)
    assert isinstance(chosen["memory_store"].home, dg.EnvVar) and chosen["memory_store"].home == env.ENV_HOME
    assert isinstance(chosen["chroma"].url, dg.EnvVar) and chosen["chroma"].url == env.ENV_CHROMA_URL
    assert defs() is defs()  # built once for an environment
