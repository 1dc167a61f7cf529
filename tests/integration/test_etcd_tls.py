"""etcd over TLS for real: the embedded etcd started from a config's ``etcd.tls`` serves
only TLS with client certificates, the membership client connects with the same config's
options, and a client without the CA, without a certificate, or with another CA's
certificate is refused. Certificates are generated here with ``cryptography``."""
from __future__ import annotations

import datetime
import ipaddress
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.configs.errors import MembershipUnavailable
from phalanx.configs.schema import EtcdConfig, EtcdTLSConfig, JobConfig, PhalanxConfig
from phalanx.launcher.services.etcd_server import EmbeddedEtcd, ServerTLS, etcd_healthy
from phalanx.launcher.services.stack import embedded_tls
from phalanx.runtime.membership.etcd import EtcdMembership, client_fields, client_options

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_pki(folder: Path, label: str) -> dict[str, str]:
    """A CA and one certificate it signs for 127.0.0.1 (serverAuth and clientAuth)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(_name(f"{label} CA"))
          .issuer_name(_name(f"{label} CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(_name("phalanx")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
                critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    paths = {name: str(folder / f"{name}.pem") for name in ("ca_file", "cert_file", "key_file")}
    Path(paths["ca_file"]).write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    Path(paths["cert_file"]).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, Path(paths["key_file"]))
    return paths


@pytest.mark.timeout(60)
def test_embedded_etcd_serves_tls_with_client_certificates_from_the_config(tmp_path: Path) -> None:
    pki, other = make_pki(tmp_path / "pki", "job"), make_pki(tmp_path / "other", "other")
    job = PhalanxConfig(job=JobConfig(entrypoint="t.py:main"),
                        etcd=EtcdConfig(tls=EtcdTLSConfig(**pki)))
    cfg, tls = job.etcd, embedded_tls(job)              # as the launcher starts it
    assert tls == ServerTLS(pki["cert_file"], pki["key_file"], pki["ca_file"])
    with EmbeddedEtcd(tmp_path / "data", 20.0, tls=tls) as server:
        argv = server.command()
        assert f"--listen-client-urls=https://127.0.0.1:{server.client_port}" in argv
        assert {f"--cert-file={pki['cert_file']}", f"--key-file={pki['key_file']}",
                f"--trusted-ca-file={pki['ca_file']}", "--client-cert-auth"} <= set(argv)
        assert etcd_healthy(server.endpoint, ssl_context=tls.client_context())
        assert not etcd_healthy(server.endpoint)            # no plain http on the port

        prefix = "/phalanx/tls/"
        member = EtcdMembership([server.endpoint], prefix, timeout_s=3.0,
                                **client_options(**client_fields(cfg))).connect()
        try:
            member.put("k", b"over tls")
            assert member.get("k").value == b"over tls"
        finally:
            member.close()

        refused = {
            "plaintext": {},
            "ca only, no client certificate": {"ca_file": pki["ca_file"]},
            "another CA's certificate": {**other, "ca_file": pki["ca_file"]},
            "server not trusted": {**pki, "ca_file": other["ca_file"]},
        }
        for why, options in refused.items():
            client = EtcdMembership([server.endpoint], prefix, timeout_s=2.0, **options)
            with pytest.raises(MembershipUnavailable, match=server.endpoint):
                client.connect()
            client.close()
            assert why      # named for the failure message of the loop


def test_server_flags_without_a_ca_do_not_require_client_certificates() -> None:
    assert embedded_tls(PhalanxConfig(job=JobConfig(entrypoint="t.py:main"))) is None
    flags = ServerTLS("c.pem", "k.pem").flags()
    assert flags == ["--cert-file=c.pem", "--key-file=k.pem"]
    assert "--client-cert-auth" not in flags


def test_client_options_read_the_password_file_and_keep_paths(tmp_path: Path) -> None:
    password = tmp_path / "pw"
    password.write_text("s3cr3t-etcd-pw\n")
    cfg = EtcdConfig(endpoints=["h:1"], user="trainer", password_file=str(password),
                     tls=EtcdTLSConfig(ca_file="ca.pem", cert_file="c.pem", key_file="k.pem"))
    fields = client_fields(cfg)
    assert "s3cr3t-etcd-pw" not in repr(fields)            # the context carries the path only
    assert client_options(**fields) == {"ca_file": "ca.pem", "cert_file": "c.pem",
                                        "key_file": "k.pem", "user": "trainer",
                                        "password": "s3cr3t-etcd-pw"}


ENTRYPOINT = '''
import torch
import phalanx


def main(steps: int = 6) -> dict:
    session = phalanx.Session()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    session.register(model=model, optimizer=optimizer)
    with session:
        while session.step_index < steps:
            with session.step() as step:
                optimizer.zero_grad()
                torch.manual_seed(step)
                model(torch.randn(8, 4)).pow(2).mean().backward()
                for p in model.parameters():
                    session.all_reduce(p.grad)
                optimizer.step()
    return {"hash": repr(float(model.weight.sum()))}     # the launcher prints it
'''


@pytest.mark.timeout(300)
def test_a_job_runs_on_a_tls_etcd_and_writes_its_secret_nowhere_else(tmp_path: Path) -> None:
    """Launcher, keepers and workers all reach the embedded etcd over TLS with client
    certificates (from ``etcd.tls``), and the generated secret is in no file of the run
    but ``secret`` (not in events.jsonl, logs, config.yaml or job.json)."""
    pki = make_pki(tmp_path / "pki", "job")
    (tmp_path / "train_tls.py").write_text(ENTRYPOINT)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"job: {{name: tlsjob, entrypoint: '{tmp_path / 'train_tls.py'}:main', world_size: 2, "
        f"nodes: 2, run_dir: '{tmp_path / 'runs'}', timeout_s: 200}}\n"
        f"etcd: {{tls: {json.dumps(pki)}}}\nspares: {{count: 0}}\n")
    proc = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "launch", str(config)],
                          cwd=ROOT, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    sums = re.findall(r"rank (\d) final parameter hash (\S+)", proc.stdout)
    assert len(sums) == 2 and sums[0][1] == sums[1][1]
    run = next((tmp_path / "runs").glob("tlsjob-*"))
    assert "client-cert-auth = true" in (run / "etcd.etcd.log").read_text()
    assert json.loads((run / "job.json").read_text())["etcd_client"]["cert_file"] == \
        pki["cert_file"]
    secret = (run / "secret").read_bytes().rstrip(b"\n")
    leaks = [path for path in run.rglob("*") if path.is_file() and path.name != "secret"
             and (secret in path.read_bytes() or secret.hex().encode() in path.read_bytes())]
    assert leaks == []
