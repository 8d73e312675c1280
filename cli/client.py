"""A small synchronous client of the job API, used by the `ftc submit`, `ftc jobs` and `ftc sweep` commands."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx

DEFAULT_API_URL = "http://127.0.0.1:8000"
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})


class ApiError(Exception):
    """The API could not be reached or refused the request; the message is fit for one stderr line."""


def _reason(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:300] or response.reason_phrase
    if isinstance(body, dict):
        return str(body.get("message") or body.get("detail") or body)
    return str(body)


class ApiClient:
    def __init__(self, base_url: str | None = None, api_key: str | None = None, timeout: float = 30.0) -> None:
        self.base_url = (base_url or os.environ.get("FTC_API_URL") or DEFAULT_API_URL).rstrip("/")
        key = api_key if api_key is not None else os.environ.get("FTC_API_KEY", "")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise ApiError(f"cannot reach the job API at {self.base_url}: {error}") from None
        if response.status_code >= 400:
            raise ApiError(f"{method} {path} answered {response.status_code}: {_reason(response)}")
        return response.json()

    def submit(self, request: dict[str, Any], idempotency_key: str | None = None) -> dict[str, Any]:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._request("POST", "/v1/jobs", json=request, headers=headers)

    def get(self, job_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/jobs/{job_id}")

    def list(self, status: str | None = None, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        params = {k: v for k, v in {"status": status, "limit": limit, "cursor": cursor}.items() if v is not None}
        return self._request("GET", "/v1/jobs", params=params)

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/jobs/{job_id}")

    def retry(self, job_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/jobs/{job_id}/retry")

    def artifacts(self, job_id: str, include_checkpoints: bool = False) -> dict[str, Any]:
        params = {"include": "checkpoints"} if include_checkpoints else None
        return self._request("GET", f"/v1/jobs/{job_id}/artifacts", params=params)

    def stream_to(self, url: str, sink: BinaryIO, on_bytes: Callable[[int], None] = lambda n: None) -> int:
        """Write what `url` answers into `sink`; returns the bytes written.

        A URL of this API is fetched with the key; any other (a presigned store link) without it,
        since a store refuses a request that carries a second credential."""
        ours = url.startswith(self.base_url + "/") or url.startswith("/")
        http = self.http if ours else httpx.Client(timeout=self.http.timeout)
        written = 0
        try:
            with http.stream("GET", url) as response:
                if response.status_code >= 400:
                    response.read()
                    shown = url if ours else url.split("?", 1)[0]
                    raise ApiError(f"GET {shown} answered {response.status_code}: {_reason(response)}")
                for chunk in response.iter_bytes():
                    sink.write(chunk)
                    written += len(chunk)
                    on_bytes(len(chunk))
        except httpx.HTTPError as error:
            where = f"reach the job API at {self.base_url}" if ours else f"download {url.split('?', 1)[0]}"
            raise ApiError(f"cannot {where}: {error}") from None
        finally:
            if not ours:
                http.close()
        return written

    def upload(self, path: Path) -> dict[str, Any]:
        with open(path, "rb") as body:
            return self._request("POST", "/v1/uploads", params={"filename": path.name}, content=body)

    def create_sweep(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/v1/sweeps", json=request)

    def get_sweep(self, sweep_id: str, run: str | None = None) -> dict[str, Any]:
        return self._request("GET", f"/v1/sweeps/{sweep_id}", params={"run": run} if run else None)

    def list_sweeps(self, limit: int = 20, cursor: str | None = None) -> dict[str, Any]:
        params = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return self._request("GET", "/v1/sweeps", params=params)

    def cancel_sweep(self, sweep_id: str) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/sweeps/{sweep_id}")

    def run_sweep(self, sweep_id: str) -> dict[str, Any]:
        return self._request("POST", f"/v1/sweeps/{sweep_id}/runs")

    def sweep_files(self, sweep_id: str) -> dict[str, Any]:
        return self._request("GET", f"/v1/sweeps/{sweep_id}/files")

    def list_plans(self) -> dict[str, Any]:
        return self._request("GET", "/v1/plans")

    def delete_plan(self, key: str) -> dict[str, Any]:
        return self._request("DELETE", f"/v1/plans/{key}")

    def events(self, job_id: str, reconnects: int = 5) -> Iterator[tuple[str, dict[str, Any]]]:
        """(event type, data) pairs until the job's final status; reconnects where it left off."""
        last_id: str | None = None
        failures = 0
        while True:
            headers = {"Last-Event-ID": last_id} if last_id else {}
            try:
                with self.http.stream("GET", f"/v1/jobs/{job_id}/events", headers=headers, timeout=None) as response:
                    if response.status_code >= 400:
                        response.read()
                        path = f"/v1/jobs/{job_id}/events"
                        raise ApiError(f"GET {path} answered {response.status_code}: {_reason(response)}")
                    for event_id, kind, data in parse_sse(response.iter_lines()):
                        last_id, failures = event_id or last_id, 0
                        yield kind, data
                        if kind == "status" and data.get("status") in TERMINAL:
                            return
                problem = "the stream ended before the job did"
            except httpx.HTTPError as error:
                problem = str(error)
            failures += 1
            if failures > reconnects:
                raise ApiError(f"lost the event stream of {job_id}: {problem}")
            time.sleep(min(5.0, 0.25 * 2**failures))


def parse_sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str, dict[str, Any]]]:
    """(id, event, data) for each event in a text/event-stream; comments and retry hints are skipped."""
    event_id, kind, data = None, "message", []
    for line in lines:
        if not line:
            if data:
                yield event_id, kind, json.loads("\n".join(data))
            event_id, kind, data = None, "message", []
        elif line.startswith(":"):
            continue
        else:
            name, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if name == "id":
                event_id = value
            elif name == "event":
                kind = value
            elif name == "data":
                data.append(value)
