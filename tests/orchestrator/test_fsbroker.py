"""The embedded broker's transport: a consumer polling while a producer publishes never takes a
half-written message (kombu's own filesystem transport creates the file, then writes it)."""

from __future__ import annotations

import threading

from kombu import Connection
from kombu.transport import TRANSPORT_ALIASES

from orchestrator.fsbroker import Transport


def test_settings_point_the_filesystem_alias_at_the_atomic_transport(settings):
    assert TRANSPORT_ALIASES["filesystem"] == "orchestrator.fsbroker:Transport"
    with Connection("filesystem://", transport_options={"data_folder_in": "/tmp"}) as conn:
        assert isinstance(conn.transport, Transport)


def test_a_consumer_racing_the_producer_gets_every_message_whole(tmp_path):
    folder = tmp_path / "broker"
    folder.mkdir()
    options = {
        "data_folder_in": str(folder),
        "data_folder_out": str(folder),
        "control_folder": str(tmp_path / "control"),
        "store_processed": False,
        "polling_interval": 0,  # the consumer lists the folder as often as it can
    }
    count = 400
    body = {"payload": "x" * 500_000}  # writes long enough to be caught half-way
    received: list[int] = []
    errors: list[BaseException] = []

    def consume() -> None:
        try:
            with Connection(transport=Transport, transport_options=options) as conn:
                queue = conn.SimpleQueue("race")
                while len(received) < count:
                    message = queue.get(block=True, timeout=30)
                    assert message.payload["payload"] == body["payload"]
                    received.append(message.payload["n"])
                    message.ack()
        except BaseException as exc:  # reported to the test thread
            errors.append(exc)

    with Connection(transport=Transport, transport_options=options) as conn:
        conn.SimpleQueue("race").close()  # declared once, before either side runs
    consumer = threading.Thread(target=consume)
    consumer.start()
    with Connection(transport=Transport, transport_options=options) as conn:
        queue = conn.SimpleQueue("race")
        for n in range(count):
            queue.put({**body, "n": n})
    consumer.join(120)

    assert errors == []
    assert sorted(received) == list(range(count))
    assert not [p.name for p in folder.iterdir() if p.name.endswith(".part")]


def test_a_publisher_reading_an_exchange_while_it_is_first_bound_never_sees_a_torn_table(
    tmp_path,
):
    options = {"data_folder_in": str(tmp_path), "control_folder": str(tmp_path / "control")}
    errors: list[BaseException] = []
    with Connection(transport=Transport, transport_options=options) as conn:
        binder, reader = conn.channel(), conn.channel()
        for round_ in range(200):
            exchange = f"ex{round_}"
            bound = threading.Event()

            def bind(exchange: str = exchange, bound: threading.Event = bound) -> None:
                try:
                    binder._queue_bind(exchange, "rk", None, "q")
                except BaseException as exc:
                    errors.append(exc)
                finally:
                    bound.set()

            thread = threading.Thread(target=bind)
            thread.start()
            try:
                while not bound.is_set():
                    reader.get_table(exchange)
                assert [q.queue for q in reader.get_table(exchange)] == ["q"]
            except BaseException as exc:
                errors.append(exc)
            thread.join(10)

    assert errors == []
