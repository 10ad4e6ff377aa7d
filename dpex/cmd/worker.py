"""dpex-worker: builds datasets from local files and serves batches."""
from __future__ import annotations

import click

from dpex.auth import load_token
from dpex.cmd.common import (DaemonCommand, ByteSize, auth_options, fail, log_options, message_limit_option, metrics_option,
                             setup_logging, tls_ca_option, version_option)
from dpex.config import WorkerConfig
from dpex.daemon import exit_now
from dpex.errors import DpexError
from dpex.procutil import reuse_freed_memory

_W = WorkerConfig  # its fields' defaults are the flags'


@click.command(cls=DaemonCommand, context_settings={"show_default": True, "help_option_names": ["-h", "--help"]})
@version_option
@click.option("--dispatcher", required=True, envvar="DPEX_DISPATCHER", show_envvar=True,
              help="The dispatcher's HOST:PORT.")
@click.option("--port", type=int, default=_W.port, envvar="DPEX_PORT", show_envvar=True,
              help="Port to serve batches on (0 picks a free one).")
@click.option("--host", default=_W.host, envvar="DPEX_HOST", show_envvar=True, help="Address to bind.")
@click.option("--advertise-host", default=None, envvar="DPEX_ADVERTISE_HOST", show_envvar=True,
              help="Host trainers should connect to [default: the interface that reaches the dispatcher].")
@click.option("--processes", type=int, default=_W.processes, envvar="DPEX_PROCESSES", show_envvar=True,
              help="Processes that load, transform and collate samples.")
@click.option("--buffer-batches", type=int, default=None, envvar="DPEX_BUFFER_BATCHES", show_envvar=True,
              help="Batches each consumer (a trainer rank of a job) may have made here ahead of its "
              "requests, running or ready [default: max(8, --processes)].")
@click.option("--buffer-mb", type=float, default=_W.buffer_bytes >> 20, envvar="DPEX_BUFFER_MB", show_envvar=True,
              help="Memory for batches made ahead, in MiB; the consumers with work here share it equally.")
@click.option("--max-splits", type=int, default=_W.max_held_splits, envvar="DPEX_MAX_SPLITS", show_envvar=True,
              help="Splits with work left taken from the dispatcher at once (one more at a time while they "
              "hold fewer batches than 2 x --processes).")
@click.option("--max-loaders", type=int, default=_W.max_loaders, envvar="DPEX_MAX_LOADERS", show_envvar=True,
              help="Open loaders (trainers' DpexDataLoaders, one stream each, kept between epochs) served at "
              "once; the next is refused with an error that says so, and counted in "
              "dpex_worker_fetch_refused_total. An open loader holds no thread, only memory.")
@click.option("--heartbeat-interval", type=float, default=_W.heartbeat_interval_s, envvar="DPEX_HEARTBEAT_INTERVAL",
              show_envvar=True, help="Seconds between heartbeats to the dispatcher (as the dispatcher's).")
@click.option("--connect-timeout", type=float, default=_W.connect_timeout_s, envvar="DPEX_CONNECT_TIMEOUT",
              show_envvar=True, help="Seconds to keep retrying an unreachable dispatcher.")
@message_limit_option(_W.max_message_bytes >> 20, "Largest batch sent, in MiB; a bigger batch is an error for the trainer "
                      "(at most 1024: what trainers accept).")
@click.option("--shm/--no-shm", default=True, envvar="DPEX_SHM", show_envvar=True,
              help="Pass large batches from the processes to the daemon through /dev/shm files, and let "
              "trainers on this host map them instead of receiving them over gRPC.")
@click.option("--shm-min-kb", type=int, default=_W.shm_min_bytes >> 10, envvar="DPEX_SHM_MIN_KB", show_envvar=True,
              help="Batches smaller than this take the pipe and gRPC.")
@click.option("--data-port", type=int, default=0, envvar="DPEX_DATA_PORT", show_envvar=True,
              help="TCP port on which trainers on other hosts receive batches beside their gRPC stream "
              "(0 picks a free one, -1 turns it off: batches go in gRPC messages). Off with TLS.")
@click.option("--drain-timeout", type=float, default=_W.drain_timeout_s, envvar="DPEX_DRAIN_TIMEOUT", show_envvar=True,
              help="On SIGTERM: seconds to answer what is in flight after deregistering (the dispatcher "
              "hands this worker's splits to others at once); then batch processes are killed and it exits.")
@click.option("--in-turn/--no-in-turn", default=_W.in_turn, envvar="DPEX_IN_TURN", show_envvar=True,
              help="Batch process k makes batches k, k+N, k+2N... of each consumer's epoch, as torch's DataLoader "
              "workers do (get_worker_info().id as in torch); with in_order=False a batch still passes a busy "
              "process. Default: the processes share one queue, each taking the next batch when it is free, which "
              "keeps them all busy when they run at different speeds.")
@click.option("--share-cache-bytes", type=ByteSize(), default=_W.share_cache_bytes, envvar="DPEX_SHARE_CACHE_BYTES",
              show_envvar=True, help="Memory for batches made for one job and kept for the other jobs of the "
              "same definition (a sweep's trials: each batch is made once for all; see docs/guides/sharing.md); "
              "e.g. 1G or 512M; 0: nothing is shared.")
@click.option("--sample-cache-bytes", type=ByteSize(), default=_W.sample_cache_bytes,
              envvar="DPEX_SAMPLE_CACHE_BYTES", show_envvar=True,
              help="Memory (/dev/shm) for the samples of jobs with cache='memory'; past it the oldest spill to "
              "disk. E.g. 1G.")
@click.option("--sample-disk-bytes", type=ByteSize(), default=_W.sample_disk_bytes, envvar="DPEX_SAMPLE_DISK_BYTES",
              show_envvar=True, help="Disk for samples (cache='disk', and those spilled); past it the oldest go.")
@click.option("--data-path", "data_paths", multiple=True, type=click.Path(), envvar="DPEX_DATA_PATH", show_envvar=True,
              help="Local data this node must have (repeatable; environment variables in it are expanded; "
              "DPEX_DATA_PATH: paths separated by ':'); without it the worker refuses to start, naming the path.")
@metrics_option
@log_options
@auth_options
@tls_ca_option
@click.option("--ready-file", default=None, hidden=True, help="Write the address here once serving.")
def main(dispatcher: str, port: int, host: str, advertise_host: str | None, processes: int,
         buffer_batches: int | None, buffer_mb: float, max_splits: int, max_loaders: int,
         heartbeat_interval: float,
         connect_timeout: float,
         max_message_mb: float, shm: bool, shm_min_kb: int, data_port: int, drain_timeout: float,
         in_turn: bool, share_cache_bytes: int, sample_cache_bytes: int, sample_disk_bytes: int,
         data_paths: tuple[str, ...], metrics_port: int | None, log_level: str,
         log_format: str,
         auth_token_file: str | None, allow_unauthenticated: bool,
         tls_cert: str | None, tls_key: str | None, tls_ca: str | None, ready_file: str | None) -> None:
    """Run a Dpex worker. It registers with the dispatcher, takes splits of
    the trainers' plans, builds each job's dataset from its own local files,
    and streams finished batches to the trainers.

    \b
    Example:
      dpex-worker --dispatcher 10.0.0.1:7070 --processes 8
    """
    setup_logging(log_level, log_format)
    reuse_freed_memory()  # frames are read, sent and freed per batch: reuse their memory
    from dpex.worker import daemon
    try:
        config = WorkerConfig(dispatcher=dispatcher, host=host, port=port, advertise_host=advertise_host,
                              processes=processes, buffer_batches=buffer_batches,
                              buffer_bytes=int(buffer_mb * 2**20),
                              max_held_splits=max_splits, max_loaders=max_loaders,
                              heartbeat_interval_s=heartbeat_interval,
                              connect_timeout_s=connect_timeout, auth_token=load_token(auth_token_file),
                              auth_token_file=auth_token_file,
                              allow_unauthenticated=allow_unauthenticated,
                              tls_cert_file=tls_cert, tls_key_file=tls_key, tls_ca_file=tls_ca,
                              max_message_bytes=int(max_message_mb * 2**20), metrics_port=metrics_port,
                              shared_memory=shm, shm_min_bytes=shm_min_kb * 1024,
                              data_port=None if data_port < 0 else data_port, drain_timeout_s=drain_timeout,
                              data_paths=tuple(data_paths), in_turn=in_turn, share_cache_bytes=share_cache_bytes,
                              sample_cache_bytes=sample_cache_bytes, sample_disk_bytes=sample_disk_bytes)
        daemon.run(config, daemon.forked_pool(config), ready_file)
    except DpexError as e:
        fail(str(e))
    exit_now()


if __name__ == "__main__":
    main()
