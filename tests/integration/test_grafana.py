"""The Grafana dashboard (deploy/grafana/dpex.json): valid JSON of panels
whose every query names only metrics a live dispatcher's scrape returns."""
import json
import os
import re

import dpex
from dpex.testing import test_cluster
from tests.integration.test_observability import scrape

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "deploy", "grafana", "dpex.json")


def test_every_query_of_the_dashboard_names_a_metric_the_dispatcher_serves():
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"\bdpex_[a-z_]+", e)}
    assert len(exprs) >= 8 and {"dpex_job_stage_seconds", "dpex_job_bottleneck", "dpex_job_wait_fraction"} <= named
    with test_cluster(num_workers=1, metrics=True) as c:  # a job with a verdict: its series exist too
        spec = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=4000, delay_s=0.005)
        with dpex.RemoteDataLoader(c.address, spec, batch_size=4, job_name="dashboard", timeout=60) as dl:
            for n, _ in enumerate(dl):
                if n % 50 == 49:
                    served = {name for name, _ in scrape(c.dispatcher.metrics_url)}
                    if "dpex_job_bottleneck" in served:
                        break
    assert named <= served, named - served
