"""The optional packages tests need: the `peers` extra (transformers, ctranslate2, x-transformers)."""

import importlib
import os

import pytest


def need(package: str):
    """Import an optional package the project declares (the `peers` extra), or skip without it,
    unless XFORMER_REQUIRE_PEERS=1 (CI installs the extra): there a missing package fails,
    so a test that guards an integration can never skip unnoticed."""
    if os.environ.get("XFORMER_REQUIRE_PEERS") == "1":
        try:
            return importlib.import_module(package)
        except ImportError as error:
            pytest.fail(f"needs {package} from the peers extra (XFORMER_REQUIRE_PEERS=1): {error}")
    return pytest.importorskip(package)
