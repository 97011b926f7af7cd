"""torchft 0.2.0 on FSDP2: two replica groups survive the loss of one and take it back.

torchtitan's recipe for FSDP2 with torchft (``torchtitan/components/ft``), on gloo: each replica
group runs ``fully_shard`` over its own ranks and trains through a ``torchft.Manager``; the
manager's process group (``ManagedProcessGroup``) averages the gradient shards across the
groups from every ``FSDPModule``'s ``set_all_reduce_hook``; ``torchft.Optimizer`` starts each
step's quorum and steps only when the step commits; what a recovering group receives is the
model's and optimizer's state dicts (``get_model_state_dict`` / ``get_optimizer_state_dict``,
taken once and served by reference, as torchtitan caches them), sent by torchft's default
checkpoint transport (``HTTPTransport``, which pickles the sharded tensors). The replica side is
``tests/integration/_torchft_replica.py``.

The scenario, the same for both engines and deterministic to the step (STEPS = 8):

* steps 0 .. KILL_AT - 1 (0-2): both groups, whose initial weights differ; at step 0 they
  agree through the checkpoint transfer (``init_sync``: for each group rank torchft names one
  group the source, here group 0 for rank 0 and group 1 for rank 1);
* after committing step KILL_AT - 1 every rank of group 1 kills itself (SIGKILL); group 0's
  next quorum forms without it once the lighthouse stops hearing its heartbeats, and group 0
  trains on alone (steps 3-4);
* at step REJOIN_AT (5) a fresh group 1 (new processes, a new manager, other initial weights)
  joins: it recovers group 0's model and optimizer through the checkpoint transfer, and both
  groups train to the end (steps 5-7).

No quorum depends on the order in which requests arrive: the lighthouse forms one as soon as
every heartbeating replica asks for it, or, with a member of the last quorum missing, once that
member's heartbeats time out (``quorum_compute`` in torchft's lighthouse; ``min_replicas=1``).
So the groups ask for their first quorum only once the lighthouse hears both managers, and group
0 asks for the rejoin step's only once the new group's request has reached the lighthouse (the
harness reads both from the lighthouse's ``/status`` page). What is left to timing: a live
manager's heartbeats (every 100 ms, from a Rust thread) must not stop for HEARTBEAT_TIMEOUT_MS.

Oracle: *compatibility*. The scenario runs with torch's ``fully_shard`` and with ours; every
step of every rank of every group (the manager's step, the quorum's size, whether the group took
part, the loss, a digest of the parameter shards after the step) is bitwise equal between the
engines. The reference run is checked against torchft's semantics too: the quorum sizes above,
each group's shards bitwise equal to group 0's after every step they share (so both transfers
happened), every step committed.

Each replica group is GROUP_SIZE (2) processes, forked from a forkserver that imported torch,
torchft and both engines once; the lighthouse and the stores live in the test process, on free
ports; every process is killed in teardown, and the forkserver stopped. The module skips where torchft is not installed
(``nox -s integration`` pins it, noxfile.py).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from typing import Final

import pytest
import torch.distributed as dist

pytest.importorskip(
    "torchft", reason="torchft is not installed (nox -s integration installs the pinned release)"
)

# imports torchft, so after the skip
from tests.integration import _torchft_replica as replica

ENGINE_NAMES: Final = ("torch", "shardweave")
# The lighthouse drops a replica this long after its last heartbeat (the managers beat every
# 100 ms, from a Rust thread the GIL does not hold up): what the kill costs in wall time.
HEARTBEAT_TIMEOUT_MS: Final = 2000
# Everything one engine's run may take, from forking the processes to their last step.
DEADLINE_S: Final = 120.0
_STATUS = re.compile(r"\[(\d+)/(\d+) participants healthy\]\[(\d+) heartbeating\]")
Records = dict[str, list[dict[str, object]]]
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class _Scenario:
    """One engine's run: its lighthouse, its stores, its processes and the steps they took."""

    def __init__(self, engine: str, ctx: multiprocessing.context.ForkServerContext) -> None:
        from torchft._torchft import LighthouseServer

        self.engine = engine
        self._ctx = ctx
        self._procs: dict[str, BaseProcess] = {}
        self._deadline = time.monotonic() + DEADLINE_S
        self._lighthouse = LighthouseServer(
            bind="[::]:0", min_replicas=1, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS
        )
        port = int(self._lighthouse.address().rsplit(":", 1)[1])
        self._lighthouse_addr = f"http://127.0.0.1:{port}"
        self._control = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        # one store per incarnation: a restarted group must not find its predecessor's keys
        self._stores = {
            inc: dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            for inc, _, _ in replica.INCARNATIONS
        }

    def run(self) -> Records:
        # the new group 1 too, now: it waits for start/g1b before it makes its manager
        for inc, group, seed in replica.INCARNATIONS:
            for rank in range(replica.GROUP_SIZE):
                role = replica.Role(
                    self.engine, inc, group, rank, seed, self._control.port,
                    self._stores[inc].port, self._lighthouse_addr,
                )  # fmt: skip
                proc = self._ctx.Process(target=replica.replica_main, args=(role,), daemon=True)
                proc.start()
                self._procs[role.name] = proc
        g0, g1 = ([f"{inc}/r{r}" for r in range(replica.GROUP_SIZE)] for inc in ("g0", "g1"))
        # The first quorum: both groups' managers heartbeating, no group asking yet.
        self._wait(lambda: all(self._control.check([f"ready/{n}"]) for n in g0 + g1), "ready")
        self._wait(lambda: self._lighthouse_counts() == (0, 2), "both groups heartbeating")
        self._control.set("go/start", "1")
        # The kill: group 1's ranks kill themselves after step KILL_AT - 1.
        self._wait(lambda: all(not self._procs[n].is_alive() for n in g1), "group 1's death")
        for name in g1:
            if self._procs[name].exitcode != -signal.SIGKILL:
                raise AssertionError(
                    f"{self.engine}: {name} did not die as planned\n{self._report()}"
                )
        # The rejoin: group 0 waits at step REJOIN_AT until the new group's request for the
        # quorum has reached the lighthouse (one group asking, two heartbeating).
        self._wait(lambda: all(self._control.check([f"gate/{n}"]) for n in g0), "the rejoin gate")
        self._control.set("start/g1b", "1")
        self._wait(lambda: self._lighthouse_counts() == (1, 2), "the new group's request")
        self._control.set("go/rejoin", "1")
        rest = [name for name in self._procs if name not in g1]
        self._wait(lambda: all(not self._procs[n].is_alive() for n in rest), "the last step")
        for name in rest:
            if self._procs[name].exitcode != 0:
                raise AssertionError(f"{self.engine}: {name} failed\n{self._report()}")
        return {name: json.loads(self._control.get(f"records/{name}")) for name in self._procs}

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self._procs.values():
            proc.join(timeout=30)
        self._lighthouse.shutdown()

    def _lighthouse_counts(self) -> tuple[int, int]:
        """(replica groups asking for the next quorum, replica groups heartbeating)."""
        with _NO_PROXY.open(f"{self._lighthouse_addr}/status", timeout=10) as page:
            text = page.read().decode()
        match = _STATUS.search(text)
        if match is None:
            raise AssertionError(f"torchft's lighthouse /status has a new format: {text!r}")
        return int(match.group(1)), int(match.group(3))

    def _report(self) -> str:
        """Every process's exit code, the error it raised and the errors torchft logged."""
        lines = []
        for name, proc in self._procs.items():
            lines.append(f"--- {name}: exit code {proc.exitcode}")
            for key in (f"error/{name}", f"logged/{name}"):
                if self._control.check([key]):
                    lines.append(self._control.get(key).decode().rstrip())
        return "\n".join(lines)

    def _wait(self, done: Callable[[], bool], what: str) -> None:
        while not done():
            failed = any(
                self._control.check([f"error/{name}"])
                or (not proc.is_alive() and proc.exitcode not in (0, -signal.SIGKILL))
                for name, proc in self._procs.items()
            )
            if failed or time.monotonic() > self._deadline:
                why = "a process failed" if failed else f"over {DEADLINE_S} s"
                raise AssertionError(f"{self.engine}, waiting for {what}: {why}\n{self._report()}")
            time.sleep(0.02)


@pytest.fixture
def scenarios(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, _Scenario]]:
    # torchft's Rust side (lighthouse, managers) logs every quorum at INFO; warnings suffice
    monkeypatch.setenv("RUST_LOG", "warn")
    # every address here is local; torchft's checkpoint transport reads a proxy from the env
    monkeypatch.setenv("no_proxy", "*")
    # Forking every rank from one process that imported torch, torchft and both engines saves
    # each rank seconds of imports; fork from the test process itself is unsafe (its lighthouse
    # and stores run threads). The forkserver is stopped at the end, with its children gone.
    ctx = multiprocessing.get_context("forkserver")
    # (dynamo: fully_shard imports it at its first call, a second or more per process)
    ctx.set_forkserver_preload([replica.__name__, "torch._dynamo"])
    made: dict[str, _Scenario] = {}
    try:
        for engine in ENGINE_NAMES:
            made[engine] = _Scenario(engine, ctx)
        yield made
    finally:
        for scenario in made.values():
            scenario.close()
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]  # private


def _check_torchft_semantics(records: Records) -> None:
    """The scenario happened as designed; checked on the reference run (torch's engine)."""
    steps, kill, rejoin = replica.STEPS, replica.KILL_AT, replica.REJOIN_AT
    for rank in range(replica.GROUP_SIZE):
        g0, g1, g1b = (records[f"{inc}/r{rank}"] for inc in ("g0", "g1", "g1b"))
        assert [r["step"] for r in g0] == list(range(steps))
        # (a recovering group does not count: torchft averages over the groups at max step)
        sizes = [2] * kill + [1] * (rejoin - kill + 1) + [2] * (steps - rejoin - 1)
        assert [r["participants"] for r in g0] == sizes, "quorum sizes"
        assert [r["step"] for r in g1] == list(range(kill))
        # init_sync: at step 0, rank r of every group takes the shards of group r % 2 (torchft's
        # primary for group rank r among the groups at the top step, by replica id) and that
        # group alone takes part; the other recovers
        source = (g0, g1)[rank % 2]
        for group in (g0, g1):
            taking_part = [group is source] + [True] * (kill - 1)
            assert [r["participating"] for r in group[:kill]] == taking_part, "init_sync"
        # the new group is at step 0 until it recovers, at its first commit
        assert [r["step"] for r in g1b] == [0, *range(rejoin + 1, steps)], "recovery"
        assert g1b[0]["committed"] == rejoin + 1, "recovery"
        assert [r["participating"] for r in g1b] == [False] + [True] * (steps - rejoin - 1)
        shards = {r["step"]: r["params"] for r in g0}
        for name, group in ((f"g1/r{rank}", g1), (f"g1b/r{rank}", g1b)):
            for r in group:
                step = rejoin if r["step"] == 0 and group is g1b else r["step"]
                assert r["params"] == shards[step], f"{name}, step {step}: shards differ from g0's"


def test_kill_and_rejoin(scenarios: dict[str, _Scenario]) -> None:
    """Oracle: compatibility (every step of every rank bitwise equal to torch's engine), and
    torchft's own semantics on the reference run (see the module docstring)."""
    results: dict[str, Records] = {}
    errors: dict[str, BaseException] = {}

    def run(engine: str) -> None:
        try:
            results[engine] = scenarios[engine].run()
        except BaseException as e:
            errors[engine] = e

    # both engines' runs at once: much of a run is waiting (for heartbeats, gates, peers)
    threads = [threading.Thread(target=run, args=(engine,)) for engine in ENGINE_NAMES]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if "torch" in errors:
        raise errors["torch"]
    _check_torchft_semantics(results["torch"])
    if "shardweave" in errors:
        raise errors["shardweave"]
    ours, theirs = results["shardweave"], results["torch"]
    assert list(ours) == list(theirs)
    for name, records in theirs.items():
        for mine, ref in zip(ours[name], records, strict=True):
            assert mine == ref, f"{name}, step {ref['step']}: {mine} != torch's {ref}"
