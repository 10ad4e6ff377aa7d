"""What operators and trainers see: Prometheus metrics on both daemons,
loader.stats(), and structured log lines."""
import json
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dpex
from dpex.testing import test_cluster, wait_until

N, B = 96, 4


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics page."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def total(samples, name: str, **labels) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == str(want) for k, want in labels.items()))


def test_metrics_of_dispatcher_and_workers_follow_an_epoch_and_a_lost_worker():
    with test_cluster(num_workers=3, metrics=True) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.005)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, job_name="observed", timeout=60) as dl:
            got = []
            for i, batch in enumerate(dl):
                got += batch["y"].tolist()
                if i == 4:
                    mid = scrape(c.dispatcher.metrics_url)
                    c.kill_worker(0)
            assert got == list(range(N))
            d = wait_until(lambda: (lambda m: m if total(m, "dpex_workers", state="lost") == 1 else None)(
                scrape(c.dispatcher.metrics_url)), 30, "the lost worker in the metrics")
        assert total(mid, "dpex_workers", state="alive") == 3
        assert total(d, "dpex_workers", state="alive") == 2 and total(d, "dpex_jobs") == 1
        job = dict(job_name="observed")
        assert total(d, "dpex_job_batches_planned_total", **job) == N // B
        assert total(d, "dpex_job_batches_delivered_total", **job) == N // B
        # 12 splits of 2 batches; the killed worker's were taken back and assigned again, except any
        # whose batches the trainer had all received, their acks on the way: the worker is lost as
        # soon as the trainer reports its broken stream, before those acks reach the dispatcher.
        reassigned = total(d, "dpex_splits_reassigned_total")
        assert reassigned >= 1
        assert 12 < total(d, "dpex_splits_assigned_total") <= 12 + reassigned
        # Heartbeats answered: the dispatcher's load from its fleet, counting up.
        assert total(d, "dpex_worker_heartbeats_total") > total(mid, "dpex_worker_heartbeats_total") > 0
        # Each surviving worker's own endpoint agrees with what its heartbeats told the dispatcher.
        # A survivor may still finish a batch it had started when the job was released
        # (e.g. a re-assigned split's batch the trainer no longer needed), so both sides
        # are read together, once the worker runs nothing.
        survivors = c.workers[1:]
        produced = []
        for w in survivors:
            def agreed(w=w):
                own = scrape(w.metrics_url)
                count = total(own, "dpex_worker_batches_produced_total")
                reported = total(scrape(c.dispatcher.metrics_url), "dpex_reported_batches_produced_total",
                                 address=w.address)
                idle = total(own, "dpex_worker_running_batches") == 0
                return (count,) if idle and reported == count else None
            produced += wait_until(agreed, 30, "the heartbeat report")
        sent_bytes = [total(scrape(w.metrics_url), "dpex_worker_bytes_sent_total") for w in survivors]
        assert sum(produced) > 0 and sum(sent_bytes) > 0
        from dpex import version
        mine = dict(version=version.package(), protocol=version.PROTOCOL, torch=version.torch())
        assert total(d, "dpex_build_info", **mine) == 1  # what each daemon runs
        # No series in both daemons' pages: a sum over all scraped targets counts each batch once.
        assert not {n for n, _ in d if n.startswith("dpex_")} & {n for n, _ in scrape(survivors[0].metrics_url)
                                                                  if n.startswith("dpex_") and n != "dpex_build_info"}
        for page in (d, scrape(survivors[0].metrics_url)):  # the process's own, as any Prometheus client's
            assert total(page, "process_resident_memory_bytes") > 0 and total(page, "process_open_fds") > 0
        for w in survivors:
            page = scrape(w.metrics_url)
            assert total(page, "dpex_build_info", **mine) == 1
            assert total(page, "dpex_worker_processes") == 1
            assert 0 <= total(page, "dpex_worker_busy_fraction") <= 1
            assert total(page, "dpex_worker_busy_seconds_total") > 0


def test_busy_fraction_and_buffer_depth_under_load():
    with test_cluster(num_workers=1, metrics=True, buffer_batches=6) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=400, delay_s=0.01)
        worker = c.workers[0]
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=60) as dl:
            it = iter(dl)
            next(it)
            # The trainer takes nothing more: the worker fills its buffer, then idles.
            wait_until(lambda: total(scrape(worker.metrics_url), "dpex_worker_buffer_batches") == 6, 30,
                       "a full buffer")
            # While the trainer drains fast, the single process is busy nearly all the time.
            busiest = 0.0
            for _ in it:
                busiest = max(busiest, total(scrape(worker.metrics_url), "dpex_worker_busy_fraction"))
        assert busiest > 0.5


def test_loader_stats_tell_an_input_bound_trainer_from_a_compute_bound_one():
    with test_cluster(num_workers=1) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=80, delay_s=0.01)  # 40 ms a batch
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=60) as dl:
            for _ in dl:
                time.sleep(0.005)  # the trainer is much faster than one process
            fast = dl.stats(reset=True)
            for _ in dl:
                time.sleep(0.1)    # the trainer is the bottleneck: batches are ready when asked for
            slow = dl.stats(reset=True)
            for _ in dl:
                pass               # no work at all: any number of workers would be waited for
            idle = dl.stats()
    assert fast.batches == slow.batches == 20 and fast.bytes_received > 0
    assert fast.input_bound and fast.wait_fraction > 0.5 and fast.workers_needed >= 3
    assert fast.workers_needed <= 4 and "input-bound" in fast.advice  # a step of at most 4x, then measure
    assert idle.input_bound and idle.workers_needed == 4 and "almost no work" in idle.advice
    assert fast.workers_alive == 1 and 0 < fast.batches_per_s < 40
    assert not slow.input_bound and slow.workers_needed == 1 and "not input-bound" in slow.advice
    assert slow.elapsed_s >= 19 * 0.1 and slow.wait_s < slow.elapsed_s / 2
    # Where the batch process's time went (issue 56): the dataset's code sleeps 40 ms a batch, computing little.
    assert fast.stages["dataset"] >= 0.9 * B * 0.01 and fast.stages["dataset_cpu"] < fast.stages["dataset"] / 2
    assert set(fast.stages) == {"dataset", "dataset_cpu", "dataset_cpu_wait", "collate", "collate_cpu", "collate_cpu_wait",
                               "dpex", "decode"}  # same host: no receive


def test_dispatcher_exports_the_workers_the_trainers_need(monkeypatch):
    """What a worker autoscaler (deploy/kubernetes: the HPA) follows: an
    input-bound trainer's measured need reaches the dispatcher's metrics and
    `dpex status`, and goes when the trainer leaves."""
    import dpex.client.stats
    monkeypatch.setattr(dpex.client.stats, "NEED_WINDOW_S", 0.5)
    monkeypatch.setattr(dpex.client.stats, "FIRST_NEED_WINDOW_S", 0.5)
    with test_cluster(num_workers=1, metrics=True) as c:
        url = c.dispatcher.metrics_url
        assert total(scrape(url), "dpex_workers_needed") == 0  # nobody training: nothing to scale for
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=2000, delay_s=0.01)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, timeout=60) as dl:
            for _ in dl:  # no work between batches: input-bound, 4x a step
                if total(scrape(url), "dpex_workers_needed") == 4:
                    assert total(scrape(url), "dpex_job_workers_needed", job_id=str(dl.job_id)) == 4
                    shown = subprocess.run([sys.executable, "-m", "dpex.cmd.status", "status", "--dispatcher",
                                            c.address, "--json"], capture_output=True, text=True, timeout=60)
                    status = json.loads(shown.stdout)
                    assert status["workersNeeded"] == 4 and status["jobs"][0]["workersNeeded"] == 4
                    break
            else:
                raise AssertionError("the dispatcher never exported the trainer's need")
        wait_until(lambda: total(scrape(url), "dpex_workers_needed") == 0, 30, "the need to go with the trainer")


def test_json_logs_carry_worker_and_job_ids():
    flags = ("--log-format", "json")
    with test_cluster(num_workers=1, dispatcher_flags=flags, worker_flags=flags) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=8)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, job_name="logged", timeout=30) as dl:
            list(dl)
        lines = [json.loads(line) for line in open(c.dispatcher.log_path) if line.startswith("{")]
        worker_lines = [json.loads(line) for line in open(c.workers[0].log_path) if line.startswith("{")]
    registered = next(e for e in lines if e["msg"] == "worker registered")
    assert registered["level"] == "info" and registered["address"] == c.workers[0].address
    created = next(e for e in lines if e["msg"] == "job created")
    assert created["job_name"] == "logged" and created["job_id"] == dl.job_id
    plan = next(e for e in lines if e["msg"] == "plan submitted")
    assert (plan["job_id"], plan["consumer"], plan["epoch"], plan["batches"]) == (dl.job_id, 0, 0, 2)
    # Every worker line after registration carries the worker's id.
    assert all(e["worker_id"] == registered["worker_id"] for e in worker_lines
               if e["msg"] != "registered with the dispatcher" and "worker serving" in e["msg"])
    assert any(e["worker_id"] == registered["worker_id"] for e in worker_lines)


def test_latencies_failures_and_the_journal_for_on_call(tmp_path):
    """What an on-call engineer reads: the calls' and the batches' latencies, the trainers' waits by
    job, failures by kind on each daemon (a dataset that raises, a batch process killed), the journal's
    size, compactions and fsyncs."""
    with test_cluster(num_workers=1, metrics=True, work_dir=str(tmp_path / "journal")) as c:
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=N, delay_s=0.001)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=B, job_name="timed", timeout=60) as dl:
            assert sum(len(b["y"]) for b in dl) == N
            job_id = str(dl.job_id)
        for target, word in (("Faulty", "ZeroDivisionError"), ("Crashing", "killed by signal")):
            with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec(f"dpex.testing.datasets:{target}", n=16, bad=5),
                                       batch_size=B, timeout=60) as dl:
                with pytest.raises(Exception, match=word):
                    list(dl)
        map_made = total(scrape(c.workers[0].metrics_url), "dpex_worker_batch_seconds_count")
        # An IterableDataset's batches come from its stream's process: counted and timed as well.
        with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:Counting", n=20),
                                   batch_size=B, timeout=60) as dl:
            assert len(list(dl)) == 20 // B
        with dpex.RemoteDataLoader(c.address, dpex.DatasetSpec("dpex.testing.datasets:BrokenStream", n=20),
                                   batch_size=B, timeout=60) as dl:
            with pytest.raises(ValueError, match="bad record 7"):
                list(dl)
        d, w = scrape(c.dispatcher.metrics_url), scrape(c.workers[0].metrics_url)
    assert total(w, "dpex_worker_batch_seconds_count") >= map_made + 20 // B + 1
    # Every batch of "timed" waited for in next() and reported: N // B observations of its job.
    assert total(d, "dpex_job_wait_seconds_count", job_id=job_id, job_name="timed") == N // B
    assert total(d, "dpex_job_wait_seconds_bucket", job_id=job_id, le="+Inf") == N // B
    assert total(d, "dpex_job_wait_seconds_sum", job_id=job_id) > 0
    assert total(d, "dpex_rpc_seconds_count", method="SubmitPlan") >= 3
    assert total(d, "dpex_rpc_seconds_count", method="WorkerHeartbeat") > 0
    assert total(d, "dpex_errors_total", kind="consumer_timeout") == 0 and total(d, "dpex_errors_total", kind="auth") == 0
    assert total(d, "dpex_journal_bytes", file="log") > 0 and total(d, "dpex_journal_fsync_seconds_count") > 0
    assert ("dpex_journal_compactions_total", ()) in d
    # The worker: each batch's making timed; the failed ones counted by kind.
    assert total(w, "dpex_worker_batch_seconds_count") == total(w, "dpex_worker_batches_produced_total") >= N // B
    assert total(w, "dpex_worker_errors_total", kind="user_code") >= 2  # a dataset's and a stream's
    assert total(w, "dpex_worker_errors_total", kind="process_death") >= 1
    assert total(w, "dpex_worker_errors_total", kind="wire") == 0
    assert total(w, "dpex_worker_rpc_seconds_count", method="Inspect") >= 1  # a loader's first look at the data
