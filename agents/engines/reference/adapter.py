"""Adapter of the reference engine: ``python -m pdbridge.cli engine serve ...`` for a role.

Who calls it: the node agent (CPU nodes, the embedded demo) and tests. See
``agents.engines.base.EngineAdapter`` for the contract.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any, ClassVar

from agents.engines.base import AdapterError, EngineAdapter


class ReferenceAdapter(EngineAdapter):
    """Launches the CPU reference engine. ``kv_connector_extra_config`` may carry ``kv_spool``
    (decode side: where KV arrives), ``dtype``, ``threads``, ``models_dir`` and ``expect_sha256``."""

    name: ClassVar[str] = "reference"
    _serving: Any = None

    def command(self) -> list[str]:
        prefix = self.spec.executable or [sys.executable, "-m", "pdbridge.cli"]
        return [*prefix, "engine", "serve", *self.serve_args()]

    def serve_args(self) -> list[str]:
        """The ``pdbridge engine serve`` options of this spec (process and in-process alike)."""
        s = self.spec
        extra = s.kv_connector_extra_config
        name = s.served_model_name
        model = f"{name}={s.model}" if name else s.model
        if extra.get("dtype"):
            model += f"@{extra['dtype']}"
        argv = ["--role", s.role, "--model", model, "--host", s.host, "--port", str(s.port)]
        argv += ["--chunked-prefill-tokens", str(s.chunked_prefill_tokens)]
        argv += ["--threads", str(int(extra.get("threads", 1)))]
        if extra.get("kv_spool") and s.role != "prefill":
            argv += ["--kv-spool", str(extra["kv_spool"])]
        if extra.get("models_dir"):
            argv += ["--models-dir", str(extra["models_dir"])]
        if extra.get("expect_sha256"):
            argv += ["--expect-sha256", str(extra["expect_sha256"])]
        return argv + list(s.extra_args)

    async def start_in_process(self) -> dict[str, Any]:
        """The engine in this event loop, built exactly as ``pdbridge engine serve`` would from
        ``serve_args()``. Model loading (seconds of CPU) runs in a worker thread; torch's thread
        count (``threads``) is process-wide, so it applies to the whole host process."""
        from agents.engines import cli

        if self._serving is not None:
            raise AdapterError("engine: already started in this process")
        try:
            args = cli._serve_parser().parse_args(self.serve_args())
        except SystemExit:
            raise AdapterError("extra_args: not valid options of pdbridge engine serve") from None
        if self.spec.api_key and not args.api_key_file:
            args.api_key = self.spec.api_key  # what the child would read from VLLM_API_KEY
        try:
            cli.check_args(args)
            models = await asyncio.to_thread(cli.load_models, args)
            self._serving = await cli.start_serving(args, models, cli.ssl_context(args))
        except cli.ServeError as exc:
            raise AdapterError(f"in-process start: {exc}") from None
        self.spec.port = int(self._serving.ready["port"])
        return dict(self._serving.ready)

    async def stop_in_process(self) -> None:
        serving, self._serving = self._serving, None
        if serving is not None:
            await serving.close()
