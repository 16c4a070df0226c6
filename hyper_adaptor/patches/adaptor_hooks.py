"""What a patch may ask of the adaptor above it, handed down once at bootstrap.

Patches sit below the features and the adaptor and never import them. A few seams still need a decision
only the adaptor can make: the level a ``TransformerConfig`` built without a command line runs at,
whether a level-1 feature serves a fusion switch, applying that feature when such a config asks for it.
``hyper_adaptor.megatron_adaptor`` fills :class:`AdaptorHooks` at bootstrap (:func:`connect`); a patch
reads them with :func:`current`. Before bootstrap (a patch module used on its own) the defaults answer:
nothing prepared, no feature enabled, nothing to apply.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class AdaptorHooks:
    # the --optimization-level of the last namespace the adaptor prepared (None before any)
    level: Callable[[], int | None] = lambda: None
    # whether feature ``name`` is enabled for the namespace ``args``
    feature_enabled: Callable[[str, object], bool] = lambda name, args: False
    # apply feature ``name`` at ``level`` for a megatron-core object that asked for it without a command line
    apply_feature: Callable[[str, int], None] | None = None
    # the command line's default --optimization-level
    default_level: int = 2


_hooks = AdaptorHooks()


def connect(hooks: AdaptorHooks) -> None:
    """Called once by hyper_adaptor.megatron_adaptor at bootstrap."""
    global _hooks
    _hooks = hooks


def current() -> AdaptorHooks:
    return _hooks
