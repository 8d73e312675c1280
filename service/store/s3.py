"""The object store on S3 or any S3-compatible server (MinIO, ...), through boto3.

Every call is retried with exponential backoff on connection errors, timeouts and 5xx answers
(botocore's own retries are off so there is one policy, ours). Each PUT is atomic in S3, so the
manifest-last rule of `finalise` is all that completeness needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError

from service.retry import RetryPolicy
from service.store.base import ObjectInfo, ObjectMissing, ObjectStore, StoreUnavailable
from service.store.layout import check_key
from service.store.retry import with_retries

_MISSING_CODES = frozenset({"NoSuchKey", "404", "NotFound"})


def _is_missing(error: ClientError) -> bool:
    return error.response.get("Error", {}).get("Code") in _MISSING_CODES


class S3Store(ObjectStore):
    """Objects under `s3://{bucket}/{prefix}`; the bucket must exist (it is created by operations)."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str = "us-east-1",
        presign_endpoint_url: str | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}"
        self.retry = retry or RetryPolicy()
        self.client = self._client(endpoint_url, region)
        # Download links must name a host the client can reach, which may differ from ours.
        self.presigner = self._client(presign_endpoint_url, region) if presign_endpoint_url else self.client

    @staticmethod
    def _client(endpoint_url: str | None, region: str) -> Any:
        config = Config(
            signature_version="s3v4",  # presigned links too: SigV2 links are refused by newer buckets and regions
            retries={"total_max_attempts": 1},
            connect_timeout=3,
            read_timeout=60,
            s3={"addressing_style": "path"} if endpoint_url else {},
        )
        return boto3.client("s3", endpoint_url=endpoint_url, region_name=region, config=config)

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _retry(self, what: str, call):
        return with_retries(call, what=what, policy=self.retry)

    def put_bytes(self, key: str, data: bytes, content_type: str | None = None) -> None:
        extra = {"ContentType": content_type} if content_type else {}
        self._retry(
            f"put {key}",
            lambda: self.client.put_object(Bucket=self.bucket, Key=self._full(key), Body=data, **extra),
        )

    def put_file(self, key: str, path: Path, content_type: str | None = None) -> None:
        extra = {"ExtraArgs": {"ContentType": content_type}} if content_type else {}
        self._retry(
            f"upload {key}",
            lambda: self.client.upload_file(str(path), self.bucket, self._full(key), **extra),
        )

    def _get(self, key: str) -> Any:
        try:
            return self._retry(f"get {key}", lambda: self.client.get_object(Bucket=self.bucket, Key=self._full(key)))
        except ClientError as error:
            if _is_missing(error):
                raise ObjectMissing(key) from None
            raise

    def get_bytes(self, key: str) -> bytes:
        return self._get(key)["Body"].read()

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        return _chunks(self._get(key)["Body"], chunk_size)

    def list(self, prefix: str) -> list[ObjectInfo]:
        def list_all() -> list[ObjectInfo]:
            found = []
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix
            )
            for page in pages:
                for item in page.get("Contents", []):
                    key = item["Key"][len(self.prefix) :]
                    found.append(ObjectInfo(key=key, size=item["Size"], modified=item["LastModified"]))
            return sorted(found, key=lambda info: info.key)

        return self._retry(f"list {prefix}", list_all)

    def exists(self, key: str) -> bool:
        try:
            self._retry(f"head {key}", lambda: self.client.head_object(Bucket=self.bucket, Key=self._full(key)))
        except ClientError as error:
            if _is_missing(error):
                return False
            raise
        return True

    def delete(self, key: str) -> None:
        self._retry(f"delete {key}", lambda: self.client.delete_object(Bucket=self.bucket, Key=self._full(key)))

    def presigned_url(self, key: str, expires_seconds: int) -> str | None:
        return self.presigner.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": self._full(key)}, ExpiresIn=expires_seconds
        )

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(key)}"

    def key_for_uri(self, uri: str) -> str | None:
        if not uri.startswith(self.url):
            return None
        try:
            return check_key(uri[len(self.url) :])
        except ValueError:
            return None

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except Exception as error:
            raise StoreUnavailable(f"object store s3://{self.bucket} not reachable: {error}") from error


def _chunks(body: Any, chunk_size: int) -> Iterator[bytes]:
    with body:
        yield from body.iter_chunks(chunk_size)
