"""Compile-only calls: a step's program compiled ahead of its first call (a warm-up).

A jitted step wrapped in `Program` runs as before, except inside `compiling()`: there it
does not run but lowers and compiles the program its arguments select and returns zeros in
its results' shapes, and the caches it was given (donated in a real call, untouched here).
JAX keeps the compiled program (in memory, and in the persistent cache when
`kvjax.decode.compile_cache` is on), so the later real call with the same shapes and static
arguments compiles nothing and runs the same executable: a warm-up changes no bit.

The host code around a step (building page tables, states, widths) runs unchanged inside
`compiling()`, which is what makes a warm-up ask for exactly the programs the real calls
will: it is the same code with placeholder results.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Iterator

import jax
import numpy as np

_HITS = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program a warm-up asked for."""

    name: str  # the step (extend, decode_loop, ...)
    seconds: float  # tracing, lowering and compiling (or loading) it
    loaded: bool  # the persistent compilation cache held it (nothing compiled)


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What a warm-up compiled."""

    programs: tuple[Compiled, ...]
    seconds: float
    not_warmed: tuple[str, ...] = ()  # programs compiled at first use

    @property
    def compiled(self) -> int:
        """Programs XLA compiled."""
        return sum(not p.loaded for p in self.programs)

    @property
    def loaded(self) -> int:
        """Programs the persistent compilation cache gave back."""
        return sum(p.loaded for p in self.programs)

    def counts(self) -> dict[str, int]:
        """Programs per step name."""
        out: dict[str, int] = {}
        for p in self.programs:
            out[p.name] = out.get(p.name, 0) + 1
        return out

    def __str__(self) -> str:
        steps = ", ".join(f"{n} {name}" for name, n in self.counts().items())
        text = (f"warm-up: {len(self.programs)} programs ({steps}; {self.loaded} from the "
                f"compilation cache) in {self.seconds:.2f} s")
        if self.not_warmed:
            text += f"; compiled at first use: {', '.join(self.not_warmed)}"
        return text


class _Session:
    """What `compiling()` collects."""

    def __init__(self):
        self.programs: list[Compiled] = []
        self.hits = 0


_ACTIVE: list[_Session] = []
_LISTENING = False


def _listen(event: str, **_) -> None:
    if event == _HITS and _ACTIVE:
        _ACTIVE[-1].hits += 1


@contextlib.contextmanager
def compiling() -> Iterator[list[Compiled]]:
    """Within it, `Program` steps compile instead of running; yields the list of what was
    compiled, filled as the block runs."""
    global _LISTENING
    if not _LISTENING:
        jax.monitoring.register_event_listener(_listen)
        _LISTENING = True
    session = _Session()
    _ACTIVE.append(session)
    try:
        yield session.programs
    finally:
        _ACTIVE.remove(session)


def active() -> bool:
    """Whether steps compile instead of running (inside `compiling()`)."""
    return bool(_ACTIVE)


class Program:
    """A jitted step that `compiling()` can compile without running.

    `caches`: {output index: argument name} of the donated caches the step returns (then
    a tuple), given back as they came in compile-only calls."""

    def __init__(self, fn, name: str, caches: dict[int, str] | None = None):
        self.fn, self.name, self.caches = fn, name, caches or {}
        self.signature = inspect.signature(fn)
        self.__doc__, self.__wrapped__ = fn.__doc__, fn

    def __call__(self, *args, **kwargs):
        if not _ACTIVE:
            return self.fn(*args, **kwargs)
        session = _ACTIVE[-1]
        hits, start = session.hits, time.perf_counter()
        lowered = self.fn.lower(*args, **kwargs)
        lowered.compile()
        session.programs.append(Compiled(self.name, time.perf_counter() - start,
                                         session.hits > hits))
        out = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), lowered.out_info)
        if not self.caches:
            return out
        out, bound = list(out), self.signature.bind(*args, **kwargs)
        for index, arg in self.caches.items():
            out[index] = bound.arguments[arg]
        return tuple(out)

    def __getattr__(self, attr):  # lower, trace, eval_shape, ... of the jitted function
        return getattr(self.fn, attr)


def program(name: str, caches: dict[int, str] | None = None):
    """Decorator: `Program(fn, name, caches)` over a jitted function."""
    return lambda fn: Program(fn, name, caches)
