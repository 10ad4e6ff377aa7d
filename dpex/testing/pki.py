"""Certificates for TLS tests: a CA and a server certificate it signed."""
from __future__ import annotations

import datetime
import ipaddress
from typing import Any, Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


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


def write_pki(root: Any, dns_names: Iterable[str] = ("localhost",),
              ips: Iterable[str] = ("127.0.0.1",)) -> tuple[str, str, str]:
    """A CA, and a certificate for ``dns_names`` (wildcards allowed) and
    ``ips`` signed by it, in ``root`` (a pathlib.Path): (cert, key, CA) files;
    also other-ca.pem, a CA that signed nothing here."""
    dns_names, ips = list(dns_names), list(ips)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("dpex test CA", "dpex test CA", ca_key, ca_key, True)
    cert = _cert(next(iter(dns_names), "dpex"), "dpex test CA", key, ca_key, False,
                 [*(x509.DNSName(n) for n in dns_names), *(x509.IPAddress(ipaddress.ip_address(i)) for i in ips)])
    files = {"ca.pem": ca.public_bytes(serialization.Encoding.PEM),
             "cert.pem": cert.public_bytes(serialization.Encoding.PEM),
             "key.pem": key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption())}
    for name, data in files.items():
        (root / name).write_bytes(data)
    other_ca = _cert("another CA", "another CA", ca_key := ec.generate_private_key(ec.SECP256R1()), ca_key, True)
    (root / "other-ca.pem").write_bytes(other_ca.public_bytes(serialization.Encoding.PEM))
    return str(root / "cert.pem"), str(root / "key.pem"), str(root / "ca.pem")


