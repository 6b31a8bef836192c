import django.db.models.deletion
from django.conf import settings
from django.db import migrations, models


def create_role_groups(apps, schema_editor):
    Group = apps.get_model("auth", "Group")
    for name in ("viewer", "operator", "admin"):
        Group.objects.get_or_create(name=name)


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
        ("auth", "0012_alter_user_first_name_max_length"),
    ]

    operations = [
        migrations.CreateModel(
            name="AuditLog",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("actor_label", models.CharField(help_text="Username or system component at the time of the change (kept if the user is deleted).", max_length=150)),
                ("action", models.CharField(choices=[("create", "Create"), ("update", "Update"), ("delete", "Delete"), ("action", "Action")], max_length=16)),
                ("verb", models.CharField(blank=True, help_text="For actions: what was done (restore, kill_switch, deploy ...).", max_length=64)),
                ("object_type", models.CharField(help_text="app_label.model of the changed object.", max_length=100)),
                ("object_id", models.CharField(blank=True, max_length=64)),
                ("object_repr", models.CharField(blank=True, max_length=200)),
                ("before", models.JSONField(blank=True, null=True)),
                ("after", models.JSONField(blank=True, null=True)),
                ("request_id", models.CharField(blank=True, max_length=64)),
                ("created_at", models.DateTimeField(auto_now_add=True, db_index=True)),
                ("actor", models.ForeignKey(blank=True, help_text="The user who made the change (empty for system actions).", null=True, on_delete=django.db.models.deletion.SET_NULL, related_name="audit_entries", to=settings.AUTH_USER_MODEL)),
            ],
            options={
                "ordering": ["-created_at", "-id"],
                "indexes": [models.Index(fields=["object_type", "object_id"], name="audit_object_idx")],
            },
        ),
        migrations.RunPython(create_role_groups, migrations.RunPython.noop),
    ]
