"""Suite-wide settings: the Hypothesis profile (tests/hypothesis_profiles.py: `dev` by default,
`ci` with HYPOTHESIS_PROFILE=ci or CI set), applied to every collected property test.

Every test stays bounded by pytest-timeout; no example has a time limit.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis_profiles import PROFILE, scaled

settings.load_profile(PROFILE)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Hypothesis reads a test's settings from this attribute when it runs the test (its own
    # decorators set it the same way); tests that are not property tests have none.
    for item in items:
        test = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        given = getattr(test, "_hypothesis_internal_use_settings", None)
        if isinstance(given, settings):
            test._hypothesis_internal_use_settings = scaled(given)  # type: ignore[union-attr]
