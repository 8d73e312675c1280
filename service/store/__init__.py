"""Object storage for job artifacts and uploads: one interface, a local-folder and an S3 backend."""

from __future__ import annotations

from service.retry import RetryPolicy
from service.settings import Settings
from service.store.base import (
    IncompleteArtifacts,
    ObjectInfo,
    ObjectMissing,
    ObjectStore,
    StoreUnavailable,
)
from service.store.local import LocalStore
from service.store.s3 import S3Store

__all__ = [
    "IncompleteArtifacts",
    "LocalStore",
    "ObjectInfo",
    "ObjectMissing",
    "ObjectStore",
    "S3Store",
    "StoreUnavailable",
    "open_store",
    "store_for",
]


def open_store(
    url: str,
    endpoint_url: str | None = None,
    *,
    region: str = "us-east-1",
    presign_endpoint_url: str | None = None,
    retry: RetryPolicy | None = None,
) -> ObjectStore:
    """The store a URL names: `s3://bucket/prefix` (at `endpoint_url` if set), or a local folder path."""
    if url.startswith("s3://"):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"store url {url!r} names no bucket; use s3://bucket/prefix")
        return S3Store(
            bucket,
            prefix,
            endpoint_url=endpoint_url,
            region=region,
            presign_endpoint_url=presign_endpoint_url,
            retry=retry,
        )
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" in url:
        raise ValueError(f"store url {url!r}: use a folder path or s3://bucket/prefix")
    return LocalStore(url)


def store_for(settings: Settings) -> ObjectStore:
    """The store the service settings describe."""
    return open_store(
        settings.store_url,
        settings.s3_endpoint_url,
        region=settings.s3_region,
        presign_endpoint_url=settings.s3_presign_endpoint_url,
        retry=RetryPolicy.from_settings(settings),
    )
