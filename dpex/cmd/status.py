"""dpex: operator commands (``dpex status``, ``dpex profile``, ``dpex health``, ``dpex ray start|status|stop``)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import click

from dpex.cmd.common import fail, tls_ca_option, version_option
from dpex.errors import DpexError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@version_option
def main() -> None:
    """Dpex operator commands."""


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


def _age(seconds: float) -> str:
    seconds = int(seconds)
    h, m, sec = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{sec:02d}s" if m else f"{sec}s"


def render(status) -> str:
    count = {s: sum(w.state == s for w in status.workers) for s in ("alive", "lost", "left")}
    lines = [f"dispatcher up {_age(status.uptime_s)} ({_versions(status.versions)}); splits assigned {status.splits_assigned_total}, "
             f"taken back from lost workers {status.splits_reassigned_total}; collected: "
             f"{status.jobs_collected_total} jobs, {status.workers_forgotten_total} workers; "
             f"workers needed by the trainers' rates: {status.workers_needed or '-'}",
             *([f"workers wanted: {status.workers_wanted} ({status.scaling_reason})"] if status.workers_wanted else []),
             *(["calls refused: " + ", ".join(f"{n} for {why}" for why, n in sorted(status.refused_calls_total.items()))]
               if status.refused_calls_total else []),
             "",
             f"WORKERS ({count['alive']} alive, {count['lost']} lost, {count['left']} left)"]
    rows = [("ID", "ADDRESS", "STATE", "SPLITS", "PROCS", "BUSY", "BUFFER", "RUNNING", "STREAMS",
             "PRODUCED", "SHARED", "CACHED", "SENT", "SENT BYTES", "QUEUED/SEND", "HEARTBEAT", "DPEX/TORCH")]
    for w in status.workers:
        load = w.load
        if w.state != "alive":  # no load of a worker that is gone
            rows.append((w.worker_id, w.address, w.state, str(w.splits_held), *["-"] * 11, "-", _versions(w.versions)))
            continue
        rows.append((w.worker_id, w.address, w.state, str(w.splits_held), str(load.processes),
                     f"{100 * load.busy_fraction:.0f}%", str(load.buffer_batches), str(load.running_batches),
                     str(load.fetch_streams), str(load.batches_produced),
                     f"{load.share_hits} ({_mb(load.share_bytes)} kept)" if load.share_hits or load.share_bytes
                     else "-", _mb(load.sample_cache_bytes) if load.sample_cache_bytes else "-",
                     str(load.batches_sent),
                     _mb(load.bytes_sent), _per_batch(load), f"{w.seconds_since_heartbeat:.1f}s ago",
                     _versions(w.versions)))
    lines += _table(rows)
    jobs = {s: [j for j in status.jobs if j.state == s] for s in ("running", "idle", "finished")}
    lines += ["", f"JOBS ({len(jobs['running'])} running, {len(jobs['idle'])} idle, "
                  f"{len(jobs['finished'])} finished)"]
    rows = [("ID", "NAME", "STATE", "CONSUMERS", "EPOCH", "PLANNED", "DELIVERED", "DONE", "SPLITS ASSIGNED",
             "UNASSIGNED", "SHARES", "SHARING")]
    for j in jobs["running"] + jobs["idle"] + jobs["finished"]:  # live ones first
        done = f"{100 * j.batches_delivered / j.batches_planned:.0f}%" if j.batches_planned else "-"
        epochs = sorted(set(j.epochs))
        rows.append((str(j.job_id), j.name or "-", j.state, f"{j.consumers_active} active / {j.num_consumers}",
                     "-" if not epochs else "/".join(map(str, epochs)), str(j.batches_planned),
                     str(j.batches_delivered), done, str(j.splits_assigned), str(j.splits_unassigned),
                     j.shares or "-", j.sharing or "-"))
    lines += _table(rows)
    verdicts = [j for j in jobs["running"] + jobs["idle"] if j.HasField("bottleneck")]
    if verdicts:
        lines += ["", "WHERE THE TIME GOES (each job's consumer that waited most, over its last window)"]
        lines += [f"job {j.job_id}{f' ({j.name})' if j.name else ''} consumer {j.bottleneck.consumer_index}: "
                  f"{j.bottleneck.bottleneck}: {j.bottleneck.reason}" for j in verdicts]
    return "\n".join(lines)


def _per_batch(load) -> str:
    """Mean ms a sent batch waited for its request, and took to send."""
    if not load.batches_sent:
        return "-"
    return f"{1000 * load.queued_s / load.batches_sent:.1f}/{1000 * load.send_s / load.batches_sent:.1f} ms"


def _versions(v) -> str:
    return f"{v.dpex or '?'}/{v.torch or '?'}"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _dispatcher_options(command: Callable) -> Callable:
    """The options that reach a dispatcher: its address, how long to try, its token, its CA."""
    for option in reversed((
            click.option("--dispatcher", required=True, envvar="DPEX_DISPATCHER", show_envvar=True,
                         help="The dispatcher's HOST:PORT."),
            click.option("--timeout", type=float, default=5.0, envvar="DPEX_TIMEOUT", show_envvar=True,
                         show_default=True, help="Seconds to try to reach the dispatcher."),
            click.option("--auth-token-file", type=click.Path(dir_okay=False), default=None,
                         envvar="DPEX_AUTH_TOKEN_FILE", show_envvar=True,
                         help="File holding the dispatcher's token (or set DPEX_AUTH_TOKEN)."),
            tls_ca_option)):
        command = option(command)
    return command


@contextlib.contextmanager
def _statuses(dispatcher: str, timeout: float, auth_token_file: str | None,
              tls_ca: str | None) -> Iterator[Callable[[], Any]]:
    """A function that reads the dispatcher's status (a GetStatusResponse),
    on one channel; a dispatcher that cannot be reached is the command's failure."""
    from dpex.proto import dispatcher_pb2 as dpb
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.auth import load_ca, load_token
    from dpex.rpc import call, channel
    try:
        with channel(dispatcher, load_token(auth_token_file), load_ca(tls_ca)) as ch:
            yield lambda: call(dgrpc.DispatcherStub(ch).GetStatus, dpb.GetStatusRequest(),
                               target=f"dispatcher {dispatcher}", timeout_s=timeout, retry_for_s=timeout)
    except DpexError as e:
        fail(str(e))


@main.command()
@_dispatcher_options
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON instead of tables.")
def status(dispatcher: str, timeout: float, auth_token_file: str | None, tls_ca: str | None,
           as_json: bool) -> None:
    """Show workers (state, splits held, load, batches produced, shared and
    sent, heartbeat) and jobs (consumers, epoch, batches planned and
    delivered, which share their batches: equal SHARES, and why one shares nothing),
    and where each live job's time goes (its trainers' verdict, in words)."""
    with _statuses(dispatcher, timeout, auth_token_file, tls_ca) as read:
        response = read()
    if as_json:
        from google.protobuf.json_format import MessageToJson
        click.echo(MessageToJson(response, always_print_fields_with_no_presence=True))
    else:
        click.echo(render(response))


@main.command()
@click.argument("address")
@click.option("--service", default="", show_default=True,
              help="The service whose health to check: dpex.v1.Dispatcher, dpex.v1.Worker, or \"\" (the server).")
@click.option("--timeout", type=float, default=3.0, show_default=True, help="Seconds to wait for the answer.")
@tls_ca_option
@click.option("--tls-server-name", default=None, envvar="DPEX_TLS_SERVER_NAME", show_envvar=True,
              help="With --tls-ca: the name the daemon's certificate must carry [default: ADDRESS's host] "
              "(a probe reaching its own pod at localhost names the Service).")
def health(address: str, service: str, timeout: float, tls_ca: str | None, tls_server_name: str | None) -> None:
    """Check a daemon's gRPC health (as Kubernetes' gRPC probe, but over TLS
    too): exit 0 and print SERVING, or exit 1 naming its status or why it
    could not be asked. E.g. ``dpex health localhost:7071 --service dpex.v1.Worker``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from dpex.auth import load_ca
    from dpex import rpc
    try:
        with rpc.channel(address, None, load_ca(tls_ca), tls_server_name) as ch:
            answer = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                          timeout=timeout)
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.NOT_FOUND:
            fail(f"{address} serves no service {service!r}")
        details = e.details() or ""
        why = rpc.tls_refusal(details)
        fail(f"{address}: {e.code().name}: {details}" + (f": {why}" if why else rpc.tls_hint(details)))
    except DpexError as e:
        fail(str(e))
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
    click.echo(name)
    if answer.status != health_pb2.HealthCheckResponse.SERVING:
        raise SystemExit(1)


@main.command()
@_dispatcher_options
@click.option("--job", "jobs", multiple=True, help="A job's id or name (repeatable) [default: every live job].")
@click.option("--seconds", type=float, default=15.0, show_default=True, help="How long to watch.")
def profile(dispatcher: str, timeout: float, auth_token_file: str | None, tls_ca: str | None,
            jobs: tuple[str, ...], seconds: float) -> None:
    """Watch jobs for a while, then say where their time goes: the verdict of
    each job's consumer that waited most, a batch's time by stage, and the
    batches/s that 1, 2, 4 and 8 workers like the live ones would give."""
    import time
    with _statuses(dispatcher, timeout, auth_token_file, tls_ca) as read:
        begun, first = time.monotonic(), read()
        time.sleep(seconds)  # watching: the trainers' windows and the delivered count move meanwhile
        last, watched = read(), time.monotonic() - begun
    if jobs:
        chosen = [j for j in last.jobs if str(j.job_id) in jobs or j.name in jobs]
        if not chosen:
            fail(f"no job {', '.join(jobs)} at dispatcher {dispatcher}")
    else:
        chosen = [j for j in last.jobs if j.state == "running"]
    if not chosen:
        click.echo(f"no running job at dispatcher {dispatcher}")
        return
    before = {j.job_id: j.batches_delivered for j in first.jobs}
    click.echo("\n\n".join(render_profile(j, (j.batches_delivered - before.get(j.job_id, 0)) / watched, watched)
                            for j in chosen))


def render_profile(job: Any, rate: float, watched_s: float) -> str:
    """A job's verdict, stage table and what-if table (dpex.bottleneck), in words."""
    from dpex import bottleneck
    title = f"job {job.job_id}" + (f" ({job.name})" if job.name else "")
    lines = [f"{title}: {rate:.1f} batches/s delivered over the {watched_s:.0f} s watched"]
    if not job.HasField("bottleneck"):
        return "\n".join(lines + ["no verdict yet: its trainers report one after ~3 s of batches"])
    v = job.bottleneck
    lines += [f"consumer {v.consumer_index}, over its last window: {v.bottleneck}", f"  {v.reason}", ""]
    stages = dict(v.stages)
    rows = [("STAGE", "MS A BATCH", "OF IT ON A CPU", "WAITING FOR A CORE")]
    for name in ("dataset", "collate", "dpex", "receive", "decode", "pin"):
        if name in stages:
            cpu, core = stages.get(f"{name}_cpu"), stages.get(f"{name}_cpu_wait")
            rows.append((name, f"{1000 * stages[name]:.1f}", "-" if cpu is None else f"{1000 * cpu:.1f}",
                         "-" if core is None else f"{1000 * core:.1f}"))
    lines += _table(rows) + [""]
    figures = bottleneck.reported(v.wait_fraction, v.batches_per_s, v.workers_alive, v.processes)
    rows = [("WORKERS", "BATCHES/S (PREDICTED)")]
    rows += [(f"{k}{' (now)' if k == v.workers_alive else ''}", f"{bottleneck.predict(figures, k):.1f}")
             for k in sorted({1, 2, 4, 8, v.workers_alive})]
    lines += _table(rows)
    if v.bottleneck == "storage" and v.processes:  # the lever: processes wait, more of them on the same cores
        now = round(v.processes)
        rows = [(f"PROCESSES A WORKER ({v.workers_alive} WORKERS)", "BATCHES/S (PREDICTED)")]
        rows += [(f"{p}{' (now)' if p == now else ''}", f"{bottleneck.predict(figures, processes=p):.1f}")
                 for p in sorted({now, 2 * now, 4 * now})]
        lines += [""] + _table(rows)
    return "\n".join(lines)


@main.group()
def ray() -> None:
    """Dpex on a Ray cluster (pip install 'dpex[ray]'): a dispatcher and one
    worker per node, as Ray actors."""


def _ray(function: str, *args: Any, **kwargs: Any) -> Any:
    """dpex.ray.FUNCTION(...), its errors as the command's."""
    try:
        import dpex.ray
    except ImportError:
        fail("Ray is not installed here: pip install 'dpex[ray]'")
    try:
        return getattr(dpex.ray, function)(*args, **kwargs)
    except DpexError as e:
        fail(str(e))


RAY_ADDRESS = click.option("--address", default="auto", envvar="RAY_ADDRESS", show_envvar=True, show_default=True,
                           help="The Ray cluster (ray://HOST:10001, HOST:6379, or auto: this machine's).")


def _print_endpoint(endpoint) -> None:
    click.echo(f"dispatcher {endpoint.address}; {len(endpoint.workers)} workers")
    for node, address in sorted(endpoint.workers.items()):
        click.echo(f"  node {node[:12]}  worker {address}")


@ray.command("start")
@RAY_ADDRESS
@click.option("--work-dir", default=None, help="The dispatcher's journal directory on the head node.")
@click.option("--data-path", "data_paths", multiple=True, help="A node without it gets no worker (repeatable).")
@click.option("--worker-cpus", type=float, default=None, help="Ray CPUs per worker [default: all of its node's].")
@click.option("--wait", type=float, default=120.0, show_default=True, help="Seconds to wait for the workers.")
@click.option("--min-workers", type=int, default=None,
              help="With --max-workers: as many workers as the dispatcher's scaling policy wants, within these "
              "bounds, instead of one per node.")
@click.option("--max-workers", type=int, default=None, help="See --min-workers.")
@click.option("--scale-cooldown", type=float, default=60.0, show_default=True,
              help="Seconds after a change before a worker is let go.")
def ray_start(address: str, work_dir: str | None, data_paths: tuple[str, ...], worker_cpus: float | None,
              wait: float, min_workers: int | None, max_workers: int | None, scale_cooldown: float) -> None:
    """Start Dpex on the Ray cluster (or find it there) and say where it serves."""
    config = _ray("RayConfig", work_dir=work_dir, data_paths=data_paths, worker_cpus=worker_cpus,
                  min_workers=min_workers, max_workers=max_workers, scale_cooldown_s=scale_cooldown)
    _print_endpoint(_ray("start", address, config, wait_s=wait))


@ray.command("status")
@RAY_ADDRESS
def ray_status(address: str) -> None:
    """Where Dpex serves on the Ray cluster (exit 1 if it does not run there)."""
    endpoint = _ray("status", address)
    if endpoint is None:
        fail(f"Dpex does not run on the Ray cluster at {address}: dpex ray start")
    _print_endpoint(endpoint)


@ray.command("stop")
@RAY_ADDRESS
def ray_stop(address: str) -> None:
    """Stop Dpex's workers (they drain) and dispatcher on the Ray cluster."""
    stopped = _ray("stop", address)
    click.echo("stopped" if stopped else f"Dpex was not running on the Ray cluster at {address}")


if __name__ == "__main__":
    main()
