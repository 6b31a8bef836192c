"""Shared plumbing of the server-rendered pages: role checks for reads and writes, and
pagination. Page views call services for every write (never ``save()``); a refused write is a
403 page, a bad value a message naming the field, never a 500."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

from django.contrib.auth.decorators import login_required
from django.core.exceptions import PermissionDenied
from django.core.paginator import Page, Paginator
from django.db.models import QuerySet
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_POST

from console.core.choices import Role
from console.core.roles import user_has_role

PER_PAGE = 50

View = TypeVar("View", bound=Callable[..., HttpResponse])


def page_view(view: View) -> View:
    """A read page: logged in (else the login page) and holding at least the viewer role
    (else 403)."""

    @login_required
    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not user_has_role(request.user, Role.VIEWER):
            raise PermissionDenied("Your account has no console role; ask an admin for one.")
        return view(request, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


def action_view(role: Role) -> Callable[[View], View]:
    """A page's write (a form POST): POST only, logged in, holding ``role`` (else 403, so a
    viewer who crafts the POST gets the same answer as from the API)."""

    def decorate(view: View) -> View:
        @require_POST
        @login_required
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not user_has_role(request.user, role):
                raise PermissionDenied(f"This needs the {role.value} role.")
            return view(request, *args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def paginate(request: HttpRequest, queryset: QuerySet[Any], per_page: int = PER_PAGE) -> Page:
    """The page of ``queryset`` named by ``?page=`` (a bad or too high number shows the
    last or first page rather than an error)."""
    return Paginator(queryset, per_page).get_page(request.GET.get("page"))


def is_id(raw: str) -> bool:
    """Whether a query or form value is an id: ASCII digits that fit the database's integers.
    (``"²".isdigit()`` is true and ``int("²")`` raises; 20 digits overflow a bigint: both
    were 500s.)"""
    return raw.isascii() and raw.isdigit() and len(raw) <= 18
