"""One table of bad inputs across config files, the command line, snapshot manifests and
payloads, peer frames and S3 objects, each with the exact error class, a fragment of its
message and the fix. docs/troubleshooting.md's "Error reference" is rendered from this table
and a test keeps the two identical: print it with
``.venv/bin/python -m tests.unit.test_bad_input_table``.

Config errors must name the file, the key, the value and a fix; command-line cases run
``phalanx.launcher.cli.main`` (no job is launched) and check the exit code and stderr.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from phalanx.configs.errors import (ConfigError, PeerUnreachable, SnapshotCorrupt, SnapshotNotFound,
                                    SnapshotUnauthenticated)
from phalanx.configs.loader import load_config
from phalanx.configs.schema import JobConfig, PhalanxConfig, SecurityConfig
from phalanx.runtime.transport.frames import (FrameInvalid, PeerRefused, client_handshake,
                                              recv_header, server_handshake)
from phalanx.runtime.snapshot.format import (Manifest, make_manifest, parse_header, plan_layout,
                                             verify_snapshot, write_checksummed)
from phalanx.runtime.tiers.config import read_job_secret

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
ERROR_REFERENCE = ROOT / "docs" / "troubleshooting.md"
SECRET = b"k" * 32
JOB = "bad-input"
ENTRY = "job:\n  entrypoint: train.py:main\n"


@dataclass(frozen=True)
class Case:
    """One bad input: ``run(env)`` raises ``error`` (for CLI cases: returns the exit code
    and prints ``fragment`` to stderr)."""

    id: str
    kind: str                      # config, cli, manifest, payload, frame, s3
    given: str                     # the input, for the README
    run: Callable[["Env"], Any]
    error: type[BaseException]
    fragment: str
    fix: str
    key: str = ""                  # config cases: the dotted key the error names
    exit_code: int = 2             # cli cases
    prefix: str = "config error:"  # cli cases: how stderr starts the message


@dataclass
class Env:
    tmp: Path
    request: pytest.FixtureRequest

    def yaml(self, text: str) -> Path:
        path = self.tmp / "job.yaml"
        path.write_text(text, encoding="utf-8")
        return path

    def load(self, text: str, *overrides: str) -> Any:
        return load_config(self.yaml(text), list(overrides), env={})


# ------------------------------------------------------------------ builders

def _config(text: str, *overrides: str) -> Callable[[Env], Any]:
    return lambda env: env.load(text, *overrides)


def _cli(*argv: str, config: str | None = None) -> Callable[[Env], Any]:
    def run(env: Env) -> int:
        from phalanx.launcher.cli import main
        args = [a.replace("{cfg}", str(env.yaml(config or ENTRY))).replace("{tmp}", str(env.tmp))
                for a in argv]
        try:
            return main(args)
        except SystemExit as exc:       # argparse's usage errors
            return int(exc.code or 0)
    return run


def _snapshot(secret: bytes | None = SECRET) -> tuple[bytes, Manifest]:
    tensors = {"model.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
               "step": torch.tensor([7])}
    layout = plan_layout(tensors)
    buf = bytearray(layout.total_bytes)
    sums = write_checksummed(buf, layout, tensors)
    manifest = make_manifest(layout, sums, job=JOB, rank=3, step=7, generation=1,
                             tree_spec={}, created_at=1.0)
    return bytes(buf), manifest.sign(secret) if secret else manifest


PAYLOAD, MANIFEST = _snapshot()


def _manifest(edit: Callable[[dict], Any] | None = None, raw: bytes | None = None,
              secret: bytes | None = None) -> Callable[[Env], Any]:
    def run(env: Env) -> Any:
        data = raw
        if data is None:
            doc = json.loads(MANIFEST.to_json())
            if edit is not None:
                edit(doc)
            data = json.dumps(doc).encode()
        parsed = Manifest.from_json(data, "tier disk rank 3 step 7")
        parsed.verify(secret, "tier disk rank 3 step 7")
    return run


def _payload(data: bytes) -> Callable[[Env], Any]:
    return lambda env: parse_header(data)


def _header(doc: dict) -> bytes:
    text = json.dumps(doc).encode()
    return len(text).to_bytes(8, "little") + text


def _frame(data: bytes, max_payload: int = 1 << 20) -> Callable[[Env], Any]:
    def run(env: Env) -> Any:
        a, b = socket.socketpair()
        b.settimeout(5.0)
        try:
            a.sendall(data)
            a.shutdown(socket.SHUT_WR)
            return recv_header(b, where="127.0.0.1:7001", max_payload=max_payload)
        finally:
            a.close()
            b.close()
    return run


def _handshake(secret: bytes = SECRET, job: str = JOB, generation: int = 5
               ) -> Callable[[Env], Any]:
    """A client with ``secret``/``job``/``generation`` against a server of (SECRET, JOB)
    that refuses generations below 5."""
    def run(env: Env) -> Any:
        a, b = socket.socketpair()
        a.settimeout(5.0)
        b.settimeout(5.0)
        server = threading.Thread(target=server_handshake,
                                  args=(b, "client", SECRET, JOB, lambda g: g >= 5), daemon=True)
        server.start()
        try:
            client_handshake(a, "127.0.0.1:7001", secret, job, "worker", generation)
        finally:
            server.join(5)
            a.close()
            b.close()
    return run


def _s3(planted: Callable[[], tuple[bytes, bytes]] | None, step: int = 7) -> Callable[[Env], Any]:
    """Write ``planted()`` (payload, manifest) as rank 3 step 7 of a real (moto) S3 tier,
    then read and verify it the way restore does."""
    def run(env: Env) -> Any:
        from phalanx.runtime.tiers.s3 import S3Tier
        tier = S3Tier(env.request.getfixturevalue("s3_config"), JOB)
        if planted is not None:
            tier.write_rank(7, 3, *planted())
        payload, manifest = tier.read_rank(step, 3)
        verify_snapshot(payload, manifest, secret=SECRET,
                        source=f"tier s3 rank 3 step {step} ({tier.locate(step, 3)})")
    return run


def _rotted() -> tuple[bytes, bytes]:
    damaged = bytearray(PAYLOAD)
    damaged[-1] ^= 0x01
    return bytes(damaged), MANIFEST.to_json()


def _secret_file(env: Env) -> Any:
    path = env.tmp / "short.secret"
    path.write_text("tooshort\n")
    return read_job_secret(PhalanxConfig(job=JobConfig(entrypoint="t.py:main"),
                                         security=SecurityConfig(secret_file=str(path))))


BILLION_LAUGHS = ENTRY + "  args:\n    a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9))

# ------------------------------------------------------------------ the table

CASES: list[Case] = [
    # config files
    Case("config-unknown-key", "config", "`job: {world_sise: 4}`",
         _config(ENTRY + "  world_sise: 4\n"), ConfigError,
         "job.world_sise: unknown key (did you mean 'world_size'?)",
         "fix the spelling; every key is in the config reference", "job.world_sise"),
    Case("config-wrong-type", "config", "`job: {world_size: four}`",
         _config(ENTRY + "  world_size: four\n"), ConfigError,
         "job.world_size: got 'four' (str), expected int", "write a whole number",
         "job.world_size"),
    Case("config-duplicate-key", "config", "`nodes:` twice under `job:`",
         _config(ENTRY + "  nodes: 1\n  nodes: 2\n"), ConfigError,
         "job.nodes: appears twice in one mapping (first on line 3)", "keep only one of them",
         "job.nodes"),
    Case("config-invalid-yaml", "config", "`job: [1, 2`",
         _config("job: [1, 2\n"), ConfigError, "(yaml): invalid YAML",
         "fix indentation, quotes or brackets there", "(yaml)"),
    Case("config-control-character", "config", "a NUL byte in the file",
         _config(ENTRY + "\x00"), ConfigError, "special characters are not allowed",
         "save the file as plain UTF-8 text without control characters", "(yaml)"),
    Case("config-too-deep", "config", "`job: {args: {a: [[[[...]]]]}}` 100 levels deep",
         _config(ENTRY + "  args:\n    a: " + "[" * 100 + "]" * 100 + "\n"), ConfigError,
         "nests deeper than 64 levels", "flatten the nesting", "(yaml)"),
    Case("config-alias-bomb", "config", "YAML aliases nested 9 deep (10^9 values)",
         _config(BILLION_LAUGHS), ConfigError, "expands to more than 100000 values",
         "expand the aliases by hand", "(yaml)"),
    Case("config-python-tag", "config", "`job: {args: {x: !!python/object/apply:os.system [id]}}`",
         _config(ENTRY + "  args:\n    x: !!python/object/apply:os.system [id]\n"), ConfigError,
         "job.args: cannot be read: could not determine a constructor for the tag",
         "remove the YAML tag or quote it", "job.args"),
    Case("config-entrypoint-no-function", "config", "`job: {entrypoint: train}`",
         _config("job:\n  entrypoint: train\n"), ConfigError,
         "job.entrypoint: 'train' is neither a script nor a function",
         "write 'path/to/train.py', 'path/to/train.py:main' or 'module:function'",
         "job.entrypoint"),
    Case("config-s3-bucket-uppercase", "config",
         "`tiers: {s3: {enabled: true, bucket: My_Bucket}}`",
         _config(ENTRY + "tiers:\n  s3:\n    enabled: true\n    bucket: My_Bucket\n"),
         ConfigError, "tiers.s3.bucket: 'My_Bucket' must use only lowercase letters",
         "use a valid bucket name, e.g. 'my-team-checkpoints'", "tiers.s3.bucket"),
    Case("config-s3-bucket-ip", "config", "`bucket: 10.0.0.1`",
         _config(ENTRY + "tiers:\n  s3:\n    enabled: true\n    bucket: 10.0.0.1\n"),
         ConfigError, "'10.0.0.1' is formatted as an IP address",
         "use a valid bucket name", "tiers.s3.bucket"),
    Case("config-s3-bucket-newline", "config", "`bucket: \"ckpts\\n\"`",
         _config(ENTRY + "tiers:\n  s3:\n    enabled: true\n    bucket: \"ckpts\\n\"\n"),
         ConfigError, "'ckpts\\n' must use only lowercase letters", "remove the newline",
         "tiers.s3.bucket"),
    Case("config-s3-sse-unknown", "config", "`sse: rot13`",
         _config(ENTRY + "tiers:\n  s3:\n    enabled: true\n    bucket: ckpts\n    sse: rot13\n"),
         ConfigError, "tiers.s3.sse: 'rot13' is unknown", "use '', 'AES256' or 'aws:kms'",
         "tiers.s3.sse"),
    Case("config-etcd-user-embedded", "config", "`etcd: {user: u, password_file: pw}` "
         "without endpoints", _config(ENTRY + "etcd:\n  user: u\n  password_file: pw\n"),
         ConfigError, "etcd.user: 'u' is set, but the embedded etcd", "set etcd.endpoints "
         "to a cluster with auth enabled, or use etcd.tls certificates", "etcd.user"),
    Case("config-etcd-ca-without-cert", "config", "`etcd: {tls: {ca_file: ca.pem}}` without "
         "endpoints", _config(ENTRY + "etcd:\n  tls:\n    ca_file: ca.pem\n"), ConfigError,
         "etcd.tls.cert_file: is empty, but ca_file is set", "set cert_file and key_file, or "
         "etcd.endpoints", "etcd.tls.cert_file"),
    Case("config-set-without-value", "config", "`--set nonsense`",
         _config(ENTRY, "nonsense"), ConfigError, "nonsense: has no '=' and so no value",
         "write section.key=value", "nonsense"),
    Case("config-short-secret", "config", "`security.secret_file` holding 8 bytes",
         _secret_file, ConfigError, "short.secret holds 8 bytes", "use at least 16 bytes, e.g. "
         "`openssl rand -hex 32 > FILE`", "security.secret_file"),
    # command line (exit code 2, message on stderr; nothing is launched)
    Case("cli-missing-config", "cli", "`phalanx launch nope.yaml`",
         _cli("launch", "{tmp}/nope.yaml"), ConfigError, "(file): does not exist",
         "check the path; relative paths start at the current directory"),
    Case("cli-set-wrong-type", "cli", "`phalanx launch job.yaml --set job.world_size=four`",
         _cli("launch", "{cfg}", "--set", "job.world_size=four"), ConfigError,
         "config error: --set: job.world_size: got 'four' (str), expected int",
         "write a whole number"),
    Case("cli-unknown-command", "cli", "`phalanx frobnicate`", _cli("frobnicate"), SystemExit,
         "invalid choice: 'frobnicate'", "run `phalanx --help`", prefix="usage: phalanx"),
    Case("cli-status-not-a-run", "cli", "`phalanx status /tmp/empty`",
         _cli("status", "{tmp}"), ConfigError, "holds no job.json",
         "pass a directory created by `phalanx launch`"),
    Case("cli-drill-missing-scenario", "cli", "`phalanx drill run nodrill.yaml --config job.yaml`",
         _cli("drill", "run", "{tmp}/nodrill.yaml", "--config", "{cfg}"), ConfigError,
         "drills.scenario: cannot be read", "point at a YAML file such as "
         "configs/drills/kill_worker.yaml"),
    Case("cli-ckpt-bad-path", "cli", "`phalanx ckpt ls --path /no/such --job j`",
         _cli("ckpt", "ls", "--path", "{tmp}/no-such", "--job", "j"), ConfigError,
         "is not a folder", "pass the disk tier root (the folder holding <job>/step_*/)",
         prefix="error: phalanx ckpt: --path:"),
    Case("cli-entrypoint-no-function", "cli", "`job.entrypoint: examples/train_mlp.py:mian`",
         _cli("launch", "{cfg}",
              config=f"job:\n  entrypoint: {ROOT}/examples/train_mlp.py:mian\n"),
         ConfigError, "has no top-level function 'mian' (hint: did you mean 'main'?",
         "fix the function name: the hint lists what the file defines (refused before any "
         "service starts)"),
    Case("cli-cpus-over-machine", "cli", "`--set ray.cpus_per_node=100000`",
         _cli("launch", "{cfg}", "--set", "ray.cpus_per_node=100000"), ConfigError,
         "ray.cpus_per_node: 100000 logical CPUs per virtual node is more than 8 x the",
         "lower ray.cpus_per_node to what the workers and spares need, or set ray.address"),
    # manifests
    Case("manifest-not-json", "manifest", "manifest bytes `{\"format_version\": 1,`",
         _manifest(raw=b'{"format_version": 1,'), SnapshotCorrupt,
         "tier disk rank 3 step 7: manifest is not valid JSON", "restore falls to the next "
         "source; `phalanx ckpt verify` names every bad rank"),
    Case("manifest-version", "manifest", "`format_version: 2`",
         _manifest(lambda d: d.update(format_version=2)), SnapshotCorrupt,
         "'format_version': unknown version 2; this reads 1", "read it with the phalanx "
         "version that wrote it"),
    Case("manifest-unknown-field", "manifest", "an extra field `pickle`",
         _manifest(lambda d: d.update(pickle="gASV")), SnapshotCorrupt,
         "manifest field 'pickle': unknown field", "the object was not written by phalanx: "
         "delete it"),
    Case("manifest-infinite-number", "manifest", "`created_at: 1e999`",
         _manifest(raw=MANIFEST.to_json().replace(b'"created_at":1.0', b'"created_at":1e999')),
         SnapshotCorrupt, "number 1e999 is out of range", "the object is damaged: restore "
         "falls to the next source"),
    Case("manifest-dtype-not-a-string", "manifest", "a tensor's `dtype: []`",
         _manifest(lambda d: d["tensors"]["step"].update(dtype=[])), SnapshotCorrupt,
         "'tensors.step': has unknown dtype []", "the object is damaged"),
    Case("manifest-bad-checksum", "manifest", "`checksum: md5:abc`",
         _manifest(lambda d: d["tensors"]["step"].update(checksum="md5:abc")), SnapshotCorrupt,
         "checksum 'md5:abc' is not '<algo>:<hex>'", "the object is damaged"),
    Case("manifest-other-secret", "manifest", "a manifest signed with another job's secret",
         _manifest(secret=b"o" * 32), SnapshotUnauthenticated,
         "tier disk rank 3 step 7: manifest HMAC does not match the job secret",
         "use the job's own security.secret_file; another job's snapshot is never restored"),
    Case("manifest-unsigned", "manifest", "`hmac: \"\"` while the job has a secret",
         _manifest(lambda d: d.update(hmac=""), secret=SECRET), SnapshotUnauthenticated,
         "manifest is unsigned but the job has a secret", "a snapshot written without the "
         "secret is refused; write it with the secret"),
    # safetensors payloads
    Case("payload-truncated", "payload", "a 5-byte payload", _payload(b"\x10\0\0\0\0"),
         SnapshotCorrupt, "shorter than its 8-byte header length (truncated)",
         "the object is damaged"),
    Case("payload-huge-header", "payload", "header length 2^63",
         _payload((1 << 63).to_bytes(8, "little")), SnapshotCorrupt,
         "exceeds the 100000000-byte cap", "the object is damaged (nothing is allocated)"),
    Case("payload-overlap", "payload", "two tensors at the same offsets",
         _payload(_header({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                           "b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}})
                  + b"\0" * 8), SnapshotCorrupt, "overlaps the previous tensor",
         "the object is damaged"),
    Case("payload-shape-overflow", "payload", "`shape: [0, 2^70]`",
         _payload(_header({"a": {"dtype": "U8", "shape": [0, 1 << 70],
                                 "data_offsets": [0, 0]}})), SnapshotCorrupt,
         "is not a list of non-negative ints below 2**63", "the object is damaged"),
    # peer frames
    Case("frame-header-too-large", "frame", "a frame header length of 2^32-1",
         _frame(struct.pack(">I", 0xFFFFFFFF)), FrameInvalid,
         "127.0.0.1:7001: header of 4294967295 bytes exceeds 1048576",
         "a peer speaking another protocol: the connection is closed before allocating"),
    Case("frame-not-json", "frame", "header bytes `\\xff\\xfe{}`",
         _frame(struct.pack(">I", 4) + b"\xff\xfe{}"), FrameInvalid, "header is not UTF-8 JSON",
         "the connection is closed; the peer must reconnect"),
    Case("frame-payload-over-limit", "frame", "`{\"nbytes\": 1099511627776}`",
         _frame(struct.pack(">I", 24) + b'{"nbytes":1099511627776}'), FrameInvalid,
         "payload of 1099511627776 bytes exceeds the limit 1048576",
         "raise max_payload only if snapshots are that large"),
    Case("frame-not-an-object", "frame", "a header `[1, 2]`",
         _frame(struct.pack(">I", 6) + b"[1, 2]"), FrameInvalid, "header is a list, not an "
         "object", "the peer is not phalanx: check the address"),
    Case("frame-negative-nbytes", "frame", "`{\"nbytes\": -1}`",
         _frame(struct.pack(">I", 13) + b'{"nbytes":-1}'), FrameInvalid,
         "nbytes -1 is not a non-negative integer", "the peer is not phalanx"),
    Case("frame-truncated", "frame", "a header cut short by a closed connection",
         _frame(struct.pack(">I", 50) + b'{"op"'), PeerUnreachable,
         "connection closed during recv header after 5 of 50 bytes",
         "transient: the peer died or the link broke; it is retried"),
    Case("peer-wrong-secret", "frame", "a client with another secret",
         _handshake(secret=b"w" * 32), PeerRefused,
         "refused the connection (auth): authentication failed: the job secret differs",
         "give every process the same security.secret_file"),
    Case("peer-other-job", "frame", "a client of job `other`", _handshake(job="other"),
         PeerRefused, "(job): job 'other' is not served here", "connect to your job's keepers"),
    Case("peer-stale-generation", "frame", "a client of generation 4 after generation 5",
         _handshake(generation=4), PeerRefused, "(generation): generation 4 is stale",
         "the process was fenced: it must rejoin the new generation"),
    # S3 objects (a real moto S3 endpoint)
    Case("s3-planted-other-secret", "s3", "an S3 object signed with another secret",
         _s3(lambda: (PAYLOAD, _snapshot(b"o" * 32)[1].to_json())), SnapshotUnauthenticated,
         "tier s3 rank 3 step 7 (s3://", "only your job's writers hold the secret; the planted "
         "object is never restored"),
    Case("s3-planted-unsigned", "s3", "an S3 object with a valid layout and no HMAC",
         _s3(lambda: (PAYLOAD, _snapshot(None)[1].to_json())), SnapshotUnauthenticated,
         "manifest is unsigned but the job has a secret", "as above: refused, next source"),
    Case("s3-rotted-byte", "s3", "one flipped bit in an S3 payload", _s3(_rotted),
         SnapshotCorrupt, "tensor 'model.weight' checksum mismatch", "restore falls to the next "
         "source; delete the step"),
    Case("s3-missing-object", "s3", "no object for rank 3 step 9", _s3(None, step=9),
         SnapshotNotFound, "step 9 rank 3 (s3://", "restore falls to the next source"),
]


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c.id, marks=[pytest.mark.integration] if c.kind == "s3" else [])
    for c in CASES])
def test_bad_input(case: Case, tmp_path: Path, request: pytest.FixtureRequest,
                   capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    env = Env(tmp_path, request)
    if case.kind == "cli":
        monkeypatch.setenv("COLUMNS", "400")       # rich must not wrap the message
        monkeypatch.chdir(tmp_path)
        code = case.run(env)
        err = _flat(capsys.readouterr().err)
        assert code == case.exit_code
        assert case.fragment in err
        assert err.startswith(case.prefix)
        return
    with pytest.raises(case.error) as info:
        case.run(env)
    assert type(info.value) is case.error
    assert case.fragment in str(info.value)
    if case.kind == "config":
        error = info.value
        assert isinstance(error, ConfigError) and error.key == case.key and error.hint
        if case.id not in ("config-set-without-value", "config-short-secret"):
            assert error.source == str(tmp_path / "job.yaml")
    if case.kind == "s3" and case.error is not SnapshotNotFound:
        assert "(s3://" in str(info.value) and "/step_000000000007/rank_3.safetensors" in \
            str(info.value)


def test_the_table_covers_every_surface() -> None:
    kinds = {c.kind for c in CASES}
    assert len(CASES) >= 30 and {"config", "cli", "manifest", "payload", "frame", "s3"} == kinds
    assert len({c.id for c in CASES}) == len(CASES)


# ------------------------------------------------------ docs/troubleshooting.md

START, END = "<!-- error-reference:start -->\n", "<!-- error-reference:end -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_table() -> str:
    """The error reference of docs/troubleshooting.md, rendered from CASES."""
    lines = ["| id | input | error | message contains | fix |", "|---|---|---|---|---|"]
    for c in CASES:
        error = "usage error (exit 2)" if c.error is SystemExit else f"`{c.error.__name__}`"
        if c.kind == "cli" and c.error is not SystemExit:
            error += " (exit 2)"
        lines.append(f"| {c.id} | {_cell(c.given)} | {error} | `{_cell(c.fragment)}` | "
                     f"{_cell(c.fix)} |")
    return "\n".join(lines) + "\n"


def test_error_reference_matches_the_table() -> None:
    text = ERROR_REFERENCE.read_text(encoding="utf-8")
    assert text.count(START) == 1 and text.count(END) == 1, \
        "docs/troubleshooting.md needs the error-reference markers"
    inside = text.partition(START)[2].partition(END)[0]
    assert inside == render_table(), ("docs/troubleshooting.md's error reference is stale: paste "
                                      "the output of `.venv/bin/python -m "
                                      "tests.unit.test_bad_input_table`")
    section = text.partition("## Error reference")[2]
    assert START in section                      # it lives under its own heading


if __name__ == "__main__":
    print(render_table(), end="")
