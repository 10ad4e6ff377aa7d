"""dpex-dispatcher: the registry of workers and jobs."""
from __future__ import annotations

import click

from dpex.auth import load_token
from dpex.cmd.common import (DaemonCommand, auth_options, fail, log_options, message_limit_option, metrics_option, setup_logging,
                             version_option)
from dpex.daemon import exit_now, serve_until_signalled
from dpex.config import DispatcherConfig
from dpex.errors import DpexError

_D = DispatcherConfig  # its fields' defaults are the flags'


@click.command(cls=DaemonCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@version_option
@click.option("--port", type=int, default=_D.port, envvar="DPEX_PORT", show_envvar=True,
              help="Port to listen on (0 picks a free one).")
@click.option("--host", default=_D.host, envvar="DPEX_HOST", show_envvar=True,
              help="Address to bind.")
@click.option("--work-dir", type=click.Path(file_okay=False), default=None, envvar="DPEX_WORK_DIR",
              show_envvar=True, help="Directory of the journal: every state change is written (fsync'd) "
              "there first; a restart reads the last snapshot and the log after it. Without it, state is "
              "in memory only.")
@click.option("--heartbeat-interval", type=float, default=_D.heartbeat_interval_s, envvar="DPEX_HEARTBEAT_INTERVAL",
              show_envvar=True, help="Seconds a worker's heartbeat long-polls when there is nothing to tell "
              "it (work and changes are answered at once); longer: less load from a large fleet.")
@click.option("--heartbeat-timeout", type=float, default=_D.heartbeat_timeout_s, envvar="DPEX_HEARTBEAT_TIMEOUT",
              show_envvar=True, help="Seconds of silence after which a worker is lost.")
@click.option("--consumer-timeout", type=float, default=_D.consumer_timeout_s, envvar="DPEX_CONSUMER_TIMEOUT",
              show_envvar=True, help="Seconds without news from a trainer mid-epoch after which its plan "
              "is released and workers free what they hold for it.")
@click.option("--job-gc-timeout", type=float, default=_D.job_gc_timeout_s, envvar="DPEX_JOB_GC_TIMEOUT", show_envvar=True,
              help="Seconds a job may go without any call from its trainers before it is removed, with its "
              "splits and the workers' batches for it (0: never). A trainer that comes back gets a fresh job.")
@click.option("--worker-gc-timeout", type=float, default=_D.worker_gc_timeout_s, envvar="DPEX_WORKER_GC_TIMEOUT",
              show_envvar=True, help="Seconds after which a lost or drained worker is forgotten (0: never).")
@click.option("--split-size", type=int, default=_D.split_size_batches, envvar="DPEX_SPLIT_SIZE", show_envvar=True,
              help="Batches per split, the unit of work handed to a worker.")
@message_limit_option(_D.max_message_bytes >> 20, "Largest request taken, in MiB (a plan of explicit indices comes in 2 MiB chunks).")
@click.option("--max-plan-batches", type=int, default=_D.max_plan_batches, envvar="DPEX_MAX_PLAN_BATCHES",
              show_envvar=True, help="Largest epoch plan taken, in batches.")
@click.option("--journal-compact-kb", type=int, default=_D.journal_compact_bytes >> 10, envvar="DPEX_JOURNAL_COMPACT_KB",
              show_envvar=True, help="With --work-dir: once the log passes this many KiB (and twice the last "
              "snapshot), a snapshot of the live state replaces it (0: never).")
@metrics_option
@log_options
@auth_options
@click.option("--min-workers", type=int, default=_D.min_workers, envvar="DPEX_MIN_WORKERS", show_envvar=True,
              help="The fewest workers the scaling policy wants (with --max-workers).")
@click.option("--max-workers", type=int, default=_D.max_workers, envvar="DPEX_MAX_WORKERS", show_envvar=True,
              help="The most workers the scaling policy wants: with it, the dispatcher says how many workers "
              "the trainers need now (dpex status, metric dpex_workers_wanted) for a deployment to act on "
              "(dpex.ray does); 0: it says nothing.")
@click.option("--scale-cooldown", type=float, default=_D.scale_cooldown_s, envvar="DPEX_SCALE_COOLDOWN",
              show_envvar=True, help="Seconds after a change before the policy lets a worker go.")
@click.option("--ready-file", default=None, hidden=True, help="Write the address here once serving.")
def main(port: int, host: str, work_dir: str | None, heartbeat_interval: float,
         heartbeat_timeout: float, consumer_timeout: float, job_gc_timeout: float, worker_gc_timeout: float,
         split_size: int, max_message_mb: float,
         max_plan_batches: int, journal_compact_kb: int, metrics_port: int | None, log_level: str, log_format: str,
         auth_token_file: str | None, allow_unauthenticated: bool, tls_cert: str | None,
         tls_key: str | None, min_workers: int, max_workers: int, scale_cooldown: float,
         ready_file: str | None) -> None:
    """Run the Dpex dispatcher: it registers workers, creates jobs, takes
    the trainers' epoch plans and hands splits of them to workers. With
    --work-dir it journals every change and a restart resumes where it was;
    without, a restart loses jobs and plans (workers re-register).

    \b
    Example:
      dpex-dispatcher --port 7070
    then start workers with `dpex-worker --dispatcher HOST:7070`.
    """
    setup_logging(log_level, log_format)
    from dpex.dispatcher.server import DispatcherServer
    try:
        config = DispatcherConfig(host=host, port=port, heartbeat_interval_s=heartbeat_interval,
                                  heartbeat_timeout_s=heartbeat_timeout, split_size_batches=split_size,
                                  work_dir=work_dir, consumer_timeout_s=consumer_timeout,
                                  job_gc_timeout_s=job_gc_timeout, worker_gc_timeout_s=worker_gc_timeout,
                                  auth_token=load_token(auth_token_file), auth_token_file=auth_token_file,
                                  allow_unauthenticated=allow_unauthenticated,
                                  tls_cert_file=tls_cert, tls_key_file=tls_key,
                                  max_message_bytes=int(max_message_mb * 2**20),
                                  max_plan_batches=max_plan_batches, metrics_port=metrics_port,
                                  journal_compact_bytes=journal_compact_kb << 10, min_workers=min_workers,
                                  max_workers=max_workers, scale_cooldown_s=scale_cooldown)
        server = DispatcherServer(config)
    except DpexError as e:
        fail(str(e))
    serve_until_signalled(server, ready_file)
    exit_now()


if __name__ == "__main__":
    main()
