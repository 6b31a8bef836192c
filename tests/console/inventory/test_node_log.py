"""The console's log page reads a supervised process's log through a real agent over mTLS
(the controller's identity): the lines of one request id, paging back, and every way it can
fail answered on the page with its status, never a 500 or a hung request."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from django.test import Client, override_settings
from google.protobuf.struct_pb2 import Struct

from agents.proto.api import pb
from console.inventory.models import Node
from tests.agents.conftest import HEALTHSERVER, AgentProc, agent_config, start_agent, stub
from tests.agents.pki import Pki, make_pki
from tests.console.factories import SiteFactory
from tests.support import scaled, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

#: Filler lines the child prints before its start line: ~300 KB, more than one page.
PREAMBLE = 3000


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[AgentProc]:
    tmp = tmp_path_factory.mktemp("agent")
    chatty = {"argv": [*HEALTHSERVER, "--tag", "{settings.tag}", "--preamble", str(PREAMBLE)]}
    proc = start_agent(tmp, agent_config(tmp, pki, engines={"chatty": chatty}))
    settings = Struct()
    settings.update({"tag": "needle-7f3a"})
    stub(proc, pki).Launch(
        pb.LaunchRequest(
            request_id=os.urandom(8).hex(),
            name="prefill-engine-1",
            kind="prefill-engine",
            engine="chatty",
            settings=settings,
        ),
        timeout=scaled(60),
    )
    yield proc
    proc.terminate()


@pytest.fixture
def controller(pki: Pki) -> Iterator[None]:
    cert, key = pki.client("orchestrator")
    with override_settings(
        PDBRIDGE_CONTROLLER_INSECURE=False,
        PDBRIDGE_CONTROLLER_TLS_CA=str(pki.ca),
        PDBRIDGE_CONTROLLER_TLS_CERT=str(cert),
        PDBRIDGE_CONTROLLER_TLS_KEY=str(key),
    ):
        yield


@pytest.fixture
def node(agent: AgentProc) -> Node:
    return Node.objects.create(
        site=SiteFactory(),
        hostname="dec-1",
        agent_address=agent.address,
        reported_children=[{"name": "prefill-engine-1", "kind": "prefill-engine"}],
    )


@pytest.fixture
def operator(make_user: Any) -> Client:
    client = Client()
    client.force_login(make_user("operator"))
    return client


def page(client: Client, node: Node, child: str = "prefill-engine-1", **query: str) -> Any:
    return client.get(f"/nodes/{node.pk}/logs/{child}/", query)


def test_the_lines_of_one_id_through_the_agent_and_paging_back(controller, node, operator):
    # The child prints its start line once it runs; wait for the agent to have logged it.
    answer = wait_for(
        lambda: (
            (r := page(operator, node, q="needle-7f3a")).status_code == 200
            and "tag=needle-7f3a" in r.content.decode()
            and r
        ),
        60,
        what="the child's start line in its log",
    )
    body = answer.content.decode()
    assert "1 of " in body
    assert "contain <code>needle-7f3a</code>" in body
    log = answer.context["log"]
    assert log.matched == 1
    assert log.earlier is not None
    assert 'id="log-earlier"' in body

    # A search nothing matches says so.
    assert (
        "No line in this range contains it" in page(operator, node, q="absent-id").content.decode()
    )

    # Paging back: the earlier 64 KiB ends with the line just before this page's first, whole.
    latest = page(operator, node).context["log"]
    first = int(latest.lines[0].split()[2])
    earlier = page(operator, node, size="64k", before=str(latest.earlier)).context["log"]
    assert earlier.end == latest.offset
    # (the agent writes its own "--- agent:" lines into the stream: the launch, exits)
    filler = [line for line in earlier.lines if not line.startswith("--- agent:")]
    numbers = [int(line.split()[2]) for line in filler]
    assert numbers == list(range(first - len(numbers), first))
    assert all(line.endswith("." * 80) for line in filler)

    # Back to the very first byte: the oldest page says so and starts at line 0.
    older = earlier
    while older.earlier is not None:
        older = page(operator, node, size="1m", before=str(older.earlier)).context["log"]
    assert older.offset == older.start_offset == 0
    assert older.lines[0].startswith("--- agent: starting ")
    assert older.lines[1].startswith("preamble line 000000 ")


def test_the_node_and_trace_pages_link_operators_to_the_log(controller, node, operator, make_user):
    body = operator.get(f"/nodes/{node.pk}/").content.decode()
    assert f'href="/nodes/{node.pk}/logs/prefill-engine-1/"' in body
    viewer = Client()
    viewer.force_login(make_user("viewer"))
    assert 'id="node-logs"' not in viewer.get(f"/nodes/{node.pk}/").content.decode()


def test_refusals_and_failures_are_named_on_the_page(controller, node, operator, make_user, pki):
    viewer = Client()
    viewer.force_login(make_user("viewer"))
    assert page(viewer, node).status_code == 403

    for query, field in [
        ({"size": "9g"}, "size: one of 64k, 256k, 1m"),
        ({"before": "-3"}, "before: a byte offset"),
        ({"before": "²"}, "before: a byte offset"),
        ({"q": "x" * 201}, "q: one line of at most 200"),
        ({"q": "a\nb"}, "q: one line"),
    ]:
        answer = page(operator, node, **query)
        assert answer.status_code == 400, query
        assert field in answer.content.decode(), query
    bad_name = page(operator, node, child="..evil")
    assert bad_name.status_code == 400
    assert "child: not a process name" in bad_name.content.decode()

    unknown = page(operator, node, child="decode-engine-9")
    assert unknown.status_code == 404
    assert "supervises no process &#x27;decode-engine-9&#x27;" in unknown.content.decode()

    # Nothing listens: refused at once (502), not a hang.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    gone = Node.objects.create(
        site=node.site, hostname="dec-gone", agent_address=f"127.0.0.1:{free}"
    )
    answer = page(operator, gone)
    assert answer.status_code in {502, 504}
    assert f"the agent at 127.0.0.1:{free}" in answer.content.decode()

    # A controller identity the agent does not allow (same CA, not allowlisted): 502 naming it.
    cert, key = pki.client("intruder")
    with override_settings(
        PDBRIDGE_CONTROLLER_TLS_CERT=str(cert), PDBRIDGE_CONTROLLER_TLS_KEY=str(key)
    ):
        refused = page(operator, node)
    assert refused.status_code == 502
    assert "PERMISSION_DENIED" in refused.content.decode()

    # No controller identity at all: 503 naming the setting.
    with override_settings(PDBRIDGE_CONTROLLER_TLS_CERT=""):
        missing = page(operator, node)
    assert missing.status_code == 503
    assert "PDBRIDGE_CONTROLLER_TLS_CERT: required to call agents" in missing.content.decode()


def test_the_api_reads_the_same_lines_and_names_what_it_refuses(controller, node, api_as):
    api = api_as("operator")
    url = f"/api/nodes/{node.pk}/logs/prefill-engine-1/"
    body = wait_for(
        lambda: (
            (r := api.get(url, {"q": "needle-7f3a"})).status_code == 200
            and r.json()["matched"] == 1
            and r.json()
        ),
        60,
        what="the start line through the API",
    )
    assert body["node"] == node.pk
    assert body["child"] == "prefill-engine-1"
    assert "tag=needle-7f3a" in body["lines"][0]
    assert body["earlier"] is not None
    older = api.get(url, {"size": "1m", "before": str(body["earlier"])}).json()
    assert older["end"] == body["earlier"]

    assert api_as("viewer").get(url).status_code == 403
    assert api_as(None).get(url).status_code == 401
    for query, field in [
        ({"size": "2k"}, "size"),
        ({"before": "x"}, "before"),
        ({"q": "a\nb"}, "q"),
    ]:
        answer = api.get(url, query)
        assert answer.status_code == 400, query
        assert field in answer.json(), answer.json()
    missing = api.get(f"/api/nodes/{node.pk}/logs/decode-engine-9/")
    assert missing.status_code == 404
    assert "supervises no process" in missing.json()["detail"]
    assert api.get(f"/api/nodes/{node.pk}/logs/..x/").status_code == 404  # not a process name
    assert api.get("/api/nodes/999999/logs/prefill-engine-1/").status_code == 404
