"""The public surface: ``errands.__all__`` is sorted, complete and importable."""

from __future__ import annotations

import importlib

import errands


def test_all_is_sorted_without_duplicates() -> None:
    """__all__ is kept in sorted order so additions are easy to review."""
    assert errands.__all__ == sorted(errands.__all__)
    assert len(set(errands.__all__)) == len(errands.__all__)


def test_every_name_in_all_is_importable() -> None:
    """`from errands import X` works for every X that __all__ promises."""
    module = importlib.import_module("errands")
    missing = [name for name in errands.__all__ if not hasattr(module, name)]
    assert missing == []
    namespace: dict[str, object] = {}
    exec("from errands import *", namespace)
    assert set(errands.__all__) <= set(namespace)


def test_every_public_class_and_function_is_listed_in_all() -> None:
    """Nothing public is re-exported at the top level without being in __all__."""
    public = {
        name
        for name, value in vars(errands).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith("errands")
        and callable(value)
    }
    assert public <= set(errands.__all__)


def test_every_exported_error_derives_from_errands_error() -> None:
    """One except clause catches every error errands raises; outcomes are signals, not errors."""
    exceptions = {
        name
        for name in errands.__all__
        if isinstance(getattr(errands, name), type)
        and issubclass(getattr(errands, name), BaseException)
    }
    signals = {"Permanent", "Retry"}
    assert signals <= exceptions
    strays = [
        n for n in exceptions - signals if not issubclass(getattr(errands, n), errands.ErrandsError)
    ]
    assert strays == []
