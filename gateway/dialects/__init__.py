"""The dialect registry: which module serves each API dialect.

Each dialect module exposes a module-level `DIALECT` instance (a `gateway.dialects.base.Dialect`).
Modules are imported on first use, one by one, so a dialect that is missing or fails to import leaves
the others serving; its routes answer `DialectUnavailable` (a 404 in a neutral error shape).
"""

from __future__ import annotations

import importlib
import logging

from gateway.dialects.base import Dialect

log = logging.getLogger("polar.gateway")

# Dialect name → module; the HTTP app maps its routes to these names.
DIALECT_MODULES: dict[str, str] = {
    "openai_chat": "gateway.dialects.openai_chat",
    "openai_responses": "gateway.dialects.openai_responses",
    "anthropic": "gateway.dialects.anthropic",
    "gemini": "gateway.dialects.gemini",
}


class DialectUnavailable(LookupError):
    """The dialect's module is missing, fails to import, or has no DIALECT."""


_loaded: dict[str, Dialect | DialectUnavailable] = {}


def get_dialect(name: str) -> Dialect:
    """The dialect registered under `name`, imported once; DialectUnavailable when it cannot be."""
    found = _loaded.get(name)
    if found is None:
        found = _loaded[name] = _load(name)
    if isinstance(found, DialectUnavailable):
        raise found
    return found


def available_dialects() -> dict[str, Dialect]:
    """Every dialect that loads, by name."""
    dialects = {}
    for name in DIALECT_MODULES:
        try:
            dialects[name] = get_dialect(name)
        except DialectUnavailable:
            continue
    return dialects


def _load(name: str) -> Dialect | DialectUnavailable:
    module_name = DIALECT_MODULES.get(name)
    if module_name is None:
        return DialectUnavailable(f"no dialect {name!r}; known: {', '.join(DIALECT_MODULES)}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            log.exception("gateway: the %s dialect needs a missing module", name)
        return DialectUnavailable(f"the {name} dialect is not available in this gateway ({exc})")
    except Exception as exc:
        log.exception("gateway: the %s dialect failed to import", name)
        return DialectUnavailable(f"the {name} dialect failed to load: {type(exc).__name__}: {exc}")
    dialect = getattr(module, "DIALECT", None)
    if not isinstance(dialect, Dialect):
        return DialectUnavailable(f"{module_name} has no DIALECT instance")
    return dialect
