"""User and role writes (admin only)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction

from console.core.choices import AuditAction, Role
from console.core.roles import role_group
from console.core.services import audit_record

User = get_user_model()
_AUDIT_FIELDS = ("password", "last_login", "user_permissions")


def _user_state(user: Any) -> dict[str, Any]:
    return {
        "username": user.username,
        "email": user.email,
        "is_active": user.is_active,
        "roles": sorted(user.groups.values_list("name", flat=True)),
    }


def _set_role(user: Any, role: Role) -> None:
    user.groups.remove(*user.groups.filter(name__in=Role.values))
    user.groups.add(role_group(role))


@transaction.atomic
def user_create(
    *,
    actor: AbstractBaseUser | AnonymousUser | None,
    username: str,
    password: str,
    role: Role | str,
    email: str = "",
    is_active: bool = True,
) -> Any:
    """Create a user holding one role."""
    user = User.objects.create_user(
        username=username, email=email, password=password, is_active=is_active
    )
    _set_role(user, Role(role))
    audit_record(actor=actor, action=AuditAction.CREATE, instance=user, after=_user_state(user))
    return user


@transaction.atomic
def user_update(
    *,
    actor: AbstractBaseUser | AnonymousUser | None,
    user: Any,
    username: str | None = None,
    email: str | None = None,
    role: Role | str | None = None,
    password: str | None = None,
    is_active: bool | None = None,
) -> Any:
    """Change a user's attributes or role; a password change is audited without the value."""
    before = _user_state(user)
    if username is not None:
        user.username = username
    if email is not None:
        user.email = email
    if is_active is not None:
        user.is_active = is_active
    if password is not None:
        user.set_password(password)
    user.save()
    if role is not None:
        _set_role(user, Role(role))
    after = _user_state(user)
    if password is not None:
        after["password_changed"] = True
    audit_record(actor=actor, action=AuditAction.UPDATE, instance=user, before=before, after=after)
    return user
