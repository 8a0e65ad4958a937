"""Deletion certificates and data-map pictures for a privacy officer: what a proof says, in words.

A certificate is rendered from a COMPLETE job's proof (and its status) as Markdown or as one
standalone HTML page. It reads only named fields of the proof (ids, the scope HMAC, states, counts
and times), never the memory content, and never the subject's raw id: the proof holds only the
scope hash. Every registered store gets a row, "not recorded" when the proof lacks it, so a store
added after the job was proven shows as a gap instead of disappearing.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from memory_pipelines.lib.forget import deployment, guarantees
from memory_pipelines.lib.infra.errors import ValidationError
from memory_pipelines.lib.memories.store import MemoryStore
from memory_pipelines.lib.stores import lineage, registry

__all__ = [
    "FORMATS",
    "GUARANTEES_NOTE",
    "LIMITS",
    "MEANING",
    "NOT_RECORDED",
    "STORES_NOTE",
    "Certificate",
    "StoreRow",
    "build",
    "data_map",
    "data_map_in",
    "data_map_markdown",
    "data_map_png",
    "h",
    "lineage_graph",
    "md_code",
    "render",
    "render_html",
    "render_markdown",
]

FORMATS = ("json", "md", "html")
NOT_RECORDED = "not recorded"
# Plain-language meaning of the two end states, as docs/forgetting.md's "Forgetting" section defines them.
MEANING = {
    "COMPLETE": "Every registered store has confirmed its deletion (`DONE`) and verification found nothing: exact-id"
    " queries on every store and paraphrase probes built from the deleted text returned zero. The data can no"
    " longer be read through any store; a job is COMPLETE only when every registered store says DONE.",
    "ERASED": "The bytes have left the files too: the tenant's files in every store were rewritten, the"
    " PostgreSQL WAL segments holding the old rows were removed, the tenant's key-encryption key was rotated, and"
    " a byte scan for keyed fingerprints the cascade took before deleting found no hit. Until then the physical"
    " target reads PENDING with its deadline.",
}


# What no file-level proof reaches (issue 20): said on every certificate, not left to silence.
LIMITS = (
    "Free filesystem blocks: files the erasure unlinks or truncates (old WAL segments, relation files replaced"
    " by VACUUM FULL, rebuilt Chroma segments) are freed by the filesystem, not wiped; their blocks keep the old"
    " bytes until reused.",
    "SSD remapping and wear levelling: an overwrite in place may land on new flash cells while the old ones keep"
    " their content until the drive erases them.",
    "Filesystem journals, copy-on-write filesystems and snapshots (data=journal ext4, btrfs, ZFS, LVM or cloud"
    " volume snapshots) may keep earlier versions of any file, the key vault's included.",
    "Memory, swap and crash dumps of the processes that held the data or its keys.",
    "External servers: a remote PostgreSQL (its WAL archive, point-in-time backups and replicas), a Chroma"
    " server, S3 and KMS are erased through their APIs; their files are not scanned here (see Not scanned).",
    "Backups: the scope's rows there are sealed under destroyed keys (SHREDDED); only versions written before"
    " version keys and not yet converted stay readable in backups until those expire (PENDING_EXPIRY).",
    "Stores whose records no key of the scope seals (the Guarantees table says which): their copies outside this"
    " machine's files (a Chroma server, replicas and WAL archives of an external PostgreSQL) are bounded by their"
    " operator, not by a key.",
)
DEPLOYMENT_HEADER = ("target", "runs", "proven in this deployment", "the operator must bound", "settings")
DEPLOYMENT_PENDING = "Recorded by the physical erasure, which has not run yet for this job."
GUARANTEES_NOTE = (
    "Cryptographic: every copy of the target is sealed under a key this deletion destroyed, and the tenant's"
    " key-encryption key was rotated, so no copy anywhere opens (WAL archives, replicas, a managed server, backups)."
    " Physical: the target's files on this machine were rewritten and a byte scan found no fingerprint."
)

# Under the stores table: what `DONE:n` and "records deleted" count, so they agree with the data map.
STORES_NOTE = (
    "Target DONE:n counts the store's records the scope reached. Records deleted leaves out those also derived"
    " from data outside the scope (a team summary of other members too): they are rebuilt without the scope,"
    " not deleted, and still count in the data map."
)


@dataclass(frozen=True)
class StoreRow:
    """One registered store's line of the certificate."""

    store: str
    owner: str
    adapter_version: str
    target: str
    deleted: str
    verification: str


@dataclass
class Certificate:
    """The certificate's content: strings ready to render (escaped by the renderer, not here)."""

    job_id: str
    tenant: str
    state: str
    scope: list[tuple[str, str]]
    timestamps: list[tuple[str, str]]
    stores: list[StoreRow]
    verification: list[tuple[str, str]]
    erasure: list[tuple[str, str]]
    backups: list[tuple[str, str]]
    # store, what seals its copies, cryptographic, physical, which held (in words)
    guarantees: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    other_targets: list[tuple[str, str]] = field(default_factory=list)
    # target, where it runs, what is proven there, what the operator must bound, the settings
    deployment: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    limits: tuple[str, ...] = LIMITS


def _text(value: Any) -> str:
    return NOT_RECORDED if value is None or value == "" else str(value)


def _deleted(target: str, rebuilt: int = 0) -> str:
    """Records deleted: DONE:n counts the records the scope reached, less those rebuilt without it."""
    if not target.startswith("DONE:"):
        return "-"
    reached = target.partition(":")[2]
    if not rebuilt or not reached.isdigit():
        return reached
    return f"{int(reached) - rebuilt} ({rebuilt} rebuilt without the scope)"


def _physical(target: str | None) -> str:
    if target is None:
        return NOT_RECORDED
    state, _, when = target.partition(":")
    if state == "ERASED":
        return f"ERASED at {when}"
    if state == "PENDING":
        return f"PENDING: to be erased by {when}"
    return target


def _backups(target: str | None) -> str:
    if target is None:
        return NOT_RECORDED
    state, _, rest = target.partition(":")
    if state == "PENDING_SHRED":
        return (
            f"PENDING_SHRED: {rest} live backup(s); the scope's key is destroyed, SHREDDED is claimed once the"
            " physical erasure has rewritten and scanned the key store's files"
        )
    if state == "SHREDDED":
        return f"SHREDDED: {rest} backup(s) are unreadable for this scope; no readable copy of its key is left"
    if state == "PENDING_EXPIRY":
        return (
            f"PENDING_EXPIRY: the rows stay in backups until they expire on {rest}; every restore removes them"
            " by replaying the journal"
        )
    if target == "DONE:0":
        return "no live backup of the tenant"
    return target


def _scanned(scan: Mapping[str, Any]) -> str:
    """Where the byte scan read: directories (under HOME), files and bytes of each."""
    areas = scan.get("scanned")
    if not areas:
        return NOT_RECORDED
    return "; ".join(f"{a.get('path')}: {a.get('files')} files, {a.get('bytes')} bytes" for a in areas)


def _keys(keys: Mapping[str, Any] | None) -> str:
    if not keys:
        return NOT_RECORDED
    if keys.get("rotated"):
        rewrapped = sum(int(n) for n in (keys.get("rewrapped") or {}).values())
        return (
            f"rotated: {rewrapped} wrapped key(s) of the tenant rewrapped under a new key-encryption key, and the"
            " old one overwritten in place in the key vault file; wrapped copies left in PostgreSQL's WAL, dead"
            " tuples or replicas open nothing"
        )
    if keys.get("vaultFile"):
        return "not rotated: the tenant has no live tenant key"
    return "not rotated: the tenant's keys and its key vault file are destroyed"


def _wal(wal: Mapping[str, Any] | None) -> str:
    if not wal:
        return NOT_RECORDED
    if wal.get("purged"):
        return (
            f"{wal.get('segmentsRemoved')} segment(s) holding the history before the erasure removed (not recycled),"
            " the rest of pg_wal scanned"
        )
    reason = wal.get("reason") or "segments from before the erasure are left"
    return f"not purged: {reason}"


def _store_rows(
    targets: Mapping[str, Any], exact: Mapping[str, Any], versions: Mapping[str, Any], rebuilt: Mapping[str, Any]
) -> list[StoreRow]:
    """One row per registered store, in cascade order: its target, what it deleted, its exact-id check."""
    rows = []
    for spec in registry.stores():
        target = targets.get(spec.name)
        left = exact.get(spec.name)
        rows.append(
            StoreRow(
                store=spec.name,
                owner=spec.owner,
                adapter_version=_text(versions.get(spec.name)),
                target=_text(target),
                deleted=NOT_RECORDED if target is None else _deleted(str(target), int(rebuilt.get(spec.name) or 0)),
                verification=NOT_RECORDED
                if left is None
                else ("passed: 0 left by exact id" if left == 0 else f"FAILED: {left} left by exact id"),
            )
        )
    return rows


def _guarantee_rows(recorded: Mapping[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """One row per registered store: what seals its copies, each guarantee's state, which held."""
    rows = []
    for spec in registry.stores():
        entry = recorded.get(spec.name)
        if not isinstance(entry, Mapping):
            rows.append((spec.name, spec.sealed_by, NOT_RECORDED, NOT_RECORDED, NOT_RECORDED))
            continue
        crypto = _text(entry.get("cryptographic"))
        if entry.get("legacySealed"):
            crypto += f" ({entry['legacySealed']} version(s) sealed under their author's live key)"
        rows.append((spec.name, spec.sealed_by, crypto, _text(entry.get("physical")), guarantees.held(entry)))
    return rows


def _scope_rows(proof: Mapping[str, Any], scope: Mapping[str, Any]) -> list[tuple[str, str]]:
    """What the proof covers: scope, its hash, basis, policy, versions (and a sweep's day and categories)."""
    scope_rows = [
        ("Scope type", _text(scope.get("type"))),
        ("Scope hash (HMAC under the control-plane key)", _text(proof.get("scopeHash"))),
        ("Basis", _text(proof.get("basis"))),
        ("Policy version", _text(proof.get("policyVersion"))),
        ("Memory versions in scope", _text(proof.get("targetVersions"))),
    ]
    if proof.get("subjectEpoch") is not None:
        scope_rows.append(("Subject epoch", _text(proof.get("subjectEpoch"))))
    if proof.get("sweepDate"):
        scope_rows.append(("Retention sweep of", _text(proof.get("sweepDate"))))
        categories = proof.get("categories") or {}
        scope_rows.append(("Categories (versions)", ", ".join(f"{k}: {v}" for k, v in sorted(categories.items()))))
    return scope_rows


def build(proof: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> Certificate:
    """The certificate of one proof; `status` (DeletionLedger.status) adds the job's current state."""
    if not isinstance(proof, Mapping) or not proof.get("jobId"):
        raise ValidationError("proof", "is not a deletion proof (no jobId)")
    status = status or {}
    targets: Mapping[str, Any] = proof.get("targets") or {}
    verification: Mapping[str, Any] = proof.get("verification") or {}
    exact: Mapping[str, Any] = verification.get("exact_id_queries") or {}
    erasure: Mapping[str, Any] = proof.get("erasure") or {}
    scan: Mapping[str, Any] = erasure.get("byteScan") or {}
    scope: Mapping[str, Any] = proof.get("scope") or {}
    rows = _store_rows(targets, exact, proof.get("adapterVersions") or {}, proof.get("rebuilt") or {})
    probes: Mapping[str, Any] = verification.get("paraphrase_probes") or {}
    physical = targets.get("physical")
    erased_at = erasure.get("erasedAt")
    return Certificate(
        job_id=str(proof["jobId"]),
        tenant=_text(scope.get("tenant") or status.get("tenant_id")),
        state=_text(status.get("state") or "COMPLETE"),  # a proof exists once the job is COMPLETE
        scope=_scope_rows(proof, scope),
        timestamps=[
            ("Requested", _text(proof.get("requestedAt"))),
            # The request is accepted and its scope hidden from every read in the same transaction.
            ("Accepted (hidden from every read)", _text(status.get("created_at") or proof.get("requestedAt"))),
            ("Deadline", _text(proof.get("deadline"))),
            # An operator's pause held the cascade; the deadline ran on (it is never extended).
            *(
                (
                    f"Paused ({_text(p.get('scope'))}: {_text(p.get('reason'))})",
                    f"{_text(p.get('pausedAt'))} to {_text(p.get('resumedAt'))}",
                )
                for p in proof.get("pauses") or []
            ),
            ("Completed", _text(proof.get("completedAt"))),
            ("Physically erased", _text(erased_at) if erased_at else _physical(physical)),
        ],
        stores=rows,
        verification=[
            ("Lineage edges left", _text(exact.get("lineage"))),
            ("Paraphrase probes", _text(probes.get("probes"))),
            ("Paraphrase probe hits", _text(probes.get("hits"))),
        ],
        erasure=[
            ("Physical target", _physical(None if physical is None else str(physical))),
            ("Files scanned", _text(scan.get("files"))),
            ("Bytes scanned", _text(scan.get("bytes"))),
            ("Fingerprints", _text(scan.get("fingerprints"))),
            ("Hits", _text(scan.get("hits"))),
            ("Shared with live data", _text(scan.get("sharedWithLiveData"))),
            ("Scanned (directories under HOME)", _scanned(scan)),
            ("Not scanned (remote files)", ", ".join(map(str, scan.get("notScanned") or [])) or "none"),
            ("Key-encryption key", _keys(erasure.get("keys"))),
            ("PostgreSQL WAL", _wal(erasure.get("wal"))),
            (
                "Bytes rewritten",
                _text(sum(int(v) for v in (erasure.get("bytesRewritten") or {}).values()) if erasure else None),
            ),
        ],
        backups=[("Backups", _backups(None if targets.get("backups") is None else str(targets["backups"])))],
        guarantees=_guarantee_rows(proof.get("guarantees") or {}),
        deployment=[
            (row.target, row.mode, row.proven, row.operator_bounds, row.settings)
            for row in deployment.rows(erasure.get("deployment") or {})
        ],
        other_targets=[
            (str(name), str(value))
            for name, value in sorted(targets.items())
            if not registry.is_registered(name) and name not in ("physical", "backups")
        ],
    )


# -- Markdown -----------------------------------------------------------------------------------


def md_code(value: Any, *, table: bool = False) -> str:
    """A value as a Markdown code span: never markup, links or HTML, whatever it holds."""
    text = " ".join(str(value).split()).replace("`", "'")
    if table:
        text = text.replace("|", "\\|")
    return f"`{text}`" if text else "` `"


def _md_pairs(pairs: Sequence[tuple[str, str]]) -> list[str]:
    return [f"- **{label}:** {md_code(value)}" for label, value in pairs]


def render_markdown(proof: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> str:
    """The certificate as Markdown (what the forget run attaches to its metadata)."""
    cert = build(proof, status)
    lines = [
        f"# Deletion certificate {md_code(cert.job_id)}",
        "",
        f"- **Job:** {md_code(cert.job_id)}",
        f"- **Tenant:** {md_code(cert.tenant)}",
        f"- **State:** {md_code(cert.state)}",
        *_md_pairs(cert.scope),
        "",
        "## Timestamps",
        "",
        *_md_pairs(cert.timestamps),
        "",
        "## Stores",
        "",
        "| store | owner | adapter | target | records deleted | verification |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        "| "
        + " | ".join(
            md_code(v, table=True)
            for v in (row.store, row.owner, row.adapter_version, row.target, row.deleted, row.verification)
        )
        + " |"
        for row in cert.stores
    ]
    lines += ["", f"_{STORES_NOTE}_"]
    lines += ["", "## Verification", "", *_md_pairs(cert.verification)]
    lines += [
        "",
        "## Guarantees",
        "",
        "| store | sealed by | cryptographic | physical | held |",
        "|---|---|---|---|---|",
        *("| " + " | ".join(md_code(v, table=True) for v in row) + " |" for row in cert.guarantees),
        "",
        f"_{GUARANTEES_NOTE}_",
    ]
    lines += ["", "## What this deployment proves", ""]
    if cert.deployment:
        lines += ["| " + " | ".join(DEPLOYMENT_HEADER) + " |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(md_code(v, table=True) for v in row) + " |" for row in cert.deployment]
    else:
        lines += [f"_{DEPLOYMENT_PENDING}_"]
    lines += ["", "## Physical erasure", "", *_md_pairs(cert.erasure)]
    lines += ["", "## Backups", "", *_md_pairs(cert.backups)]
    if cert.other_targets:
        lines += ["", "## Other targets", "", *_md_pairs(cert.other_targets)]
    lines += ["", "## What no file-level proof reaches", ""]
    lines += [f"- {limit}" for limit in cert.limits]
    lines += ["", "## What the states mean", ""]
    lines += [f"- **{state}:** {meaning}" for state, meaning in MEANING.items()]
    lines += ["", "_This certificate holds ids, hashes, states, counts and times only; never memory content._", ""]
    return "\n".join(lines)


# -- HTML ---------------------------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2rem auto;max-width:64rem;color:#1b1f24;
padding:0 1rem;line-height:1.45}
h1{font-size:1.4rem;margin-bottom:.2rem}h2{font-size:1.1rem;margin-top:1.6rem;border-bottom:1px solid #d0d7de}
code{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:.9em;word-break:break-all}
table{border-collapse:collapse;width:100%;font-size:.92rem}th,td{border:1px solid #d0d7de;padding:.3rem .5rem;
text-align:left;vertical-align:top}th{background:#f6f8fa}dl{display:grid;grid-template-columns:max-content 1fr;
gap:.25rem 1rem}dt{font-weight:600}dd{margin:0}.ok{color:#1a7f37}.bad{color:#cf222e}.gap{color:#9a6700}
.note{color:#57606a;font-size:.88rem}@media print{body{margin:0}}
"""


def h(value: Any) -> str:
    """HTML-escape any value (quotes too), so nothing in a proof can become markup."""
    return html.escape(str(value), quote=True)


def _cls(value: str) -> str:
    if value == NOT_RECORDED:
        return "gap"
    if value.startswith(("FAILED", "BLOCKED")):
        return "bad"
    if value.startswith(("DONE", "passed", "ERASED", "SHREDDED", "COMPLETE", "KEY_DESTROYED", "SCANNED", "both")):
        return "ok"
    return ""


def _dl(pairs: Sequence[tuple[str, str]]) -> str:
    items = "".join(
        f'<dt>{h(label)}</dt><dd class="{_cls(value)}"><code>{h(value)}</code></dd>' for label, value in pairs
    )
    return f"<dl>{items}</dl>"


def render_html(proof: Mapping[str, Any], status: Mapping[str, Any] | None = None) -> str:
    """The certificate as one standalone HTML page (inline CSS, no external assets, every value escaped)."""
    cert = build(proof, status)
    header = ("store", "owner", "adapter", "target", "records deleted", "verification")
    rows = "".join(
        "<tr>"
        + "".join(
            f'<td class="{_cls(v)}"><code>{h(v)}</code></td>'
            for v in (row.store, row.owner, row.adapter_version, row.target, row.deleted, row.verification)
        )
        + "</tr>"
        for row in cert.stores
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>Deletion certificate {h(cert.job_id)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Deletion certificate <code>{h(cert.job_id)}</code></h1>",
        _dl([("Job", cert.job_id), ("Tenant", cert.tenant), ("State", cert.state), *cert.scope]),
        "<h2>Timestamps</h2>",
        _dl(cert.timestamps),
        "<h2>Stores</h2>",
        "<table><thead><tr>" + "".join(f"<th>{h(c)}</th>" for c in header) + "</tr></thead>",
        f"<tbody>{rows}</tbody></table>",
        f'<p class="note">{h(STORES_NOTE)}</p>',
        "<h2>Verification</h2>",
        _dl(cert.verification),
        "<h2>Guarantees</h2>",
        "<table><thead><tr>"
        + "".join(f"<th>{h(c)}</th>" for c in ("store", "sealed by", "cryptographic", "physical", "held"))
        + "</tr></thead><tbody>"
        + "".join(
            "<tr>" + "".join(f'<td class="{_cls(v)}"><code>{h(v)}</code></td>' for v in row) + "</tr>"
            for row in cert.guarantees
        )
        + "</tbody></table>",
        f'<p class="note">{h(GUARANTEES_NOTE)}</p>',
        "<h2>What this deployment proves</h2>",
        (
            "<table><thead><tr>"
            + "".join(f"<th>{h(c)}</th>" for c in DEPLOYMENT_HEADER)
            + "</tr></thead><tbody>"
            + "".join("<tr>" + "".join(f"<td>{h(v)}</td>" for v in row) + "</tr>" for row in cert.deployment)
            + "</tbody></table>"
            if cert.deployment
            else f'<p class="note">{h(DEPLOYMENT_PENDING)}</p>'
        ),
        "<h2>Physical erasure</h2>",
        _dl(cert.erasure),
        "<h2>Backups</h2>",
        _dl(cert.backups),
    ]
    if cert.other_targets:
        parts += ["<h2>Other targets</h2>", _dl(cert.other_targets)]
    parts += ["<h2>What no file-level proof reaches</h2>", "<ul>"]
    parts += [f"<li>{h(limit)}</li>" for limit in cert.limits]
    parts += ["</ul>", "<h2>What the states mean</h2>", "<dl>"]
    parts += [f"<dt>{h(state)}</dt><dd>{h(meaning.replace('`', ''))}</dd>" for state, meaning in MEANING.items()]
    parts += [
        "</dl>",
        '<p class="note">This certificate holds ids, hashes, states, counts and times only; never memory content.</p>',
        "</body></html>",
        "",
    ]
    return "\n".join(parts)


def render(proof: Mapping[str, Any], status: Mapping[str, Any] | None, fmt: str) -> str:
    """The certificate in `fmt` (md or html); json is the proof itself, printed by the caller."""
    if fmt == "md":
        return render_markdown(proof, status)
    if fmt == "html":
        return render_html(proof, status)
    raise ValidationError("format", f"must be one of {', '.join(FORMATS)}, got {fmt!r}")


# -- the tenant's data map ------------------------------------------------------------------------


def data_map(store: MemoryStore, tenant_id: str) -> dict[str, int]:
    """Records per registered store for one tenant: derived records by lineage, the primary's
    memory versions and the key store's keys (counts only)."""
    with store.transaction() as conn:
        return data_map_in(conn, tenant_id)


def data_map_in(conn: psycopg.Connection, tenant_id: str) -> dict[str, int]:
    """`data_map` on an open connection: each store's own count (its spec's `count`: the primary's
    versions, the key store's keys), else its records by lineage."""
    counts = lineage.record_counts(conn, tenant_id=tenant_id)
    return {
        spec.name: registry.resolve(spec.count)(conn, tenant_id) if spec.count else counts.get(spec.name, 0)
        for spec in registry.stores()
    }


def data_map_markdown(before: Mapping[str, int] | None, after: Mapping[str, int], *, image: bytes | None = None) -> str:
    """The data map as a Markdown table (before, after, removed per registered store), with the PNG
    inlined as a data: URI when given."""
    lines = ["| store | before | after | removed |", "|---|---:|---:|---:|"]
    for spec in registry.stores():
        b = None if before is None else before.get(spec.name)
        a = after.get(spec.name, 0)
        removed = "" if b is None else str(b - a)
        lines.append(f"| {md_code(spec.name, table=True)} | {'' if b is None else b} | {a} | {removed} |")
    if image is not None:
        lines += ["", f"![data map by lineage](data:image/png;base64,{base64.b64encode(image).decode('ascii')})"]
    return "\n".join(lines)


def _figure(width: float, height: float) -> Any:
    # The object API, not pyplot: no global figure state shared between threads or runs.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, fmt: str) -> bytes:
    out = io.BytesIO()
    fig.savefig(out, format=fmt)
    return out.getvalue()


def data_map_png(before: Mapping[str, int] | None, after: Mapping[str, int], *, title: str = "") -> bytes:
    """A bar chart of records per registered store, before and after a forget (PNG bytes)."""
    names = [spec.name for spec in registry.stores()]
    fig = _figure(8, 3.6)
    ax = fig.add_subplot()
    xs = list(range(len(names)))
    width = 0.4
    if before is not None:
        bars = ax.bar([x - width / 2 for x in xs], [before.get(n, 0) for n in names], width, label="before")
        ax.bar_label(bars, fontsize=7)
    bars = ax.bar([x + width / 2 for x in xs], [after.get(n, 0) for n in names], width, label="after")
    ax.bar_label(bars, fontsize=7)
    ax.set_xticks(xs, names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("records")
    ax.set_title(title or "Records per store by lineage", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return _save(fig, "png")


def _short(text: str, limit: int = 30) -> str:
    # The middle goes: a record id's end (":<version>") tells records of one memory apart.
    return text if len(text) <= limit else text[: limit - 12] + "…" + text[-11:]


def lineage_graph(records: Sequence[Mapping[str, Any]], *, title: str, fmt: str = "png") -> bytes:
    """One memory's lineage as a picture: its versions on the left, each derived record on the right
    (labelled store: record id, coloured by store), an edge per derivedFrom link. `fmt` png or svg."""
    if fmt not in ("png", "svg"):
        raise ValidationError("format", f"must be png or svg for a picture, got {fmt!r}")
    versions = sorted({int(r["version"]) for r in records})
    targets = sorted({(str(r["store"]), str(r["record_id"])) for r in records})
    height = max(2.5, 0.32 * max(len(targets), len(versions)) + 1.2)
    fig = _figure(8, height)
    ax = fig.add_subplot()
    ax.set_axis_off()
    ax.set_title(title, fontsize=10)
    if not records:
        ax.text(0.5, 0.5, "no derived records", ha="center", va="center")
        return _save(fig, fmt)

    def ys(n: int) -> list[float]:
        return [1.0 - (i + 0.5) / n for i in range(n)]

    v_at = dict(zip(versions, ys(len(versions)), strict=True))
    t_at = dict(zip(targets, ys(len(targets)), strict=True))
    stores = [spec.name for spec in registry.stores()]
    colors = {name: f"C{i % 10}" for i, name in enumerate(stores)}
    box = {"fc": "#f6f8fa", "ec": "grey"}
    memory_id = str(records[0].get("memory_id", ""))
    ax.text(0.02, 0.5, f"memory\n{_short(memory_id, 20)}", ha="left", va="center", fontsize=8, bbox=box)
    for r in records:
        key = (str(r["store"]), str(r["record_id"]))
        ax.plot([0.36, 0.58], [v_at[int(r["version"])], t_at[key]], color=colors.get(key[0], "grey"), lw=0.8)
    for version, y in v_at.items():
        ax.plot([0.2, 0.28], [0.5, y], color="grey", lw=0.8)
        ax.text(0.28, y, f"version {version}", ha="left", va="center", fontsize=8, bbox=box)
    for (store_name, record_id), y in t_at.items():
        ax.text(
            0.59,
            y,
            f"{store_name}: {_short(record_id)}",
            ha="left",
            va="center",
            fontsize=7,
            color=colors.get(store_name, "black"),
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    fig.tight_layout()
    return _save(fig, fmt)
