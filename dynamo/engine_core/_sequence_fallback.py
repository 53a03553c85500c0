"""Pure-Python twin of ``dynamo.engine_core._sequence`` (contract: ``_sequence.pyi``), used where
the extension is not built or ``DYN_NATIVE=0``. Import through ``dynamo.engine_core.sequence``."""

from __future__ import annotations

from types import MemberDescriptorType
from typing import Any, TypeVar

T = TypeVar("T")


def build(cls: type[T], values: tuple[Any, ...]) -> T:
    names = getattr(cls, "__slots__", None)
    if isinstance(names, str) or names is None:
        raise TypeError("build() needs a class of plain object slots")
    names = tuple(names)
    for name in names:
        if not isinstance(getattr(cls, name, None), MemberDescriptorType):
            raise TypeError("build() needs a class of plain object slots")
    if len(values) != len(names):
        raise ValueError("build() needs one value per slot")
    obj = object.__new__(cls)
    for name, value in zip(names, values, strict=True):
        object.__setattr__(obj, name, value)
    return obj
