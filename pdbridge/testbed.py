"""``pdbridge run``: two datacenters on one machine, a hybrid model deployed end to end.

Brings up, as child processes in their own process groups: the console (``pdbridge serve``,
TLS, embedded SQLite database), a Celery worker and beat (filesystem broker), and two sites on
loopback — ``local`` (decode agent; the agent later launches the decode engine, the kv-link
receiver and the gateway) and ``remote`` (prefill agent, whose prefill engine sends KV across
the "WAN"). The WAN is two userspace proxies in a row on the KV path: the remote agent's fault
proxy (drills cut or degrade it) and a shaping proxy (``pdbridge kv proxy``: bandwidth and
latency, default 200 Mbit/s and 10 ms). With ``--remote-sites N`` (1-3) there are N remote
sites (``remote``, ``remote-b``, ``remote-c``), each with its own prefill agent, node, link,
prefill pool and its own WAN path (fault proxy and shapers): a drill can cut one and keep the
others. Then it registers sites, nodes (tokens handed to the agents), the links, the model, a demo deployment with a fast rollout plan, runs the deployment
workflow through its eight steps (the canary of step 8 to 100 %, with demo traffic) and prints
the console URL, the gateway URL and a ``curl`` line.

With ``--netns`` (root) the sites run in two network namespaces instead (:mod:`pdbridge.netns`):
each site's agent (and everything it launches) and the shaper are started inside its namespace
with ``ip netns exec``; the console, worker and beat stay in the root namespace, reachable from
the sites at the console address; the WAN is the veth between the sites, shaped with ``tc tbf``
(bandwidth), latency still from the shaping proxy. The node certificate is re-issued for the
run's addresses; the namespaces are removed at shutdown.

Called by ``pdbridge.run.main``; blocks until SIGINT/SIGTERM (or ``--exit-after``), then stops
every process group and kills any descendant left. Errors while coming up are printed with the
failing process's log tail; the exit code is then 1.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdbridge import netns, testbed_vllm
from pdbridge.console_server import command, testbed_config
from pdbridge.procgroup import ProcessGroups, become_subreaper, free_port, pinned_port, port_is_free
from pdbridge.testbed_models import demo_model, demo_params, model_unavailable, model_weights_sha256
from pdbridge.testbed_rows import Layout, Ports, agent_config, register

REPO = Path(__file__).resolve().parents[1]
#: The pause before retrying a failed deploy step doubles from this on each retry, up to the cap.
RETRY_BACKOFF_S = 2.0
#: A site's agent that exits is started again after this long (deploy/systemd's RestartSec).
AGENT_RESTART_S = 3.0
RETRY_BACKOFF_MAX_S = 15.0


class Stop(Exception):
    """SIGINT/SIGTERM arrived: shut down."""


@dataclass
class Endpoints:
    """What the testbed prints and writes to ``--ready-file`` (the smoke test and soak read it)."""

    console_url: str
    gateway_url: str
    ca: str
    served_model: str
    deployment_id: int
    deploy_run: int
    agents: dict[str, str]
    var_dir: str
    pid: int
    namespaces: list[str]  # with --netns: the sites' namespaces (removed at shutdown)


def _say(message: str) -> None:
    print(f"[pdbridge run] {message}", flush=True)


def _child_env(var_dir: Path, pki: dict[str, Path]) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(
        DJANGO_SETTINGS_MODULE="console.settings",
        PDBRIDGE_VAR_DIR=str(var_dir),
        PDBRIDGE_CONTROLLER_TLS_CA=str(pki["ca"]),
        PDBRIDGE_CONTROLLER_TLS_CERT=str(pki["controller_cert"]),
        PDBRIDGE_CONTROLLER_TLS_KEY=str(pki["controller_key"]),
    )
    return env


def fresh_state(var_dir: Path) -> None:
    """Each testbed starts from an empty database and broker (ports and tokens are new each
    time); the PKI is kept. The console-only mode keeps its own database."""
    import shutil

    for name in ("pdbridge.sqlite3", "celery", "sites", "logs", "celerybeat-schedule"):
        path = var_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def make_pki(directory: Path) -> dict[str, Path]:
    """CA, a node certificate (``localhost``: console, agents, engines, gateway) and the
    controller's client certificate (``orchestrator``) under ``directory``; reused when present.
    Every process of the testbed shares the node certificate and dials the others on loopback,
    so it asks for the loopback names explicitly (``loopback=True``; a node certificate of
    ``pdbridge kv certs`` carries only its node's names). Its identity -- the common name the
    allowlists match -- is ``localhost``, the hostname of every testbed node; the controller's
    is ``orchestrator``, a client only, so it carries no loopback name."""
    from grpc_kv.api import create_ca, create_node_cert
    from grpc_kv.certs import CertFiles

    ca_dir, nodes = directory / "ca", directory / "nodes"
    paths = {
        "ca": ca_dir / "ca.pem",
        "node_cert": nodes / "localhost.pem",
        "node_key": nodes / "localhost-key.pem",
        "controller_cert": nodes / "orchestrator.pem",
        "controller_key": nodes / "orchestrator-key.pem",
    }
    if all(p.exists() for p in paths.values()):
        return paths
    ca: CertFiles = create_ca(ca_dir)
    create_node_cert(ca, nodes, "localhost", loopback=True)
    create_node_cert(ca, nodes, "orchestrator")
    return paths


def site_cert(pki: dict[str, Path], addresses: list[str]) -> dict[str, Path]:
    """With ``--netns``: a node certificate (``sites``) whose SANs add this run's addresses
    (servers are dialled by IP: the console by the agents, the agents and kv-link by the
    worker, the KV receiver by the prefill engine) and the loopback names (each namespace's
    processes also dial each other on their own loopback); issued per run, the addresses
    change. Every site shares it, so its identity ``sites`` is not any one node's hostname
    (their addresses): the deployment allows it explicitly (``testbed_rows.register``)."""
    from grpc_kv.api import create_node_cert
    from grpc_kv.certs import CertFiles

    ca = CertFiles(pki["ca"], pki["ca"], pki["ca"].parent / "ca-key.pem")
    cert = create_node_cert(
        ca, pki["node_cert"].parent, "sites", sans=addresses, days=7, loopback=True
    )
    return {**pki, "node_cert": cert.cert_file, "node_key": cert.key_file}


def netns_up(args: Any) -> netns.NamespaceSites:
    """The namespace sites of ``--netns`` (NetnsError, a RuntimeError, when impossible); sites
    left by a killed earlier run in the same state directory are removed first."""
    netns.check_available()
    record = Path(args.var_dir).resolve() / "netns.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    left = netns.remove_recorded(record)
    if left:
        _say(f"removed namespaces left by an earlier run: {', '.join(left)}")
    sites = netns.create(rate_mbit=args.wan_mbit, remote_sites=_remote_sites(args))
    sites.record(record)
    named = ", ".join(f"{s.namespace} ({s.name}, {s.address})" for s in sites.all)
    wans = "WAN veth" if len(sites.remotes) == 1 else f"{len(sites.remotes)} WAN veths"
    _say(f"network namespaces: {named}; console side {sites.console_address}; "
         f"{wans} shaped to {args.wan_mbit} Mbit/s (tc tbf)")  # fmt: skip
    return sites


def netns_down(sites: netns.NamespaceSites, args: Any) -> None:
    sites.teardown()
    (Path(args.var_dir).resolve() / "netns.json").unlink(missing_ok=True)
    _say(f"removed namespaces {', '.join(s.namespace for s in sites.all)}")


def _remote_sites(args: Any) -> int:
    return int(getattr(args, "remote_sites", 1))


def _https_answers(url: str, context: ssl.SSLContext) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2, context=context)  # noqa: S310 - our own server
    except urllib.error.HTTPError:
        return True  # 401/404 are answers
    except OSError:
        return False
    return True


class DemoTraffic:
    """Completions to the gateway from a few threads until stopped, so the canary's gates see
    remote traffic (prompts longer than the deployment's remote threshold). Counts outcomes."""

    def __init__(self, url: str, context: ssl.SSLContext, served: str, threads: int = 2) -> None:
        self.url, self.context, self.served = url, context, served
        self.stopped = threading.Event()
        self.outcomes: dict[str, int] = {}
        self.lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)
        ]

    @property
    def started(self) -> bool:
        return self.threads[0].ident is not None

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.stopped.set()
        for thread in self.threads:
            thread.join(30)

    def _loop(self, index: int) -> None:
        from agents.engines.verify import make_prompt

        n = 0
        while not self.stopped.is_set():
            n += 1
            body = {"model": self.served, "prompt": make_prompt(300, seed=index * 100_000 + n),
                    "max_tokens": 4, "temperature": 0}  # fmt: skip
            request = urllib.request.Request(  # noqa: S310 - our own gateway
                f"{self.url}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60, context=self.context) as r:  # noqa: S310
                    r.read()
                    key = f"{r.status} {r.headers.get('x-pdbridge-path', '')}"
            except urllib.error.HTTPError as exc:
                key = f"{exc.code} {exc.headers.get('x-pdbridge-path', '')}"
            except OSError:
                key = "unreachable"
                time.sleep(0.5)
            with self.lock:
                self.outcomes[key] = self.outcomes.get(key, 0) + 1


def _setup_django(env: dict[str, str]) -> None:
    keys = [k for k in env if k.startswith("PDBRIDGE_CONTROLLER_")]
    for key in ("DJANGO_SETTINGS_MODULE", "PDBRIDGE_VAR_DIR", "PYTHONPATH", *keys):
        os.environ[key] = env[key]
    # This process's own logs (service INFO lines) would drown the progress lines.
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    import django

    django.setup()


def _prepare_database() -> str | None:
    from django.conf import settings
    from django.core.management import call_command

    from pdbridge.run import ensure_admin

    call_command("migrate", interactive=False, verbosity=0)
    call_command("collectstatic", interactive=False, verbosity=0)
    fixtures_dir = Path(settings.BASE_DIR) / "console" / "fixtures"
    for fixture in sorted(fixtures_dir.glob("*.json")) if fixtures_dir.is_dir() else []:
        call_command("loaddata", str(fixture), verbosity=0)
    return ensure_admin()


def _follow(run_id: int, traffic: DemoTraffic, deadline: float, seen: dict[str, str]) -> Any:
    """Print each step as it changes state until the run ends; returns the ended run."""
    from console.runs.models import WorkflowRun

    while True:
        run = WorkflowRun.objects.get(pk=run_id)
        for step in run.steps.order_by("index"):
            key = f"{step.state}:{step.attempt}"
            if seen.get(step.name) != key and step.state != "pending":
                seen[step.name] = key
                _say(f"step {step.index + 1}/8 {step.name}: {step.state}")
                if step.name == "gateway" and step.state == "succeeded" and not traffic.started:
                    traffic.start()
        if run.state in {"succeeded", "failed", "rolled_back", "canceled"}:
            return run
        if time.monotonic() > deadline:
            raise RuntimeError(f"deploy run {run_id} not finished in time (--deploy-timeout)")
        time.sleep(0.5)


def _deploy(
    deployment_id: int, traffic: DemoTraffic, timeout: float, retries: int, params: dict[str, Any]
) -> int:
    """Start the deploy workflow and follow it; demo traffic runs once the gateway is up. A
    failed step is retried from that step up to ``retries`` times (what an operator would do
    after a transient failure on a loaded machine), visibly. Returns the run id; raises when
    it still fails."""
    from console.deployments import flows
    from console.deployments.models import Deployment
    from console.runs import services as run_services

    deployment = Deployment.objects.get(pk=deployment_id)
    run = flows.deployment_deploy(actor=None, deployment=deployment, params=params)
    deadline = time.monotonic() + timeout
    seen: dict[str, str] = {}
    for attempt in range(retries + 1):
        run = _follow(run.pk, traffic, deadline, seen)
        if run.state == "succeeded":
            break
        failed = next((s for s in run.steps.order_by("index") if s.state == "failed"), None)
        reason = failed.error if failed else run.error
        _say(f"deploy run {run.pk} {run.state}: {reason}")
        if failed is None or attempt == retries:
            raise RuntimeError(f"deploy run {run.pk} {run.state}: {reason}")
        # Backoff before the retry: on a loaded machine what failed (a probe's first
        # connection, an engine's start) usually needs seconds, not an immediate second try.
        pause = min(RETRY_BACKOFF_S * 2**attempt, RETRY_BACKOFF_MAX_S)
        _say(f"retrying from step {failed.index + 1} ({failed.name}) in {pause:g} s")
        time.sleep(pause)
        run = run_services.run_retry(actor=None, run=run, from_index=failed.index)
    deployment = Deployment.objects.get(pk=deployment_id)
    if deployment.remote_share_percent != 100:
        raise RuntimeError(
            f"deploy run {run.pk} ended with remote share {deployment.remote_share_percent} %"
        )
    _say(
        f"deployment {deployment.name}: {deployment.state}, remote share {deployment.remote_share_percent} %"
    )
    return int(run.pk)


def _wait_agents_online(node_ids: list[int], timeout: float) -> None:
    from console.inventory.models import Node

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        nodes = list(Node.objects.filter(pk__in=node_ids))
        if all(n.last_heartbeat_at for n in nodes):
            return
        time.sleep(0.5)
    raise RuntimeError("agents did not heartbeat to the console in time")


def bring_up(
    args: Any,
    groups: ProcessGroups,
    stop: threading.Event,
    sites: netns.NamespaceSites | None = None,
) -> Endpoints:
    """Everything up to a deployment at 100 %; blocking. Raises RuntimeError on a failure.
    ``sites``: run the two sites in these namespaces (``--netns``), else on loopback."""
    var_dir = Path(args.var_dir).resolve()
    var_dir.mkdir(parents=True, exist_ok=True)
    fresh_state(var_dir)
    model = demo_model(args)
    _say(f"state under {var_dir}; logs under {var_dir / 'logs'}")
    pki = make_pki(var_dir / "pki")
    if sites is not None:
        pki = site_cert(pki, sites.addresses)
    env = _child_env(var_dir, pki)
    groups.env = env
    groups.cwd = var_dir
    _setup_django(env)
    password = _prepare_database()
    context = ssl.create_default_context(cafile=str(pki["ca"]))
    py = sys.executable

    def check_stop() -> None:
        if stop.is_set():
            raise Stop

    if model.zoo:
        _say(f"building {args.model} weights (once, cached)")
        build = groups.start(
            "model-build", [py, "-m", "pdbridge.cli", "engine", "build", model.zoo]
        )
        build.proc.wait(600)
        if build.proc.returncode != 0:
            raise RuntimeError(f"weights not built: {build.tail()}")
        groups.children.remove(build)
    if model.engine == "vllm":
        _say("engines: vLLM with pdbridge's KV connector; building the tiny Gemma-3 checkpoint "
             "(once, cached)")  # fmt: skip
        testbed_vllm.build_checkpoint()
    check_stop()

    console_port = args.port or free_port(args.host)
    if not port_is_free(console_port, args.host):
        raise RuntimeError(f"--port: {console_port} is taken (pick another, or 0 for any)")
    console_url = f"https://{args.host}:{console_port}"
    layout = (
        Layout.loopback(args.host, _remote_sites(args))
        if sites is None
        else Layout.namespaces(sites)
    )

    def wrap(site: str, argv: list[str]) -> list[str]:
        return argv if sites is None else sites.wrap(site, argv)

    # With --netns the console also listens where the sites reach it (and accepts that Host);
    # a wildcard --host covers that address already (a second bind would collide).
    wildcard = args.host in {"0.0.0.0", "::"}  # noqa: S104 - the operator's choice
    binds = dict.fromkeys([args.host] if wildcard else [args.host, layout.console_host])
    hosts = dict.fromkeys(["localhost", "127.0.0.1", "[::1]", args.host, layout.console_host])
    _say("starting the console, worker and beat")
    # The production server and its slow-client deadlines (pdbridge.console_server), with TLS.
    served = testbed_config(
        [f"{b}:{console_port}" for b in binds], pki["node_cert"], pki["node_key"]
    )
    console = groups.start("console", command(served, py), {"ALLOWED_HOSTS": ",".join(hosts)})
    # The liveness loop probes the console where the agents reach it (a stall is not theirs).
    probe = {"PDBRIDGE_LIVENESS_PROBE_URL": f"https://{layout.console_host}:{console_port}",
             "PDBRIDGE_LIVENESS_PROBE_CA": str(pki["ca"])}  # fmt: skip
    groups.start("worker", [py, "-m", "celery", "-A", "orchestrator.celery", "worker", "-P", "threads",
        "-c", "4", "--without-heartbeat", "--without-gossip", "--without-mingle", "-l", "INFO"], probe)  # fmt: skip
    groups.start("beat", [py, "-m", "celery", "-A", "orchestrator.celery", "beat", "-l", "INFO",
        "--schedule", str(var_dir / "celerybeat-schedule")])  # fmt: skip
    groups.wait_until(
        console, lambda: _https_answers(f"{console_url}/api/", context), 90, "console answering"
    )
    check_stop()

    ports = Ports.choose(pinned_port, args.gateway_port, layout.remotes)

    def shaper(listen: str, upstream_port: int) -> list[str]:
        command = [py, "-m", "pdbridge.cli", "kv", "proxy", "--listen", listen, "--upstream",
                   f"{layout.binds['local']}:{upstream_port}", "--latency-ms", str(args.wan_latency_ms)]  # fmt: skip
        # On loopback the shaper is the WAN's bandwidth too; in namespaces the tbf on the veth is.
        return command + (["--bandwidth-mbit", str(args.wan_mbit)] if sites is None else [])

    if sites is None:
        _say(
            f"WAN: {args.wan_mbit} Mbit/s, {args.wan_latency_ms} ms (shaping proxy on the KV path)"
        )
    else:
        # Bandwidth is the tbf on the WAN veth; the shaper (in the remote site, in front of the
        # veth) adds the latency the kernel cannot (no netem).
        _say(f"WAN: {args.wan_latency_ms} ms from the shaping proxy on the KV path, in front "
             f"of the {args.wan_mbit} Mbit/s veth")  # fmt: skip
    if len(layout.remotes) > 1:
        _say(f"remote sites: {', '.join(layout.remotes)}, each with its own WAN path")
    for site in layout.remotes:
        own, tag = ports.site(site), "" if site == "remote" else f"-{site}"
        groups.start(
            f"wan-shaper{tag}",
            wrap(site, shaper(f"127.0.0.1:{own.kv_shaped}", ports.kv_receiver)),
        )
        # The same WAN in front of the kv-link, for step 2's probe (its own proxy: the KV
        # path's fault proxy is the drills' and stays on the engines' path only).
        probe_listen = f"{layout.binds[site]}:{own.kv_link_wan}"
        groups.start(f"wan-shaper-probe{tag}", wrap(site, shaper(probe_listen, ports.kv_link)))

    # The gateway ships every request's trace to the console (the default samples 1 %): a
    # testbed's few requests are all worth a look on the trace pages.
    gateway_settings = var_dir / "sites" / "local" / "gateway.yaml"
    gateway_settings.parent.mkdir(parents=True, exist_ok=True)
    gateway_settings.write_text(
        "trace_ship_sample_rate: 1.0\ntrace_ship_interval_s: 1.0\n" + model.gateway_settings
    )
    rows = register(
        model, ports, pki, args.wan_mbit, layout, model_weights_sha256(model), gateway_settings
    )
    addresses: dict[str, str] = {}
    for site, token in rows.tokens.items():
        site_dir = var_dir / "sites" / site
        site_dir.mkdir(parents=True, exist_ok=True)
        token_file = site_dir / "node.token"
        # Created private: the token is the node's credential towards the console.
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(token)
        agents_console = f"https://{layout.console_host}:{console_port}"
        config = agent_config(site, site_dir, pki, agents_console, token_file, ports, layout)
        agent_env: dict[str, str] = {}
        if model.engine == "vllm":
            config = testbed_vllm.configure_agent(config)
            # One core per site's engine: local (decode) core 0, the remote sites after it.
            agent_env = testbed_vllm.engine_env(list(rows.tokens).index(site))
        config_path = site_dir / "agent.json"
        config_path.write_text(json.dumps(config, indent=2))
        info = site_dir / "state" / "agent.json"
        info.unlink(missing_ok=True)
        _say(f"starting the {site} site's agent")
        agent = groups.start(
            f"agent-{site}",
            wrap(site, [py, "-m", "pdbridge.cli", "agent", "--config", str(config_path)]),
            agent_env,
        )
        groups.wait_until(agent, info.exists, 60, "agent listening")
        addresses[site] = f"{layout.binds[site]}:{json.loads(info.read_text())['port']}"
    rows.set_agent_addresses(addresses)
    _wait_agents_online(rows.node_ids, 60)
    _say("agents online; running the deployment workflow (8 steps)")
    check_stop()

    gateway_url = f"https://{layout.hosts['local']}:{ports.gateway}"
    traffic = DemoTraffic(gateway_url, context, model.served)
    try:
        run_id = _deploy(rows.deployment_id, traffic, args.deploy_timeout, args.deploy_retries,
                         demo_params(model))  # fmt: skip
    finally:
        if traffic.started:
            traffic.stop()
            _say(f"demo traffic during the canary: {traffic.outcomes}")

    from django.db import connection

    connection.close()
    namespaces = [] if sites is None else [s.namespace for s in sites.all]
    ready = Endpoints(console_url, gateway_url, str(pki["ca"]), model.served, rows.deployment_id,
                      run_id, addresses, str(var_dir), os.getpid(), namespaces)  # fmt: skip
    _print_ready(ready, password, model)
    return ready


def _print_ready(ready: Endpoints, password: str | None, model: Any) -> None:
    prompt = model.demo_prompt.replace('"', '\\"')
    body = json.dumps({"model": ready.served_model, "prompt": prompt, "max_tokens": 16})
    print(flush=True)
    print(f"  console:  {ready.console_url}/  (CA: {ready.ca})", flush=True)
    if password:
        print(f"  login:    admin / {password}   (shown once)", flush=True)
    else:
        print("  login:    admin (reset: pdbridge console changepassword admin)", flush=True)
    print(f"  gateway:  {ready.gateway_url}/v1/completions", flush=True)
    print(f"  try:      curl -si --cacert {ready.ca} {ready.gateway_url}/v1/completions "
          f"-H 'Content-Type: application/json' -d '{body}'", flush=True)  # fmt: skip
    print("  Ctrl-C stops everything.", flush=True)


def main(args: Any) -> int:
    """Run the testbed until a signal; see the module docstring."""
    unavailable = model_unavailable(args)
    if unavailable:
        print(f"pdbridge run: {unavailable}", file=sys.stderr, flush=True)
        return 2
    become_subreaper()
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()
        if threading.current_thread() is threading.main_thread() and not _serving[0]:
            raise Stop

    _serving = [False]
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    groups = ProcessGroups(Path(args.var_dir).resolve() / "logs", dict(os.environ))
    code = 0
    sites: netns.NamespaceSites | None = None
    try:
        if getattr(args, "netns", False):
            sites = netns_up(args)
        ready = bring_up(args, groups, stop, sites)
        if args.ready_file:
            Path(args.ready_file).write_text(json.dumps(asdict(ready)))
        _serving[0] = True
        deadline = time.monotonic() + args.exit_after if args.exit_after else None
        exited: dict[str, float] = {}
        while not stop.wait(1.0):
            # A site's agent that exits is started again after AGENT_RESTART_S, as its systemd
            # unit would be (Restart=always); its engines come back through the console's
            # reconcile loop. Any other child that exits stops the testbed.
            for child in [c for c in groups.children if c.name.startswith("agent-")]:
                if child.alive():
                    continue
                since = exited.setdefault(child.name, time.monotonic())
                if time.monotonic() - since >= AGENT_RESTART_S:
                    del exited[child.name]
                    _say(f"{child.name} exited ({child.proc.returncode}); starting it again")
                    groups.restart(child)
            dead = [c.name for c in groups.children if not c.alive() and c.name not in exited]
            if dead:
                _say(f"stopping: {', '.join(dead)} exited (logs under {groups.log_dir})")
                code = 1
                break
            if deadline is not None and time.monotonic() > deadline:
                break
    except Stop:
        pass
    except RuntimeError as exc:
        _say(f"failed: {exc}")
        code = 1
    finally:
        _serving[0] = True  # no more Stop exceptions while shutting down
        _say("shutting down")
        groups.stop_all()
        left = groups.reap_descendants()
        if left:
            for pid, command in left:
                _say(f"killed leftover process {pid}: {command[:160]}")
        if sites is not None:  # after the processes: a namespace lives while one is inside
            netns_down(sites, args)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _say("stopped")
    return code
