"""The typed plugin registry: extension points, their plugins, and lazy entry-point discovery.

Design note: registry layers
    An ``ExtensionPoint`` holds two layers of plugins. *Discovered* plugins come from the
    entry-point group ``shardweave.<point>`` of every installed distribution; they are
    loaded once, on the first lookup, under the point's lock, so importing a package never
    imports its plugins. *Explicit* plugins come from ``register()``. A lookup sees the
    discovered layer overlaid by the explicit one, so an explicit registration wins over a
    discovered plugin with the same key, or handling the same type, whichever happened first.
    A discovered plugin that fails to load (import error, factory raising, wrong Protocol) is
    kept as an ``ExtensionLoadError`` and every lookup on the point raises it, naming the entry
    point and its distribution: a half-working plugin set would otherwise fall back silently
    (say, to plain-tensor handling for a tensor subclass whose plugin is broken). Registering
    the same key explicitly, or ``unregister(key)``, clears it.
"""

from __future__ import annotations

import importlib.metadata
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Generic, TypeVar

__all__ = [
    "ExtensionLoadError",
    "ExtensionPoint",
    "MissingExtensionError",
    "RegistrySnapshot",
]

T = TypeVar("T")

_KEY = re.compile(r"[A-Za-z0-9_.-]+")
_GROUP = re.compile(r"shardweave\.[A-Za-z0-9_.-]+")


class MissingExtensionError(LookupError):
    """A lookup found no plugin for a key or type.

    The message names the extension point (its entry-point group), what was looked for, what
    is registered, and the distribution to install. The same facts are attributes, so callers
    can build their own message.

    Attributes:
        group: the entry-point group of the extension point, e.g. ``"shardweave.param_kinds"``.
        looked_for: the key (``"'float8'"``) or type (``"type torch.Tensor"``) looked up,
            followed by the caller's ``what=`` context if any.
        registered: the keys registered at the time of the lookup, sorted.
        install: the distribution that ships the point's default plugins.

    Where a missing plugin is an expected case, ``find_for_type`` returns None instead of
    raising.

    Example::

        from shardweave.mesh.extension_points import PARAM_KINDS

        try:
            kind = PARAM_KINDS.get_for_type(DTensor, what="parameter 'w1.weight'")
        except MissingExtensionError as e:
            print(e.group, e.looked_for, e.registered)  # the facts, for your own message
            raise SystemExit(f"pip install {e.install}")  # 'shardweave-extensions'
    """

    def __init__(
        self,
        message: str,
        *,
        group: str = "",
        looked_for: str = "",
        registered: tuple[str, ...] = (),
        install: str = "",
    ) -> None:
        super().__init__(message)
        self.group = group
        self.looked_for = looked_for
        self.registered = registered
        self.install = install

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the attributes across pickling: worker processes send errors back to the parent.
        state = {
            "group": self.group,
            "looked_for": self.looked_for,
            "registered": self.registered,
            "install": self.install,
        }
        return (type(self), (str(self),), state)


class ExtensionLoadError(RuntimeError):
    """An installed plugin is broken: its entry point failed to load or to satisfy the Protocol.

    Raised by lookups on the plugin's extension point (not at import), with the original
    exception as ``__cause__``.

    Attributes:
        group: the entry-point group, e.g. ``"shardweave.param_kinds"``.
        key: the entry-point name.
        value: the entry-point value, e.g. ``"my_plugin:Factory"``.
        distribution: ``"name version"`` of the distribution declaring it (``""`` if unknown).

    Example::

        from shardweave.mesh.extension_points import PARAM_KINDS

        try:
            kind = PARAM_KINDS.get_for_type(DTensor)
        except ExtensionLoadError as e:
            print(f"plugin {e.key!r} ({e.value}) from {e.distribution}: {e.__cause__!r}")
            PARAM_KINDS.unregister(e.key)  # else every lookup on the point raises
    """

    def __init__(
        self,
        message: str,
        *,
        group: str = "",
        key: str = "",
        value: str = "",
        distribution: str = "",
    ) -> None:
        super().__init__(message)
        self.group = group
        self.key = key
        self.value = value
        self.distribution = distribution

    def __reduce__(self) -> tuple[object, ...]:
        state = {
            "group": self.group,
            "key": self.key,
            "value": self.value,
            "distribution": self.distribution,
        }
        return (type(self), (str(self),), state)


@dataclass(frozen=True)
class _State(Generic[T]):
    explicit: dict[str, T]
    discovered: dict[str, T]
    broken: dict[str, ExtensionLoadError]
    is_discovered: bool


class RegistrySnapshot(Generic[T]):
    """The state of one ``ExtensionPoint``, taken by ``snapshot()``; restore it to undo changes.

    Use it as a context manager (restores on exit) or pass it to ``ExtensionPoint.restore``.
    Meant for tests: a restore replaces the point's whole state for the process, so
    registrations made meanwhile (by any thread) are undone too.

    Example::

        from shardweave.mesh.extension_points import PARAM_KINDS

        @pytest.fixture
        def param_kinds_point():
            saved = PARAM_KINDS.snapshot()
            yield PARAM_KINDS  # a test may register fakes freely
            PARAM_KINDS.restore(saved)
    """

    def __init__(self, point: ExtensionPoint[T], state: _State[T]) -> None:
        self._point = point
        self._state = state

    def __enter__(self) -> RegistrySnapshot[T]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._point.restore(self)


class ExtensionPoint(Generic[T]):
    """A typed key that plugins implementing one Protocol are registered under.

    Plugins are announced by installed distributions in the entry-point group ``group``
    (each value names a zero-argument factory; a class is fine) and loaded lazily, once, on
    the first lookup; or registered in code with ``register()``, which wins over discovery.
    See Design note: registry layers.

    Args:
        group: the entry-point group, ``shardweave.<point>``.
        protocol: a ``runtime_checkable`` Protocol that every plugin must satisfy (checked
            with ``isinstance``, so methods and attributes are checked by name only), or a
            class every plugin must be an instance of (``ParamKind``).
        install: the distribution that ships this point's default plugins, named in errors.

    Example::

        @runtime_checkable
        class Greeter(Protocol):
            def greet(self) -> str: ...

        GREETERS: Final[ExtensionPoint[Greeter]] = ExtensionPoint(
            "shardweave.greeters", Greeter, install="shardweave-greeters"
        )
        GREETERS.register("en", English())
        GREETERS.get("en").greet()
    """

    def __init__(self, group: str, protocol: type, install: str) -> None:
        # `protocol` is a plain `type`, not type[T]: mypy rejects Protocol classes where
        # type[T] is expected. The Final annotation at the definition site binds T.
        if not _GROUP.fullmatch(group):
            raise ValueError(
                f"ExtensionPoint: group {group!r} must be 'shardweave.<point>' with "
                "[A-Za-z0-9_.-] characters, e.g. 'shardweave.param_kinds'"
            )
        try:
            isinstance(object(), protocol)
        except TypeError as e:
            raise TypeError(
                f"ExtensionPoint {group!r}: protocol {protocol!r} must be a Protocol decorated "
                "with @typing.runtime_checkable (plugins are checked with isinstance)"
            ) from e
        self._group = group
        self._protocol = protocol
        self._install = install
        self._explicit: dict[str, T] = {}
        self._discovered: dict[str, T] = {}
        self._broken: dict[str, ExtensionLoadError] = {}
        self._is_discovered = False
        # Reentrant: a plugin's module may look up its own point while it is being imported.
        self._lock = threading.RLock()
        # cls -> key of the plugin that handles it (None: nothing does); cleared on any change.
        # A plain dict (strong references to classes, which live long anyway) so that copying
        # the instance's state, as a test harness may, copies the cache along with the layers.
        self._type_cache: dict[type, str | None] = {}

    @property
    def group(self) -> str:
        """The entry-point group, ``shardweave.<point>``."""
        return self._group

    @property
    def protocol(self) -> type:
        """The Protocol every plugin satisfies."""
        return self._protocol

    @property
    def install(self) -> str:
        """The distribution that ships this point's default plugins."""
        return self._install

    def __repr__(self) -> str:
        return (
            f"ExtensionPoint({self._group!r}, {self._protocol.__name__}, install={self._install!r})"
        )

    # --- registration --------------------------------------------------------------------

    def register(self, key: str, impl: T, *, override: bool = False) -> None:
        """Register ``impl`` under ``key``; it wins over a discovered plugin with that key.

        Args:
            key: a name matching ``[A-Za-z0-9_.-]+``.
            impl: the plugin, an object satisfying the point's Protocol.
            override: replace an earlier ``register()`` under ``key`` instead of raising.

        Raises:
            TypeError: ``impl`` does not satisfy the Protocol, or its ``handled_type`` is not
                a class.
            ValueError: ``key`` is malformed; ``key`` was already registered (and not
                ``override``); or ``impl.handled_type`` is already handled by another
                registered key (unregister that one first).
        """
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"{self._group}.register: key {key!r} must match [A-Za-z0-9_.-]+")
        self._check(impl, f"{self._group}.register({key!r})")
        with self._lock:
            if key in self._explicit and not override:
                raise ValueError(
                    f"{self._group}.register: {key!r} is already registered "
                    f"({self._explicit[key]!r}); pass override=True to replace it"
                )
            handled = _handled_type(impl)
            if handled is not None:
                for other, other_impl in self._explicit.items():
                    if other != key and _handled_type(other_impl) is handled:
                        raise ValueError(
                            f"{self._group}.register: type {_type_name(handled)} is already "
                            f"handled by {other!r}; unregister({other!r}) first, or "
                            f"register under {other!r} with override=True"
                        )
            self._explicit[key] = impl
            self._broken.pop(key, None)
            self._type_cache.clear()

    def unregister(self, key: str) -> None:
        """Remove ``key``, whether registered or discovered (a broken plugin included).

        Raises:
            MissingExtensionError: nothing is registered under ``key``.
        """
        with self._lock:
            self._discover()
            found = False
            for layer in (self._explicit, self._discovered, self._broken):
                found = layer.pop(key, None) is not None or found
            if not found:
                raise self._missing(repr(key), None)
            self._type_cache.clear()

    # --- lookup --------------------------------------------------------------------------

    def get(self, key: str, *, what: str | None = None) -> T:
        """The plugin registered under ``key``.

        Args:
            key: the key, e.g. ``"cpu"`` for collectives.
            what: context for the error message, e.g. ``"parameter 'layers.0.w'"``.

        Raises:
            MissingExtensionError: nothing is registered under ``key``.
            ExtensionLoadError: an installed plugin of this point is broken.
        """
        with self._lock:
            self._discover()
            self._raise_if_broken()
            if key in self._explicit:
                return self._explicit[key]
            if key in self._discovered:
                return self._discovered[key]
            raise self._missing(repr(key), what)

    def get_for_type(self, cls: type, *, what: str | None = None) -> T:
        """The plugin whose ``handled_type`` is the most specific class in ``cls.__mro__``.

        A plugin for a base class therefore covers its subclasses, and a plugin for the
        subclass itself wins over it. Results are cached per class until the next
        ``register()`` / ``unregister()``.

        Args:
            cls: the class to handle, e.g. ``type(param)``.
            what: context for the error message, e.g. ``"parameter 'layers.0.w'"``.

        Raises:
            MissingExtensionError: no plugin handles ``cls`` or any of its bases.
            ExtensionLoadError: an installed plugin of this point is broken.
        """
        impl = self.find_for_type(cls)
        if impl is None:
            with self._lock:
                raise self._missing(f"type {_type_name(cls)}", what)
        return impl

    def find_for_type(self, cls: type) -> T | None:
        """Like ``get_for_type`` but returns None when no plugin handles ``cls``.

        Raises:
            ExtensionLoadError: an installed plugin of this point is broken (a broken
                plugin might be the one that handles ``cls``, so this does not return None).
        """
        with self._lock:
            self._discover()
            self._raise_if_broken()
            effective = self._effective()
            key = self._type_cache.get(cls, "")
            if key is not None and key not in effective:  # not cached (or stale)
                key = self._find_key(cls)
                self._type_cache[cls] = key
            return None if key is None else effective[key]

    def registered(self) -> Mapping[str, T]:
        """A read-only copy of every usable plugin by key (discovered and explicit).

        Discovers plugins if that has not happened yet. Broken plugins are not listed (and do
        not raise here); lookups raise for them.
        """
        with self._lock:
            self._discover()
            return MappingProxyType(self._effective())

    # --- test support --------------------------------------------------------------------

    def snapshot(self) -> RegistrySnapshot[T]:
        """Save the point's state; ``restore()`` it, or use it as a context manager.

        Saves whether discovery ran, so a restore can also undo a discovery. Example::

            with POINT.snapshot():
                POINT.register("fake", FakePlugin())
                ...  # POINT is as before once the block exits
        """
        with self._lock:
            state = _State(
                explicit=dict(self._explicit),
                discovered=dict(self._discovered),
                broken=dict(self._broken),
                is_discovered=self._is_discovered,
            )
        return RegistrySnapshot(self, state)

    def restore(self, snapshot: RegistrySnapshot[T]) -> None:
        """Put the point back in the state saved by ``snapshot()``.

        Raises:
            ValueError: the snapshot was taken from another extension point.
        """
        if snapshot._point is not self:
            raise ValueError(f"{self._group}.restore: the snapshot belongs to {snapshot._point!r}")
        state = snapshot._state
        with self._lock:
            self._explicit = dict(state.explicit)
            self._discovered = dict(state.discovered)
            self._broken = dict(state.broken)
            self._is_discovered = state.is_discovered
            self._type_cache.clear()

    # --- internals (call with the lock held) ---------------------------------------------

    def _effective(self) -> dict[str, T]:
        return {**self._discovered, **self._explicit}

    def _find_key(self, cls: type) -> str | None:
        # Explicit entries overwrite discovered ones handling the same type (see Design note:
        # registry layers); register() keeps explicit handled types unique, discovery keeps
        # discovered ones unique.
        by_type: dict[type, str] = {}
        shadowed = self._discovered.keys() & self._explicit.keys()
        for layer in (self._discovered, self._explicit):
            for key, impl in layer.items():
                handled = _handled_type(impl)
                if handled is not None and not (layer is self._discovered and key in shadowed):
                    by_type[handled] = key
        for base in cls.__mro__:
            if base in by_type:
                return by_type[base]
        return None

    def _raise_if_broken(self) -> None:
        for key in sorted(self._broken):
            if key not in self._explicit:
                # A fresh exception per lookup: re-raising the stored one would pile up
                # tracebacks and contexts from every earlier lookup.
                stored = self._broken[key]
                raise ExtensionLoadError(
                    str(stored),
                    group=stored.group,
                    key=stored.key,
                    value=stored.value,
                    distribution=stored.distribution,
                ) from stored.__cause__

    def _check(self, impl: object, where: str) -> None:
        if not isinstance(impl, self._protocol) and not getattr(
            self._protocol, "_is_protocol", False
        ):
            raise TypeError(
                f"{where}: {impl!r} is a {type(impl).__name__}, not a {self._protocol.__name__}"
            )
        if not isinstance(impl, self._protocol):
            missing = [
                name for name in _protocol_members(self._protocol) if not hasattr(impl, name)
            ]
            detail = f"; missing: {', '.join(missing)}" if missing else ""
            raise TypeError(
                f"{where}: {impl!r} does not satisfy the {self._protocol.__name__} protocol{detail}"
            )
        handled = getattr(impl, "handled_type", None)
        if "handled_type" in _protocol_members(self._protocol) and not isinstance(handled, type):
            raise TypeError(f"{where}: {impl!r}.handled_type must be a class, got {handled!r}")

    def _discover(self) -> None:
        if self._is_discovered:
            return
        # Set first: a plugin module that looks this point up while loading sees the plugins
        # loaded so far instead of recursing into discovery.
        self._is_discovered = True
        entry_points = sorted(
            importlib.metadata.entry_points(group=self._group),
            key=lambda ep: (ep.name, _dist_label(ep)),
        )
        owner: dict[str, importlib.metadata.EntryPoint] = {}
        handled_by: dict[type, importlib.metadata.EntryPoint] = {}
        for ep in entry_points:
            if ep.name in self._explicit:
                continue  # an explicit register() already won; do not even import it
            if ep.name in owner:
                first = owner[ep.name]
                self._broken[ep.name] = self._load_error(
                    ep,
                    f"the name {ep.name!r} is also declared by "
                    f"{_dist_label(first) or 'another distribution'} ({first.value}); "
                    "uninstall one of them",
                    None,
                )
                self._discovered.pop(ep.name, None)
                continue
            owner[ep.name] = ep
            try:
                if not _KEY.fullmatch(ep.name):
                    raise ValueError(f"entry-point name {ep.name!r} is not [A-Za-z0-9_.-]+")
                factory = ep.load()
                if not callable(factory):
                    raise TypeError(
                        f"{ep.value} is {factory!r}, not a zero-argument factory (a class "
                        "or function)"
                    )
                impl = factory()
                self._check(impl, f"{self._group} entry point {ep.name!r}")
            # Any failure inside a third-party plugin becomes that plugin's load error.
            except Exception as e:
                self._broken[ep.name] = self._load_error(ep, f"{type(e).__name__}: {e}", e)
                continue
            handled = _handled_type(impl)
            if handled is not None and handled in handled_by:
                first = handled_by[handled]
                self._broken[ep.name] = self._load_error(
                    ep,
                    f"it handles {_type_name(handled)}, which entry point {first.name!r} "
                    f"from {_dist_label(first) or 'another distribution'} already handles; "
                    "uninstall one of them",
                    None,
                )
                continue
            if handled is not None:
                handled_by[handled] = ep
            self._discovered[ep.name] = impl
        self._type_cache.clear()

    def _load_error(
        self,
        ep: importlib.metadata.EntryPoint,
        reason: str,
        cause: BaseException | None,
    ) -> ExtensionLoadError:
        dist = _dist_label(ep)
        source = f"from distribution {dist}" if dist else "from an unknown distribution"
        fix = f"fix or uninstall {dist.split(' ')[0]}" if dist else "fix or uninstall it"
        error = ExtensionLoadError(
            f"{self._group}: plugin {ep.name!r} (entry point '{ep.name} = {ep.value}', "
            f"{source}) is broken: {reason}. To go on, {fix}, or replace it with "
            f"register({ep.name!r}, ...) or drop it with unregister({ep.name!r}) "
            f"on the {self._group} extension point",
            group=self._group,
            key=ep.name,
            value=ep.value,
            distribution=dist,
        )
        error.__cause__ = cause
        return error

    def _missing(self, looked_for: str, what: str | None) -> MissingExtensionError:
        if what:
            looked_for = f"{looked_for} ({what})"
        effective = self._effective()
        entries = []
        for key in sorted(effective):
            handled = _handled_type(effective[key])
            entries.append(key if handled is None else f"{key} (handles {_type_name(handled)})")
        known = ", ".join(entries) or "nothing"
        return MissingExtensionError(
            f"No {self._protocol.__name__} for {looked_for} in extension point "
            f"{self._group!r} (registered: {known}). Install the plugins with "
            f"`pip install {self._install}`, or register one yourself with "
            f"register(key, impl) on the {self._group} extension point",
            group=self._group,
            looked_for=looked_for,
            registered=tuple(sorted(effective)),
            install=self._install,
        )


def _handled_type(impl: object) -> type | None:
    handled = getattr(impl, "handled_type", None)
    return handled if isinstance(handled, type) else None


def _type_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _dist_label(ep: importlib.metadata.EntryPoint) -> str:
    dist = ep.dist
    if dist is None:
        return ""
    return f"{dist.name} {dist.version}"


def _protocol_members(protocol: type) -> list[str]:
    # What a runtime_checkable Protocol's isinstance check looks at: its own annotations and
    # methods, not object's or Protocol's machinery.
    members: set[str] = set()
    for base in protocol.__mro__:
        if base.__module__ in ("typing", "typing_extensions", "builtins"):
            continue
        members.update(getattr(base, "__annotations__", {}))
        members.update(
            name
            for name, value in vars(base).items()
            if callable(value) and not name.startswith("_")
        )
    return sorted(members)
