"""Credentials for the test control plane: a CA, the API server's serving certificate, the
service-account signing key, static tokens for every component, and kubeconfigs.

Everything is made fresh per cluster with ``cryptography`` (ECDSA P-256: fast to generate, and
accepted by kube-apiserver both for TLS and for signing service-account tokens).

Who is who (the names the apiserver's bootstrap RBAC and the Node authorizer expect):

* ``admin`` in ``system:masters``: tests and ``kubectl``;
* ``system:kube-controller-manager`` and ``system:kube-scheduler``: their bootstrap roles;
* ``system:node:<node>`` in ``system:nodes``: each process kubelet, so the Node authorizer and
  the NodeRestriction admission plugin hold it to its own Node and its own pods, as they hold a
  real kubelet.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import secrets
from collections.abc import Iterable, Sequence
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

CLUSTER_DOMAIN = "cluster.local"
VALIDITY = dt.timedelta(days=7)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _write(path: Path, data: bytes, mode: int = 0o600) -> Path:
    path.write_bytes(data)
    path.chmod(mode)
    return path


@dataclasses.dataclass(frozen=True)
class Pki:
    """Paths of the files one cluster's components read."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_key: Path
    sa_pub: Path
    token_file: Path
    tokens: dict[str, str]
    """User name -> bearer token."""

    def token(self, user: str) -> str:
        return self.tokens[user]


def _authority(
    name: str, now: dt.datetime, *, usage: bool = False
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh CA key and self-signed CA certificate (``usage``: with a KeyUsage extension)."""
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
    )
    if usage:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    return key, builder.sign(key, hashes.SHA256())


def _serving(
    ca_key: ec.EllipticCurvePrivateKey,
    ca: x509.Certificate,
    name: str,
    dns: Iterable[str],
    ips: Iterable[str],
    now: dt.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh key and a serving certificate for ``dns`` and ``ips``, signed by the CA."""
    key = _key()
    alt: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    alt += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_pki(directory: Path, *, ips: Iterable[str], nodes: Sequence[str]) -> Pki:
    """Write a fresh CA, serving certificate (for ``ips`` and the kubernetes Service names),
    service-account key pair and static token file into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_key, ca = _authority("ddpjob-test-ca", now, usage=True)
    names = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"]
    names.append(f"kubernetes.default.svc.{CLUSTER_DOMAIN}")
    serving_key, serving = _serving(ca_key, ca, "kube-apiserver", names, ips, now)
    sa_key = _key()
    tokens = {"admin": secrets.token_hex(16)}
    lines = [f"{tokens['admin']},admin,admin,system:masters"]
    for user in ("system:kube-controller-manager", "system:kube-scheduler"):
        tokens[user] = secrets.token_hex(16)
        lines.append(f"{tokens[user]},{user},{user}")
    for node in nodes:
        user = f"system:node:{node}"
        tokens[user] = secrets.token_hex(16)
        lines.append(f'{tokens[user]},{user},{user},"system:nodes"')
    pem = serialization.Encoding.PEM
    return Pki(
        ca_cert=_write(directory / "ca.crt", ca.public_bytes(pem), 0o644),
        serving_cert=_write(directory / "apiserver.crt", serving.public_bytes(pem), 0o644),
        serving_key=_write(directory / "apiserver.key", _pem_key(serving_key)),
        sa_key=_write(directory / "sa.key", _pem_key(sa_key)),
        sa_pub=_write(
            directory / "sa.pub",
            sa_key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo),
            0o644,
        ),
        token_file=_write(directory / "tokens.csv", ("\n".join(lines) + "\n").encode()),
        tokens=tokens,
    )


def write_kubeconfig(path: Path, *, server: str, ca_cert: Path, token: str, user: str) -> Path:
    """A kubeconfig with one cluster, one user (a bearer token) and one current context."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "ddpjob-test",
                "cluster": {"server": server, "certificate-authority": str(ca_cert)},
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [
            {
                "name": "ddpjob-test",
                "context": {"cluster": "ddpjob-test", "user": user, "namespace": "default"},
            }
        ],
        "current-context": "ddpjob-test",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path


def self_signed(directory: Path, name: str, ips: Iterable[str]) -> tuple[Path, Path]:
    """A self-signed serving certificate (a kubelet's, which the API server does not verify
    unless told to), as (certificate, key) files."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    key = _key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    alt = [x509.DNSName(name), *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path = _write(directory / f"{name}.crt", cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, _write(directory / f"{name}.key", _pem_key(key))


@dataclasses.dataclass(frozen=True)
class ServingCert:
    """A serving certificate and the fresh CA that signed it (a webhook's ``caBundle``)."""

    ca_cert: Path
    cert: Path
    key: Path


def serving_cert(
    directory: Path, name: str, *, ips: Iterable[str] = ("127.0.0.1",), dns: Iterable[str] = ()
) -> ServingCert:
    """A fresh CA (``ca.crt``) and a serving certificate it signed for ``ips`` and ``dns``
    (``tls.crt``, ``tls.key``: the names a controller-runtime ``certDir`` expects)."""
    directory.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    ca_key, ca = _authority(f"{name}-ca", now)
    key, cert = _serving(ca_key, ca, name, [name, *dns], ips, now)
    pem = serialization.Encoding.PEM
    return ServingCert(
        ca_cert=_write(directory / "ca.crt", ca.public_bytes(pem), 0o644),
        cert=_write(directory / "tls.crt", cert.public_bytes(pem), 0o644),
        key=_write(directory / "tls.key", _pem_key(key)),
    )
