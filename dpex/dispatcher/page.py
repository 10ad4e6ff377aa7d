"""The live picture: the dispatcher's metrics port serves a page at ``/``
(page.html: plain HTML and script, nothing fetched from elsewhere, so it works
on a cluster with no internet) that polls ``/status.json``, what `dpex status
--json` prints, and draws per job the rate and the trainers' wait over time,
the verdict and the stage times, per worker the busy share and the queued and
send times, and the autoscaler's decisions."""
from __future__ import annotations

from importlib import resources
from typing import Any, Callable

from google.protobuf.json_format import MessageToJson

from dpex.metrics import Page


def pages(status: Callable[[], Any]) -> dict[str, Page]:
    """The page and its data, ``status()`` being the dispatcher's GetStatusResponse now."""
    html = resources.files("dpex.dispatcher").joinpath("page.html").read_bytes()
    return {"/": lambda: ("text/html; charset=utf-8", html),
            "/status.json": lambda: ("application/json",
                                     MessageToJson(status(), always_print_fields_with_no_presence=True).encode())}
