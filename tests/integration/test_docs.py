"""The documentation as a reader meets it (issue 60): the site builds strictly (a broken link or a missing
API reference fails), README is a front door whose first screen shows the one-line change and whose links
all lead somewhere, every Python example in it and in the docs runs (given what it leaves to the reader, a cluster where it names one), and the built site's pages
are what a browser shows (their screenshots are saved where DPEX_DOCS_SCREENSHOTS says: docs/screenshots)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dpex.testing import programs

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FIRST_SCREEN = 24  # lines


def blocks(path: Path, lang: str = "python") -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", path.read_text(), flags=re.S | re.M)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_site_builds_strictly_with_every_page_in_the_nav_and_the_api_from_the_docstrings(site):
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    nav = set(re.findall(r":\s*([\w/.-]+\.md)$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    assert pages == nav, (pages - nav, nav - pages)  # no page left out of the reader's path, none missing
    api = (site / "reference" / "api" / "index.html").read_text()
    for name in ("dpex.DpexDataLoader", "dpex.RemoteDataLoader", "dpex.DatasetSpec", "dpex.LocalCluster",
                 "dpex.ShuffleSampler", "dpex.errors.DpexWorkerError"):
        assert f'id="{name}"' in api, name
    cli = (site / "reference" / "cli" / "index.html").read_text()
    for flag in ("--work-dir", "--processes", "--heartbeat-timeout", "DPEX_DISPATCHER"):
        assert flag in cli, flag
    protocol = (site / "reference" / "protocol" / "index.html").read_text()
    assert all(message in protocol for message in ("RegisterWorkerRequest", "FetchRequest", "WorkerLost"))


def test_readme_is_a_front_door_whose_links_all_lead_somewhere():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 200
    for page in (readme, (ROOT / "docs" / "index.md").read_text().splitlines()):
        assert any("distribute_mode=True" in line for line in page[:FIRST_SCREEN])
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", "\n".join(readme)):
        if not re.match(r"\w+://", target):
            assert (ROOT / target).exists(), target


# What a page's example leaves to the reader, given here: names it uses, a package the workers import (the
# examples' `mypkg`), and its placeholder addresses, which become the module's cluster. A block whose rule says
# "check" cannot run here (a loop for ever, a Ray cluster with a data path): it must compile and name only
# what exists. Any other block runs as written; a new one without a rule must too.
DATASET = ("import torch\nfrom torch.utils.data import TensorDataset\n"
           "dataset = TensorDataset(torch.arange(64.0).unsqueeze(1), torch.arange(64))\n")
FREE_PORT = ("import os, socket\nif __name__ == '__main__':  # not again in a spawned child\n"
             "    with socket.socket() as s:\n        s.bind(('127.0.0.1', 0))\n"
             "        os.environ['MASTER_PORT'] = str(s.getsockname()[1])\n")  # where the page fixes one
RULES = {
    ("docs/index.md", "DpexDataLoader(dataset"): {"prelude": DATASET},
    ("README.md", "DpexDataLoader(dataset"): {"prelude": DATASET},
    ("docs/get-started.md", "== torch_batches"): {"continues": True},  # the page's script before it
    ("docs/guides/dpexdataloader.md", "worker_init_fn=init"): {
        "prelude": DATASET + "init = lambda worker_id: None\ng = torch.Generator().manual_seed(0)\n"},
    ("docs/guides/accelerate.md", "prepare_data_loader"): {
        "prelude": DATASET + "from accelerate import Accelerator\naccelerator = Accelerator(cpu=True)\n",
        "after": "assert sum(len(y) for _, y in loader) == 64\n"},
    ("docs/guides/waiting.md", "loader.stats()"): {
        "prelude": DATASET + "import dpex\nloader = dpex.DpexDataLoader(dataset, distribute_mode=True, "
                             "batch_size=8)\nassert sum(1 for _ in loader) == 8\n"},
    ("README.md", "mypkg.data:Shapes"): {"cluster": True},
    ("docs/guides/loader.md", "mypkg.data:Shapes"): {"cluster": True},
    ("docs/guides/sharing.md", "mypkg.data:Images"): {"cluster": True, "prelude": "import dpex\n",
                                                      "after": "assert sum(1 for _ in loader) == 32\n"},
    ("docs/guides/spawn.md", "mp.spawn(train"): {"prelude": FREE_PORT},
    ("docs/guides/ddp.md", "init_process_group"): {"torchrun": 2},
    ("docs/guides/resume.md", "def resume(loader"): {"check": ("dpex:DpexDataLoader",)},
    ("docs/guides/autoscaling.md", "while True"): {"check": ("dpex.rpc:call", "dpex.rpc:channel")},
    ("docs/guides/ray.md", "dpex.ray.start"): {"check": ("dpex.ray:start", "dpex.ray:status", "dpex.ray:stop",
                                                         "dpex.ray:RayConfig")},
}
MYPKG = """
import torch

class Shapes(torch.utils.data.Dataset):  # stands in for a dataset read from the worker's own files
    def __init__(self, root):
        self.root = root
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return torch.full((3, 8, 8), float(i)), i

Images = lambda root: torch.utils.data.TensorDataset(torch.zeros(8192, 1), torch.arange(8192))
"""
PLACEHOLDERS = ("dpex://10.0.0.1:7070", "dispatcher:7070")


def pages() -> list[str]:
    """README, then every docs page, as paths from the checkout's root."""
    return ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md"))


def examples() -> list[tuple[str, int, str]]:
    return [(page, k, code) for page in pages() for k, code in enumerate(blocks(ROOT / page))]


@pytest.fixture(scope="module")
def docs_cluster(tmp_path_factory):
    from dpex import LocalCluster
    where = tmp_path_factory.mktemp("mypkg")
    (where / "mypkg").mkdir()
    (where / "mypkg" / "__init__.py").write_text("")
    (where / "mypkg" / "data.py").write_text(MYPKG)
    with LocalCluster(num_workers=1, processes=2, env={"PYTHONPATH": str(where)}, warm_start=True) as cluster:
        yield cluster


@pytest.mark.parametrize("page,index,code", [pytest.param(*e, id=f"{e[0]}[{e[1]}]") for e in examples()])
def test_every_python_example_in_readme_and_the_docs_runs(request, tmp_path, page, index, code):
    rule = next((r for (where, key), r in RULES.items() if where == page and key in code), {})
    if "check" in rule:
        compile(code, f"{page}[{index}]", "exec")
        import importlib
        for name in rule["check"]:
            module, attr = name.split(":")
            assert hasattr(importlib.import_module(module), attr), name
        return
    if rule.get("continues"):
        code = blocks(ROOT / page)[index - 1] + code
    code = rule.get("prelude", "") + code.replace("    ...\n", "    pass\n") + rule.get("after", "")
    if rule.get("cluster"):
        cluster = request.getfixturevalue("docs_cluster")
        for placeholder in PLACEHOLDERS:
            code = code.replace(placeholder, cluster.address)
        code = code.replace("range(10)", "range(2)")  # two epochs tell as much as ten
    (tmp_path / "example.py").write_text(code)  # a file, as a reader runs it (a spawned child imports it again)
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={rule['torchrun']}",
                "--log-dir", str(tmp_path / "logs")] if "torchrun" in rule else []
    # Forked warm (dpex.testing.programs), as a new interpreter runs it; torchrun's ranks are new interpreters.
    done = programs.run([*launcher, "example.py"], cwd=str(tmp_path), timeout=180,
                        preload=programs.LIGHTNING if "lightning" in code else programs.TRAINER)
    assert done.returncode == 0, f"{page} block {index}:\n{code}\n{done.stderr[-4000:]}"


def test_every_rule_still_names_an_example():
    found = examples()
    for where, key in RULES:
        assert any(page == where and key in code for page, _, code in found), (where, key)


@pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (Debian's chromium package)")
@pytest.mark.parametrize("page", ["index.html", "reference/api/index.html"])
def test_the_built_pages_are_what_a_browser_shows(site, tmp_path, page):
    where = Path(os.environ.get("DPEX_DOCS_SCREENSHOTS") or tmp_path)
    shot = where / (page.replace("/index.html", "").replace("/", "-").replace(".html", "") + ".png")
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--window-size=1280,900", f"--screenshot={shot}", (site / page).as_uri()],
                   capture_output=True, timeout=120, check=True)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


def shell_lines() -> list[tuple[str, str]]:
    return [(page, line.split(" #")[0].strip()) for page in pages() for lang in ("sh", "bash")
            for block in blocks(ROOT / page, lang) for line in block.splitlines() if line.split(" #")[0].strip()]


def test_every_shell_example_names_flags_targets_and_files_that_exist():
    """What cannot run here (a daemon for ever, docker, kubectl against a cluster) is checked for what can be:
    the Dpex commands' flags are theirs, make's targets are the Makefile's, the paths are the checkout's."""
    from dpex.cmd import dispatcher, status, worker
    commands = {"dpex-dispatcher": dispatcher.main, "dpex-worker": worker.main}
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    lines = shell_lines()
    assert len(lines) > 20
    for page, line in lines:
        words = line.split()
        for k, word in enumerate(words):
            starts = k == 0 or words[k - 1] == "&&" or "=" in words[k - 1]  # a command, after VAR=value too
            command = commands.get(word) if starts else None
            if starts and word == "dpex" and k + 1 < len(words):
                command = status.main.commands.get(words[k + 1])
                assert command is not None, (page, line)
            if command is not None:
                flags = {o for p in command.params for o in getattr(p, "opts", [])}
                for flag in (w.split("=")[0].strip("[]") for w in words[k + 1:] if w.lstrip("[").startswith("--")):
                    assert flag in flags, (page, line, flag)
            if word == "make" and k + 1 < len(words):
                assert words[k + 1] in targets, (page, line)
            path = word.split("=", 1)[-1]
            if re.match(r"(deploy|docker|benchmarks|examples|tests)/", path):  # the checkout's, or the reader's own
                made = re.findall(r"[Ss]ave it as `([^`]+)`", (ROOT / page).read_text())
                assert (ROOT / path).exists() or any(m.startswith(path) for m in made), (page, line, path)


def metric_rows(url: str) -> dict[str, tuple[str, str | None, str]]:
    """A daemon's series as the metrics page's table has them: name -> (type, labels, its HELP); labels None
    for a family with no sample yet (the exposition names no labels then: the page's are not checked)."""
    import urllib.request
    from prometheus_client.parser import text_string_to_metric_families
    rows = {}
    for family in text_string_to_metric_families(urllib.request.urlopen(url, timeout=10).read().decode()):
        if family.name.startswith(("process_", "python_")):
            continue  # prometheus-client's own: one line of prose on the page
        labels = sorted({k for s in family.samples for k in s.labels if k != "le"})
        rows[family.name + ("_total" if family.type == "counter" else "")] = (
            family.type, ", ".join(f"`{k}`" for k in labels) if family.samples else None, family.documentation)
    return rows


def page_rows(page: str, heading: str) -> dict[str, tuple[str, str, str]]:
    """The table under ``heading`` (a `## ` line) of a page: series -> (type, labels, meaning)."""
    section = (ROOT / page).read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines()
             if line.startswith("| `")]
    return {name.strip("`"): (kind, labels, meaning) for name, kind, labels, meaning in cells}


def test_the_metrics_page_lists_every_series_each_daemon_serves(tmp_path):
    """The reference's tables are what the daemons serve after an epoch (a journal, a job, a worker's
    load): every series with its type, labels and help, none missing and none that is gone."""
    import dpex
    from dpex import LocalCluster
    dataset = dpex.DatasetSpec("dpex.testing.datasets:Slow", n=32, delay_s=0.0)
    with LocalCluster(num_workers=1, metrics=True, work_dir=str(tmp_path / "journal"), warm_start=True) as cluster:
        with dpex.RemoteDataLoader(cluster.address, dataset, batch_size=4, job_name="seen") as loader:
            assert sum(1 for _ in loader) == 8
            served = {"The dispatcher's series": metric_rows(cluster.dispatcher.metrics_url),
                      "A worker's series": metric_rows(cluster.workers[0].metrics_url)}
    for heading, rows in served.items():
        page = page_rows("docs/reference/metrics.md", heading)
        assert sorted(page) == sorted(rows), heading  # every series, none that is gone
        for name, (kind, labels, meaning) in rows.items():
            assert page[name][0] == kind and page[name][2] == meaning, name
            assert labels is None or page[name][1] == labels, name


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl")
def test_every_kustomization_in_the_docs_renders_into_its_namespace():
    """A guide's overlay, saved where it says (deploy/kubernetes/overlays/mine), renders with kubectl kustomize
    into objects the Kubernetes schema accepts, all in its namespace, KEDA's query reading that namespace."""
    import yaml
    from dpex.testing import kube
    found = [(page, code) for page in pages() for code in blocks(ROOT / page, "yaml") if "kind: Kustomization" in code]
    assert found
    for page, code in found:
        objects = kube.render_installation(str(ROOT / "deploy" / "kubernetes"), code)
        kube.validate([o for o in objects if o["kind"] != "ScaledObject"])
        namespace = yaml.safe_load(code)["namespace"]
        assert {o["metadata"].get("namespace") for o in objects} == {namespace}, page
        for scaled in (o for o in objects if o["kind"] == "ScaledObject"):
            assert f'namespace="{namespace}"' in scaled["spec"]["triggers"][0]["metadata"]["query"], page


def test_every_environment_variable_dpex_reads_is_documented():
    """A ``DPEX_*`` name in the package is a flag's (the CLI reference lists it, from click) or is on the
    environment variables page."""
    from dpex.cmd import dispatcher, status, worker
    commands = [dispatcher.main, worker.main, *status.main.commands.values()]
    flags = {p.envvar for c in commands for p in c.params if isinstance(getattr(p, "envvar", None), str)}
    page = (ROOT / "docs" / "reference" / "environment.md").read_text()
    named = {m for path in (ROOT / "dpex").rglob("*.py") for m in re.findall(r"[\"'](DPEX_[A-Z_]+)[\"']", path.read_text())}
    assert named, "found none: the search is wrong"
    assert {n for n in named - flags if f"`{n}" not in page} == set()
