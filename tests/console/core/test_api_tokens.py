"""User API tokens are stored hashed (#44, item 9), as node tokens and gateway client keys
are: the same ``Authorization: Token <key>`` works, the database holds only the sha256, the
token is shown once (password exchange, admin, management command), and the migration from
DRF's plaintext ``authtoken_token`` keeps existing clients working."""

from __future__ import annotations

import hashlib
import io
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from rest_framework.test import APIClient

from console.core.models import ApiToken, AuditLog
from console.core.services_tokens import api_token_issue, api_token_revoke
from tests.support import unavailable


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def me(token: str) -> Any:
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    return api.get("/api/me/")


def tables_holding(text: str) -> list[str]:
    """Every table with a row whose text form contains ``text`` (PostgreSQL: ``row::text``)."""
    if connection.vendor != "postgresql":
        unavailable("the whole-database scan needs PostgreSQL")
    found = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            name = connection.ops.quote_name(table)
            cursor.execute(f"SELECT 1 FROM {name} t WHERE t::text LIKE %s LIMIT 1", [f"%{text}%"])  # noqa: S608
            if cursor.fetchone():
                found.append(table)
    return found


@pytest.mark.django_db
def test_password_exchange_token_works_and_the_database_holds_only_its_hash(make_user, client):
    make_user("operator", username="ci")

    response = client.post(
        "/api/auth/token/", {"username": "ci", "password": "pw-for-tests-1", "name": "nightly"}
    )

    assert response.status_code == 200
    body = response.json()
    token = body["token"]
    assert token.startswith("pdbu_")
    assert (body["token_prefix"], body["name"]) == (token[:12], "nightly")
    answer = me(token)
    assert answer.status_code == 200
    assert (answer.json()["username"], answer.json()["role"]) == ("ci", "operator")
    row = ApiToken.objects.get()
    assert (row.token_hash, row.token_prefix, row.name) == (sha256(token), token[:12], "nightly")
    assert tables_holding(token) == []  # not in the token table, the audit log, anywhere
    entry = AuditLog.objects.get(verb="token_issue")
    assert (entry.actor_label, entry.after["token_prefix"]) == ("ci", token[:12])


@pytest.mark.django_db
def test_each_exchange_issues_another_token_and_both_work(make_user, client):
    make_user("viewer", username="two")
    login = {"username": "two", "password": "pw-for-tests-1"}

    first = client.post("/api/auth/token/", login).json()["token"]
    second = client.post("/api/auth/token/", login, content_type="application/json").json()["token"]

    assert first != second
    assert [me(first).status_code, me(second).status_code] == [200, 200]


@pytest.mark.django_db
def test_bad_revoked_and_inactive_tokens_are_401(make_user):
    user = make_user("viewer")
    row, token = api_token_issue(actor=None, user=user)
    other_user = make_user("viewer")
    _, inactive = api_token_issue(actor=None, user=other_user)
    other_user.is_active = False
    other_user.save()

    wrong = me(token + "x")
    row_id = row.pk
    api_token_revoke(actor=None, token=row)
    revoked = me(token)
    refused = me(inactive)

    assert [wrong.status_code, revoked.status_code, refused.status_code] == [401, 401, 401]
    assert wrong["WWW-Authenticate"] == "Token"
    assert wrong.json() == {"detail": "Invalid token."}
    assert refused.json() == {"detail": "User inactive or deleted."}
    assert AuditLog.objects.filter(verb="token_revoke", object_id=str(row_id)).count() == 1


@pytest.mark.django_db
def test_management_command_prints_a_working_token(make_user):
    make_user("admin", username="ops")
    out = io.StringIO()

    call_command("api_token_issue", "ops", "--name", "deploy-bot", stdout=out)

    token = out.getvalue().strip()
    assert me(token).json()["username"] == "ops"
    assert ApiToken.objects.get().name == "deploy-bot"


@pytest.mark.django_db
def test_admin_issues_a_token_shown_once_and_revokes_it(client, django_user_model, make_user):
    root = django_user_model.objects.create_superuser("root", "", "pw-for-tests-1")
    client.force_login(root)
    user = make_user("viewer", username="scripted")

    issued = client.post(
        "/admin/core/apitoken/add/", {"user": user.pk, "name": "laptop"}, follow=True
    )

    shown = [str(m) for m in issued.context["messages"]]
    assert len(shown) == 2, shown  # the token, then the admin's own "added" line
    token = shown[0].split(": ", 1)[1].split(" ", 1)[0]
    assert me(token).json()["username"] == "scripted"
    row = ApiToken.objects.get()
    assert (row.created_by, row.name) == (root, "laptop")
    listing = client.get("/admin/core/apitoken/").content.decode()
    assert row.token_prefix in listing
    assert token not in listing
    client.post(f"/admin/core/apitoken/{row.pk}/delete/", {"post": "yes"})
    assert me(token).status_code == 401


LEGACY_KEY = "3f2a9c0d5b7e14c6a8f0e2d4b6c8a0e1f3d5b7c9"  # a DRF token: 40 hex characters


@pytest.mark.django_db(transaction=True)
def test_migration_hashes_existing_drf_tokens_in_place(make_user):
    """An install from before: DRF's ``authtoken_token`` with a plaintext key. After the
    migration the same key still authenticates, and no plaintext is left (the table is
    dropped)."""
    user = make_user("operator", username="legacy")
    executor = MigrationExecutor(connection)
    executor.migrate([("core", "0002_apitoken")])
    with connection.cursor() as cursor:
        cursor.execute(
            'CREATE TABLE "authtoken_token" ("key" varchar(40) NOT NULL PRIMARY KEY, '
            '"created" timestamp with time zone NOT NULL, "user_id" integer NOT NULL UNIQUE)'
        )
        cursor.execute(
            'INSERT INTO "authtoken_token" ("key", "created", "user_id") '
            "VALUES (%s, '2025-03-01T12:00:00Z', %s)",
            [LEGACY_KEY, user.pk],
        )

    executor = MigrationExecutor(connection)
    executor.loader.build_graph()
    executor.migrate([("core", "0003_hash_legacy_api_tokens")])

    assert "authtoken_token" not in connection.introspection.table_names()
    row = ApiToken.objects.get()
    assert (row.user_id, row.token_hash, row.name) == (user.pk, sha256(LEGACY_KEY), "legacy")
    assert row.created_at.isoformat() == "2025-03-01T12:00:00+00:00"
    answer = me(LEGACY_KEY)
    assert answer.status_code == 200
    assert answer.json()["username"] == "legacy"
    assert tables_holding(LEGACY_KEY) == []
