"""Object storage's errors, sorted in one place, and the one retry loop every storage call goes through.

``classify(exc)`` says whether an error may heal (a server restarting, throttling, 5xx, a timeout: retried) or not
(no credentials, credentials or access refused, no such bucket or object, an invalid bucket name: failed at once),
with the advice a person needs: the AWS_* variables, ``~/.aws``, ``--s3-endpoint``, ``--storage-option``.
``retried(...)`` runs an attempt again after each transient error with backoff (0.5 s doubling to 8 s) for up to
``retry_seconds``, and has a cancel path: a set ``cancel`` event (the daemon's stop, the CLI's signals) ends the
backoff wait *and* an attempt in flight at once (the attempt runs on a helper thread, abandoned then), so a
signal never waits for a storage library's own retries. ``FetchWatch``: who hears that storage is being waited on.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from stoker.producer.dataset.sources.sharded import ShardUnavailable

log = logging.getLogger("stoker.producer")

#: every storage error's advice ends with where credentials come from and the flags that reach the server
CREDENTIALS_ADVICE = ("credentials come from the AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY variables (or "
                      "AWS_PROFILE and ~/.aws/credentials, or an instance role); --s3-endpoint names an "
                      "S3-compatible server, --storage-option passes anything else (e.g. anon=true for a public "
                      "bucket)")
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError", "NoAuthTokenError",
                   "UnauthorizedSSOTokenError", "SSOTokenLoadError", "InvalidConfigError", "ProfileNotFound"}
_INVALID_REQUEST = {"ParamValidationError", "InvalidS3AddressingStyleError", "NoRegionError",
                    "InvalidEndpointConfigurationError"}
_POLL_S = 0.1  # how often a waited-on attempt looks at ``cancel``


@dataclass(frozen=True)
class StorageVerdict:
    """What an error of object storage means: ``transient`` (retry it), ``reason`` (a few words a person reads
    first) and ``advice`` (the fix; empty for a transient error)."""

    transient: bool
    reason: str
    advice: str = ""


class StorageRefused(ShardUnavailable):
    """An error of object storage that retrying cannot heal; ``verdict`` holds the reason and the fix."""

    def __init__(self, message: str, verdict: StorageVerdict) -> None:
        super().__init__(message)
        self.verdict = verdict


class StorageCancelled(KeyboardInterrupt):
    """A stop was asked for (a signal, the daemon stopping) while object storage was waited on: callers end as
    on Ctrl-C (the CLI exits 130 saying "interrupted")."""


class FetchWatch(Protocol):
    """Hears about waits on storage (a producer's worker: its status, stage times and metrics)."""

    def waiting(self, error: str) -> None:
        """A storage call failed with a transient ``error`` and will be tried again."""

    def settled(self) -> None:
        """The wait after such failures ended: the call succeeded, was given up or was stopped."""

    def fetched(self, seconds: float) -> None:
        """A read waited ``seconds`` for its shard to be fetched (retries included)."""


def _names(exc: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(exc).__mro__}


def classify(exc: BaseException) -> StorageVerdict:
    """Whether ``exc``, raised by a storage call (s3fs, botocore, gcsfs, fsspec), may heal if tried again, and
    if not, why and the fix. Unknown errors are taken as transient: a retry bounded by ``retry_seconds`` costs
    a wait, failing a healthy run on one odd error costs the run."""
    names, text = _names(exc), str(exc)
    if names & _NO_CREDENTIALS:
        return StorageVerdict(False, "no credentials for object storage were found",
                              f"give them: {CREDENTIALS_ADVICE}")
    if isinstance(exc, PermissionError) or "AccessDenied" in text or "403" in text.split(":")[0]:
        return StorageVerdict(False, "object storage refused the credentials or the access (403 Forbidden)",
                              f"check the keys and that they may read (or write) this bucket, and that "
                              f"--s3-endpoint is the right server: {CREDENTIALS_ADVICE}")
    if isinstance(exc, FileNotFoundError) and "bucket" in text.lower():
        return StorageVerdict(False, "the bucket does not exist",
                              "check the bucket in the URL, and that --s3-endpoint is the server that holds it")
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return StorageVerdict(False, "the object does not exist", "check the URL")
    if names & _INVALID_REQUEST or "Invalid bucket name" in text or "InvalidBucketName" in text:
        return StorageVerdict(False, "the request is invalid (the bucket's name, the region or the endpoint)",
                              "check the URL (s3://BUCKET/PREFIX), --s3-endpoint and --storage-option")
    return StorageVerdict(True, "object storage is not answering")


def describe(exc: BaseException) -> str:
    """``Type: message`` of an error, on one line (what status fields and log lines quote)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def retried(what: str, attempt: Callable[[], Any], retry_seconds: float, cancel: Optional[threading.Event] = None,
            watch: Optional[FetchWatch] = None) -> Any:
    """``attempt()``, again after each transient error (``classify``) with backoff until ``retry_seconds`` passed.

    Raises StorageRefused at once for an error that cannot heal (naming ``what``, the reason and the fix),
    ShardUnavailable naming ``what`` and the last error once the time is up, StorageCancelled as soon as
    ``cancel`` is set (between attempts or during one). ``watch`` hears each transient failure, and when the
    wait they began ends.
    """
    failed: list[bool] = []
    try:
        return _retry_loop(what, attempt, retry_seconds, cancel, watch, failed)
    finally:
        if failed and watch is not None:
            watch.settled()


def _retry_loop(what: str, attempt: Callable[[], Any], retry_seconds: float, cancel: Optional[threading.Event],
                watch: Optional[FetchWatch], failed: list[bool]) -> Any:
    deadline, delay, tries = time.monotonic() + retry_seconds, 0.5, 0
    while True:
        tries += 1
        try:
            return _attempt(attempt, cancel, what)
        except (ShardUnavailable, StorageCancelled):
            raise
        except Exception as exc:  # the storage libraries raise many types for one failure: classify sorts them
            verdict = classify(exc)
            if not verdict.transient:
                raise StorageRefused(f"{what}: {verdict.reason} ({describe(exc)}): {verdict.advice}",
                                     verdict) from None
            if time.monotonic() + delay > deadline:
                raise ShardUnavailable(f"{what}: {verdict.reason}: still failing after {tries} tries in "
                                       f"{retry_seconds:.0f} s: {describe(exc)}") from None
            failed.append(True)
            if watch is not None:
                watch.waiting(describe(exc))
            log.warning("%s failed (%s); trying again in %.1f s", what, describe(exc), delay)
            if cancel is not None and cancel.wait(delay):
                raise StorageCancelled(f"{what}: stopped while waiting to try again") from None
            if cancel is None:
                time.sleep(delay)
            delay = min(8.0, delay * 2)


def _attempt(attempt: Callable[[], Any], cancel: Optional[threading.Event], what: str) -> Any:
    """``attempt()``; with ``cancel``, on a helper thread waited on until it ends or ``cancel`` is set (a storage
    library's own retries and timeouts may hold a call for minutes: a signal must not wait for them). A
    cancelled attempt's thread is left to end on its own (a daemon thread: it never holds the process)."""
    if cancel is None:
        return attempt()
    if cancel.is_set():
        raise StorageCancelled(f"{what}: stopped")
    outcome: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            outcome["value"] = attempt()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller, raised there
            outcome["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="stoker-storage-call", daemon=True).start()
    while not done.wait(_POLL_S):
        if cancel.is_set():
            raise StorageCancelled(f"{what}: stopped during the call")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
