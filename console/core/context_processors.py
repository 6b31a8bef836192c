from typing import Any

from django.http import HttpRequest

from console.core.choices import Role
from console.core.nav import nav_items
from console.core.roles import user_has_role, user_role


def roles(request: HttpRequest) -> dict[str, Any]:
    """Template flags so pages show only the buttons a user's role allows."""
    user = getattr(request, "user", None)
    role = user_role(user)
    return {
        "user_role": role,
        "nav": nav_items(role),
        "can_operate": user_has_role(user, Role.OPERATOR),
        "can_admin": user_has_role(user, Role.ADMIN),
    }
