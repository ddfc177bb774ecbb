"""In CI (``CI=true``) a test that skips because a service is missing fails instead.

The docker path, the disk-full tests on a real tmpfs and the real-vLLM tests are part of what
CI proves; a machine that cannot run them must turn the run red, not green with a skip. Other
skips (a Hugging Face token, a reachable hub) stay skips. Loaded by conftest.py.
"""

from __future__ import annotations

import os

import pytest

# Words of the skip reasons of the tests that must run in CI.
REQUIRED_IN_CI = ("vllm", "docker", "debootstrap", "tmpfs")


def strict() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def required_service(reason: str) -> str | None:
    text = reason.lower()
    return next((word for word in REQUIRED_IN_CI if word in text), None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (strict() and report.skipped):
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    service = required_service(reason)
    if service:
        report.outcome = "failed"
        report.longrepr = (f"skipped in CI (CI=true), where the {service} tests must run: "
                           f"{reason}")
