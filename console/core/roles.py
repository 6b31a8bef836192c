"""Role lookup. Roles are Django groups named after ``Role`` values; superusers are admins."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser, Group

from console.core.choices import ROLE_RANK, Role


def user_role(user: AbstractBaseUser | AnonymousUser | None) -> Role | None:
    """The highest role a user holds, or None for anonymous users and users with no role."""
    if user is None or not user.is_authenticated or not user.is_active:
        return None
    if getattr(user, "is_superuser", False):
        return Role.ADMIN
    names = getattr(user, "_pdbridge_group_names", None)
    if names is None:
        names = set(user.groups.values_list("name", flat=True))  # type: ignore[attr-defined]
        user._pdbridge_group_names = names  # cache for this request's user object
    held = [Role(name) for name in names if name in Role.values]
    if not held:
        return None
    return max(held, key=lambda role: ROLE_RANK[role])


def user_has_role(user: AbstractBaseUser | AnonymousUser | None, role: Role) -> bool:
    """Whether ``user`` holds ``role`` or a higher one."""
    held = user_role(user)
    return held is not None and ROLE_RANK[held] >= ROLE_RANK[role]


def role_group(role: Role) -> Group:
    group, _ = Group.objects.get_or_create(name=role.value)
    return group
