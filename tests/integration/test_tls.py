"""TLS on every port, with a CA and a server certificate the test makes."""
import os

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
    with pytest.raises(dpex.DpexConnectionError, match="cannot reach dispatcher"):
        dpex.RemoteDataLoader(tls_cluster.address, dpex.DatasetSpec("dpex.testing.datasets:Squares"),
                              auth_token=TOKEN, tls_ca=ca_file, connect_timeout=1)


def test_status_over_tls(tls_cluster, pki):
    out = run("dpex", "status", "--dispatcher", tls_cluster.address, "--tls-ca", pki[2],
              env={"DPEX_AUTH_TOKEN": TOKEN})
    assert out.returncode == 0 and "WORKERS (2 alive, 0 lost, 0 left)" in out.stdout, out.stderr


def test_a_key_without_a_certificate_is_a_clear_error(pki):
    out = run("dpex-dispatcher", "--port", "0", "--tls-key", pki[1])
    assert out.returncode == 1 and "TLS needs both --tls-cert and --tls-key" in out.stderr
