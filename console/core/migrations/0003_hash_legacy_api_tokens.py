"""Move the tokens of DRF's ``rest_framework.authtoken`` (stored in plaintext in
``authtoken_token``) into ``core.ApiToken`` as their sha256, then drop that table, so existing
clients keep working with the same ``Authorization: Token <key>`` and the database no longer
holds a usable token.

The table is read with plain SQL: ``rest_framework.authtoken`` is no longer installed, so its
models and migrations are not available here. A database that never had it (a new install)
has nothing to move. Not reversible: the plaintext is gone (migrating back leaves the legacy
tokens unusable; issue new ones)."""

import hashlib
from datetime import UTC

from django.db import migrations

LEGACY_TABLE = "authtoken_token"


def hash_legacy_tokens(apps, schema_editor):
    connection = schema_editor.connection
    if LEGACY_TABLE not in connection.introspection.table_names():
        return
    ApiToken = apps.get_model("core", "ApiToken")
    table = schema_editor.quote_name(LEGACY_TABLE)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {schema_editor.quote_name('key')}, user_id, created FROM {table}")  # noqa: S608
        rows = cursor.fetchall()
    for key, user_id, created in rows:
        token, _ = ApiToken.objects.get_or_create(
            token_hash=hashlib.sha256(key.encode()).hexdigest(),
            defaults={"user_id": user_id, "token_prefix": key[:12], "name": "legacy"},
        )
        # auto_now_add stamped "now": keep when the token was really issued (SQLite hands
        # back a naive UTC time).
        if created is not None and created.tzinfo is None:
            created = created.replace(tzinfo=UTC)
        ApiToken.objects.filter(pk=token.pk).update(created_at=created)
    schema_editor.execute(f"DROP TABLE {table}")


class Migration(migrations.Migration):
    dependencies = [
        ("core", "0002_apitoken"),
    ]

    operations = [
        migrations.RunPython(hash_legacy_tokens, migrations.RunPython.noop, elidable=False),
    ]
