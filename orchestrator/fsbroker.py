"""The embedded broker: kombu's filesystem transport with atomic files.

kombu's ``filesystem`` transport (5.x) creates a message file in the queue folder and then
writes it; a consumer that lists the folder in between takes an empty or half-written message,
and its ``json.loads`` error ends the worker's consumer loop (the testbed then stops: "worker
exited"). The first binding of an exchange has the same gap: its table file is created empty
and locked only afterwards, so a publisher reading the table in between fails the same way.
This transport writes each message under a name the consumer does not match and renames it
into place (``os.replace``, atomic within one filesystem), and creates an exchange's table
file already holding a valid (empty) table (``os.link``: atomic, never overwrites). Everything
else is kombu's.

Selected by ``console.settings`` for ``CELERY_BROKER_URL=filesystem://`` (the embedded
default) by pointing kombu's ``filesystem`` alias here; Redis deployments never load it.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    """kombu's channel; ``_put`` writes then renames, ``_queue_bind`` creates the exchange
    table whole."""

    # kombu.transport.filesystem.Channel (our parent) and its virtual base name the second
    # parameter differently; this keeps the parent's.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # A leading dot: `_get` matches `<anything>.<queue>.msg` on the part after the first
        # dot, which for ".<name>.part" is "<name>.part": never taken half-written.
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as out:
                out.write(str_to_bytes(dumps(payload)))
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _queue_bind(self, exchange: Any, routing_key: Any, pattern: Any, queue: Any) -> None:
        table = self._exchange_file(exchange)
        self.control_folder.mkdir(exist_ok=True)
        if not table.exists():
            partial = table.with_name(f".{table.name}.{uuid.uuid4()}.part")
            partial.write_bytes(str_to_bytes(dumps([])))
            try:
                os.link(partial, table)  # created whole, or somebody else's stays
            except FileExistsError:
                pass
            finally:
                partial.unlink()
        # The table now exists: kombu reads, extends and rewrites it under its lock.
        super()._queue_bind(exchange, routing_key, pattern, queue)


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`."""

    Channel = Channel
