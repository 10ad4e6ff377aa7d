"""dpex: operator commands (``dpex status``)."""
from __future__ import annotations

import click

from dpex.cmd.common import fail
from dpex.errors import DpexError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Dpex operator commands."""


def render(status) -> str:
    lines = [f"WORKERS ({sum(w.state == 'alive' for w in status.workers)} alive)"]
    rows = [("ID", "ADDRESS", "STATE", "SPLITS", "LAST HEARTBEAT")]
    rows += [(w.worker_id, w.address, w.state, str(w.splits_held), f"{w.seconds_since_heartbeat:.1f}s ago")
             for w in status.workers]
    lines += _table(rows)
    lines += ["", f"JOBS ({len(status.jobs)})"]
    rows = [("ID", "NAME", "CONSUMERS", "PLANNED", "DELIVERED", "SPLITS ASSIGNED", "UNASSIGNED")]
    rows += [(str(j.job_id), j.name or "-", str(j.num_consumers), str(j.batches_planned),
              str(j.batches_delivered), str(j.splits_assigned), str(j.splits_unassigned))
             for j in status.jobs]
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
@click.option("--tls-ca", type=click.Path(dir_okay=False), default=None, envvar="DPEX_TLS_CA", show_envvar=True,
              help="Reach the dispatcher over TLS, verifying it against these CAs (PEM).")
def status(dispatcher: str, timeout: float, auth_token_file: str | None, tls_ca: str | None) -> None:
    """Show workers (state, splits held, heartbeat) and jobs (batches
    planned and delivered)."""
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
    click.echo(render(response))


if __name__ == "__main__":
    main()
