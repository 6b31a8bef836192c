from django.db import models


class Role(models.TextChoices):
    """Console roles, each including the rights of the ones before it."""

    # Reads everything; changes nothing.
    VIEWER = "viewer", "Viewer"
    # Deployments, rollout plans, canaries, drills, the kill switch.
    OPERATOR = "operator", "Operator"
    # Sites, nodes, links, users and credentials.
    ADMIN = "admin", "Admin"


ROLE_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}


class AuditAction(models.TextChoices):
    """What a write did."""

    CREATE = "create", "Create"
    UPDATE = "update", "Update"
    DELETE = "delete", "Delete"
    # A verb on an object (restore a snapshot, flip the kill switch, start a run ...).
    ACTION = "action", "Action"
