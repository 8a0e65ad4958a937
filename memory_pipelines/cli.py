"""`memory-pipelines` command: every command prints one JSON document on stdout.

Errors go to stderr as `memory-pipelines: error: FIELD: message` with a non-zero exit code
(2 bad input, 3 not found, 4 permission denied, 5 conflict, 6 service unavailable).

One front door: every command calls a `MemoryPlatform` method (memory_pipelines/platform/), the
same API a host application uses. What stays outside it, each saying why where it happens:
commands that launch Dagster runs (`materialize`, `forget --wait`, `deletion retry|erase`, `backup`,
`restore --wait`, `retention sweep --wait`, `eval run`, `demo`: memory_pipelines/launch/materialize.py)
and those that manage HOME's services and processes (`stop`, `dev`, `env`). From the library
itself the CLI takes errors, settings and input checks only, the checks run before any service
starts (tests/integration/test_front_door.py keeps it so).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.children import isolated_env
from memory_pipelines.lib.infra.errors import (
    MemoryPipelinesError,
    NotFoundError,
    PartialWriteError,
    ResourceExhaustedError,
    ValidationError,
    resource_exhausted,
)
from memory_pipelines.lib.infra.owner_only import restrict_umask
from memory_pipelines.lib.infra.progress import ENV_VERBOSE
from memory_pipelines.lib.infra.settings import ENV_HOME, Settings
from memory_pipelines.lib.memories.crypto import DecryptionError

if TYPE_CHECKING:
    from memory_pipelines.lib.memories.store import MemoryStore
    from memory_pipelines.lib.stores.derived import DerivedStores
    from memory_pipelines.platform import MemoryPlatform

__all__ = ["main"]

PROG = "memory-pipelines"
# Set to 1 to get the traceback of an unexpected error (never of a refused input).
ENV_DEBUG = "MEMORY_PIPELINES_DEBUG"

Handler = Callable[[argparse.Namespace], None]
# What each command group's function is given to add its commands: add(name, handler, help).
Adder = Callable[[str, Handler, str], argparse.ArgumentParser]


def _emit(document: Any) -> None:
    json.dump(document, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")
    sys.stdout.flush()


def _settings(args: argparse.Namespace) -> Settings:
    if args.home:
        os.environ[ENV_HOME] = os.path.abspath(args.home)
    return Settings.from_env()


def _store(args: argparse.Namespace) -> MemoryStore:
    """HOME's memory store, its embedded services started (or found) once per command.

    Every command reaches the services through here, `_platform` included: a caller that replaces
    it (the CLI's tests do, to prove that refused input opens nothing) gets a platform on its
    stand-in."""
    platform: MemoryPlatform | None = getattr(args, "_platform", None)
    if platform is None:
        from memory_pipelines.platform import MemoryPlatform

        _settings(args)  # --home first: from_env reads it
        platform = args._platform = MemoryPlatform.from_env()
    return platform.store


def _platform(args: argparse.Namespace) -> MemoryPlatform:
    """The command's MemoryPlatform, made once, on `_store(args)`."""
    store = _store(args)
    platform: MemoryPlatform | None = getattr(args, "_platform", None)
    if platform is None:  # `_store` was replaced: a platform on the store it gave
        from memory_pipelines.platform import MemoryPlatform

        platform = args._platform = MemoryPlatform(settings=_settings(args), store=store)
    return platform


def _derived(args: argparse.Namespace) -> DerivedStores:
    """The derived stores (Chroma, the embedding model). No command calls it: the platform methods
    open them when they need them. Kept for tests/unit/test_cli_errors.py, which replaces it."""
    return _platform(args).derived


def _text_arg(value: str, field: str) -> str:
    """The argument itself, or stdin for `-`.

    Stdin is read as bytes and decoded strictly: text that is not UTF-8 is refused naming the
    field, where a text-mode read would raise (a traceback) or smuggle lone surrogates further.
    At most one byte more than the text limit is read, so a huge stream is not held in memory.
    """
    if value != "-":
        return value
    if sys.stdin is None:
        raise ValidationError(field, "is - but stdin is closed")
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a text-only stdin (an embedding program's replacement): already decoded
        return validation.check_utf8(field, sys.stdin.read())
    raw = stream.read(validation.MAX_TEXT_BYTES + 1)
    if len(raw) > validation.MAX_TEXT_BYTES:
        raise ValidationError(
            field, f"is more than {validation.MAX_TEXT_BYTES} bytes; the limit is {validation.MAX_TEXT_BYTES} (64 KiB)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValidationError(
            field, f"stdin is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None


# -- commands --------------------------------------------------------------------------------


def cmd_write(args: argparse.Namespace) -> None:
    text = _text_arg(args.text, "text")  # before any service starts: bad stdin changes nothing
    result = _platform(args).write(
        tenant_id=args.tenant,
        user_id=args.user,
        text=text,
        memory_id=args.memory_id,
        team_id=args.team,
        shareable=True if args.shareable else None,
        category=args.category,
        confidence=args.confidence,
        original_query=args.original_query,
        do_not_sell=True if args.do_not_sell else None,
    )
    _emit(result)


def cmd_history(args: argparse.Namespace) -> None:
    _emit(_platform(args).history(tenant_id=args.tenant, memory_id=args.memory_id))


def cmd_rollback(args: argparse.Namespace) -> None:
    _emit(_platform(args).rollback(tenant_id=args.tenant, memory_id=args.memory_id, user_id=args.user))


def cmd_list(args: argparse.Namespace) -> None:
    _emit(_platform(args).list(tenant_id=args.tenant, user_id=args.user, team_id=args.team))


def cmd_export(args: argparse.Namespace) -> None:
    chunks = _platform(args).export_json(tenant_id=args.tenant, subject=args.subject)
    first = next(chunks)  # errors surface before anything reaches stdout
    sys.stdout.write(first)
    for chunk in chunks:
        sys.stdout.write(chunk)
    sys.stdout.flush()


def cmd_team(args: argparse.Namespace) -> None:
    platform = _platform(args)
    if args.team_command == "add-member":
        _emit(platform.add_team_member(tenant_id=args.tenant, team_id=args.team, user_id=args.user))
    else:
        _emit(platform.remove_team_member(tenant_id=args.tenant, team_id=args.team, user_id=args.user))


def cmd_tenants(args: argparse.Namespace) -> None:
    _emit(_platform(args).tenants())


def cmd_tenant(args: argparse.Namespace) -> None:
    platform = _platform(args)
    if args.tenant_command == "create":
        _emit(platform.create_tenant(tenant_id=args.tenant, sharing_mode=args.sharing_mode))
    elif args.tenant_command == "set-test":
        _emit(platform.set_test_tenant(tenant_id=args.tenant, test=not args.off))
    else:
        _emit(platform.set_sharing_mode(tenant_id=args.tenant, sharing_mode=args.sharing_mode))


def cmd_do_not_sell(args: argparse.Namespace) -> None:
    _emit(
        _platform(args).set_do_not_sell(
            tenant_id=args.tenant, memory_id=args.memory_id, subject=args.subject, value=not args.off, user_id=args.user
        )
    )


def _document(args: argparse.Namespace, content: str | bytes) -> None:
    """A rendered document (certificate, picture) to `--output` (then `{"written": path}` on stdout),
    or as is on stdout."""
    if args.output:
        path = os.path.abspath(args.output)
        data = content.encode("utf-8") if isinstance(content, str) else content
        try:
            with open(path, "wb") as out:
                out.write(data)
        except OSError as exc:
            raise ValidationError("output", f"cannot write {args.output!r}: {exc.strerror}") from exc
        _emit({"written": path})
    else:
        sys.stdout.write(content if isinstance(content, str) else content.decode("utf-8"))
        sys.stdout.flush()


def _json_document(args: argparse.Namespace, document: Any) -> None:
    """A JSON answer: on stdout, or to `--output` when given."""
    if args.output:
        _document(args, json.dumps(document, indent=2) + "\n")
    else:
        _emit(document)


def cmd_lineage(args: argparse.Namespace) -> None:
    if args.format != "json" and not args.memory_id:
        raise ValidationError("format", f"{args.format} draws one memory's lineage: give --memory-id")
    if args.format == "png" and not args.output:
        raise ValidationError("output", "is required with --format png (a binary file)")
    platform = _platform(args)
    if args.format != "json":
        _document(args, platform.lineage_picture(tenant_id=args.tenant, memory_id=args.memory_id, fmt=args.format))
    else:
        _json_document(args, platform.lineage(tenant_id=args.tenant, memory_id=args.memory_id, record=args.record))


def cmd_recall(args: argparse.Namespace) -> None:
    # As the Dagster assets built the indexes (`materialize`, or automation in `dev`): no sync here.
    _emit(
        _platform(args).recall(
            tenant_id=args.tenant,
            user_id=args.user,
            team_id=args.team,
            query=args.query,
            k=args.k,
            mode=args.mode,
            sync=False,
        )
    )


def cmd_analytics(args: argparse.Namespace) -> None:
    from memory_pipelines.lib.stores.analytics.store import parse_select

    parse_select(args.sql)  # an input check, before any service starts
    # Unknown, deleted and restoring tenants are refused as everywhere else; the query then sees
    # only this tenant's rows, less those an accepted deletion hides.
    _emit(_platform(args).analytics(tenant_id=args.tenant, sql=args.sql))


def cmd_materialize(args: argparse.Namespace) -> None:
    # A Dagster run of the code location (memory_pipelines/launch/materialize.py), not a platform call:
    # MemoryPlatform has no Dagster (its `sync` is the in-process equivalent).
    from memory_pipelines.launch.materialize import materialize

    select = [name.strip() for name in args.select.split(",") if name.strip()] if args.select else None
    result = materialize(_settings(args), args.tenant, select)
    _emit(result)
    if not result["success"]:
        from memory_pipelines.launch.materialize import run_failed

        raise run_failed("run", result["failures"], prefix=f"run {result['run_id']} failed: ")


def cmd_summary(args: argparse.Namespace) -> None:
    platform = _platform(args)
    if args.subject:
        _emit(platform.summary(tenant_id=args.tenant, subject=args.subject))
    else:
        _emit(platform.summary(tenant_id=args.tenant, team_id=args.team))


def cmd_summary_mode(args: argparse.Namespace) -> None:
    _emit(_platform(args).set_summary_mode(tenant_id=args.tenant, subject=args.subject, mode=args.mode))


def _wait_for(args: argparse.Namespace, job: Mapping[str, Any]) -> dict[str, Any]:
    """Run the job's forget now, as a Dagster run of the code location (memory_pipelines/launch/materialize.py,
    the platform has no Dagster), and return the job's final status with the run."""
    from memory_pipelines.launch.materialize import run_failed, run_forget
    from memory_pipelines.lib.forget.ledger import DeletionBlocked

    run = run_forget(_settings(args), job["tenant_id"], [job["job_id"]])
    status = _platform(args).deletion_status(job_id=job["job_id"])
    if status["state"] != "COMPLETE" and run["failures"]:  # a run that failed is never a success
        failed = run_failed("forget", run["failures"], prefix=f"run {run['run_id']} left it {status['state']}: ")
        if status["state"] == "BLOCKED" and failed.exit_code == 1:
            raise DeletionBlocked("forget", "BLOCKED", failed.message)
        raise failed
    return {**status, "run_id": run["run_id"], "run_failures": run["failures"]}


def cmd_forget(args: argparse.Namespace) -> None:
    job = _platform(args).request_deletion(
        tenant_id=args.tenant,
        subject=args.subject,
        memory_id=args.memory_id,
        version=args.version,
        all_tenant=args.all,
        confirm=args.confirm,
        basis=args.basis,
    )
    if args.wait and job["state"] != "COMPLETE" and not _paused(job):
        try:
            waited = _wait_for(args, job)
        except Exception as exc:
            # Accepted and hidden already: whatever stopped the wait, the caller learns which job to follow.
            raise _after_acceptance(exc, job) from exc
        _emit({**waited, "duplicate": job["duplicate"]})
    else:
        _emit(job)


def _paused(job: Mapping[str, Any]) -> bool:
    """Whether the job waits for `deletion resume` (said on stderr): nothing is run for it now."""
    pause = job.get("paused")
    if pause:
        whose = "every tenant" if pause["tenant_id"] is None else f"tenant {pause['tenant_id']}"
        print(
            f"deletion work of {whose} is paused since {pause['paused_at']} ({pause['reason']}): job"
            f" {job['job_id']} is accepted and hidden, and runs after `memory-pipelines deletion resume`",
            file=sys.stderr,
        )
    return bool(pause)


def _after_acceptance(exc: Exception, job: Mapping[str, Any]) -> MemoryPipelinesError:
    """`exc` (as the CLI reports it) naming the accepted job, which `deletion status` or `deletion retry` follow."""
    cause: MemoryPipelinesError | None = resource_exhausted(exc)
    if cause is None:
        internal = MemoryPipelinesError("internal", f"{type(exc).__name__}: {exc}")
        cause = exc if isinstance(exc, MemoryPipelinesError) else internal
    kind = ResourceExhaustedError if isinstance(cause, ResourceExhaustedError) else MemoryPipelinesError
    error = kind(
        cause.field,
        f"{cause.message} (deletion job {job['job_id']} was accepted and its scope is hidden from every read;"
        f" `deletion retry {job['job_id']}` runs it again)",
    )
    error.exit_code = cause.exit_code
    return error


def cmd_deletion(args: argparse.Namespace) -> None:
    if args.deletion_command == "erase":
        # A Dagster run (physical erasure), as the erasure sensor launches it.
        from memory_pipelines.launch.materialize import run_erasure, run_failed

        _platform(args).require_tenant(tenant_id=args.tenant)  # an unknown tenant is not made a partition
        result = run_erasure(_settings(args), args.tenant)
        _emit(result)
        if not result["success"]:
            raise run_failed("physical_erasure", result["failures"])
        return
    # Reading jobs needs only the control plane, not Chroma or the embedding model.
    platform = _platform(args)
    if args.deletion_command == "status":
        _emit(platform.deletion_status(job_id=args.job_id))
    elif args.deletion_command == "proof":
        if args.format == "json":
            _json_document(args, platform.deletion_proof(job_id=args.job_id))
        else:
            _document(args, platform.deletion_certificate(job_id=args.job_id, fmt=args.format))
    elif args.deletion_command == "list":
        _emit(platform.deletion_jobs(state=args.state, tenant_id=args.tenant))
    elif args.deletion_command == "pause":
        _emit(platform.pause_deletions(tenant_id=args.tenant, reason=args.reason))
    elif args.deletion_command == "resume":
        _emit(platform.resume_deletions(tenant_id=args.tenant))
    elif args.deletion_command == "pauses":
        _emit(platform.deletion_pauses(tenant_id=args.tenant))
    elif args.deletion_command == "adapter":
        if args.adapter_command == "pin":
            _emit(platform.pin_adapter(store=args.store, version=args.version, reason=args.reason))
        elif args.adapter_command == "unpin":
            _emit(platform.unpin_adapter(store=args.store))
        else:
            _emit(platform.adapters())
    elif args.deletion_command == "notifications":
        if args.deliver:
            _emit(platform.deliver_notifications())
        else:
            _emit(platform.notifications(job_id=args.job, limit=args.limit))
    else:
        job = platform.deletion_status(job_id=args.job_id)
        if job["state"] == "COMPLETE" or _paused(job):
            _emit(job)
        else:
            try:
                _emit(_wait_for(args, job))
            except Exception as exc:
                raise _after_acceptance(exc, job) from exc


def cmd_backup(args: argparse.Namespace) -> None:
    if args.backup_command == "list":
        _emit(_platform(args).list_backups(tenant_id=args.tenant))
    elif args.backup_command == "sweep":
        _emit(_platform(args).sweep_backups())
    else:
        # A Dagster run of the `backup` job (what the nightly schedule launches).
        from memory_pipelines.launch.materialize import run_backup, run_failed

        if not args.tenant:
            raise ValidationError("tenant", "is required: backup --tenant T")
        _platform(args).require_tenant(tenant_id=args.tenant)
        result = run_backup(_settings(args), args.tenant)
        if not result["success"]:
            raise run_failed("backup", result["failures"])
        _emit(result)


def cmd_restore(args: argparse.Namespace) -> None:
    if args.reopen:
        _emit(_platform(args).reopen_tenant(tenant_id=args.tenant))
        return
    if not args.backup:
        raise ValidationError("backup", "is required: restore --tenant T --backup ID")
    platform = _platform(args)
    if not args.wait:
        _emit(platform.request_restore(tenant_id=args.tenant, backup_id=args.backup, restore_id=args.restore_id))
        return
    # A Dagster run of the `restore` job (what the restore sensor launches); bad ids fail before it starts.
    from memory_pipelines.launch.materialize import run_failed, run_restore

    platform.check_restore(tenant_id=args.tenant, backup_id=args.backup, restore_id=args.restore_id)
    result = run_restore(_settings(args), args.tenant, args.backup, restore_id=args.restore_id)
    if not result["success"] or result["report"] is None:
        raise run_failed("restore", result["failures"])
    _emit({**result["report"], "run_id": result["run_id"]})


def cmd_keys(args: argparse.Namespace) -> None:
    if args.keys_command == "convert":
        _emit({"converted": _platform(args).convert_keys(tenant_id=args.tenant)})
        return
    if args.subject is None and args.confirm != args.tenant:
        raise ValidationError("confirm", "shredding a whole tenant needs --confirm with the tenant id")
    _emit(_platform(args).shred_keys(tenant_id=args.tenant, subject=args.subject, confirm=args.confirm))


def cmd_retention(args: argparse.Namespace) -> None:
    from memory_pipelines.lib.retention import rules as retention  # input checks only

    if args.retention_command == "preview":
        # A preview of a future day is allowed: counts only, nothing written (see retention.preview).
        _emit(_platform(args).retention_preview(day=retention.check_day(args.date).isoformat()))
        return
    day = retention.check_sweep_day(args.date).isoformat()  # a day that has ended, on every path
    if not args.wait:
        _emit(_platform(args).sweep_retention(day=day, run=False))
        return
    # One Dagster run of the `retention` job per tenant partition (what the daily schedule launches).
    from memory_pipelines.launch.materialize import run_failed, run_retention

    retention.load_policies()  # a broken policy file fails here, naming its line
    if day < retention.FIRST_DAY:
        raise ValidationError("date", f"must be from {retention.FIRST_DAY}, the retention job's first day")
    platform = _platform(args)
    if args.tenant:
        platform.require_tenant(tenant_id=args.tenant)
        tenants = [args.tenant]
    else:  # one run per tenant partition of the store: internal tenants are not partitions
        tenants = [t["tenant_id"] for t in platform.tenants() if not validation.is_reserved_tenant(t["tenant_id"])]
    result = run_retention(_settings(args), day, tenants)
    if not result["success"]:
        raise run_failed("retention", result["failures"])
    _emit(result)


def cmd_run(args: argparse.Namespace) -> None:
    prompt = _text_arg(args.prompt, "prompt") if args.run_command == "snapshot" else None
    platform = _platform(args)
    if args.run_command == "open":
        _emit(platform.open_run(tenant_id=args.tenant, subject_id=args.user, run_id=args.run, ttl_seconds=args.ttl))
    elif args.run_command == "recall":
        _emit(platform.run_recall(lease_id=args.lease, query=args.query, team_id=args.team, k=args.k, mode=args.mode))
    elif args.run_command == "revoke":
        _emit(platform.revoke_lease(lease_id=args.lease))
    elif args.run_command == "permit":
        with platform.permit(lease_id=args.lease, sink=args.sink) as permit:
            held = {"permit_id": permit.permit_id, "seq": permit.seq, "sink": permit.sink}
        _emit({**held, "state": "RELEASED"})
    else:
        assert prompt is not None
        _emit(platform.snapshot_prompt(lease_id=args.lease, prompt=prompt))


def cmd_explain(args: argparse.Namespace) -> None:
    _emit(_platform(args).explain(tenant_id=args.tenant, run_id=args.run))


def cmd_eval(args: argparse.Namespace) -> None:
    if args.eval_command == "run":
        # A Dagster run materializing memory_eval and memory_drift for the month's partition.
        from memory_pipelines.launch.materialize import run_evaluation, run_failed

        month = _month(args.month)
        result = run_evaluation(_settings(args), month)
        if not result["success"]:
            raise run_failed("eval", result["failures"])
        _emit(result)
        return
    from memory_pipelines.lib.evaluation.evaluator import check_mode

    check_mode(args.mode)  # an input check, before any service starts
    trend = _platform(args).evaluation_trend(mode=args.mode)
    if not trend["months"]:
        raise NotFoundError("eval", "no evaluation yet: run `eval run --month YYYY-MM` first")
    print(f"memory quality of tenant {trend['tenant']!r}, recall mode {args.mode}, K={trend['k']}")
    print(trend["markdown"])
    if trend["at_k"]:  # none from a month evaluated before per-K figures were kept
        at = trend["at_k"][0]
        print(f"\nevery recall mode per K, evaluated for {at['month']} ({at['queries']} queries, {at['judge']} judge)")
        print(trend["at_k_markdown"])


def _month(value: str) -> str:
    today = datetime.now(UTC).date()
    try:
        first = datetime.strptime(value, "%Y-%m").date()
    except ValueError:
        raise ValidationError("month", f"must be YYYY-MM, got {value!r}") from None
    if not (2026, 1) <= (first.year, first.month) < (today.year, today.month):
        raise ValidationError("month", f"must be a month that has ended, from 2026-01 to before {today:%Y-%m}")
    return first.isoformat()


def cmd_canary(args: argparse.Namespace) -> None:
    result = _platform(args).canary_drill()
    _emit(result)
    if not result["passed"]:
        raise MemoryPipelinesError("canary", f"drill found leftovers: {result['leftovers']}")


def cmd_stop(args: argparse.Namespace) -> None:
    """Everything of HOME ends: its Dagster processes (code servers, run workers, daemon, webserver;
    SIGTERM, then SIGKILL), then the embedded Chroma and PostgreSQL servers. The JSON names each.

    Process management, not a platform call: a MemoryPlatform would start the services it stops."""
    from memory_pipelines.lib.infra.services import stop_services

    _emit(stop_services(_settings(args)))


def cmd_dev(args: argparse.Namespace) -> None:
    """Embedded services and `dg dev` under supervision: process management, not a platform call."""
    from memory_pipelines.launch.code_server import module_workspace
    from memory_pipelines.launch.devserver import GRACE_SECONDS, dg_dev_command, port_taken, run_supervised
    from memory_pipelines.lib.infra.errors import ConflictError, ServiceError
    from memory_pipelines.lib.infra.services import ensure_services

    if not 1 <= args.port <= 65535:
        raise ValidationError("port", f"must be from 1 to 65535, got {args.port}")
    if port_taken(args.host, args.port):
        raise ConflictError("port", f"{args.host}:{args.port} is in use (another dev?): choose one with --port")
    settings = _settings(args)
    ensure_services(settings)
    env = isolated_env({**os.environ, "DAGSTER_HOME": str(settings.dagster_home), ENV_HOME: str(settings.home)})
    _emit(
        {
            "dagster_home": str(settings.dagster_home),
            "url": f"http://{args.host}:{args.port}",
            "assets": f"http://{args.host}:{args.port}/assets/memories",
        }
    )
    # The workspace file names the code location, so the UI and dg agree on "memory_pipelines".
    command = dg_dev_command(module_workspace(settings), args.host, args.port)
    try:
        outcome = run_supervised(
            command,
            env,
            on_stop=f"{PROG}: dev: {{signal}}: stopping Dagster; the embedded services keep running"
            f" (`{PROG} stop` ends them)",
        )
    except OSError as exc:
        raise MemoryPipelinesError("dagster", f"cannot start `{' '.join(command[:2])}`: {exc}") from exc
    if outcome.killed:
        print(f"{PROG}: dev: what was left of Dagster {GRACE_SECONDS:.0f} s after SIGINT was killed", file=sys.stderr)
    if outcome.left:
        raise MemoryPipelinesError("dagster", f"processes {outcome.left} of `dg dev` outlived SIGKILL")
    if outcome.stop_signal is None:  # e.g. the port was taken, or `stop` ended this HOME's Dagster processes
        raise ServiceError(
            "dagster", f"`dg dev` ended without being asked to (exit code {outcome.returncode}); its output is above"
        )


def cmd_env(args: argparse.Namespace) -> None:
    """The variables Dagster's own tools need for HOME's instance, as shell exports or JSON.

    Starts the embedded services when needed: the Dagster URL names the embedded server's socket.
    Service management, not a platform call: it needs the services' endpoints, not the store, so it
    migrates nothing and works on a database a newer release migrated (the downgrade gate's refusal
    comes with the first command that opens the store)."""
    import shlex

    from memory_pipelines.lib.infra.services import ensure_services
    from memory_pipelines.lib.infra.settings import ENV_DAGSTER_PG_URL, ENV_DAGSTER_PG_URL_EXPORTED

    settings = _settings(args)
    endpoints = ensure_services(settings, migrate=False)
    exports = {
        "DAGSTER_HOME": str(settings.dagster_home),
        ENV_HOME: str(settings.home),
        ENV_DAGSTER_PG_URL: endpoints.dagster_url,
    }
    # Marked as ours, as for our own children: a later command on another HOME computes its own
    # URL instead of taking this one for the user's. A URL the user set stays unmarked, theirs.
    if os.environ.get(ENV_DAGSTER_PG_URL_EXPORTED) == endpoints.dagster_url:
        exports[ENV_DAGSTER_PG_URL_EXPORTED] = endpoints.dagster_url
    if args.format == "json":
        _emit(exports)
        return
    sys.stdout.write("".join(f"export {name}={shlex.quote(value)}\n" for name, value in exports.items()))
    sys.stdout.flush()


def cmd_demo(args: argparse.Namespace) -> None:
    # Dagster runs of the code location throughout (memory_pipelines/demo.py).
    from memory_pipelines.demo import run_demo

    _emit(run_demo(_settings(args)))


# -- parser ------------------------------------------------------------------------------------


# Never forked warm: `stop` ends the forker's own code server, and `dev` supervises its process
# group, which the terminal's Ctrl-C reaches.
_RUN_HERE: frozenset[Handler] = frozenset({cmd_stop, cmd_dev})


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors follow the CLI's error contract: `FIELD: message`, exit 2."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        raise ValidationError(self._field_of(message), message)

    def _field_of(self, message: str) -> str:
        """The dest of the first argument argparse names in `message` (`--memory-id` -> memory_id)."""
        for prefix in ("argument ", "the following arguments are required: ", "one of the arguments "):
            if message.startswith(prefix):
                name = message[len(prefix) :].replace("/", " ").replace(",", " ").replace(":", " ").split()[0]
                for action in self._actions:
                    if name in action.option_strings or name in (action.metavar, action.dest):
                        return str(action.dest)
                return name.lstrip("-").replace("-", "_")
        return "arguments"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Long-term memory lifecycle on Dagster.")
    parser.add_argument("--home", help=f"data folder (default: ${ENV_HOME} or ./.memory_pipelines)")
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="show Dagster's event log and library warnings on stderr (default: a progress bar on a terminal,"
        " else errors only; runs' output goes to HOME/logs/cli-runs.log); a run then gets a code server of its"
        " own instead of the HOME's warm one",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text, description=help_text)
        command.set_defaults(handler=handler)
        return command

    # In this order in `--help`.
    for add_group in (
        _memory_commands,
        _tenant_commands,
        _derived_commands,
        _forget_commands,
        _backup_and_retention_commands,
        _run_commands,
        _operator_commands,
    ):
        add_group(add)
    return parser


def _memory_commands(add: Adder) -> None:
    write = add("write", cmd_write, "write a memory, or a new version of --memory-id")
    write.add_argument("--tenant", required=True)
    write.add_argument("--user", required=True, help="the subject who writes (and owns) the memory")
    write.add_argument("--memory-id")
    write.add_argument("--team")
    write.add_argument("--shareable", action="store_true")
    write.add_argument("--category", help="medical, financial, general (default), ...")
    write.add_argument("--confidence", type=float)
    write.add_argument("--original-query", help="the query that produced the memory (kept for drift evaluation)")
    write.add_argument("--do-not-sell", action="store_true")
    write.add_argument("text", metavar="TEXT", help="memory text, or - to read it from stdin")

    history = add("history", cmd_history, "every version of a memory")
    history.add_argument("--tenant", required=True)
    history.add_argument("--memory-id", required=True)

    rollback = add("rollback", cmd_rollback, "make the previous version current again, as a new version")
    rollback.add_argument("--tenant", required=True)
    rollback.add_argument("--user", required=True, help="who acts: only the memory's author may roll it back")
    rollback.add_argument("--memory-id", required=True)

    listing = add("list", cmd_list, "current memories visible to a user (personal view, or --team view)")
    listing.add_argument("--tenant", required=True)
    listing.add_argument("--user", required=True)
    listing.add_argument("--team")

    export = add("export", cmd_export, "everything a subject wrote, every version (GDPR Art. 15/20, CCPA)")
    export.add_argument("--tenant", required=True)
    export.add_argument("--subject", required=True)


def _tenant_commands(add: Adder) -> None:
    team = add("team", cmd_team, "team membership")
    team_sub = team.add_subparsers(dest="team_command", required=True, metavar="ACTION")
    for action in ("add-member", "remove-member"):
        member = team_sub.add_parser(action, help=f"{action.replace('-', ' ')} of a team")
        member.add_argument("--tenant", required=True)
        member.add_argument("--team", required=True)
        member.add_argument("--user", required=True)

    add("tenants", cmd_tenants, "every tenant with its sharing mode and counts")
    tenant = add("tenant", cmd_tenant, "create a tenant, change its sharing mode, or mark it a test tenant")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    for action, default in (("create", "strict"), ("set-mode", None)):
        t = tenant_sub.add_parser(action)
        t.add_argument("--tenant", required=True)
        t.add_argument(
            "--sharing-mode",
            required=default is None,
            default=default,
            help="strict (default), shared_pool or progressive",
        )
    test = tenant_sub.add_parser("set-test", help="stores registered `onboarding` receive only test tenants' memories")
    test.add_argument("--tenant", required=True)
    test.add_argument("--off", action="store_true", help="no longer a test tenant")

    dns = add("do-not-sell", cmd_do_not_sell, "CCPA opt-out for one memory or a whole subject")
    dns.add_argument("--tenant", required=True)
    dns.add_argument("--user", required=True, help="who acts: the memory's author, or the subject flagging themselves")
    target = dns.add_mutually_exclusive_group(required=True)
    target.add_argument("--memory-id")
    target.add_argument("--subject")
    dns.add_argument("--off", action="store_true", help="clear the flag instead of setting it")


def _derived_commands(add: Adder) -> None:
    lineage = add("lineage", cmd_lineage, "derivedFrom lineage: derived records of a memory, or sources of a record")
    lineage.add_argument("--tenant", required=True)
    which = lineage.add_mutually_exclusive_group(required=True)
    which.add_argument("--memory-id")
    which.add_argument("--record", help="STORE:ID, e.g. chroma:m_...:2 or subject_summaries:subject:alice")
    lineage.add_argument(
        "--format", default="json", choices=("json", "png", "svg"), help="json (default), or a picture of --memory-id"
    )
    lineage.add_argument("--output", metavar="FILE", help='write to FILE (required for png); prints {"written": FILE}')

    recall = add("recall", cmd_recall, "memories visible to a user that best match QUERY")
    recall.add_argument("--tenant", required=True)
    recall.add_argument("--user", required=True)
    recall.add_argument("--team")
    recall.add_argument("--k", type=int, default=5, help="1..100 (default 5)")
    recall.add_argument("--mode", default="hybrid", help="semantic, keyword or hybrid (default)")
    recall.add_argument("query", metavar="QUERY")

    analytics = add("analytics", cmd_analytics, "one SELECT over one tenant's analytics rows (table `memories`)")
    analytics.add_argument("--tenant", required=True, help="the only tenant whose rows the query sees")
    analytics.add_argument("--sql", required=True, help="e.g. SELECT category, count(*) FROM memories GROUP BY 1")

    materialize = add("materialize", cmd_materialize, "materialize a tenant's assets through the Dagster instance")
    materialize.add_argument("--tenant", required=True)
    materialize.add_argument("--select", help="comma-separated asset names (default: all)")

    summary = add("summary", cmd_summary, "a subject's or a team's summary, decrypted")
    summary.add_argument("--tenant", required=True)
    of = summary.add_mutually_exclusive_group(required=True)
    of.add_argument("--subject")
    of.add_argument("--team")

    summary_mode = add("summary-mode", cmd_summary_mode, "full, summary or hybrid summaries for one subject")
    summary_mode.add_argument("--tenant", required=True)
    summary_mode.add_argument("--subject", required=True)
    summary_mode.add_argument("--mode", required=True, help="full, summary or hybrid (default)")


def _forget_commands(add: Adder) -> None:
    forget = add("forget", cmd_forget, "request deletion of a subject, a memory (version) or a whole tenant")
    forget.add_argument("--tenant", required=True)
    scope = forget.add_mutually_exclusive_group(required=True)
    scope.add_argument("--subject", help="everything the subject wrote, personal and team")
    scope.add_argument("--memory-id", help="all versions of the memory, or --version V only")
    scope.add_argument("--all", action="store_true", help="the whole tenant (needs --confirm TENANT)")
    forget.add_argument("--version", type=int)
    forget.add_argument("--confirm")
    forget.add_argument(
        "--basis", default="user-request", help="gdpr-art17, ccpa, user-request (default), retention or offboarding"
    )
    forget.add_argument("--wait", action="store_true", help="run the forget job now and return its final state")

    deletion = add(
        "deletion",
        cmd_deletion,
        "deletion jobs: status, proof, list, retry; erase a tenant's bytes now; pause, resume, adapter pins;"
        " notifications",
    )
    deletion_sub = deletion.add_subparsers(dest="deletion_command", required=True, metavar="ACTION")
    for action in ("status", "proof", "retry"):
        one = deletion_sub.add_parser(action)
        one.add_argument("job_id", metavar="JOB")
        if action == "proof":
            one.add_argument(
                "--format",
                default="json",
                choices=("json", "md", "html"),
                help="json (default: the proof), md or html (a deletion certificate for a privacy officer)",
            )
            one.add_argument("--output", metavar="FILE", help='write the document to FILE; prints {"written": FILE}')
    listing_jobs = deletion_sub.add_parser("list")
    listing_jobs.add_argument("--state")
    listing_jobs.add_argument("--tenant")
    pause = deletion_sub.add_parser(
        "pause", help="incident switch: accept and hide requests, but start no cascade or erasure until resume"
    )
    pause.add_argument("--tenant", help="only this tenant (default: every tenant)")
    pause.add_argument("--reason", required=True, help="why, in one line (an incident id); shown in every proof")
    resume = deletion_sub.add_parser("resume", help="end the pause of --tenant (or of every tenant)")
    resume.add_argument("--tenant")
    pauses = deletion_sub.add_parser("pauses", help="every pause, newest first (the tenant's and every tenant's)")
    pauses.add_argument("--tenant")
    adapter = deletion_sub.add_parser(
        "adapter", help="which deletion adapter version each store runs: list, pin STORE VERSION, unpin STORE"
    )
    adapter_sub = adapter.add_subparsers(dest="adapter_command", required=True, metavar="ACTION")
    adapter_sub.add_parser("list", help="every store: the version cascades run, its default, what it ships")
    pin = adapter_sub.add_parser("pin", help="later cascades run VERSION of STORE's adapter (one it ships)")
    pin.add_argument("store", metavar="STORE")
    pin.add_argument("version", metavar="VERSION")
    pin.add_argument("--reason", required=True, help="why, in one line (an incident id)")
    unpin = adapter_sub.add_parser("unpin", help="later cascades run STORE's default adapter version")
    unpin.add_argument("store", metavar="STORE")
    notices = deletion_sub.add_parser(
        "notifications",
        help="the notices sent when jobs reach COMPLETE (or ERASED) and each channel's delivery state;"
        " --deliver sends the due ones now",
    )
    notices.add_argument("--job", metavar="JOB", help="only this job's notices")
    notices.add_argument("--limit", type=int, default=50, help="the newest N notices (default 50)")
    notices.add_argument("--deliver", action="store_true", help="send the due notices now (as the `notify` job does)")
    erase = deletion_sub.add_parser(
        "erase", help="run the tenant's physical erasure now: rewrite its files, byte-scan them, mark ERASED"
    )
    erase.add_argument("--tenant", required=True)


def _backup_and_retention_commands(add: Adder) -> None:
    backup = add("backup", cmd_backup, "back a tenant up now (encrypted), list its backups, or sweep expired ones")
    backup.add_argument("backup_command", nargs="?", choices=["list", "sweep"], metavar="list|sweep")
    backup.add_argument("--tenant")

    restore = add("restore", cmd_restore, "restore a tenant from a backup; forgotten data stays forgotten")
    restore.add_argument("--tenant", required=True)
    restore.add_argument("--backup", metavar="BACKUP_ID")
    restore.add_argument("--reopen", action="store_true", help="open a tenant a BLOCKED restore left closed")
    restore.add_argument("--wait", action="store_true", help="run the restore now and print its report")
    restore.add_argument(
        "--restore-id", metavar="RESTORE_ID", help="id for the restore (r_...); one naming another restore is refused"
    )

    keys = add("keys", cmd_keys, "crypto-shredding of keys; converting texts of older releases to version keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True, metavar="ACTION")
    shred = keys_sub.add_parser("shred", help="destroy the keys now (every backup of that scope becomes unreadable)")
    shred.add_argument("--tenant", required=True)
    shred.add_argument("--subject", help="only this subject's key (default: every key of the tenant)")
    shred.add_argument("--confirm", help="the tenant id again, to shred a whole tenant")
    convert = keys_sub.add_parser(
        "convert", help="seal texts an older release wrote under a key of their own version (resumable; reads go on)"
    )
    convert.add_argument("--tenant", help="only this tenant (default: every tenant with something to convert)")

    retention = add("retention", cmd_retention, "retention sweeps by policy (assets/retention_policies.yaml)")
    retention_sub = retention.add_subparsers(dest="retention_command", required=True, metavar="ACTION")
    for action, help_text in (("sweep", "remove what the day's retention ended"), ("preview", "counts only")):
        day = retention_sub.add_parser(action, help=help_text)
        day.add_argument("--date", "--day", dest="date", required=True, help="the day, YYYY-MM-DD (UTC)")
        if action == "sweep":
            day.add_argument(
                "--wait", action="store_true", help="run the retention job now, one run per tenant (else the schedule)"
            )
            day.add_argument("--tenant", help="with --wait: only this tenant (default: every tenant)")


def _run_commands(add: Adder) -> None:
    run = add("run", cmd_run, "try the agent-run fence: open a lease, recall inside it, take a permit, snapshot")
    run_sub = run.add_subparsers(dest="run_command", required=True, metavar="ACTION")
    opening = run_sub.add_parser("open", help="open a run's lease")
    opening.add_argument("--tenant", required=True)
    opening.add_argument("--user", required=True, help="the subject the run acts for")
    opening.add_argument("--run", required=True, help="the run id (what explain takes)")
    opening.add_argument("--ttl", type=int, default=300, help="lease lifetime in seconds (default 300)")
    fenced = run_sub.add_parser("recall", help="recall inside the run: every hit is fenced on the lease")
    fenced.add_argument("--lease", required=True)
    fenced.add_argument("--team")
    fenced.add_argument("--k", type=int, default=5)
    fenced.add_argument("--mode", default="hybrid")
    fenced.add_argument("query", metavar="QUERY")
    permit = run_sub.add_parser("permit", help="take and release one permit (fails once a fence closed)")
    permit.add_argument("--lease", required=True)
    permit.add_argument(
        "--sink", required=True, help="model_output, tool_dispatch, state_write, memory_write, queued_work"
    )
    revoke = run_sub.add_parser("revoke", help="operator: cancel a crashed run's in-flight permits, close its lease")
    revoke.add_argument("--lease", required=True)
    snapshot = run_sub.add_parser("snapshot", help="store the prompt the run sent (sealed, with lineage)")
    snapshot.add_argument("--lease", required=True)
    snapshot.add_argument("prompt", metavar="PROMPT", help="prompt text, or - to read it from stdin")

    explain = add(
        "explain", cmd_explain, "the recall chain of a run: memories read (text while present), derived records"
    )
    explain.add_argument("--tenant", required=True)
    explain.add_argument("--run", required=True)


def _operator_commands(add: Adder) -> None:
    ev = add("eval", cmd_eval, "memory quality: run a month's evaluation, or print the month-by-month report")
    ev_sub = ev.add_subparsers(dest="eval_command", required=True, metavar="ACTION")
    ev_run = ev_sub.add_parser("run", help="materialize memory_eval and memory_drift for one month")
    ev_run.add_argument("--month", required=True, help="YYYY-MM, a month that has ended")
    report = ev_sub.add_parser(
        "report", help="the trend table (month, precision, recall, drift), then every mode at K = 1, 5, 10"
    )
    report.add_argument("--mode", default="hybrid", help="semantic, keyword or hybrid (default)")

    add("canary", cmd_canary, "end-to-end deletion drill in an isolated tenant; fails if anything is left")
    add("stop", cmd_stop, "end everything of this HOME: its Dagster processes, then its embedded services")
    dev = add("dev", cmd_dev, "embedded services + `dg dev` (ends with all its processes on SIGTERM or SIGINT)")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=3000)
    env = add(
        "env",
        cmd_env,
        "shell exports for Dagster's own CLI on this HOME's instance: eval \"$(memory-pipelines env)\"",
    )
    env.add_argument(
        "--format", default="sh", choices=("sh", "json"), help="sh (default): export lines; json: one object"
    )
    add("demo", cmd_demo, "seed a demo tenant, show versions and sharing modes, materialize `memories`")


def _check_arguments(args: argparse.Namespace) -> None:
    """Every string argument must be UTF-8 before any command runs.

    Python hands over argv bytes that are not UTF-8 as lone surrogates (surrogateescape); they
    would fail much later, in `.encode()` or the database driver, after work had begun.
    """
    for name, value in vars(args).items():
        if isinstance(value, str):
            validation.check_utf8(name, value)
    # The platform's own tenants (evaluation, canary drills) are not customers' to read or write.
    if isinstance(getattr(args, "tenant", None), str):
        validation.check_customer_tenant("tenant", args.tenant)


def _error(field: str, message: str) -> None:
    """One line on stderr, whatever the message holds (newlines, undecodable input echoed back)."""
    line = f"{PROG}: error: {field}: {' '.join(message.split())}"
    print(line.encode("utf-8", "backslashreplace").decode("utf-8"), file=sys.stderr)


def _forwarded(args: argparse.Namespace) -> int | None:
    """The program's command run in a process forked from HOME's warm code server, which has
    Dagster and the definitions imported (launch/warm_commands.py); None: run it here. A command
    that launches runs starts that server first when none has a forker, as it would have itself."""
    from memory_pipelines.launch.warm_commands import enabled, forward

    try:
        settings = _settings(args)
    except MemoryPipelinesError:
        return None  # the command reports it, in its own order
    code = forward(sys.argv[1:], settings.home)
    if code is None and _launches(args) and enabled():
        from memory_pipelines.launch.code_server import start_for_commands

        if start_for_commands(settings):
            code = forward(sys.argv[1:], settings.home)
    return code


def _launches(args: argparse.Namespace) -> bool:
    """Whether the command launches Dagster runs, through HOME's warm code server (launch/materialize.py).
    A wrong answer costs time, not correctness: a server started for nothing, or Dagster imported here."""
    handler = args.handler
    if handler in (cmd_materialize, cmd_demo):
        return True
    if handler is cmd_forget:
        return bool(args.wait)
    if handler is cmd_restore:
        return bool(args.wait) and not args.reopen
    if handler is cmd_retention:
        return args.retention_command == "sweep" and bool(args.wait)
    if handler is cmd_deletion:
        return args.deletion_command in ("erase", "retry")
    if handler is cmd_backup:
        return args.backup_command is None
    if handler is cmd_eval:
        return bool(args.eval_command == "run")
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI; its exit code. As the program (`argv` None, read from sys.argv) a command may run in
    HOME's warm command forker; a caller's own argv always runs in this process."""
    # Whatever this command and the processes it starts write under HOME is the owner's alone; a
    # caller of main() in its own process gets its umask back.
    umask = restrict_umask()
    try:
        return _main(argv)
    finally:
        os.umask(umask)


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        _check_arguments(args)
        # Runs launched by this command read it too (memory_pipelines.launch.materialize).
        if args.verbose:
            os.environ[ENV_VERBOSE] = "1"
        else:
            os.environ.pop(ENV_VERBOSE, None)
        if argv is None and not args.verbose and args.handler not in _RUN_HERE:
            code = _forwarded(args)
            if code is not None:
                return code
        with warnings.catch_warnings():
            if not args.verbose:  # Dagster's Beta/Preview/Deprecation warnings are not the user's to act on
                warnings.simplefilter("ignore")
            args.handler(args)
    except MemoryPipelinesError as exc:
        exhausted = resource_exhausted(exc) if not isinstance(exc, PartialWriteError) else None
        shown = exhausted if exhausted is not None else exc
        _error(shown.field, shown.message)
        return shown.exit_code
    except DecryptionError as exc:
        _error("ciphertext", str(exc))
        return 7
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        _error("interrupted", "stopped by the user")
        return 130
    except Exception as exc:
        exhausted = resource_exhausted(exc)
        if exhausted is not None:
            _error(exhausted.field, exhausted.message)
            return exhausted.exit_code
        # A bug, not bad input: one line by default; the traceback when asked for.
        if os.environ.get(ENV_DEBUG) == "1":
            traceback.print_exc()
        _error("internal", f"{type(exc).__name__}: {exc} (set {ENV_DEBUG}=1 for the traceback)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
