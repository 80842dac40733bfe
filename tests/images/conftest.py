"""The ``images`` marker: tests that build the product and scheduler images with buildah (root)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "images: builds the images with hack/build-images.sh (root, buildah, mmdebstrap)"
    )
