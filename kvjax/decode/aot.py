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

import collections
import contextlib
import dataclasses
import functools
import inspect
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np

from kvjax.decode import programs

_HITS = "/jax/compilation_cache/cache_hits"
LOADED = "/kvjax/programs/loaded"  # a step's program read from `kvjax.decode.programs`


@dataclasses.dataclass(frozen=True)
class Compiled:
    """One program a warm-up asked for."""

    name: str  # the step (extend, decode_loop, ...)
    seconds: float  # tracing, lowering and compiling (or loading) it
    loaded: bool  # the persistent compilation cache held it (nothing compiled)
    held: bool = False  # this process held it already (nothing compiled or loaded)


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What a warm-up compiled."""

    programs: tuple[Compiled, ...]
    seconds: float

    @property
    def compiled(self) -> int:
        """Programs XLA compiled."""
        return sum(not (p.loaded or p.held) for p in self.programs)

    @property
    def loaded(self) -> int:
        """Programs the persistent compilation cache gave back."""
        return sum(p.loaded for p in self.programs)

    @property
    def held(self) -> int:
        """Programs the process held already."""
        return sum(p.held for p in self.programs)

    def counts(self) -> dict[str, int]:
        """Programs per step name."""
        out: dict[str, int] = {}
        for p in self.programs:
            out[p.name] = out.get(p.name, 0) + 1
        return out

    def __str__(self) -> str:
        steps = ", ".join(f"{n} {name}" for name, n in self.counts().items())
        return (f"warm-up: {len(self.programs)} programs ({steps}; {self.compiled} compiled, "
                f"{self.loaded} from the compilation cache, {self.held} held already) in "
                f"{self.seconds:.2f} s")


class _Session:
    """What `compiling()` collects."""

    def __init__(self):
        self.programs: list[Compiled] = []
        self.hits = 0


_STATE = threading.local()  # .sessions: this thread's compile-only sessions


def _sessions() -> list:
    if not hasattr(_STATE, "sessions"):
        _STATE.sessions = []
    return _STATE.sessions


_PROGRAMS: list[Program] = []
_LISTENING = False


def _listen(event: str, **_) -> None:
    if event == _HITS and _sessions():
        _sessions()[-1].hits += 1


@contextlib.contextmanager
def compiling() -> Iterator[list[Compiled]]:
    """Within it, `Program` steps compile instead of running; yields the list of what was
    compiled, filled as the block runs."""
    global _LISTENING
    if not _LISTENING:
        jax.monitoring.register_event_listener(_listen)
        _LISTENING = True
    session = _Session()
    _sessions().append(session)
    try:
        yield session.programs
    finally:
        _sessions().remove(session)


def active() -> bool:
    """Whether steps compile instead of running (inside `compiling()`, this thread)."""
    return bool(_sessions())


class Program:
    """A jitted step that `compiling()` can compile without running, and whose compiled
    programs outlive the process by kvjax's own key (`kvjax.decode.programs`).

    `caches`: {where in the output: argument name} of the donated caches the step returns,
    given back as they came in compile-only calls; where: an index into the output tuple,
    or a path of indices and field names (`()`: the output itself; `(0, "head", "cache")`:
    the cache field of the first output's head, none where the head is None); `static_argnames` and
    `donate_argnames` as `jax.jit` takes them; `check`, called with a call's arguments before
    anything else, raises on what the program would silently get wrong (a traced argument's
    range: the host still sees its value)."""

    def __init__(self, fn, name: str, caches: dict[int | tuple, str] | None = None,
                 static_argnames: tuple[str, ...] = (), donate_argnames: tuple[str, ...] = (),
                 check=None):
        @functools.wraps(fn)
        def traced(*args, **kwargs):  # runs once per trace: counts it
            note_trace(name)
            return fn(*args, **kwargs)

        self.fn = jax.jit(traced, static_argnames=static_argnames,
                          donate_argnames=donate_argnames)
        self.name, self.caches, self.check = name, caches or {}, check
        self.signature = inspect.signature(fn)
        self.params = list(self.signature.parameters)
        self.statics = frozenset(static_argnames)
        self.loaded: dict[str, object] = {}  # key -> compiled program, this process's
        self.__doc__, self.__wrapped__ = fn.__doc__, fn
        _PROGRAMS.append(self)

    def split(self, args: tuple, kwargs: dict) -> tuple[dict, tuple, dict]:
        """(static arguments by name, the other positional ones, the other keywords), as
        jit splits them."""
        named = list(zip(self.params, args, strict=False))
        statics = {n: a for n, a in named if n in self.statics}
        statics.update((k, v) for k, v in kwargs.items() if k in self.statics)
        return (statics, tuple(a for n, a in named if n not in self.statics),
                {k: v for k, v in kwargs.items() if k not in self.statics})

    def __call__(self, *args, **kwargs):
        if self.check is not None:
            self.check(*args, **kwargs)
        base = programs.folder()
        if base is None:
            return self._jit_call(args, kwargs)
        statics, dargs, dkwargs = self.split(args, kwargs)
        try:
            key = programs.key(self.name, statics, dargs, dkwargs)
        except programs.Unkeyed:
            return self._jit_call(args, kwargs)
        program = self.loaded.get(key)
        if program is not None and _sessions():
            _sessions()[-1].programs.append(Compiled(self.name, 0.0, False, held=True))
        if program is None:
            program = self._obtain(base / f"{self.name}-{key[:48]}", args, kwargs)
            self.loaded[key] = program
        if _sessions():
            return self._placeholder(program.out_info, args, kwargs)
        return program(*dargs, **dkwargs)

    def _obtain(self, path, args, kwargs):
        """The program from the folder, else compiled (and kept there); a compile-only
        session records it."""
        session = _sessions()[-1] if _sessions() else None
        hits, start = (session.hits if session else 0), time.perf_counter()
        program = programs.load(path)
        kept = program is not None
        if kept:
            jax.monitoring.record_event(LOADED)
            note_trace(self.name)  # a new program for this process, as a trace would be
        else:
            with programs.handed_back() as code:
                program = self.fn.lower(*args, **kwargs).compile()
            programs.save(path, program, code[0] if len(code) == 1 else None)
        if session is not None:
            session.programs.append(Compiled(self.name, time.perf_counter() - start,
                                             kept or session.hits > hits))
        return program

    def _jit_call(self, args, kwargs):
        """jit's path: run, or inside `compiling()` lower and compile."""
        if not _sessions():
            return self.fn(*args, **kwargs)
        session = _sessions()[-1]
        hits, start = session.hits, time.perf_counter()
        lowered = self.fn.lower(*args, **kwargs)
        lowered.compile()
        session.programs.append(Compiled(self.name, time.perf_counter() - start,
                                         session.hits > hits))
        return self._placeholder(lowered.out_info, args, kwargs)

    def _placeholder(self, out_info, args, kwargs):
        """Zeros in the results' shapes, with the given caches in their places."""
        out = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), out_info)
        if not self.caches:
            return out
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        for where, arg in self.caches.items():
            out = _put(out, where if isinstance(where, tuple) else (where,),
                       bound.arguments[arg])
        return out

    def clear_cache(self) -> None:
        """Drops the programs this process holds for the step (jit's and kvjax's)."""
        self.fn.clear_cache()
        self.loaded.clear()

    def __getattr__(self, attr):  # lower, trace, eval_shape, ... of the jitted function
        return getattr(self.fn, attr)


def _put(out, path: tuple, value):
    """`out` with `value` at `path` (indices into tuples, field names of dataclasses); `out`
    unchanged where the path runs into None."""
    if not path:
        return value
    first, rest = path[0], path[1:]
    if isinstance(first, int):
        items = list(out)
        items[first] = _put(items[first], rest, value)
        return tuple(items)
    inner = getattr(out, first)
    if inner is None and rest:
        return out
    return out.replace(**{first: _put(inner, rest, value)})


def clear() -> None:
    """Drops every compiled program the steps hold in this process (with `jax.clear_caches`,
    what frees their memory maps)."""
    for p in _PROGRAMS:
        p.loaded.clear()


def concrete(value) -> int | None:
    """`value` as an int, or None where it is traced (a `Program` check called inside
    another trace sees no value)."""
    try:
        return int(value)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError):
        return None


def program(name: str, caches: dict[int | tuple, str] | None = None,
            static_argnames: tuple[str, ...] = (), donate_argnames: tuple[str, ...] = (),
            check=None):
    """Decorator: the function as a `Program` (it applies `jax.jit` itself)."""
    return lambda fn: Program(fn, name, caches, static_argnames, donate_argnames, check)


_TRACES: collections.Counter = collections.Counter()


def trace_counts() -> dict[str, int]:
    """How many programs each step has taken on in this process (traced and compiled, or
    loaded from `kvjax.decode.programs`): its compilations, as far as the process is
    concerned (each `Program` counts its own through `note_trace`)."""
    return dict(_TRACES)


def note_trace(step: str) -> None:
    """Counts one trace (or load) of a step's program (`Program` calls it)."""
    _TRACES[step] += 1
