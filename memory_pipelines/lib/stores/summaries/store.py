"""Subject and team summaries: an extractive default that needs no network, or an OpenAI-compatible
HTTP summarizer. Modes (per subject): full original, summary, hybrid (medical and legal always
keep the full original). Each build of a summary is sealed under a key of its own (a build key,
wrapped by the tenant's KEK) that the next build destroys, with lineage to every source version.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from typing import Protocol

import httpx
import psycopg

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import MemoryPipelinesError, NotFoundError, ValidationError
from memory_pipelines.lib.memories import crypto, ordering
from memory_pipelines.lib.memories.keys import BUILD_KEY_PREFIX
from memory_pipelines.lib.memories.store import CurrentVersion, MemoryStore
from memory_pipelines.lib.results import Summary, SummaryMode
from memory_pipelines.lib.stores import lineage

__all__ = [
    "BUILD_KEY_PURPOSE",
    "DEFAULT_MODE",
    "MODES",
    "SENSITIVE_CATEGORIES",
    "SUBJECT_STORE",
    "TEAM_STORE",
    "ExtractiveSummarizer",
    "OpenAICompatibleSummarizer",
    "Summarizer",
    "SummarizerError",
    "SummaryStore",
    "compose",
]

SUBJECT_STORE = "subject_summaries"
TEAM_STORE = "team_summaries"
MODES = ("full", "summary", "hybrid")
DEFAULT_MODE = "hybrid"
SENSITIVE_CATEGORIES = frozenset({"medical", "legal"})
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
BUILD_KEY_PURPOSE = "summary"


class SummarizerError(MemoryPipelinesError):
    """The summarizer failed or answered something unusable; nothing was overwritten."""

    exit_code = 6

    def __init__(self, message: str) -> None:
        super().__init__("summarizer", message)


class Summarizer(Protocol):
    name: str

    def summarize(self, texts: list[str]) -> str: ...


class ExtractiveSummarizer:
    """Deterministic and offline: the first sentence of each memory, most confident first, bounded."""

    name = "extractive-v1"

    def __init__(self, *, max_chars: int = 2000, max_sentence_chars: int = 200) -> None:
        self.max_chars = max_chars
        self.max_sentence_chars = max_sentence_chars

    def summarize(self, texts: list[str]) -> str:
        lines: list[str] = []
        seen: set[str] = set()
        size = 0
        for text in texts:
            first = _SENTENCE_END.split(text.strip(), maxsplit=1)[0].strip()
            if len(first) > self.max_sentence_chars:
                first = first[: self.max_sentence_chars - 1].rstrip() + "…"
            if not first or first.casefold() in seen:
                continue
            line = f"- {first}"
            if size + len(line) + 1 > self.max_chars:
                break
            seen.add(first.casefold())
            lines.append(line)
            size += len(line) + 1
        return "\n".join(lines)


class OpenAICompatibleSummarizer:
    """POST {base_url}/chat/completions (OpenAI's API shape), e.g. vLLM, Ollama, OpenAI itself."""

    def __init__(self, *, base_url: str, model: str, api_key: str | None = None, timeout: float = 60.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.name = f"openai-compatible:{model}"

    def summarize(self, texts: list[str]) -> str:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {
            "model": self.model,
            "temperature": 0,
            "messages": [
                {
                    "role": "system",
                    "content": "Summarise these facts a user's assistant remembers about them, as short bullet "
                    "points. Keep every fact; add nothing.",
                },
                {"role": "user", "content": "\n".join(f"- {t}" for t in texts)},
            ],
        }
        url = f"{self.base_url}/chat/completions"
        try:
            response = httpx.post(url, json=body, headers=headers, timeout=self.timeout)
        except httpx.HTTPError as exc:
            raise SummarizerError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code != 200:
            raise SummarizerError(f"{url} answered HTTP {response.status_code}")
        try:
            content = response.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise SummarizerError(f"{url} answered something that is not a chat completion") from exc
        if not isinstance(content, str) or not content.strip():
            raise SummarizerError(f"{url} answered an empty summary")
        return content.strip()


def compose(mode: str, rows: list[tuple[CurrentVersion, str]], summarizer: Summarizer) -> str:
    """The summary text of one subject or team under `mode`."""
    if mode == "full":
        return "\n".join(f"- {text}" for _, text in rows)
    if mode == "summary":
        return summarizer.summarize([text for _, text in rows])
    kept = [text for cv, text in rows if cv.category in SENSITIVE_CATEGORIES]
    summarised = [text for cv, text in rows if cv.category not in SENSITIVE_CATEGORIES]
    parts = [summarizer.summarize(summarised)] if summarised else []
    parts += [f"- {text}" for text in kept]
    return "\n".join(parts)


def _sources_hash(mode: str, summarizer: str, sources: list[tuple[str, int]]) -> bytes:
    digest = hashlib.sha256(f"{mode}\x1f{summarizer}".encode())
    for memory_id, version in sources:
        digest.update(f"\x1e{memory_id}:{version}".encode())
    return digest.digest()


def _aad(tenant_id: str, scope: str, scope_id: str) -> bytes:
    return crypto.aad("summary", tenant_id, scope, scope_id)


class SummaryStore:
    """Builds, stores (encrypted) and reads subject and team summaries."""

    def __init__(self, store: MemoryStore, summarizer: Summarizer) -> None:
        self.store = store
        self.summarizer = summarizer

    def set_mode(self, *, tenant_id: str, subject: str, mode: str) -> SummaryMode:
        validation.check_id("subject", subject)
        if mode not in MODES:
            raise ValidationError("mode", f"must be one of {', '.join(MODES)}")
        self.store.require_tenant(tenant_id=tenant_id)
        with self.store.transaction() as conn:
            conn.execute(
                "INSERT INTO derived.summary_modes (tenant_id, user_id, mode) VALUES (%s, %s, %s)"
                " ON CONFLICT (tenant_id, user_id) DO UPDATE SET mode = EXCLUDED.mode",
                (tenant_id, subject, mode),
            )
        return {"tenant_id": tenant_id, "subject": subject, "mode": mode}

    def _modes(self, tenant_id: str) -> dict[str, str]:
        with self.store.transaction() as conn:
            return dict(
                conn.execute("SELECT user_id, mode FROM derived.summary_modes WHERE tenant_id = %s", (tenant_id,))
            )

    def sync(self, *, tenant_id: str, scope: str, scope_ids: list[str] | None = None) -> dict[str, int]:
        """Rebuild the summaries of `scope` ('subject' or 'team') whose sources or mode changed.

        `scope_ids` limits the work to those subjects or teams (a deletion knows which it touched).
        """
        groups = self._groups(tenant_id, scope, scope_ids)
        modes = self._modes(tenant_id) if scope == "subject" else {}
        store_name = SUBJECT_STORE if scope == "subject" else TEAM_STORE
        with self.store.transaction() as conn:
            existing = dict(
                conn.execute(
                    "SELECT scope_id, sources_hash FROM derived.summaries WHERE tenant_id = %s AND scope = %s"
                    " AND (%s::text[] IS NULL OR scope_id = ANY(%s))",
                    (tenant_id, scope, scope_ids, scope_ids),
                ).fetchall()
            )
        outcomes = {"built": 0, "unchanged": 0, "discarded": 0}
        for scope_id, members in sorted(groups.items()):
            members.sort(key=lambda cv: (-cv.confidence, cv.version_created_at, cv.memory_id))
            mode = modes.get(scope_id, DEFAULT_MODE)
            outcome = self._build(tenant_id, scope, scope_id, members, mode, existing.get(scope_id), store_name)
            outcomes[outcome] += 1
        gone = sorted(set(existing) - set(groups))
        if gone:
            self._remove(tenant_id, scope, gone, store_name)
        return {
            "summaries": len(groups),
            "rebuilt": outcomes["built"],
            "unchanged": outcomes["unchanged"],
            "removed": len(gone),
            "discarded": outcomes["discarded"],
        }

    def _groups(self, tenant_id: str, scope: str, scope_ids: list[str] | None) -> dict[str, list[CurrentVersion]]:
        """The current versions each summary of `scope` (of `scope_ids`, or all) is built from."""
        if scope_ids is None:
            current = self.store.current_versions(tenant_id=tenant_id)
        elif scope == "subject":
            current = self.store.current_versions(tenant_id=tenant_id, user_ids=scope_ids)
        else:
            current = self.store.current_versions(tenant_id=tenant_id, team_ids=scope_ids)
        groups: dict[str, list[CurrentVersion]] = defaultdict(list)
        for cv in current:
            if scope == "subject" and cv.team_id is None:
                groups[cv.user_id].append(cv)
            elif scope == "team" and cv.team_id is not None:
                groups[cv.team_id].append(cv)
        if scope_ids is not None:
            groups = defaultdict(list, {k: v for k, v in groups.items() if k in set(scope_ids)})
        return groups

    def _build(
        self,
        tenant_id: str,
        scope: str,
        scope_id: str,
        members: list[CurrentVersion],
        mode: str,
        stored_hash: bytes | None,
        store_name: str,
    ) -> str:
        """Build and store one summary unless its stored build is of the same sources and mode;
        returns 'built', 'unchanged' or 'discarded' (a source forgotten, or a key gone, meanwhile)."""
        sources = sorted(cv.source for cv in members)
        digest = _sources_hash(mode, self.summarizer.name, sources)
        if stored_hash is not None and bytes(stored_hash) == digest:
            return "unchanged"
        texts = self.store.open_texts(tenant_id=tenant_id, sources=sources, skip_unreadable=True)
        if len(texts) < len(sources):
            return "discarded"  # a key was destroyed since we listed the sources: a deletion is running
        summary = compose(mode, [(cv, texts[cv.source]) for cv in members], self.summarizer)
        del texts
        record_id = f"{scope}:{scope_id}"
        with self.store.transaction() as conn:
            # The summarizer may have taken seconds: if any source was forgotten meanwhile, the
            # summary states forgotten text and is dropped (the cascade rebuilds it without).
            if ordering.guard_build(conn, tenant_id, [(cv.memory_id, cv.version, cv.epoch) for cv in members]):
                return "discarded"
            try:
                if scope == "subject":  # never a summary of a subject whose key is gone
                    self.store.keys.subject_key(conn, tenant_id, scope_id, create=False)
                # A key of this build only: replacing the row below deletes the previous build's key
                # in this transaction (migration 0015), so the old summary, wherever PostgreSQL's
                # history keeps it, is sealed under a key that no longer exists.
                key_id, key = self.store.keys.new_build_key(conn, tenant_id, BUILD_KEY_PURPOSE)
            except NotFoundError:
                return "discarded"
            sealed = crypto.seal(key, summary.encode(), _aad(tenant_id, scope, scope_id))
            conn.execute(
                "INSERT INTO derived.summaries (tenant_id, scope, scope_id, mode, summary_ct, key_id,"
                " sources_hash, source_count, summarizer) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s)"
                " ON CONFLICT (tenant_id, scope, scope_id) DO UPDATE SET mode = EXCLUDED.mode,"
                " summary_ct = EXCLUDED.summary_ct, key_id = EXCLUDED.key_id,"
                " sources_hash = EXCLUDED.sources_hash, source_count = EXCLUDED.source_count,"
                " summarizer = EXCLUDED.summarizer, created_at = now()",
                (tenant_id, scope, scope_id, mode, sealed, key_id, digest, len(sources), self.summarizer.name),
            )
            lineage.record_edges(conn, tenant_id=tenant_id, store=store_name, record_id=record_id, sources=sources)
        return "built"

    def _remove(self, tenant_id: str, scope: str, gone: list[str], store_name: str) -> None:
        """Delete the summaries of `gone` (subjects or teams with no current version left) and their lineage."""
        with self.store.transaction() as conn:
            conn.execute(
                "DELETE FROM derived.summaries WHERE tenant_id = %s AND scope = %s AND scope_id = ANY(%s)",
                (tenant_id, scope, gone),
            )
            lineage.remove_records(
                conn, tenant_id=tenant_id, store=store_name, record_ids=[f"{scope}:{g}" for g in gone]
            )

    def read(self, *, tenant_id: str, scope: str, scope_id: str) -> Summary:
        """The decrypted summary of one subject or team, with its sources."""
        validation.check_id("subject" if scope == "subject" else "team", scope_id)
        self.store.require_tenant(tenant_id=tenant_id)
        with self.store.transaction() as conn:
            row = conn.execute(
                "SELECT mode, summary_ct, source_count, summarizer, created_at, key_id FROM derived.summaries"
                " WHERE tenant_id = %s AND scope = %s AND scope_id = %s",
                (tenant_id, scope, scope_id),
            ).fetchone()
            field = "subject" if scope == "subject" else "team"
            if row is None:
                raise NotFoundError(field, f"no {scope} summary for {scope_id!r}")
            record_sources = lineage.sources_of_record(
                conn,
                tenant_id=tenant_id,
                store=SUBJECT_STORE if scope == "subject" else TEAM_STORE,
                record_id=f"{scope}:{scope_id}",
            )
            # Hide at once: a summary stating anything whose deletion was accepted is not shown,
            # even before the cascade rebuilds it (or while that job is BLOCKED).
            hidden = ordering.hidden_sources(conn, tenant_id, [(s["memory_id"], s["version"]) for s in record_sources])
            if hidden or (scope == "subject" and self._forgotten(conn, tenant_id, scope_id)):
                raise NotFoundError(
                    field, f"the {scope} summary of {scope_id!r} is being rebuilt after a deletion; try again later"
                )
            key = self._key(conn, tenant_id, scope, scope_id, str(row[5]))
            text = crypto.open_sealed(key, bytes(row[1]), _aad(tenant_id, scope, scope_id)).decode()
            sources = record_sources
        return {
            "tenant_id": tenant_id,
            "scope": scope,
            "scope_id": scope_id,
            "mode": row[0],
            "summary": text,
            "source_count": row[2],
            "summarizer": row[3],
            "created_at": row[4].isoformat(),
            "sources": sources,
        }

    def _key(self, conn: psycopg.Connection, tenant_id: str, scope: str, scope_id: str, key_id: str) -> bytes:
        """The key a stored summary names: its build's key, or (built before per-build keys) the
        subject's key by its id (retired once their texts are converted to version keys) or the team's."""
        keys = self.store.keys
        if key_id.startswith(BUILD_KEY_PREFIX) or scope == "subject":
            return keys.key_by_id(conn, tenant_id, key_id)
        return keys.team_key(conn, tenant_id, scope_id, create=False)[1]

    @staticmethod
    def _forgotten(conn: psycopg.Connection, tenant_id: str, subject: str) -> bool:
        row = conn.execute(
            "SELECT forgotten_at IS NOT NULL FROM memory.subjects WHERE tenant_id = %s AND user_id = %s",
            (tenant_id, subject),
        ).fetchone()
        return row is not None and bool(row[0])

    def check(self, *, tenant_id: str, scope: str) -> dict[str, int]:
        """Counts that must be zero: summaries without lineage, summaries built from non-current versions."""
        current = {cv.source for cv in self.store.current_versions(tenant_id=tenant_id)}
        store_name = SUBJECT_STORE if scope == "subject" else TEAM_STORE
        with self.store.transaction() as conn:
            ids = [
                f"{scope}:{r[0]}"
                for r in conn.execute(
                    "SELECT scope_id FROM derived.summaries WHERE tenant_id = %s AND scope = %s", (tenant_id, scope)
                )
            ]
            edges = lineage.records_of_store(conn, tenant_id=tenant_id, store=store_name)
        return {
            "records": len(ids),
            "without_lineage": sum(1 for i in ids if not edges.get(i)),
            "from_non_current_versions": sum(1 for i in ids if edges.get(i, set()) - current),
        }
