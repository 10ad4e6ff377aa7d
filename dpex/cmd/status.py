"""dpex: operator commands (``dpex status``)."""
from __future__ import annotations

import click

from dpex.cmd.common import fail, tls_ca_option
from dpex.errors import DpexError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
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
    lines = [f"dispatcher up {_age(status.uptime_s)}; splits assigned {status.splits_assigned_total}, "
             f"taken back from lost workers {status.splits_reassigned_total}; collected: "
             f"{status.jobs_collected_total} jobs, {status.workers_forgotten_total} workers; "
             f"workers needed by the trainers' rates: {status.workers_needed or '-'}", "",
             f"WORKERS ({count['alive']} alive, {count['lost']} lost, {count['left']} left)"]
    rows = [("ID", "ADDRESS", "STATE", "SPLITS", "PROCS", "BUSY", "BUFFER", "RUNNING", "STREAMS",
             "PRODUCED", "SENT", "SENT BYTES", "HEARTBEAT")]
    for w in status.workers:
        load = w.load
        if w.state != "alive":  # no load of a worker that is gone
            rows.append((w.worker_id, w.address, w.state, str(w.splits_held), *["-"] * 8, "-"))
            continue
        rows.append((w.worker_id, w.address, w.state, str(w.splits_held), str(load.processes),
                     f"{100 * load.busy_fraction:.0f}%", str(load.buffer_batches), str(load.running_batches),
                     str(load.fetch_streams), str(load.batches_produced), str(load.batches_sent),
                     _mb(load.bytes_sent), f"{w.seconds_since_heartbeat:.1f}s ago"))
    lines += _table(rows)
    jobs = {s: [j for j in status.jobs if j.state == s] for s in ("running", "idle", "finished")}
    lines += ["", f"JOBS ({len(jobs['running'])} running, {len(jobs['idle'])} idle, "
                  f"{len(jobs['finished'])} finished)"]
    rows = [("ID", "NAME", "STATE", "CONSUMERS", "EPOCH", "PLANNED", "DELIVERED", "DONE", "SPLITS ASSIGNED",
             "UNASSIGNED")]
    for j in jobs["running"] + jobs["idle"] + jobs["finished"]:  # live ones first
        done = f"{100 * j.batches_delivered / j.batches_planned:.0f}%" if j.batches_planned else "-"
        epochs = sorted(set(j.epochs))
        rows.append((str(j.job_id), j.name or "-", j.state, f"{j.consumers_active} active / {j.num_consumers}",
                     "-" if not epochs else "/".join(map(str, epochs)), str(j.batches_planned),
                     str(j.batches_delivered), done, str(j.splits_assigned), str(j.splits_unassigned)))
    lines += _table(rows)
    return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


@main.command()
@click.option("--dispatcher", required=True, envvar="DPEX_DISPATCHER", show_envvar=True,
              help="The dispatcher's HOST:PORT.")
@click.option("--timeout", type=float, default=5.0, envvar="DPEX_TIMEOUT", show_envvar=True,
              show_default=True, help="Seconds to try to reach the dispatcher.")
@click.option("--auth-token-file", type=click.Path(dir_okay=False), default=None, envvar="DPEX_AUTH_TOKEN_FILE",
              show_envvar=True, help="File holding the dispatcher's token (or set DPEX_AUTH_TOKEN).")
@tls_ca_option
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON instead of tables.")
def status(dispatcher: str, timeout: float, auth_token_file: str | None, tls_ca: str | None,
           as_json: bool) -> None:
    """Show workers (state, splits held, load, batches produced and sent,
    heartbeat) and jobs (consumers, epoch, batches planned and delivered)."""
    from dpex.proto import dispatcher_pb2 as dpb
    from dpex.proto import dispatcher_pb2_grpc as dgrpc
    from dpex.auth import load_ca, load_token
    from dpex.rpc import call, channel
    try:
        with channel(dispatcher, load_token(auth_token_file), load_ca(tls_ca)) as ch:
            response = call(dgrpc.DispatcherStub(ch).GetStatus, dpb.GetStatusRequest(),
                            target=f"dispatcher {dispatcher}", timeout_s=timeout, retry_for_s=timeout)
    except DpexError as e:
        fail(str(e))
    if as_json:
        from google.protobuf.json_format import MessageToJson
        click.echo(MessageToJson(response, always_print_fields_with_no_presence=True))
    else:
        click.echo(render(response))


if __name__ == "__main__":
    main()
