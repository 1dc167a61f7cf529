"""The S3 checkpoint tier: steps as objects under ``<prefix>/<job>/step_<n:012d>/``.

The only module that imports boto3/botocore; their errors become ``TierUnavailable``
(transient, after bounded retries) or ``SnapshotNotFound`` (404) at this boundary. Bound to
a run (``run_id``) it sees, commits and deletes only that run's steps, like the disk tier
(``phalanx.runtime.tiers.run_identity``).
"""
from __future__ import annotations

import io
import logging
import math
import random
import threading
import time
from typing import Any, Callable, TypeVar
from urllib.parse import urlparse

import boto3
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                 HTTPClientError, NoCredentialsError, PartialCredentialsError)

from phalanx.configs.errors import ConfigError, SnapshotNotFound, TierUnavailable
from phalanx.configs.schema import S3TierConfig, validate_bucket
from phalanx.runtime.base import iter_chunks
from phalanx.runtime.tiers import run_identity as runs
from phalanx.runtime.tiers.disk import (COMMIT_NAME, STEP_RE, as_byte_view, commit_marker,
                                        normalize_ranks, rank_file_names, retention_victims,
                                        step_dir_name, validate_job)

log = logging.getLogger(__name__)
T = TypeVar("T")

MIN_PART_SIZE = 5 * 1024 * 1024  # S3's floor for every part but the last
DEFAULT_PART_SIZE = 8 * 1024 * 1024
MAX_PARTS = 10_000
_TRANSIENT_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
                              "Throttling", "ThrottlingException", "RequestLimitExceeded"})
_NOT_FOUND_CODES = frozenset({"NoSuchKey", "404", "NotFound"})
_NO_BUCKET_CODES = frozenset({"NoSuchBucket"})


class _ViewReader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so botocore streams (and rewinds on
    retry) a part without a copy of the whole view."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view = view
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def read(self, size: int | None = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        chunk = self._view[self._pos:end].tobytes() if end > self._pos else b""
        self._pos = max(self._pos, end)
        return chunk

    def readinto(self, buffer: Any) -> int:
        chunk = self._view[self._pos:self._pos + len(buffer)]
        buffer[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or exc.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
    return False


def _describe(exc: BaseException) -> str:
    """Error text from codes and the service's message only: never a credential."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        return f"{error.get('Code', '?')} (HTTP {status}) {error.get('Message', '')}".rstrip()
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return ("no usable AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE or an instance role)")
    return f"{type(exc).__name__}: {exc}"


class S3Tier:
    """Checkpoint tier in one S3 bucket. Thread-safe (one boto3 client, created lazily).

    Raises ``ConfigError`` at construction for a bad bucket or endpoint (ValueError for bad
    tuning arguments). An injected ``client`` keeps its own timeouts and retry settings.
    """

    name = "s3"

    def __init__(self, cfg: S3TierConfig, job: str, client: Any = None, *, run_id: str = "",
                 part_size: int = DEFAULT_PART_SIZE, max_attempts: int = 4,
                 deadline_s: float = 120.0, backoff_base_s: float = 0.2,
                 backoff_cap_s: float = 5.0, botocore_max_attempts: int = 3,
                 connect_timeout_s: float = 10.0, read_timeout_s: float = 60.0) -> None:
        self._cfg = cfg
        self._bucket = validate_bucket(cfg.bucket)
        self._job = validate_job(job)
        self.run_id = run_id
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size {part_size} is below S3's minimum part size "
                             f"{MIN_PART_SIZE}")
        if cfg.endpoint_url:
            url = urlparse(cfg.endpoint_url)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise ConfigError("tiers.s3.endpoint_url", f"{cfg.endpoint_url!r} is not an "
                                  "http(s) URL", "write e.g. https://s3.example.com:9000")
        if max_attempts < 1 or deadline_s <= 0 or botocore_max_attempts < 1:
            raise ValueError("max_attempts, botocore_max_attempts and deadline_s must be positive")
        self._part_size = part_size
        self._max_attempts = max_attempts
        self._deadline_s = deadline_s
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._botocore_cfg = Config(
            region_name=cfg.region or None, connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"mode": "standard", "total_max_attempts": botocore_max_attempts},
            s3={"addressing_style": "path" if cfg.endpoint_url else "auto"})
        self._client = client
        self._client_lock = threading.Lock()
        root = cfg.prefix.strip("/")
        self._base = f"{root}/{self._job}" if root else self._job

    # ------------------------------------------------------------------ plumbing

    @property
    def client(self) -> Any:
        """The boto3 S3 client (built on first use from endpoint_url and region)."""
        with self._client_lock:
            if self._client is None:
                session = boto3.session.Session()
                self._client = session.client("s3", endpoint_url=self._cfg.endpoint_url or None,
                                              config=self._botocore_cfg)
            return self._client

    def _key(self, step: int, name: str) -> str:
        return f"{self._base}/{step_dir_name(step)}/{name}"

    def _url(self, key: str = "") -> str:
        return f"s3://{self._bucket}/{key}"

    def _params(self, key: str | None = None, **extra: Any) -> dict[str, Any]:
        params: dict[str, Any] = {"Bucket": self._bucket, **extra}
        if key is not None:
            params["Key"] = key
        if self._cfg.expected_owner:
            params["ExpectedBucketOwner"] = self._cfg.expected_owner
        return params

    def _sse(self) -> dict[str, str]:
        if not self._cfg.sse:
            return {}
        params = {"ServerSideEncryption": self._cfg.sse}
        if self._cfg.sse == "aws:kms" and self._cfg.sse_kms_key_id:
            params["SSEKMSKeyId"] = self._cfg.sse_kms_key_id
        return params

    def _retry(self, op: str, target: str, fn: Callable[[], T]) -> T:
        """Run ``fn``, retrying transient errors with full-jitter exponential backoff, at most
        ``max_attempts`` times within ``deadline_s``; then translate the error."""
        deadline = time.monotonic() + self._deadline_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except (ClientError, BotoCoreError) as exc:
                remaining = deadline - time.monotonic()
                if not _is_transient(exc) or attempt >= self._max_attempts or remaining <= 0:
                    raise self._translate(op, target, exc, attempt) from exc
                base, cap = self._backoff
                delay = min(remaining, random.uniform(0, min(cap, base * 2 ** (attempt - 1))))
                log.warning("tier_retry tier=s3 op=%s target=%s attempt=%d delay_s=%.3f error=%r",
                            op, target, attempt, delay, _describe(exc))
                time.sleep(delay)

    def _translate(self, op: str, target: str, exc: BaseException, attempts: int) -> Exception:
        code = exc.response.get("Error", {}).get("Code", "") if isinstance(exc, ClientError) else ""
        text = f"tier s3: {op} of {target} failed after {attempts} attempt(s): {_describe(exc)}"
        if code in _NO_BUCKET_CODES or (op == "head_bucket" and code in _NOT_FOUND_CODES):
            text = (f"tier s3: bucket {self._bucket!r} does not exist at "
                    f"{self._cfg.endpoint_url or 'AWS'} ({op}: {_describe(exc)}); create it or "
                    "fix tiers.s3.bucket")
        elif code in _NOT_FOUND_CODES:
            return SnapshotNotFound(f"tier s3: {target} not found ({op}: {_describe(exc)})")
        elif code in ("403", "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            text += "; check the credentials' permissions and tiers.s3.expected_owner"
        log.warning("tier_error tier=s3 op=%s target=%s attempts=%d error=%r",
                    op, target, attempts, _describe(exc))
        return TierUnavailable(text)

    # ------------------------------------------------------------------- writes

    def _put(self, key: str, body: bytes | memoryview, target: str) -> None:
        def call() -> Any:
            data = body if isinstance(body, bytes) else _ViewReader(body)
            return self.client.put_object(**self._params(key, Body=data, ContentLength=len(body),
                                                         **self._sse()))
        self._retry("put_object", target, call)

    def _multipart(self, key: str, view: memoryview, target: str) -> int:
        """Upload ``view`` in parts read from slices of it; aborts the upload on any failure."""
        part_size = max(self._part_size, math.ceil(view.nbytes / MAX_PARTS))
        created = self._retry("create_multipart_upload", target, lambda: self.client
                              .create_multipart_upload(**self._params(key, **self._sse())))
        upload_id = created["UploadId"]
        parts: list[dict[str, Any]] = []
        try:
            for number, chunk in enumerate(iter_chunks(view, part_size), start=1):
                def upload(chunk: memoryview = chunk, number: int = number) -> Any:
                    return self.client.upload_part(**self._params(
                        key, UploadId=upload_id, PartNumber=number, Body=_ViewReader(chunk),
                        ContentLength=len(chunk)))
                response = self._retry("upload_part", f"{target} part {number}", upload)
                parts.append({"PartNumber": number, "ETag": response["ETag"]})
            self._retry("complete_multipart_upload", target, lambda: self.client
                        .complete_multipart_upload(**self._params(
                            key, UploadId=upload_id, MultipartUpload={"Parts": parts})))
        except BaseException:
            self._abort(key, upload_id)
            raise
        return len(parts)

    def _abort(self, key: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(**self._params(key, UploadId=upload_id))
            log.info("tier_abort tier=s3 key=%s", key)
        except (ClientError, BotoCoreError) as exc:
            log.warning("tier_abort_failed tier=s3 key=%s error=%r (a bucket lifecycle rule for "
                        "incomplete multipart uploads reclaims it)", key, _describe(exc))

    def get_object(self, step: int, name: str) -> bytes | None:
        try:
            return self._get(self._key(step, name), self._url(self._key(step, name)))
        except SnapshotNotFound:
            return None

    def put_object(self, step: int, name: str, data: bytes) -> None:
        self._put(self._key(step, name), data, self._url(self._key(step, name)))

    def delete_object(self, step: int, name: str) -> None:
        key = self._key(step, name)
        self._retry("delete_object", self._url(key),
                    lambda: self.client.delete_object(**self._params(key)))

    def step_names(self, step: int) -> list[str]:
        prefix = f"{self._base}/{step_dir_name(step)}/"
        return sorted(k[len(prefix):] for k in self._list(prefix, delimiter=None))

    def write_rank(self, step: int, rank: int, payload: memoryview | bytes, manifest: bytes) -> None:
        """Payload (multipart above part_size), then manifest (with a run: between its
        run records). Raises TierUnavailable."""
        runs.write_owned(self, step, rank, self.run_id,
                         lambda: self._write_files(step, rank, payload, manifest))

    def _write_files(self, step: int, rank: int, payload: memoryview | bytes,
                     manifest: bytes) -> bytes:
        payload_name, manifest_name = rank_file_names(rank)
        view = as_byte_view(payload)
        key = self._key(step, payload_name)
        target = f"step {step} rank {rank} ({self._url(key)})"
        started = time.monotonic()
        if view.nbytes > self._part_size:
            parts = self._multipart(key, view, target)
        else:
            self._put(key, view, target)
            parts = 1
        self._put(self._key(step, manifest_name), bytes(manifest), target)
        log.debug("tier_write tier=s3 step=%d rank=%d bytes=%d parts=%d elapsed_s=%.3f",
                  step, rank, view.nbytes, parts, time.monotonic() - started)
        return bytes(manifest)

    def commit_step(self, step: int, ranks: list[int]) -> None:
        """Write ``COMMIT`` once a listing shows every rank's two objects.

        Raises SnapshotNotFound naming the first missing rank (SnapshotOfOtherRun: bound to
        a run, and a rank's objects are another run's), TierUnavailable on errors."""
        wanted = normalize_ranks(ranks)
        prefix = f"{self._base}/{step_dir_name(step)}/"
        present = set(self._list(prefix, delimiter=None))
        for rank in wanted:
            for name in rank_file_names(rank):
                if prefix + name not in present:
                    raise SnapshotNotFound(f"tier s3: cannot commit step {step}: rank {rank} "
                                           f"has no {name} at {self._url(prefix)}")
        if self.run_id:
            runs.check_owned(self, step, wanted, self.run_id, "commit")
        self._put(self._key(step, COMMIT_NAME), commit_marker(step, wanted, self.run_id),
                  f"step {step} commit")
        log.info("tier_commit tier=s3 step=%d ranks=%d", step, len(wanted))

    # -------------------------------------------------------------------- reads

    def _get(self, key: str, target: str) -> bytes:
        def call() -> bytes:
            body = self.client.get_object(**self._params(key))["Body"]
            try:
                return body.read()
            finally:
                body.close()
        return self._retry("get_object", target, call)

    def locate(self, step: int, rank: int) -> str:
        """Where one rank's objects of ``step`` live (``s3://bucket/key``, both names), for
        messages that must name the object a refused snapshot came from."""
        payload_name, manifest_name = rank_file_names(rank)
        return f"{self._url(self._key(step, payload_name))} + {manifest_name}"

    def read_rank(self, step: int, rank: int) -> tuple[bytes, bytes]:
        """(payload, manifest), byte for byte; raises SnapshotNotFound naming step and rank
        (SnapshotOfOtherRun: bound to a run, and they are another run's)."""
        if self.run_id:
            runs.check_owned(self, step, [rank], self.run_id, "restore")
        payload_name, manifest_name = rank_file_names(rank)
        payload_key, manifest_key = self._key(step, payload_name), self._key(step, manifest_name)
        payload = self._get(payload_key, f"step {step} rank {rank} ({self._url(payload_key)})")
        manifest = self._get(manifest_key, f"step {step} rank {rank} ({self._url(manifest_key)})")
        return payload, manifest

    def _list(self, prefix: str, delimiter: str | None) -> list[str]:
        """Every key under ``prefix`` (or common prefixes when ``delimiter`` is set)."""
        found: list[str] = []
        token: str | None = None
        while True:
            extra: dict[str, Any] = {"Prefix": prefix}
            if delimiter:
                extra["Delimiter"] = delimiter
            if token:
                extra["ContinuationToken"] = token
            page = self._retry("list_objects_v2", self._url(prefix),
                               lambda: self.client.list_objects_v2(**self._params(**extra)))
            if delimiter:
                found += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
            else:
                found += [o["Key"] for o in page.get("Contents", [])]
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    def _exists(self, key: str) -> bool:
        try:
            self._retry("head_object", self._url(key),
                        lambda: self.client.head_object(**self._params(key)))
        except SnapshotNotFound:
            return False
        return True

    def _scan(self) -> tuple[list[int], list[int]]:
        """(every step with objects, committed steps), both ascending: one listing plus one
        HEAD per step (steps are few: retention bounds them)."""
        steps = []
        for common in self._list(f"{self._base}/", delimiter="/"):
            match = STEP_RE.match(common.rstrip("/").rsplit("/", 1)[-1])
            if match:
                steps.append(int(match.group(1)))
        steps.sort()
        committed = [s for s in steps if self._exists(self._key(s, COMMIT_NAME))]
        return steps, committed

    def committed_steps(self) -> list[int]:
        """Steps with a ``COMMIT`` marker (bound to a run: of that run), ascending."""
        committed = self._scan()[1]
        return runs.committed_of_run(self, committed, self.run_id) if self.run_id else committed

    # ------------------------------------------------------------ deletes, check

    def delete_step(self, step: int) -> None:
        """Delete the marker first, then the rank objects in batches; absent is no error."""
        marker = self._key(step, COMMIT_NAME)
        self._retry("delete_object", self._url(marker),
                    lambda: self.client.delete_object(**self._params(marker)))
        keys = self._list(f"{self._base}/{step_dir_name(step)}/", delimiter=None)
        for start in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True}
            result = self._retry("delete_objects", f"step {step}", lambda: self.client
                                 .delete_objects(**self._params(Delete=batch)))
            if result.get("Errors"):
                first = result["Errors"][0]
                raise TierUnavailable(f"tier s3: deleting step {step} left {len(result['Errors'])} "
                                      f"object(s), e.g. {first.get('Key')}: {first.get('Code')}")
        log.info("tier_delete tier=s3 step=%d objects=%d", step, len(keys))

    def apply_retention(self, keep: int) -> list[int]:
        """All but the newest ``keep`` committed steps, and older partial ones; bound to a
        run, only that run's."""
        steps, committed = self._scan()
        if self.run_id:
            steps, committed = runs.steps_of_run(self, steps, committed, self.run_id)
        victims = retention_victims(steps, committed, keep)
        for step in victims:
            self.delete_step(step)
        if victims:
            log.info("tier_retention tier=s3 keep=%d deleted=%s", keep, victims)
        return victims

    def clean_abandoned(self, ranks: list[int]) -> list[tuple[int, int]]:
        """Remove ``ranks``' objects whose write this run never finished, in uncommitted
        steps; returns the (step, rank) pairs removed. Unbound: nothing."""
        if not self.run_id:
            return []
        steps, committed = self._scan()
        found = runs.abandoned_writes(self, steps, committed, ranks, self.run_id)
        for step, rank in found:
            for name in (*rank_file_names(rank), runs.record_name(rank)):
                self.delete_object(step, name)
        if found:
            log.info("tier_cleaned tier=s3 run=%s abandoned=%s", self.run_id, found)
        return found

    def check(self) -> None:
        """The launch check: HEAD the bucket (credentials, existence, owner), then put and
        delete a small probe object under the prefix with the options every upload sends
        (ExpectedBucketOwner, SSE), so a missing write or delete permission fails the
        launch, not the first persisted step. Raises TierUnavailable naming the bucket,
        the prefix and the fix."""
        self._retry("head_bucket", self._url(), lambda: self.client.head_bucket(**self._params()))
        where = self._url(f"{self._base}/")
        key = f"{self._base}/.phalanx-launch-check-{time.time_ns():x}-{random.getrandbits(32):08x}"
        grant = (f"allow s3:PutObject and s3:DeleteObject on arn:aws:s3:::{self._bucket}/"
                 f"{self._base}/*")
        if self._cfg.sse == "aws:kms":
            grant += " and kms:GenerateDataKey on tiers.s3.sse_kms_key_id"
        fix = f"{grant}, or point tiers.s3.bucket / tiers.s3.prefix at a writable location"
        try:
            self._put(key, b"phalanx launch check\n", f"launch check object {self._url(key)}")
        except (TierUnavailable, SnapshotNotFound) as exc:
            raise TierUnavailable(f"tier s3: cannot write under {where} (bucket "
                                  f"{self._bucket!r}, prefix {self._base!r}): {exc}; fix: "
                                  f"{fix}") from exc
        try:
            self._retry("delete_object", self._url(key),
                        lambda: self.client.delete_object(**self._params(key)))
        except (TierUnavailable, SnapshotNotFound) as exc:
            raise TierUnavailable(f"tier s3: cannot delete under {where} (bucket "
                                  f"{self._bucket!r}, prefix {self._base!r}; retention needs "
                                  f"it, and the check object {self._url(key)} was left behind): "
                                  f"{exc}; fix: {fix}") from exc
        log.info("tier_check tier=s3 bucket=%s prefix=%s endpoint=%s write=ok", self._bucket,
                 self._base, self._cfg.endpoint_url or "aws")
