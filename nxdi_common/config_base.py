"""Generic building blocks shared by ``config`` and ``config_extra``.

Value helpers (dtype parsing, JSON conversion, ``"module:qualname"`` references), the ``check_*``
validators, ``coerce_nested`` and ``ConfigBase``, the keyword-only, validated, JSON-serializable
base of every config class. ``nxdi_common.config`` re-exports the public names.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


# ---------------------------------------------------------------------------- value helpers
def to_torch_dtype(value: Any, name: str = "torch_dtype") -> torch.dtype:
    """Parse a torch dtype or its name ("bfloat16"/"bf16", "float16"/"fp16", "float32"/"fp32")."""
    if isinstance(value, torch.dtype) and value in _DTYPE_NAMES.values():
        return value
    if isinstance(value, str) and value.lower().removeprefix("torch.") in _DTYPE_NAMES:
        return _DTYPE_NAMES[value.lower().removeprefix("torch.")]
    raise ValueError(f"{name} must be torch.bfloat16, torch.float16 or torch.float32 (or the "
                     f"names 'bfloat16'/'bf16', 'float16'/'fp16', 'float32'/'fp32'); got {value!r}")


def object_path(obj: Any) -> str:
    """Return ``"module:qualname"`` for a module-level class or function (JSON-safe reference)."""
    qualname = getattr(obj, "__qualname__", None)
    if qualname is None or "<locals>" in qualname:
        raise ValueError(f"{obj!r} cannot be saved in a config: define it at module level")
    return f"{obj.__module__}:{qualname}"


def to_jsonable(value: Any) -> Any:
    """Convert a config value to JSON types: dtypes and enums to strings, configs to dicts."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if hasattr(value, "to_dict") and not isinstance(value, type):
        return value.to_dict()
    return object_path(value) if callable(value) else value


def unknown_name_message(owner: str, name: str, known: Sequence[str]) -> str:
    """Message for an unknown attribute, suggesting the closest known name."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else "; see the API reference for valid names"
    return f"{owner} has no attribute {name!r}{hint}"


def check_int(name: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    """Raise ValueError unless ``value`` is an int >= ``minimum`` (or None when optional)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """Raise ValueError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def check_buckets(name: str, buckets: Optional[List[int]], upper: int, upper_name: str,
                  allow_zero: bool = False) -> None:
    """Explicit bucket lists must be non-empty, positive (a leading 0 when ``allow_zero``),
    strictly increasing and at most ``upper`` (the value of ``upper_name``)."""
    if buckets is None:
        return
    if not isinstance(buckets, (list, tuple)) or not buckets:
        raise ValueError(f"{name} must be a non-empty list of sizes, got {buckets!r}")
    for i, b in enumerate(buckets):
        check_int(f"each entry of {name}", b, minimum=0 if allow_zero and i == 0 else 1)
    if any(a >= b for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {list(buckets)}")
    if buckets[-1] > upper:
        raise ValueError(f"{name} has bucket {buckets[-1]} > {upper_name} ({upper}); remove it "
                         f"or raise {upper_name}")


def coerce_nested(name: str, value: Any, cls: type) -> Any:
    """Accept None, a ``cls`` instance, or a dict of its attributes (as loaded from JSON)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        return cls.from_dict(value)
    raise ValueError(f"{name} must be a {cls.__name__} or a dict of its attributes, got {value!r}")


# ---------------------------------------------------------------------------- config base
@dataclass(init=False)
class ConfigBase:
    """Keyword-only, validated, JSON-serializable config: the base of every config class here.

    Construction assigns fields (unknown names raise ValueError with a suggestion), then
    ``_derive()`` fills derived defaults and normalises types, then ``validate()`` checks.
    """

    def __init__(self, **kwargs: Any) -> None:
        self._assign(kwargs)
        self._derive()
        self.validate()

    def _assign(self, kwargs: Dict[str, Any]) -> None:
        fields = dataclasses.fields(self)
        known = [f.name for f in fields]
        for name in kwargs:
            if name not in known:
                raise ValueError(unknown_name_message(type(self).__name__, name, known))
        for f in fields:
            if f.name in kwargs:
                setattr(self, f.name, kwargs[f.name])
            elif f.default is not dataclasses.MISSING:
                setattr(self, f.name, f.default)
            elif f.default_factory is not dataclasses.MISSING:
                setattr(self, f.name, f.default_factory())
            else:
                raise ValueError(f"{type(self).__name__} requires {f.name!r}")

    def _derive(self) -> None:
        """Fill derived defaults and normalise types (no-op by default)."""

    def validate(self) -> None:
        """Raise ValueError describing what to change (no-op by default)."""

    def to_dict(self) -> Dict[str, Any]:
        """JSON-safe dict of every field, plus public attributes a subclass sets in its own
        ``__init__`` (NxDI style: ``self.x = kwargs.pop("x", default)``)."""
        names = [f.name for f in dataclasses.fields(self)]
        names += [k for k in vars(self) if not k.startswith("_") and k not in names]
        return {name: to_jsonable(getattr(self, name)) for name in names}

    @classmethod
    def from_dict(cls, config_dict: Dict[str, Any]) -> "ConfigBase":
        """Build a config from ``to_dict`` output (or any dict of attributes)."""
        return cls(**config_dict)
