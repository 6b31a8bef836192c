"""``pdbridge verify``: token-by-token verification that remote prefill + local decode gives the
same output as a local run (deployment step 7).

For each prompt it sends, with greedy decoding, (a) the prefill leg to the prefill engine and
the decode leg to the decode engine, either with one ``transfer_id`` and both at once (push
mode, pdbridge's engines) or one after the other with the prefill answer's
``kv_transfer_params`` handed to the decode leg (pull mode, vLLM's built-in connectors; see
``pdproto.kv.KV_MODES``), and (b) the same prompt as a plain request to the decode
engine (local prefill + decode). It then compares token ids and, where both responses carry
them, per-step logits digests, and reports per prompt: match, the first divergent position
and step, tokens compared and timings.
Results are bit-identical only when both engines chunk prefill at the same boundaries, so the
engines' ``chunked_prefill_tokens`` are read and compared first.

Who calls it: operators, and the deployment workflow's step 7 (JSON on stdout or ``--output``).
Blocking from the caller's point of view (runs its own event loop). Exit code 0 when every
prompt matched, 1 on any mismatch, 2 when the check could not run (engine down, HTTP error).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from pdproto.kv import KV_MODES, PULL_PREFILL_KV, pulled_kv_params, push_kv_params

#: Prompt lengths (tokens of the byte tokenizer) of the default suite: the guide's 4K/16K/32K
#: scaled to what the CPU reference engine does in seconds.
DEFAULT_LENGTHS = (64, 512, 2048, 4096)
_WORDS = [
    "prefill",
    "decode",
    "cache",
    "link",
    "site",
    "token",
    "layer",
    "state",
    "window",
    "chunk",
    "transfer",
    "verify",
    "route",
    "model",
    "weight",
    "latency",
    "bandwidth",
    "queue",
    "stream",
    "fallback",
    "canary",
    "drill",
    "tidal",
    "schedule",
]


def make_prompt(length: int, seed: int = 0) -> str:
    """Deterministic ASCII text of ``length - 1`` bytes (the byte tokenizer adds BOS)."""
    rng = random.Random(f"{seed}:{length}")  # noqa: S311 - prompt text, not security
    words: list[str] = []
    size = 0
    while size < length:
        w = rng.choice(_WORDS)
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[: max(length - 1, 1)]


@dataclass
class Divergence:
    """Where the two runs first differ."""

    step: int
    position: int
    kind: str  # "token", "logits" or "logprobs"
    local_token: int | None
    remote_token: int | None
    #: For "logprobs": how far apart the step's top-k were, against the tolerance.
    detail: str = ""


@dataclass
class PromptResult:
    length: int
    prompt_tokens: int
    match: bool
    tokens_compared: int
    logits_compared: int
    first_divergence: Divergence | None
    remote_path: str | None
    timings: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _step_logprobs(choice: dict[str, Any]) -> list[Any]:
    """Per-step (token logprob, top-k) pairs from an OpenAI logprobs object (completions or chat)."""
    lp = choice.get("logprobs") or {}
    if "token_logprobs" in lp:
        return list(zip(lp["token_logprobs"], lp.get("top_logprobs") or [], strict=False))
    return [
        (e["logprob"], {t["token"]: t["logprob"] for t in e.get("top_logprobs", [])})
        for e in lp.get("content") or []
    ]


def _close(a: Any, b: Any, tolerance: float) -> bool:
    (la, ta), (lb, tb) = a, b
    if abs(la - lb) > tolerance or set(ta) != set(tb):
        return False
    return all(abs(ta[k] - tb[k]) <= tolerance for k in ta)


def _gap(a: Any, b: Any, tolerance: float) -> str:
    """Why two steps' (logprob, top-k) are not close, for the report."""
    (la, ta), (lb, tb) = a, b
    if set(ta) != set(tb):
        return f"top-{len(ta)} tokens differ: local {sorted(ta)} remote {sorted(tb)}"
    gap = max([abs(la - lb), *(abs(ta[k] - tb[k]) for k in ta)])
    return f"top-{len(ta)} logprobs up to {gap:.6g} apart (tolerance {tolerance:g})"


def compare(
    local: dict[str, Any], remote: dict[str, Any], logprob_tolerance: float = 0.0
) -> tuple[bool, int, int, Divergence | None]:
    """Compare two completion responses: (match, tokens compared, steps whose logits were
    compared, divergence).

    A difference in length counts as a divergence at the first missing step. Logits are
    compared by the per-step digests where both responses carry them (the reference engine),
    otherwise by top-k logprobs where both carry them (vLLM: send ``logprobs``), within
    ``logprob_tolerance``.
    """
    lc, rc = local["choices"][0], remote["choices"][0]
    lt, rt = list(lc.get("token_ids") or []), list(rc.get("token_ids") or [])
    ld, rd = list(lc.get("logits_digests") or []), list(rc.get("logits_digests") or [])
    if not (ld and rd):
        ld, rd = _step_logprobs(lc), _step_logprobs(rc)
        same = lambda a, b: _close(a, b, logprob_tolerance)  # noqa: E731
        kind = "logprobs"
    else:
        same, kind = (lambda a, b: a == b), "logits"
    prompt_tokens = len(local.get("prompt_token_ids") or []) or int(local["usage"]["prompt_tokens"])
    checked = bool(ld) and bool(rd)
    steps = max(len(lt), len(rt))
    for i in range(steps):
        a = lt[i] if i < len(lt) else None
        b = rt[i] if i < len(rt) else None
        if a != b:
            return (
                False,
                i,
                min(i, len(ld), len(rd)) if checked else 0,
                Divergence(i, prompt_tokens + i, "token", a, b),
            )
        if checked and i < len(ld) and i < len(rd) and not same(ld[i], rd[i]):
            detail = _gap(ld[i], rd[i], logprob_tolerance) if kind == "logprobs" else ""
            return False, i + 1, i, Divergence(i, prompt_tokens + i, kind, a, b, detail)
    return True, steps, min(len(ld), len(rd)) if checked else 0, None


def token_ids_of(resp: dict[str, Any]) -> list[Any]:
    """The first choice's output token ids ([] when the engine did not return them)."""
    choices = resp.get("choices") or [{}]
    return list(choices[0].get("token_ids") or [])


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=body) as resp:
        data = await resp.json(content_type=None)
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {json.dumps(data)[:300]}")
        return dict(data)


async def engine_info(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, Any]:
    """The engine's ``/v1/models`` entry for ``model`` (with its pdbridge extension, if any)."""
    async with session.get(f"{base}/v1/models") as resp:
        data = await resp.json(content_type=None)
    for entry in data.get("data", []):
        if entry.get("id") == model:
            return dict(entry)
    raise RuntimeError(f"{base}: model {model!r} not served")


async def verify_prompt(
    session: aiohttp.ClientSession,
    *,
    prefill: str,
    decode: str,
    model: str,
    length: int,
    max_tokens: int,
    kv_destination: str,
    deadline_s: float,
    seed: int = 0,
    logprobs: int | None = None,
    logprob_tolerance: float = 0.0,
    local_chunk: int | None = None,
    kv_mode: str = "push",
) -> PromptResult:
    """Run one prompt both ways and compare. Never raises for engine errors: they land in
    ``error`` with ``match`` false."""
    prompt = make_prompt(length, seed)
    base = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        # vLLM (>= 0.10.2) returns token ids only when asked; the reference engine always does.
        "return_token_ids": True,
    }
    if logprobs:
        # Where no logits digests exist (vLLM) the per-step top-k logprobs stand in for them.
        base["logprobs"] = logprobs
    tid = f"verify-{uuid.uuid4().hex}"
    timings: dict[str, float] = {}
    try:
        t0 = time.monotonic()
        if kv_mode == "pull":
            prefill_body = {**base, "max_tokens": 1, "kv_transfer_params": dict(PULL_PREFILL_KV)}
            pre = await _post(session, f"{prefill}/v1/completions", prefill_body)
            params = pulled_kv_params(pre)
            if params is None:
                raise RuntimeError(
                    "pull mode: the prefill engine answered without kv_transfer_params (is its "
                    "KV connector configured as a producer?)"
                )
            dec = await _post(
                session, f"{decode}/v1/completions", {**base, "kv_transfer_params": params}
            )
        else:
            prefill_kv, decode_kv = push_kv_params(tid, kv_destination, deadline_s)
            pre, dec = await asyncio.gather(
                _post(
                    session, f"{prefill}/v1/completions", {**base, "kv_transfer_params": prefill_kv}
                ),
                _post(
                    session, f"{decode}/v1/completions", {**base, "kv_transfer_params": decode_kv}
                ),
            )
        timings["remote_s"] = time.monotonic() - t0
        t0 = time.monotonic()
        # The local reference prefills at the prefill engine's chunk boundaries.
        local_body = {**base, "chunked_prefill_tokens": local_chunk} if local_chunk else base
        local = await _post(session, f"{decode}/v1/completions", local_body)
        timings["local_s"] = time.monotonic() - t0
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
        return PromptResult(length, 0, False, 0, 0, None, None, timings, str(exc))
    missing = [n for n, r in (("remote", dec), ("local", local)) if not token_ids_of(r)]
    if missing:
        # Nothing to compare is not a match: an engine that omits token ids (vLLM before
        # 0.10.2) would otherwise pass every prompt with zero tokens compared.
        return PromptResult(
            length,
            int((local.get("usage") or {}).get("prompt_tokens") or 0),
            False,
            0,
            0,
            None,
            (dec.get("pdbridge") or {}).get("path"),
            timings,
            f"no token ids in the {' and '.join(missing)} response: cannot compare "
            "(vLLM needs >= 0.10.2 for return_token_ids)",
        )
    for name, resp in (("remote", dec), ("local", local), ("prefill", pre)):
        for k, v in (resp.get("pdbridge") or {}).get("timings", {}).items():
            timings[f"{name}_{k}"] = v
    match, compared, digests, div = compare(local, dec, logprob_tolerance)
    # The prefill leg's first token must also be the decoder's first token.
    if (
        match
        and pre["choices"][0].get("token_ids", [None])[:1]
        != dec["choices"][0].get("token_ids", [None])[:1]
    ):
        match, div = False, Divergence(0, int(local["usage"]["prompt_tokens"]), "token", None, None)
    return PromptResult(
        length=length,
        prompt_tokens=int(local["usage"]["prompt_tokens"]),
        match=match,
        tokens_compared=compared,
        logits_compared=digests,
        first_divergence=div,
        remote_path=(dec.get("pdbridge") or {}).get("path"),
        timings={k: round(v, 6) for k, v in timings.items()},
    )


def verdict(results: list[PromptResult], fingerprints_equal: bool) -> bool:
    """The report's ``ok``: every prompt matched its local run, every decode answer that says
    which path served it says ``remote`` (a decode engine that prefilled locally because the
    KV did not come has not verified the transfer, however equal its tokens), and both
    engines run the same weights and architecture."""
    return (
        bool(results)
        and all(r.match for r in results)
        and all(r.remote_path in (None, "remote") for r in results)
        and fingerprints_equal
    )


async def run_verification(
    *,
    prefill: str,
    decode: str,
    model: str,
    lengths: list[int],
    max_tokens: int,
    kv_destination: str,
    deadline_s: float = 30.0,
    timeout_s: float = 300.0,
    logprobs: int | None = None,
    logprob_tolerance: float = 0.0,
    kv_mode: str = "push",
) -> dict[str, Any]:
    """The whole report (a JSON-ready dict). Raises ``RuntimeError`` when an engine cannot be
    asked for its model (nothing to compare)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        pinfo = await engine_info(session, prefill, model)
        dinfo = await engine_info(session, decode, model)
        pext, dext = pinfo.get("pdbridge") or {}, dinfo.get("pdbridge") or {}
        # A reference decode engine can prefill the local run at the prefill engine's chunk
        # boundaries; other engines (vLLM) must be configured alike.
        local_chunk = pext.get("chunked_prefill_tokens") if dext else None
        results = []
        for length in lengths:
            results.append(
                await verify_prompt(
                    session,
                    prefill=prefill,
                    decode=decode,
                    model=model,
                    length=length,
                    max_tokens=max_tokens,
                    kv_destination=kv_destination,
                    deadline_s=deadline_s,
                    logprobs=logprobs,
                    logprob_tolerance=logprob_tolerance,
                    local_chunk=local_chunk,
                    kv_mode=kv_mode,
                )
            )
    aligned = bool(local_chunk) or pext.get("chunked_prefill_tokens") == dext.get(
        "chunked_prefill_tokens"
    )
    fingerprints_equal = pext.get("fingerprint") == dext.get("fingerprint")
    return {
        "model": model,
        "kv_mode": kv_mode,
        "ok": verdict(results, fingerprints_equal),
        "chunk_aligned": aligned,
        "local_chunked_prefill_tokens": local_chunk,
        "fingerprints_equal": fingerprints_equal,
        "engines": {"prefill": {"url": prefill, **pext}, "decode": {"url": decode, **dext}},
        "prompts": [asdict(r) for r in results],
    }


def main(argv: list[str]) -> int:
    """Entry point of ``pdbridge verify``."""
    p = argparse.ArgumentParser(prog="pdbridge verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", required=True, help="prefill engine base URL")
    p.add_argument("--decode", required=True, help="decode engine base URL")
    p.add_argument("--model", required=True)
    p.add_argument(
        "--kv-destination",
        required=True,
        help="where the prefill engine sends KV (the decoder's receiver)",
    )
    p.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        help="comma-separated prompt lengths",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=30.0)
    p.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="also request top-k logprobs and compare them where no logits digests exist (vLLM)",
    )
    p.add_argument("--logprob-tolerance", type=float, default=0.0)
    p.add_argument(
        "--kv-mode",
        choices=KV_MODES,
        default="push",
        help="push: pdbridge engines (both legs at once); pull: vLLM's built-in connectors "
        "(prefill first, its kv_transfer_params handed to the decode leg)",
    )
    p.add_argument("--output", help="also write the JSON report here")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        print("--lengths: comma-separated integers expected", file=sys.stderr)
        return 2
    if not lengths or min(lengths) < 2 or args.max_tokens < 1:
        print("--lengths: each >= 2; --max-tokens: >= 1", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(
            run_verification(
                prefill=args.prefill.rstrip("/"),
                decode=args.decode.rstrip("/"),
                model=args.model,
                lengths=lengths,
                max_tokens=args.max_tokens,
                kv_destination=args.kv_destination,
                deadline_s=args.deadline_s,
                logprobs=args.logprobs,
                logprob_tolerance=args.logprob_tolerance,
                kv_mode=args.kv_mode,
            )
        )
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
        print(f"pdbridge verify: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    print(text)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(text + "\n")
    if any(r["error"] for r in report["prompts"]):
        return 2
    return 0 if report["ok"] else 1
