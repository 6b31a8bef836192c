import pytest
from django.core.management import call_command


def test_openapi_schema_generates_without_warnings(tmp_path):
    out = tmp_path / "schema.yaml"

    call_command("spectacular", "--fail-on-warn", "--file", str(out))

    text = out.read_text()
    for path in ["/api/heartbeats/", "/api/deployments/{id}/config/", "/api/models/{id}/kv-size/"]:
        assert path in text
    assert "nodeToken" in text


@pytest.mark.django_db
def test_models_and_migrations_agree():
    call_command("makemigrations", "--check", "--dry-run", verbosity=0)
