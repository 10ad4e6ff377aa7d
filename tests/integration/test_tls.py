"""TLS on every port, with a CA and a server certificate the test makes."""
import datetime
import ipaddress
import os
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

import dpex

BIN = os.path.dirname(sys.executable)
TOKEN = "tls-and-token"


def _cert(subject, issuer, key, issuer_key, ca, sans=()):
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def write_pki(root):
    """A CA, and a certificate for 127.0.0.1 / localhost signed by it."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("dpex test CA", "dpex test CA", ca_key, ca_key, True)
    cert = _cert("localhost", "dpex test CA", key, ca_key, False,
                 [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    files = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM),
             "cert.pem": cert.public_bytes(serialization.Encoding.PEM),
             "key.pem": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())}
    for name, data in files.items():
        (root / name).write_bytes(data)
    other_ca = _cert("another CA", "another CA", ca_key := ec.generate_private_key(ec.SECP256R1()), ca_key, True)
    (root / "other-ca.pem").write_bytes(other_ca.public_bytes(serialization.Encoding.PEM))
    return str(root / "cert.pem"), str(root / "key.pem"), str(root / "ca.pem")


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
    env = {**os.environ, "DPEX_AUTH_TOKEN": TOKEN}
    out = subprocess.run([os.path.join(BIN, "dpex"), "status", "--dispatcher", tls_cluster.address,
                          "--tls-ca", pki[2]], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and "WORKERS (2 alive, 0 lost, 0 left)" in out.stdout, out.stderr


def test_a_key_without_a_certificate_is_a_clear_error(pki):
    out = subprocess.run([os.path.join(BIN, "dpex-dispatcher"), "--port", "0", "--tls-key", pki[1]],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "TLS needs both --tls-cert and --tls-key" in out.stderr
