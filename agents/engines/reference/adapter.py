"""Adapter of the reference engine: ``python -m pdbridge.cli engine serve ...`` for a role.

Who calls it: the node agent (CPU nodes, the embedded demo) and tests. See
``agents.engines.base.EngineAdapter`` for the contract.
"""

from __future__ import annotations

import sys
from typing import ClassVar

from agents.engines.base import EngineAdapter


class ReferenceAdapter(EngineAdapter):
    """Launches the CPU reference engine. ``kv_connector_extra_config`` may carry ``kv_spool``
    (decode side: where KV arrives), ``dtype``, ``threads``, ``models_dir`` and ``expect_sha256``."""

    name: ClassVar[str] = "reference"

    def command(self) -> list[str]:
        s = self.spec
        extra = s.kv_connector_extra_config
        name = s.served_model_name
        model = f"{name}={s.model}" if name else s.model
        if extra.get("dtype"):
            model += f"@{extra['dtype']}"
        argv = [*(s.executable or [sys.executable, "-m", "pdbridge.cli"]), "engine", "serve"]
        argv += ["--role", s.role, "--model", model, "--host", s.host, "--port", str(s.port)]
        argv += ["--chunked-prefill-tokens", str(s.chunked_prefill_tokens)]
        argv += ["--threads", str(int(extra.get("threads", 1)))]
        if extra.get("kv_spool") and s.role != "prefill":
            argv += ["--kv-spool", str(extra["kv_spool"])]
        if extra.get("models_dir"):
            argv += ["--models-dir", str(extra["models_dir"])]
        if extra.get("expect_sha256"):
            argv += ["--expect-sha256", str(extra["expect_sha256"])]
        return argv + list(s.extra_args)
