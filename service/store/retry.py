"""Retrying object-store calls with exponential backoff, for outages that last seconds."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from boto3.exceptions import S3UploadFailedError
from botocore.exceptions import ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from service.retry import RetryPolicy
from service.store.base import StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = frozenset(
    {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "ServiceUnavailable", "InternalError"}
)


def is_transient(error: BaseException) -> bool:
    """Connection failures, timeouts, 5xx answers and throttling are worth retrying; 4xx are not."""
    if isinstance(error, (BotoConnectionError, HTTPClientError)):
        return True
    if isinstance(error, ClientError):
        status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return status >= 500 or error.response.get("Error", {}).get("Code") in _TRANSIENT_CODES
    if isinstance(error, S3UploadFailedError) and error.__context__ is not None:
        return is_transient(error.__context__)  # upload_file wraps the ClientError it got
    return False


def with_retries(
    call: Callable[[], T],
    *,
    what: str,
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """Run `call`, retrying transient failures `policy.store_attempts` times with `policy.store_delay`
    backoff (plus 20% jitter, so many clients do not retry in step).

    After the last attempt the failure becomes StoreUnavailable naming the operation, so callers
    and job records say what could not be done rather than showing a botocore traceback.
    """
    attempts = policy.store_attempts
    for attempt in range(1, attempts + 1):
        try:
            return call()
        except Exception as error:
            if not is_transient(error):
                raise
            if attempt == attempts:
                raise StoreUnavailable(
                    f"object store unavailable: {what} failed {attempts} times; last error: {error}"
                ) from error
            delay = policy.store_delay(attempt) * random.uniform(0.8, 1.2)
            log.warning("%s failed (%s); retry %d/%d in %.2fs", what, error, attempt, attempts - 1, delay)
            sleep(delay)
    raise AssertionError("unreachable")
