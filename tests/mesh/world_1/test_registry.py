"""The typed plugin registry: registration, lookup by key and by type, discovery, errors.

Each test builds its own ``ExtensionPoint`` (or snapshots a shared one), so registrations
never leak between tests.
"""

from __future__ import annotations

import importlib.metadata
import pickle
import threading
from collections.abc import Callable, Sequence
from typing import Final, Protocol, runtime_checkable

import pytest
import torch

from shardweave.mesh import (
    ExtensionLoadError,
    ExtensionPoint,
    MissingExtensionError,
)
from shardweave.mesh.extension_points import (
    COLLECTIVES,
    PARAM_KINDS,
    AllGatherExtension,
    Collectives,
    ParamHandler,
    ParamKind,
    StateDictTransform,
)

GROUP: Final = "shardweave.test_point"


@runtime_checkable
class Handler(Protocol):
    handled_type: type

    def describe(self) -> str: ...


class Base:
    pass


class Middle(Base):
    pass


class Leaf(Middle):
    pass


class Other:
    pass


class BaseHandler:
    handled_type: type = Base

    def describe(self) -> str:
        return "base"


class MiddleHandler:
    handled_type: type = Middle

    def describe(self) -> str:
        return "middle"


class NoDescribe:
    handled_type: type = Base


class BadHandledType:
    handled_type = "Base"

    def describe(self) -> str:
        return "bad"


# Factories named by the fake entry points below; count how often discovery loads them.
LOADS: dict[str, int] = {}


class DiscoveredBase(BaseHandler):
    def __init__(self) -> None:
        LOADS["DiscoveredBase"] = LOADS.get("DiscoveredBase", 0) + 1

    def describe(self) -> str:
        return "discovered-base"


class DiscoveredLeaf:
    handled_type: type = Leaf

    def describe(self) -> str:
        return "discovered-leaf"


def failing_factory() -> Handler:
    raise RuntimeError("factory exploded")


def point() -> ExtensionPoint[Handler]:
    return ExtensionPoint(GROUP, Handler, install="shardweave-test-dist")


class FakeEntryPoints:
    """Entry points served for GROUP instead of the installed ones; counts the queries."""

    def __init__(self) -> None:
        self.calls = 0

    eps: list[importlib.metadata.EntryPoint]

    def add(self, name: str, value: str) -> None:
        self.eps.append(importlib.metadata.EntryPoint(name=name, value=value, group=GROUP))


@pytest.fixture
def fake_eps(monkeypatch: pytest.MonkeyPatch) -> FakeEntryPoints:
    fake = FakeEntryPoints()
    fake.eps = []
    real = importlib.metadata.entry_points

    def entry_points(**params: str) -> object:
        if params.get("group") == GROUP:
            fake.calls += 1
            return importlib.metadata.EntryPoints(fake.eps)
        return real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    LOADS.clear()
    return fake


MODULE: Final = __name__


# --- register / get ------------------------------------------------------------------------


def test_register_and_get_by_key(fake_eps: FakeEntryPoints) -> None:
    p = point()
    impl = BaseHandler()
    p.register("base", impl)
    assert p.get("base") is impl
    assert dict(p.registered()) == {"base": impl}


def test_get_for_type_walks_the_mro_most_specific_wins(
    fake_eps: FakeEntryPoints,
) -> None:
    p = point()
    p.register("base", BaseHandler())
    assert p.get_for_type(Leaf).describe() == "base"  # a base's plugin covers subclasses
    p.register("middle", MiddleHandler())  # invalidates the cached answer for Leaf
    assert p.get_for_type(Leaf).describe() == "middle"
    assert p.get_for_type(Middle).describe() == "middle"
    assert p.get_for_type(Base).describe() == "base"
    p.unregister("middle")
    assert p.get_for_type(Leaf).describe() == "base"
    assert p.find_for_type(Other) is None


def test_protocol_is_checked(fake_eps: FakeEntryPoints) -> None:
    p = point()
    with pytest.raises(
        TypeError, match=r"does not satisfy the Handler protocol; missing: describe"
    ):
        p.register("x", NoDescribe())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="handled_type must be a class"):
        p.register("x", BadHandledType())  # type: ignore[arg-type]
    assert dict(p.registered()) == {}


def test_duplicate_key_needs_override(
    fake_eps: FakeEntryPoints,
) -> None:
    p = point()
    p.register("base", BaseHandler())
    with pytest.raises(ValueError, match=r"'base' is already registered.*override=True"):
        p.register("base", BaseHandler())
    replacement = BaseHandler()
    p.register("base", replacement, override=True)
    assert p.get("base") is replacement
    assert p.get_for_type(Base) is replacement


def test_two_explicit_plugins_for_one_type_is_an_error(
    fake_eps: FakeEntryPoints,
) -> None:
    p = point()
    p.register("a", BaseHandler())
    with pytest.raises(ValueError, match=r"already handled by 'a'; unregister\('a'\) first"):
        p.register("b", BaseHandler())


@pytest.mark.parametrize("key", ["", "has space", "a/b", "naïve", "a:b"])
def test_malformed_keys_are_rejected(key: str) -> None:
    with pytest.raises(ValueError, match=r"must match \[A-Za-z0-9_.-\]\+"):
        point().register(key, BaseHandler())


def test_well_formed_keys(fake_eps: FakeEntryPoints) -> None:
    p = point()
    p.register("Float8_v2.0-rc", BaseHandler())
    assert "Float8_v2.0-rc" in p.registered()


def test_unregister_missing_key_raises(
    fake_eps: FakeEntryPoints,
) -> None:
    with pytest.raises(MissingExtensionError, match="'nope'"):
        point().unregister("nope")


def test_point_arguments_are_validated() -> None:
    with pytest.raises(ValueError, match=r"must be 'shardweave\.<point>'"):
        ExtensionPoint("other.group", Handler, install="x")

    class NotRuntime(Protocol):
        def describe(self) -> str: ...

    with pytest.raises(TypeError, match="runtime_checkable"):
        ExtensionPoint(GROUP, NotRuntime, install="x")


# --- missing plugins -----------------------------------------------------------------------


def test_missing_key_message_names_point_key_registered_and_install(
    fake_eps: FakeEntryPoints,
) -> None:
    p = point()
    p.register("middle", MiddleHandler())
    p.register("plain", BaseHandler())
    with pytest.raises(MissingExtensionError) as info:
        p.get("float8", what="parameter 'layers.0.w'")
    error = info.value
    assert isinstance(error, LookupError)
    text = str(error)
    assert GROUP in text
    assert "'float8' (parameter 'layers.0.w')" in text
    assert "registered: middle (handles tests.mesh.world_1.test_registry.Middle), plain" in text
    assert "pip install shardweave-test-dist" in text
    assert error.group == GROUP
    assert error.registered == ("middle", "plain")
    assert error.install == "shardweave-test-dist"


def test_missing_type_message_names_the_type_and_context(
    fake_eps: FakeEntryPoints,
) -> None:
    with pytest.raises(MissingExtensionError) as info:
        point().get_for_type(Leaf, what="parameter 'w'")
    text = str(info.value)
    assert f"type {MODULE}.Leaf (parameter 'w')" in text
    assert "registered: nothing" in text
    assert "pip install shardweave-test-dist" in text


def test_errors_survive_pickling() -> None:
    # Worker processes send errors to the parent; the attributes must come along.
    error = MissingExtensionError(
        "msg", group=GROUP, looked_for="'k'", registered=("a",), install="d"
    )
    copy = pickle.loads(pickle.dumps(error))
    assert (str(copy), copy.group, copy.looked_for, copy.registered, copy.install) == (
        "msg",
        GROUP,
        "'k'",
        ("a",),
        "d",
    )
    load = ExtensionLoadError("m", group=GROUP, key="k", value="m:f", distribution="d 1")
    load_copy = pickle.loads(pickle.dumps(load))
    assert (load_copy.key, load_copy.value, load_copy.distribution) == (
        "k",
        "m:f",
        "d 1",
    )


# --- snapshot / restore --------------------------------------------------------------------


def test_snapshot_context_manager_undoes_registrations(
    fake_eps: FakeEntryPoints,
) -> None:
    p = point()
    kept = BaseHandler()
    p.register("base", kept)
    with p.snapshot():
        p.register("middle", MiddleHandler())
        p.unregister("base")
        assert p.get_for_type(Leaf).describe() == "middle"
    assert dict(p.registered()) == {"base": kept}
    assert p.get_for_type(Leaf) is kept  # the type cache was reset too


def test_snapshot_and_restore(fake_eps: FakeEntryPoints) -> None:
    p = point()
    saved = p.snapshot()
    p.register("base", BaseHandler())
    p.restore(saved)
    assert dict(p.registered()) == {}
    with pytest.raises(ValueError, match="belongs to"):
        point().restore(saved)


def test_snapshot_restores_discovery_state(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("disc", f"{MODULE}:DiscoveredBase")
    p = point()
    with p.snapshot():
        assert p.get("disc").describe() == "discovered-base"
    assert LOADS["DiscoveredBase"] == 1
    p.get("disc")  # discovery had been undone, so it runs again
    assert LOADS["DiscoveredBase"] == 2


def test_shared_points_can_be_snapshotted() -> None:
    with PARAM_KINDS.snapshot():
        demo = ParamKind(torch.Tensor, all_gather=_SampleAllGather())
        PARAM_KINDS.register("test-only", demo, override=True)
        assert PARAM_KINDS.get("test-only") is demo
    assert "test-only" not in PARAM_KINDS.registered()


# --- discovery -----------------------------------------------------------------------------


def test_discovery_is_lazy_and_runs_once(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("disc", f"{MODULE}:DiscoveredBase")
    p = point()
    p.register("middle", MiddleHandler())
    assert fake_eps.calls == 0 and LOADS == {}  # neither construction nor register() discovers
    assert p.get("disc").describe() == "discovered-base"
    assert p.get_for_type(Leaf).describe() == "middle"
    assert p.get_for_type(Base).describe() == "discovered-base"
    p.registered()
    assert fake_eps.calls == 1
    assert LOADS == {"DiscoveredBase": 1}


def test_concurrent_first_lookups_discover_once(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("disc", f"{MODULE}:DiscoveredBase")
    p = point()
    barrier = threading.Barrier(8)
    results: list[str] = []

    def lookup() -> None:
        barrier.wait()
        results.append(p.get_for_type(Leaf).describe())

    threads = [threading.Thread(target=lookup) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["discovered-base"] * 8
    assert fake_eps.calls == 1
    assert LOADS == {"DiscoveredBase": 1}


@pytest.mark.parametrize("register_first", [True, False])
def test_explicit_register_beats_discovery(fake_eps: FakeEntryPoints, register_first: bool) -> None:
    fake_eps.add("base", f"{MODULE}:DiscoveredBase")
    fake_eps.add("leaf", f"{MODULE}:DiscoveredLeaf")
    p = point()
    explicit = BaseHandler()
    if not register_first:
        assert p.get("base").describe() == "discovered-base"
    p.register("base", explicit)  # the same key as a discovered plugin: no override needed
    assert p.get("base") is explicit
    assert p.get_for_type(Middle) is explicit
    assert p.get_for_type(Leaf).describe() == "discovered-leaf"
    # Registered before discovery, the overridden plugin is never even imported.
    assert LOADS.get("DiscoveredBase", 0) == (0 if register_first else 1)


def test_explicit_plugin_under_a_discovered_key_drops_its_type(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("base", f"{MODULE}:DiscoveredBase")
    p = point()
    assert p.get_for_type(Middle).describe() == "discovered-base"
    p.register("base", DiscoveredLeaf())  # same key, another handled type: replaces it whole
    assert p.find_for_type(Middle) is None
    assert p.get_for_type(Leaf).describe() == "discovered-leaf"


def test_explicit_plugin_for_a_discovered_type_wins(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("disc", f"{MODULE}:DiscoveredBase")
    p = point()
    assert p.get_for_type(Base).describe() == "discovered-base"
    p.register("mine", BaseHandler())  # another key, same handled type
    assert p.get_for_type(Base).describe() == "base"
    assert p.get("disc").describe() == "discovered-base"  # still there by key


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (f"{MODULE}:DoesNotExist", "AttributeError"),
        ("no_such_module_for_shardweave:Factory", "ModuleNotFoundError"),
        (f"{MODULE}:failing_factory", "RuntimeError: factory exploded"),
        (
            f"{MODULE}:NoDescribe",
            "does not satisfy the Handler protocol; missing: describe",
        ),
        (f"{MODULE}:GROUP", "not a zero-argument factory"),
    ],
)
def test_broken_plugin_fails_at_lookup_naming_the_entry_point(
    fake_eps: FakeEntryPoints, value: str, reason: str
) -> None:
    fake_eps.add("bad", value)
    fake_eps.add("disc", f"{MODULE}:DiscoveredBase")
    p = point()  # constructing the point (importing its module) does not raise
    lookups: list[Callable[[], object]] = [
        lambda: p.get("disc"),
        lambda: p.get_for_type(Leaf),
        lambda: p.find_for_type(Other),
    ]
    for lookup in lookups:
        with pytest.raises(ExtensionLoadError) as info:
            lookup()
        error = info.value
        assert f"{GROUP}: plugin 'bad' (entry point 'bad = {value}'" in str(error)
        assert reason in str(error)
        assert "register('bad', ...)" in str(error) and "unregister('bad')" in str(error)
        assert (error.group, error.key, error.value) == (GROUP, "bad", value)
    assert "disc" in p.registered()  # listing does not raise; the broken one is not listed
    assert "bad" not in p.registered()
    p.unregister("bad")  # dropping the broken plugin makes the point usable
    assert p.get("disc").describe() == "discovered-base"


def test_broken_plugin_is_replaced_by_explicit_register(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("bad", f"{MODULE}:failing_factory")
    p = point()
    with pytest.raises(ExtensionLoadError):
        p.get_for_type(Base)
    p.register("bad", BaseHandler())
    assert p.get_for_type(Base).describe() == "base"


def test_two_discovered_plugins_for_one_type_is_an_error(
    fake_eps: FakeEntryPoints,
) -> None:
    fake_eps.add("one", f"{MODULE}:DiscoveredBase")
    fake_eps.add("two", f"{MODULE}:DiscoveredBase")
    with pytest.raises(ExtensionLoadError, match=r"which entry point 'one'.*already handles"):
        point().get_for_type(Leaf)


# --- the installed test distribution -------------------------------------------------------


def test_discovers_plugin_from_installed_distribution() -> None:
    """Real entry points of the installed ``shardweave-test-plugin`` distribution."""
    plugin = pytest.importorskip(
        "shardweave_test_plugin",
        reason="install tests/fixtures/shardweave_test_plugin (the nox tests session does)",
    )
    p: ExtensionPoint[ParamKind] = ExtensionPoint(
        "shardweave.param_kinds", ParamKind, install="shardweave-extensions"
    )
    demo = p.get("demo")
    assert demo.handled_type is plugin.DemoTensor
    assert isinstance(demo.all_gather, plugin.DemoAllGather)
    assert demo.handler is None and demo.state_dict is None

    class SubDemo(plugin.DemoTensor):  # type: ignore[misc, name-defined]
        pass

    assert p.get_for_type(SubDemo) is demo
    # The shared point finds it too; the snapshot undoes the discovery afterwards.
    with PARAM_KINDS.snapshot():
        assert isinstance(PARAM_KINDS.get("demo").all_gather, plugin.DemoAllGather)


def test_broken_plugin_from_installed_distribution_names_it() -> None:
    pytest.importorskip(
        "shardweave_test_plugin",
        reason="install tests/fixtures/shardweave_test_plugin (the nox tests session does)",
    )
    p: ExtensionPoint[Handler] = ExtensionPoint(
        "shardweave.test_broken", Handler, install="shardweave-test-plugin"
    )
    with pytest.raises(ExtensionLoadError) as info:
        p.get("anything")
    text = str(info.value)
    assert "entry point 'broken = shardweave_test_plugin:DoesNotExist'" in text
    assert "from distribution shardweave-test-plugin 0.1.0" in text
    assert "fix or uninstall shardweave-test-plugin" in text
    assert info.value.distribution == "shardweave-test-plugin 0.1.0"
    assert isinstance(info.value.__cause__, AttributeError)


# --- the engine's extension points ---------------------------------------------------------


class _SampleParamHandler:
    handled_type: type = torch.Tensor

    def local_tensor(self, param: torch.Tensor) -> torch.Tensor:
        return param

    def sharded_spec(self, param: object, mesh_info: object, shard_dim: int) -> object:
        return None

    def template(self, param: torch.Tensor, mesh_info: object) -> object:
        return None

    def unsharded(self, template: object, local_unsharded: torch.Tensor) -> torch.Tensor:
        return local_unsharded

    def reduce_grad(self, template: object, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def may_reduce_grad_outside_dp(self, template: object) -> bool:
        return False


class _SampleAllGather:
    handled_type: type = torch.Tensor

    def pre_all_gather(
        self, local: torch.Tensor, mesh: object
    ) -> tuple[tuple[torch.Tensor, ...], object]:
        return (local,), None

    def post_all_gather(
        self, outs: Sequence[torch.Tensor], meta: object, dtype: torch.dtype
    ) -> torch.Tensor:
        return outs[0]


class _SampleStateDict:
    handled_type: type = torch.Tensor

    def chunk(self, full: torch.Tensor, mesh: object, placements: object) -> torch.Tensor:
        return full

    def gather(self, sharded: torch.Tensor) -> torch.Tensor:
        return sharded


class _SampleCollectives:
    def all_gather_into_tensor(self, *args: object, **kwargs: object) -> None:
        return None

    def reduce_scatter_tensor(self, *args: object, **kwargs: object) -> None:
        return None

    def all_reduce(self, *args: object, **kwargs: object) -> None:
        return None


class _SampleKind(ParamKind):
    """A kind with all three parts (a subclass only so ``test_engine_points`` can build it)."""

    def __init__(self) -> None:
        super().__init__(
            torch.Tensor,
            handler=_SampleParamHandler(),
            all_gather=_SampleAllGather(),
            state_dict=_SampleStateDict(),
        )


@pytest.mark.parametrize(
    ("ext", "group", "install", "protocol", "sample"),
    [
        (
            PARAM_KINDS,
            "shardweave.param_kinds",
            "shardweave-extensions",
            ParamKind,
            _SampleKind,
        ),
        (
            COLLECTIVES,
            "shardweave.collectives",
            "shardweave-fsdp",
            Collectives,
            _SampleCollectives,
        ),
    ],
)
def test_engine_points(
    ext: ExtensionPoint[object], group: str, install: str, protocol: type, sample: type
) -> None:
    assert (ext.group, ext.install, ext.protocol) == (group, install, protocol)
    assert isinstance(sample(), protocol)
    assert not isinstance(object(), protocol)
    with ext.snapshot():
        ext.register("sample", sample(), override=True)
        assert isinstance(ext.get("sample"), sample)


def test_the_old_per_part_points_are_gone() -> None:
    """One registration per kind: ``PARAM_KINDS`` replaced the three per-part points."""
    import shardweave.mesh.extension_points as points

    for old in ("PARAM_HANDLING", "ALL_GATHER", "STATE_DICT"):
        assert not hasattr(points, old), old
    found = [v for v in vars(points).values() if isinstance(v, ExtensionPoint)]
    assert sorted(p.group for p in found) == ["shardweave.collectives", "shardweave.param_kinds"]


# --- ParamKind: one registration per parameter kind ---------------------------------------


class _Tagged(torch.Tensor):
    pass


class _SubTagged(_Tagged):
    pass


class _TaggedAllGather(_SampleAllGather):
    handled_type: type = _Tagged


def test_param_kind_parts_are_optional() -> None:
    kind = _SampleKind()
    assert isinstance(kind.handler, ParamHandler)
    assert isinstance(kind.all_gather, AllGatherExtension)
    assert isinstance(kind.state_dict, StateDictTransform)
    kind = ParamKind(_Tagged)
    assert (kind.handler, kind.all_gather, kind.state_dict) == (None, None, None)
    with pytest.raises(AttributeError):  # frozen: a registered kind cannot change under the engine
        kind.handler = _SampleParamHandler()  # type: ignore[misc]


def test_param_kind_parts_must_satisfy_their_protocols() -> None:
    with pytest.raises(TypeError, match=r"ParamKind\(_Tagged\)\.handler: .* ParamHandler protocol"):
        ParamKind(_Tagged, handler=_SampleAllGather())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\.all_gather: .* AllGatherExtension protocol"):
        ParamKind(_Tagged, all_gather=_SampleStateDict())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\.state_dict: .* StateDictTransform protocol"):
        ParamKind(_Tagged, state_dict=_SampleAllGather())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="handled_type must be a class"):
        ParamKind("not a class")  # type: ignore[arg-type]


def test_param_kind_part_handles_the_kind_or_a_base() -> None:
    # A part written for a base class (torch.Tensor here, DTensor for a DTensor subclass)
    # serves a kind of a subclass; one for an unrelated or more specific class does not.
    ParamKind(_SubTagged, all_gather=_SampleAllGather())
    ParamKind(_SubTagged, all_gather=_TaggedAllGather())
    with pytest.raises(TypeError, match="handles _Tagged, which is not Tensor or a base of it"):
        ParamKind(torch.Tensor, all_gather=_TaggedAllGather())
    with pytest.raises(TypeError, match="which is not Other or a base of it"):
        ParamKind(Other, all_gather=_TaggedAllGather())


def test_param_kinds_takes_kinds_only() -> None:
    """A bare part (the pre-kind way of registering) is refused, naming what is expected."""
    with (
        PARAM_KINDS.snapshot(),
        pytest.raises(TypeError, match="is a _TaggedAllGather, not a ParamKind"),
    ):
        PARAM_KINDS.register("bare", _TaggedAllGather())  # type: ignore[arg-type]


def test_param_kinds_lookup_follows_the_mro_and_the_most_specific_kind_decides() -> None:
    base = ParamKind(_Tagged, all_gather=_TaggedAllGather())
    sub = ParamKind(_SubTagged, handler=_SampleParamHandler())
    with PARAM_KINDS.snapshot():
        PARAM_KINDS.register("tagged", base)
        assert PARAM_KINDS.find_for_type(_SubTagged) is base  # a base's kind covers subclasses
        PARAM_KINDS.register("sub-tagged", sub)
        assert PARAM_KINDS.find_for_type(_Tagged) is base
        found = PARAM_KINDS.find_for_type(_SubTagged)
        # The subclass's own kind wins whole: no all-gather is borrowed from the base's kind.
        assert found is sub and found.all_gather is None
        assert PARAM_KINDS.find_for_type(torch.Tensor) is None


def test_missing_param_kind_names_the_point_and_the_package() -> None:
    p: ExtensionPoint[ParamKind] = ExtensionPoint(
        "shardweave.param_kinds", ParamKind, install="shardweave-extensions"
    )
    with pytest.raises(MissingExtensionError) as info:
        p.get_for_type(_Tagged, what="parameter 'w'")
    text = str(info.value)
    assert text.startswith("No ParamKind for type ") and "(parameter 'w')" in text
    assert "'shardweave.param_kinds'" in text and "pip install shardweave-extensions" in text
