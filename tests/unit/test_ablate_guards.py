"""Every guard of ``bin/ablate`` still names code that exists: each mutation's text is found
exactly once in its file (after the guard's earlier mutations). A guard whose text moved away
is not ablated at all: ``make ablate`` stopped on five such guards on 2026-12-03."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys

from tests.conftest import ROOT

PACKAGE = ROOT / "platform" / "src" / "taskplatform"


def test_every_ablation_names_code_found_exactly_once() -> None:
    loader = importlib.machinery.SourceFileLoader("ablate_guards", str(ROOT / "bin" / "ablate"))
    spec = importlib.util.spec_from_loader("ablate_guards", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ablate_guards"] = module  # its dataclasses look their module up
    try:
        loader.exec_module(module)
    finally:
        sys.modules.pop("ablate_guards", None)
    stale = []
    for guard in module.GUARDS:
        texts: dict[str, str] = {}
        for mutation in guard.mutations:
            text = texts.get(mutation.path) or (PACKAGE / mutation.path).read_text()
            if text.count(mutation.old) != 1:
                stale.append(f"{guard.name}: {mutation.path} holds it {text.count(mutation.old)} times")
            texts[mutation.path] = text.replace(mutation.old, mutation.new, 1)
    assert len(module.GUARDS) > 80
    assert not stale, stale
