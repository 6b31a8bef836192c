"""API permission: every endpoint needs a role.

Reads need ``viewer``. Writes need the view's ``write_role`` (default ``operator``); a view may
name a role per action in ``action_roles`` (``{"kill_switch": Role.OPERATOR}``) and a read role
in ``read_role`` (for views whose reads are sensitive).
"""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import SAFE_METHODS, BasePermission

from console.core.choices import Role
from console.core.roles import user_has_role


class RolePermission(BasePermission):
    message = "Your role does not allow this."

    def has_permission(self, request: Any, view: Any) -> bool:
        if not request.user or not request.user.is_authenticated:
            return False
        action = getattr(view, "action", None)
        action_roles: dict[str, Role] = getattr(view, "action_roles", {})
        if action in action_roles:
            required = action_roles[action]
        elif request.method in SAFE_METHODS:
            required = getattr(view, "read_role", Role.VIEWER)
        else:
            required = getattr(view, "write_role", Role.OPERATOR)
        return user_has_role(request.user, required)
