"""The one HTTP client of the server engines (vLLM, SGLang) and their evaluators.

* Several base URLs, used round-robin; one `httpx.Client` (connection pool sized for the
  concurrency); a per-request timeout.
* Retries with exponential backoff and jitter (tenacity) on the transient failures -- a timeout, a
  connection error (refused, reset), an HTTP 5xx; anything else fails at once.
* Every failure is classified into the reasons the feature stores count: `timeout`, `connection`,
  `http_5xx`, `too_long` (a 4xx that says the prompt does not fit), `http_<status>` (other 4xx),
  `bad_response` (not JSON).
* The client keeps its own account of every request (`stats()`): how many requests and attempts,
  the failed attempts by reason, and one record per request that needed more than one attempt or
  failed (its tag, the reason of each failed attempt, the outcome).  Tests and run summaries read
  that account instead of guessing from the outside.
* `map()` runs a function over items with at most `concurrency` in flight.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from eaglenest import EaglenestError

RETRYABLE = frozenset({"timeout", "connection", "http_5xx"})
# what vLLM 0.32 and SGLang 0.5.23 answer (HTTP 400) when a prompt does not fit the context
TOO_LONG_HINTS = ("context length", "too long", "max_model_len", "maximum context", "exceeds", "maximum model length")
MAX_RECORDS = 10_000  # notable requests kept in memory (a long run keeps its counts regardless)


class RequestFailed(Exception):
    """A request that failed for good: `reason` is the key the stores count."""

    def __init__(self, reason: str, message: str, status: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.status = status

    @property
    def retryable(self) -> bool:
        return self.reason in RETRYABLE


@dataclass
class RequestRecord:
    """One request as the client saw it: the reason of each failed attempt, then the outcome
    ("ok", or the reason it failed with)."""

    tag: str
    method: str
    path: str
    failed_attempts: list[str] = field(default_factory=list)
    outcome: str = "pending"

    @property
    def attempts(self) -> int:
        return len(self.failed_attempts) + (self.outcome == "ok")


def classify(status: int, text: str) -> str:
    if status >= 500:
        return "http_5xx"
    low = text.lower()
    return "too_long" if any(h in low for h in TOO_LONG_HINTS) else f"http_{status}"


class Client:
    def __init__(self, urls: list[str], *, timeout: float, retries: int, concurrency: int = 4,
                 backoff: float = 0.5, max_backoff: float = 8.0, connect_timeout: float = 10.0):
        import httpx

        if not urls:
            raise EaglenestError("no server URL given")
        self.urls = [u.rstrip("/") for u in urls]
        self.retries = max(0, int(retries))
        self.concurrency = max(1, int(concurrency))
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=min(connect_timeout, timeout)),
                                 limits=httpx.Limits(max_connections=max(4, 2 * self.concurrency)))
        self._rr = itertools.count()
        self._lock = threading.Lock()
        self._requests = 0
        self._attempts = 0
        self._failed = Counter()  # failed attempts by reason
        self._outcomes = Counter()  # requests by outcome
        self.records: list[RequestRecord] = []  # requests that were retried or failed

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def next_url(self) -> str:
        with self._lock:
            return self.urls[next(self._rr) % len(self.urls)]

    # -- one request
    def request(self, method: str, path: str, payload=None, *, url: str | None = None, make_payload=None,
                tag: str = ""):
        """JSON of the first successful attempt, else RequestFailed.  `make_payload(attempt)` builds
        a fresh body per attempt (e.g. new request ids); otherwise `payload` is sent each time."""
        from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_exponential_jitter

        rec = RequestRecord(tag, method, path)
        counter = itertools.count()

        def attempt():
            n = next(counter)
            base = url or self.next_url()
            try:
                return self._send(method, base, path, make_payload(n) if make_payload is not None else payload)
            except RequestFailed as e:
                rec.failed_attempts.append(e.reason)
                raise

        retrying = Retrying(stop=stop_after_attempt(self.retries + 1),
                            wait=wait_exponential_jitter(multiplier=self.backoff, max=self.max_backoff, jitter=self.backoff),
                            retry=retry_if_exception(lambda e: isinstance(e, RequestFailed) and e.retryable),
                            reraise=True)
        try:
            out = retrying(attempt)
            rec.outcome = "ok"
            return out
        except RequestFailed as e:
            rec.outcome = e.reason
            if e.retryable:
                e.message += f" (after {rec.attempts} attempts)"
                e.args = (e.message,)
            raise
        finally:
            self._account(rec)

    def _send(self, method: str, base: str, path: str, body):
        import httpx

        where = f"{base}{path}"
        try:
            r = self.http.request(method, where, json=body)
        except httpx.TimeoutException as e:
            raise RequestFailed("timeout", f"{where}: timed out ({type(e).__name__})") from None
        except httpx.TransportError as e:
            raise RequestFailed("connection", f"{where}: {type(e).__name__}: {e}") from None
        if r.status_code >= 400:
            raise RequestFailed(classify(r.status_code, r.text[:500]),
                                f"{where}: HTTP {r.status_code}: {r.text[:500]}", r.status_code)
        try:
            return r.json()
        except (json.JSONDecodeError, ValueError):
            raise RequestFailed("bad_response", f"{where}: response is not JSON: {r.text[:200]}") from None

    def get_json(self, path: str, url: str | None = None):
        return self.request("GET", path, url=url, tag=path)

    def _account(self, rec: RequestRecord) -> None:
        with self._lock:
            self._requests += 1
            self._attempts += len(rec.failed_attempts) + (rec.outcome == "ok")
            self._failed.update(rec.failed_attempts)
            self._outcomes[rec.outcome] += 1
            if (rec.failed_attempts or rec.outcome != "ok") and len(self.records) < MAX_RECORDS:
                self.records.append(rec)

    def stats(self) -> dict:
        """The client's own account of its requests (JSON-able)."""
        with self._lock:
            return {
                "requests": self._requests,
                "attempts": self._attempts,
                "failed_attempts": dict(self._failed),
                "requests_retried": sum(1 for r in self.records if r.failed_attempts and r.outcome == "ok"),
                "requests_failed": self._requests - self._outcomes["ok"],
                "records": [dict(asdict(r), attempts=r.attempts) for r in self.records],
            }

    # -- many requests
    def map(self, fn, items) -> list:
        """[fn(x) for x in items], at most `concurrency` at a time, in order."""
        items = list(items)
        if len(items) <= 1 or self.concurrency == 1:
            return [fn(x) for x in items]
        with ThreadPoolExecutor(max_workers=min(self.concurrency, len(items))) as ex:
            return list(ex.map(fn, items))


def merge_stats(*stats: dict) -> dict:
    """Sum several clients' stats() (an engine with more than one client)."""
    out = {"requests": 0, "attempts": 0, "failed_attempts": Counter(), "requests_retried": 0, "requests_failed": 0,
           "records": []}
    for s in stats:
        for k in ("requests", "attempts", "requests_retried", "requests_failed"):
            out[k] += s[k]
        out["failed_attempts"].update(s["failed_attempts"])
        out["records"] += s["records"]
    out["failed_attempts"] = dict(out["failed_attempts"])
    return out


def describe(stats: dict) -> str:
    """One line for a run summary."""
    failed = ", ".join(f"{k}: {v}" for k, v in sorted(stats["failed_attempts"].items())) or "none"
    return (f"{stats['requests']} requests, {stats['attempts']} attempts ({stats['requests_retried']} retried to success, "
            f"{stats['requests_failed']} failed; failed attempts by reason: {failed})")

