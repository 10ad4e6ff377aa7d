"""TLS on every port, with a CA and a server certificate the test makes."""
import os
import ssl
import urllib.error
import urllib.request

import pytest
import dpex
from dpex.testing.pki import write_pki
from tests.integration.commands import run

TOKEN = "tls-and-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_cluster(pki):
    with dpex.testing.test_cluster(num_workers=2, auth_token=TOKEN, tls=pki) as c:
        yield c


def test_batches_flow_over_tls(tls_cluster, pki):
    spec = dpex.DatasetSpec("dpex.testing.datasets:Squares", n=12)
    with dpex.RemoteDataLoader(tls_cluster.address, spec, batch_size=4, auth_token=TOKEN, tls_ca=pki[2],
                               timeout=30) as dl:
        assert [b["y"].tolist() for b in dl] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("ca", [None, "other-ca.pem"], ids=["plaintext", "untrusted CA"])
def test_plaintext_or_an_untrusted_ca_cannot_connect(tls_cluster, pki, ca, monkeypatch):
    monkeypatch.delenv("DPEX_TLS_CA", raising=False)
    ca_file = os.path.join(os.path.dirname(pki[2]), ca) if ca else None
    if ca is None:  # as a restarting daemon may look: retried for connect_timeout, with a hint
        with pytest.raises(dpex.DpexConnectionError, match="cannot reach dispatcher.*if it serves TLS, give its CA"):
            dpex.RemoteDataLoader(tls_cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares"),
                                  auth_token=TOKEN, connect_timeout=1)
        return
    # A certificate that does not verify is a configuration error: said at once, however long the retry.
    with pytest.raises(dpex.DpexAuthError, match="failed TLS verification: its certificate is not signed by the CA"):
        dpex.RemoteDataLoader(tls_cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares"),
                              auth_token=TOKEN, tls_ca=ca_file, connect_timeout=3600)


def test_a_certificate_for_another_name_or_tls_at_a_plaintext_daemon_is_said_at_once(tls_cluster, pki):
    port = tls_cluster.address.rsplit(":", 1)[1]
    out = run("dpex", "health", f"127.0.0.1:{port}", "--tls-ca", pki[2], env={"DPEX_TLS_SERVER_NAME": "other.example"})
    assert out.returncode == 1 and "does not name the host dialled" in out.stderr, out.stderr
    other_ca = os.path.join(os.path.dirname(pki[2]), "other-ca.pem")
    out = run("dpex-worker", "--dispatcher", tls_cluster.address, "--tls-ca", other_ca, "--processes", "1",
              "--connect-timeout", "3600", env={"DPEX_AUTH_TOKEN": TOKEN})
    assert out.returncode == 1 and "not signed by the CA given" in out.stderr, out.stderr  # a worker exits, says why
    with dpex.testing.test_cluster(num_workers=0) as plain:
        with pytest.raises(dpex.DpexAuthError, match="it does not serve TLS"):
            dpex.RemoteDataLoader(plain.address, dpex.DatasetSpec("dpex.testing.datasets:Squares"), tls_ca=pki[2],
                                  connect_timeout=3600)


def test_status_over_tls(tls_cluster, pki):
    out = run("dpex", "status", "--dispatcher", tls_cluster.address, "--tls-ca", pki[2],
              env={"DPEX_AUTH_TOKEN": TOKEN})
    assert out.returncode == 0 and "WORKERS (2 alive, 0 lost, 0 left)" in out.stdout, out.stderr


def test_a_key_without_a_certificate_is_a_clear_error(pki):
    out = run("dpex-dispatcher", "--port", "0", "--tls-key", pki[1])
    assert out.returncode == 1 and "TLS needs both --tls-cert and --tls-key" in out.stderr


def test_health_over_tls_as_the_certificate_names_the_daemon(tls_cluster, pki):
    """`dpex health` is the probe the manifests' TLS components run (Kubernetes' gRPC probe has no TLS)."""
    worker = tls_cluster.worker_addresses[0]
    port = worker.rsplit(":", 1)[1]
    out = run("dpex", "health", worker, "--service", "dpex.v1.Worker", "--tls-ca", pki[2])
    assert out.returncode == 0 and out.stdout == "SERVING\n", out.stderr
    out = run("dpex", "health", f"127.0.0.1:{port}", "--tls-ca", pki[2], "--tls-server-name", "localhost")
    assert out.returncode == 0 and out.stdout == "SERVING\n", out.stderr
    out = run("dpex", "health", worker, "--tls-ca", pki[2], "--tls-server-name", "not-named.example")
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr and "does not name the host" in out.stderr
    out = run("dpex", "health", worker, unset=("DPEX_TLS_CA",))  # plaintext at a TLS port
    assert out.returncode == 1 and "if it serves TLS, give its CA" in out.stderr


def test_a_renewed_certificate_is_served_with_no_restart(tmp_path):
    """The certificate and key files replaced (as cert-manager or a Kubernetes Secret renews them): the next
    connection is served with the new ones; the running daemon is not restarted."""
    import shutil
    import subprocess
    from dpex.testing import wait_until
    from tests.integration.commands import command
    for name in ("first", "second"):
        (tmp_path / name).mkdir()
    first, second = write_pki(tmp_path / "first"), write_pki(tmp_path / "second")
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(first[0], live / "tls.crt")
    shutil.copy(first[1], live / "tls.key")
    ready = tmp_path / "ready"
    proc = subprocess.Popen([command("dpex-dispatcher"), "--host", "127.0.0.1", "--port", "0", "--ready-file",
                             str(ready), "--tls-cert", str(live / "tls.crt"), "--tls-key", str(live / "tls.key"),
                             "--metrics-port", "0"],
                            env={k: v for k, v in os.environ.items() if k != "DPEX_PORT"})
    try:
        wait_until(ready.exists, 60, "the dispatcher")
        grpc_address, metrics = ready.read_text().splitlines()
        address = "localhost:" + grpc_address.rsplit(":", 1)[1]
        metrics_url = f"https://localhost:{metrics.split()[0]}/metrics"
        assert metrics.split()[1] == "https"

        def serves_with(ca: str) -> bool:
            grpc_ok = run("dpex", "health", address, "--tls-ca", ca, "--timeout", "5").returncode == 0
            return grpc_ok and scrapes_with(ca)

        def scrapes_with(ca: str) -> bool:
            try:
                page = urllib.request.urlopen(metrics_url, timeout=10, context=ssl.create_default_context(cafile=ca))
            except urllib.error.URLError as e:
                assert isinstance(e.reason, ssl.SSLCertVerificationError), e
                return False
            return b"dpex_build_info" in page.read()

        assert serves_with(first[2]) and not serves_with(second[2])
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP at HTTPS: nothing served
            urllib.request.urlopen(metrics_url.replace("https", "http"), timeout=10)
        for name, source in (("tls.key", second[1]), ("tls.crt", second[0])):  # each file replaced whole
            shutil.copy(source, live / f"{name}.new")
            os.replace(live / f"{name}.new", live / name)
        wait_until(lambda: serves_with(second[2]), 30, "the renewed certificate")
        assert not serves_with(first[2]) and not scrapes_with(first[2]) and proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(30)
