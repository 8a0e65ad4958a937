import os

import pytest

from memory_pipelines.lib.infra import validation
from memory_pipelines.lib.infra.errors import ValidationError


@pytest.mark.parametrize("bad", ["", "a b", "x;DROP TABLE memories", "o'brien", "a" * 65, "-lead", "ü", None, 3])
def test_ids_reject_malformed_values_and_name_the_field(bad):
    with pytest.raises(ValidationError) as err:
        validation.check_id("tenant", bad)
    assert err.value.field == "tenant"


@pytest.mark.parametrize("good", ["acme", "team_42", "user.7", "a-b", "A" * 64])
def test_ids_accept_opaque_keys(good):
    assert validation.check_id("user", good) == good


def test_memory_id_format():
    generated = validation.new_memory_id()
    assert validation.check_memory_id("memory_id", generated) == generated
    for bad in ["m_123", "m_" + "G" * 32, "1; DELETE FROM memory.memories", generated.upper()]:
        with pytest.raises(ValidationError, match="memory_id"):
            validation.check_memory_id("memory_id", bad)


def test_text_limits_are_in_utf8_bytes():
    limit = validation.MAX_TEXT_BYTES
    assert validation.check_text("text", "a" * limit) == "a" * limit
    with pytest.raises(ValidationError, match="65537 bytes"):
        validation.check_text("text", "a" * (limit + 1))
    with pytest.raises(ValidationError, match="bytes"):
        validation.check_text("text", "é" * (limit // 2 + 1))  # 2 bytes each
    for blank in ["", "   ", "\n\t"]:
        with pytest.raises(ValidationError, match="empty"):
            validation.check_text("text", blank)


def test_text_may_contain_sql_metacharacters():
    text = "Robert'); DROP TABLE memory.memories;-- \\ % _ $1"
    assert validation.check_text("text", text) == text


@pytest.mark.parametrize("bad", [-0.01, 1.01, float("nan"), "0.5", True])
def test_confidence_range(bad):
    with pytest.raises(ValidationError, match="confidence"):
        validation.check_confidence(bad)


def test_category_and_sharing_mode():
    assert validation.check_category("medical") == "medical"
    with pytest.raises(ValidationError, match="category"):
        validation.check_category("Medical'--")
    with pytest.raises(ValidationError, match="sharing_mode"):
        validation.check_sharing_mode("everyone")


# Python decodes argv (and a C-locale stdin) with surrogateescape: b"caf\xe9" arrives as "caf\udce9".
UNDECODABLE = os.fsdecode(b"caf\xe9")


@pytest.mark.parametrize("bad", [UNDECODABLE, "\ud800", "ok \udfff ok"])
def test_text_that_is_not_utf8_is_refused_naming_the_field(bad):
    with pytest.raises(ValidationError) as err:
        validation.check_text("original_query", bad)
    assert err.value.field == "original_query" and "UTF-8" in err.value.message
    with pytest.raises(ValidationError) as id_err:
        validation.check_id("tenant", bad)
    assert id_err.value.field == "tenant"


def test_the_undecodable_byte_is_named():
    with pytest.raises(ValidationError, match="byte 0xe9 at character 3"):
        validation.check_utf8("text", UNDECODABLE)
    with pytest.raises(ValidationError, match="U\\+D800"):
        validation.check_utf8("text", "\ud800")
    assert validation.check_utf8("text", "café ☕") == "café ☕"


@pytest.mark.parametrize("field", ["text", "original_query", "query", "prompt"])
def test_nul_is_refused_in_every_text_field(field):
    with pytest.raises(ValidationError, match="NUL") as err:
        validation.check_text(field, "a\x00b")
    assert err.value.field == field


@pytest.mark.parametrize("bad", [0, -1, 2**31, 10**30, True, "1", 1.0])
def test_versions_fit_the_database_column(bad):
    with pytest.raises(ValidationError) as err:
        validation.check_version(bad)
    assert err.value.field == "version"
    assert validation.check_version(2**31 - 1) == 2**31 - 1


def test_a_dagster_url_our_commands_exported_is_not_taken_for_the_users():
    from memory_pipelines.lib.infra.settings import ENV_DAGSTER_PG_URL, ENV_DAGSTER_PG_URL_EXPORTED, Settings

    url = "postgresql+psycopg2://postgres@/dagster?host=%2Fother%2Fhome%2Fpg%2Fdata"
    # Exported by a command for its HOME (marked): a process of another HOME computes its own.
    assert Settings.from_env({ENV_DAGSTER_PG_URL: url, ENV_DAGSTER_PG_URL_EXPORTED: url}).dagster_pg_url is None
    # Set by the user (unmarked, or marked with another value): theirs, whatever the HOME.
    assert Settings.from_env({ENV_DAGSTER_PG_URL: url}).dagster_pg_url == url
    assert Settings.from_env({ENV_DAGSTER_PG_URL: url, ENV_DAGSTER_PG_URL_EXPORTED: url + "x"}).dagster_pg_url == url
