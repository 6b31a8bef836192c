"""The embedded broker: kombu's filesystem transport with atomic message files.

kombu's ``filesystem`` transport (5.x) creates a message file in the queue folder and then
writes it; a consumer that lists the folder in between takes an empty or half-written message,
and its ``json.loads`` error ends the worker's consumer loop (the testbed then stops: "worker
exited"). This transport writes each message under a name the consumer does not match and
renames it into place (``os.replace``, atomic within one filesystem), so a consumer sees a
message whole or not at all. Everything else is kombu's.

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
    """kombu's channel; only ``_put`` differs (write, then rename into place)."""

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


class Transport(filesystem.Transport):
    """kombu's filesystem transport with :class:`Channel`."""

    Channel = Channel
