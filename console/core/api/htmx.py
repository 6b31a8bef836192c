"""Page buttons call the API's actions with htmx (``hx-post``): the same code path, roles,
audit and 409s as automation. What htmx puts into the page, though, must be something a
person reads, not the JSON document: for a request carrying ``HX-Request: true`` the answer of
a POST action becomes a toast -- what happened, in words, and links to the run or report it
started -- with the API's status code kept (base.html lets htmx swap 4xx answers in, so a
refusal is shown where the button is). A successful action also sends ``HX-Trigger:
pdbridge-run-changed``, which parts of a page that follow a run (the canary's buttons)
listen to and reload on. Automation, which sends no ``HX-Request``, gets JSON as always."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponse
from django.template.loader import render_to_string
from django.urls import NoReverseMatch, reverse
from rest_framework.request import Request
from rest_framework.response import Response

#: The event a successful action triggers on the page (``hx-trigger="... from:body"``).
RUN_CHANGED = "pdbridge-run-changed"


def _url(name: str, pk: Any) -> str:
    try:
        return reverse(name, args=[int(pk)])
    except (NoReverseMatch, TypeError, ValueError):
        return ""


def _error_text(data: Any) -> str:
    if isinstance(data, dict):
        if "detail" in data:
            return str(data["detail"])
        return "; ".join(
            f"{field}: {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for field, v in data.items()
        )
    if isinstance(data, list):
        return " ".join(map(str, data))
    return str(data)


def _success(data: Any) -> tuple[str, list[tuple[str, str]]]:
    """Words and links for an action's answer, by what it is: a run or a drill report."""
    if not isinstance(data, dict) or "id" not in data:
        return "Done.", []
    if "drill" in data and "run" in data:  # a drill report
        links = [("the report", _url("drill-report-page", data["id"]))]
        if data.get("run"):
            links.append(("the run", _url("run-page", data["run"])))
        return f"Drill {data.get('drill_name', '')} started: report #{data['id']}.", links
    if "moves" in data and "state" in data:  # a rebalancing proposal
        links = [("its run", _url("run-page", data["run"]))] if data.get("run") else []
        return f"Rebalancing proposal #{data['id']} is {data['state']}.", links
    if "kind" in data and "state" in data:  # a workflow run
        links = [("the run's steps", _url("run-page", data["id"]))]
        if data["kind"] == "canary":
            links.insert(0, ("the canary", _url("canary-page", data["id"])))
        flag = " (paused)" if (data.get("params") or {}).get("paused") else ""
        if data.get("cancel_requested") and data["state"] in ("pending", "running"):
            flag = ": cancel requested, it ends canceled at its next step"
            if data["kind"] == "canary":
                flag += " (the remote share is already 0 %)"
        return f"{data['kind'].capitalize()} run #{data['id']} is {data['state']}{flag}.", links
    return "Done.", []


def as_toast(request: Request, response: Response) -> HttpResponse | None:
    """The toast for an htmx POST's answer, or None when the request is not one."""
    if request.method != "POST" or request.headers.get("HX-Request") != "true":
        return None
    ok = response.status_code < 400
    if ok:
        message, links = _success(response.data)
    else:
        message, links = _error_text(response.data), []
    html = render_to_string(
        "core/_toast.html",
        {
            "ok": ok,
            "status": response.status_code,
            "message": message,
            "links": [(label, url) for label, url in links if url],
        },
    )
    answer = HttpResponse(html, status=response.status_code)
    if ok:
        answer["HX-Trigger"] = RUN_CHANGED
    return answer
