"""Credentials as the installed ``kubernetes`` client loads them: the token must reach the header.

kubernetes >= 36 keeps a bearer token under ``api_key["BearerToken"]``; older clients used
``"authorization"``. Looking up only the old key sent no ``Authorization`` header at all, so the
operator died at its CRD check on every token-based cluster (issue 14, point 1).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import kubernetes
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ddpjob_operator.kube import load_credentials

TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-token"


def _ca_certificate(path: Path) -> None:
    """A self-signed CA certificate: the in-cluster loader hands it to the SSL context."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kubernetes-ca")])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def test_in_cluster_service_account_token_is_sent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file, ca_file = tmp_path / "token", tmp_path / "ca.crt"
    token_file.write_text(TOKEN)
    _ca_certificate(ca_file)
    incluster = kubernetes.config.incluster_config
    monkeypatch.setattr(incluster, "SERVICE_TOKEN_FILENAME", str(token_file))
    monkeypatch.setattr(incluster, "SERVICE_CERT_FILENAME", str(ca_file))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    credentials = load_credentials()
    assert credentials.server == "https://10.96.0.1:443"
    assert credentials.token() == f"bearer {TOKEN}"


def test_kubeconfig_token_is_sent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:6443"}}],
                "users": [{"name": "u", "user": {"token": TOKEN}}],
                "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "ctx",
            }
        )
    )
    credentials = load_credentials(str(kubeconfig))
    assert credentials.server == "http://127.0.0.1:6443"
    assert credentials.token() == f"Bearer {TOKEN}"


def test_the_installed_client_is_one_that_keeps_the_token_under_bearer_token() -> None:
    """The reason for the lookup: if a future client moves the key again, this says so."""
    config = kubernetes.client.Configuration()
    config.api_key["BearerToken"] = "Bearer x"
    assert config.get_api_key_with_prefix("BearerToken", alias="authorization") == "Bearer x"
    assert int(kubernetes.__version__.split(".")[0]) >= 29
