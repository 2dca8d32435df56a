"""The dialect registry: lazy imports, one broken or missing dialect leaves the others serving."""

from __future__ import annotations

import pytest

import gateway.dialects as registry
from gateway.dialects.base import Dialect


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", {})
    return registry


def test_each_dialect_module_exposes_its_dialect(fresh):
    assert all(isinstance(fresh.get_dialect(name), Dialect) for name in fresh.DIALECT_MODULES)


def test_a_missing_module_is_unavailable_and_the_others_still_load(fresh, monkeypatch):
    monkeypatch.setitem(fresh.DIALECT_MODULES, "ghost", "gateway.dialects.ghost")
    with pytest.raises(fresh.DialectUnavailable, match="ghost"):
        fresh.get_dialect("ghost")
    assert "ghost" not in fresh.available_dialects() and "openai_chat" in fresh.available_dialects()


def test_a_module_without_a_dialect_instance_is_unavailable(fresh, monkeypatch):
    monkeypatch.setitem(fresh.DIALECT_MODULES, "base", "gateway.dialects.base")
    with pytest.raises(fresh.DialectUnavailable, match="no DIALECT"):
        fresh.get_dialect("base")


def test_an_unknown_name_is_unavailable(fresh):
    with pytest.raises(fresh.DialectUnavailable, match="known"):
        fresh.get_dialect("cobol")
