"""DataService: starts (or joins) Ray and launches the Planner (which starts the loaders) and
the Data Constructors.

The Planner and the constructors are named (``planner``, ``constructor/<j>``, see
`runtime.topology`) in the Ray namespace of the config, so trainer processes find them after
``ray.init(address=...)``: the `ServiceHandles` that travel to torchrun ranks carry the address
and the `ServiceTopology`; a process given only the namespace asks the Planner for it. The
loader actors are the Planner's (`runtime.autoscaler`): the offline partition's groups and
shards with ``autoscale.enabled``, else one actor per source; found through it.

Fault tolerance (`FaultToleranceConfig`, on by default): actors are restartable, the Planner
checkpoints every planned step into the checkpoint directory, and with ``shadow_loaders`` a warm
shadow beside every loader actor serves while it is down (`runtime.shadows`). `start` reports
its phases with timings (`progress`), and an elastic resume (``reshard=True``) continues a state
saved under another parallel layout. With ``placement.trainer_nodes`` each Data Constructor runs
on the node of the ranks it serves.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import ray

from megascale_data_ext.dataplane.placetree import ClientPlaceTree
from megascale_data_ext.dataplane.plan_store import PlanStore
from megascale_data_ext.runtime.actor_table import actor_rows, ask_all
from megascale_data_ext.runtime.checkpoints import PlannerCheckpoints
from megascale_data_ext.runtime.config import ServiceConfig
from megascale_data_ext.runtime.fault_tolerance import FaultToleranceConfig
from megascale_data_ext.runtime.handles import ServiceHandles
from megascale_data_ext.runtime.planner import plan_fingerprint
from megascale_data_ext.runtime.embedded_ray import init_ray
from megascale_data_ext.runtime.ray_address import check_reachable
from megascale_data_ext.runtime.ray_actor import Held
from megascale_data_ext.runtime.remote import find_planner
from megascale_data_ext.runtime.topology import ServiceTopology
from megascale_data_ext.runtime.wiring import start_constructors, start_planner


def check_sources(specs: list) -> None:
    """Open every source once in the driver so a bad one fails here, named, before any actor starts.

    Reads only what opening reads (Parquet footers, Megatron index headers); raises the
    source's own SourceError (file, source and what to do) or one listing empty sources.
    """
    from megascale_data_ext.errors import SourceError
    from megascale_data_ext.sources.registry import open_source

    empty = []
    for spec in specs:
        src = open_source(spec)
        try:
            if len(src) == 0:
                empty.append(f"{spec.name!r} ({', '.join(spec.paths)})")
        finally:
            src.close()
    if empty:
        raise SourceError(f"empty sources: {', '.join(empty)}; give them data or remove them from `sources`")


def print_progress(line: str) -> None:
    """Default start-up progress: one line per phase on stderr."""
    print(f"[megascale-data] {line}", file=sys.stderr, flush=True)


def replay_steps(config: ServiceConfig, tree: ClientPlaceTree) -> int | None:
    """How many steps the plans of ``config.replay_dir`` cover, after checking here, before any actor
    starts, that they were made for this config and layout (one named error, not one per actor)."""
    if not config.replay_dir:
        return None
    store = PlanStore(config.replay_dir)
    store.check(plan_fingerprint(config, tree))
    return store.num_steps


class DataService:
    """Owns the actors of one data service; `start()` returns once every actor is ready.

    Ray is started from ``config.ray`` (`RayConfig.init_kwargs`: an embedded local Ray with its
    ``num_cpus`` / ``resources``, or the cluster at ``address``) unless the process already
    joined one.

    Args:
        config: The service config.
        tree: The trainer's parallel layout.
        fault_tolerance: Restart, checkpoint, shadow and injection settings (default:
            ``config.fault_tolerance``, i.e. the ``data.fault_tolerance`` node); under feedback mixing
            its look-ahead is lowered to what can be planned (`FaultToleranceConfig.within_report_delay`).
        progress: Called with one line per start-up phase (None: silent).
    """

    def __init__(self, config: ServiceConfig, tree: ClientPlaceTree, *,
                 fault_tolerance: FaultToleranceConfig | None = None,
                 progress: Callable[[str], None] | None = print_progress):
        self.config = config
        self.topology = replace(ServiceTopology.of(config, tree), replay_steps=replay_steps(config, tree),
                                job=f"{config.ray.namespace}#{uuid.uuid4().hex[:8]}")  # see ServiceTopology.job
        self.tree = self.topology.tree
        delay = self.topology.report_delay
        asked = fault_tolerance or config.fault_tolerance
        self.ft = asked.within_report_delay(delay)  # see its docstring
        self.progress = progress
        if self.ft is not asked and progress is not None:
            ahead = self.ft.client_prefetch
            progress(f"feedback mixing (delay {delay}): clients ask {ahead} step{'s' * (ahead != 1)} "
                     f"ahead, not {asked.client_prefetch} (fault_tolerance.client_prefetch): no step can be planned "
                     "sooner")
        self.partition: Any = None  # the offline partition (``autoscale.enabled``)
        self.planner: Any = None
        self.constructors: list[Any] = []
        self.startup_seconds = 0.0
        self.ray_init_seconds = 0.0
        self.phases: dict[str, float] = {}
        self.checkpoint_dir: str | None = None
        self._owns_ray = False
        self._owns_dir = False
        self._held: list[Any] = []  # large actor arguments by reference (`runtime.ray_actor.Held`)
        self._stopping = threading.Event()
        self._home_watch: threading.Thread | None = None
        self._placement_of_constructors: Any = None  # `runtime.placement.Placement`, with trainer_nodes
        self.asked_at: float | None = None  # perf_counter when the actors were asked for (`launch`, `start*`)
        self.launched_early = False  # `launch` asked for them before `start_in_background` waited
        self._launched_state: dict | None = None

    def _phase(self, name: str, t0: float, detail: str = "") -> None:
        self.phases[name] = time.perf_counter() - t0
        if self.progress is not None:
            self.progress(f"{name} in {self.phases[name]:.2f} s{detail}")

    def _prepare_checkpoint_dir(self) -> str | None:
        if not self.ft.restart:
            return None
        if self.ft.checkpoint_dir is None:
            self.checkpoint_dir, self._owns_dir = tempfile.mkdtemp(prefix="megascale-ft-"), True
        else:
            self.checkpoint_dir = self.ft.checkpoint_dir
        PlannerCheckpoints(self.checkpoint_dir).clear()  # a fresh service never restores another run's states
        return self.checkpoint_dir

    def start(self, *, state: dict | None = None, reshard: bool = False) -> ServiceHandles:
        """Start every actor; `state` (a saved `state_dict`) resumes the planner before prefetch starts.

        Args:
            state: A `state_dict` of a previous run to continue from.
            reshard: Accept a `state` saved under another parallel layout (elastic resume,
                `runtime.elastic`); the trainer resumes at ``state["step"]``.
        """
        self.asked_at = t0 = time.perf_counter()
        self._init_ray()
        return self._start_actors(t0, state, reshard)

    def start_in_background(self, *, state: dict | None = None, reshard: bool = False) -> Future:
        """`start` with the actors started on a thread, so the caller builds its model meanwhile:
        a `Future` of the `ServiceHandles` (its exception is `start`'s). Ray is joined or started
        here, on the calling thread, which must outlive the service (Ray's driver state is
        tied to the thread that ran ``ray.init``). Meanwhile the caller must add no environment
        variable: the thread's C ``getenv`` (pyarrow, Ray) would race the reallocation
        (`trainer.model.settle_model_environ` writes megatron's model-build variables first).
        After `launch`, the thread only waits for what was launched (`state` must be the same)."""
        launched = self.launched_early
        if launched and state != self._launched_state:
            raise ValueError("start_in_background(state=...) after launch(state=...) must pass the same state")
        if not launched:
            self.asked_at = time.perf_counter()
            self._init_ray()
        t0 = self.asked_at
        pool = ThreadPoolExecutor(1, thread_name_prefix="megascale-service-start")
        future = pool.submit(self._start_actors, t0, state, reshard, launched)
        pool.shutdown(wait=False)
        return future

    def launch(self, *, state: dict | None = None) -> None:
        """Join or start Ray, check the sources and ask for every actor, then return without
        waiting for any: they start in their own processes while this one does its own slow
        start-up (a trainer imports torch and megatron-core) with no thread of ours running.
        `start_in_background` (same `state`) then waits for them. Raises what `start` would
        have raised by then; nothing is left running."""
        self.asked_at = t0 = time.perf_counter()
        self.launched_early, self._launched_state = True, state
        self._init_ray()
        try:
            self._launch_actors(t0, state, warm_first=False)
        except Exception:
            self._kill_actors()
            raise

    def _init_ray(self) -> None:
        cfg, t0 = self.config, time.perf_counter()
        if not ray.is_initialized():
            check_reachable(cfg.ray.address)  # a named error in seconds, not ray.init retrying for minutes
            init_ray(cfg.ray, log_to_driver=True)  # embedded: its workers inherit the allocator settings and preloads
            self._owns_ray = True
        self.ray_init_seconds = time.perf_counter() - t0

    def _start_actors(self, t0: float, state: dict | None, reshard: bool, launched: bool = False) -> ServiceHandles:
        try:
            if not launched:
                self._launch_actors(t0, state, warm_first=True)
            self._await_actors(t0, state, reshard)
        except Exception:  # a source that cannot open, a bad resume state: leave nothing running
            self._kill_actors()
            raise
        self.startup_seconds = time.perf_counter() - t0
        if self._placement_of_constructors is not None and self.config.placement.move_back_s > 0 and self.ft.restart:
            self._home_watch = threading.Thread(target=self._watch_homes, args=(self.config.placement.move_back_s,),
                                                daemon=True, name="megascale-home-watch")
            self._home_watch.start()
        return ServiceHandles(
            address=ray.get_runtime_context().gcs_address,
            topology=self.topology,
            ray_env={k: v for k, v in os.environ.items() if k.startswith("RAY_AUTH_")},
        )

    def _launch_actors(self, t0: float, state: dict | None, *, warm_first: bool) -> None:
        """Checks, the loader plan, the Planner (which starts its loaders) and, with nothing to
        restore, the constructors: asked for, not waited for (but with `warm_first` the Planner's
        process is up before the constructors are asked for, so its loaders get Ray's warm workers)."""
        cfg, topo, ft = self.config, self.topology, self.ft
        _check_namespace_free(topo.namespace)
        check_sources(cfg.sources)
        ckpt = self._prepare_checkpoint_dir()
        self._phase("sources checked", t0, f" ({len(cfg.sources)} sources)")
        self._placement_of_constructors = placement = self._placement()
        loader_opts = ft.actor_options(retry_tasks=False)
        if cfg.autoscale.enabled:
            from megascale_data_ext.runtime.autoscale_plan import build_autoscale_plan

            plan, self.partition = build_autoscale_plan(cfg, nodes=self._nodes(), placement=placement,
                                                        progress=self.progress, restart_options=loader_opts)
            self._phase("loaders partitioned", t0, f" ({len(self.config.sources)} sources -> "
                                                   f"{len(plan.actors)} loader actors)")
        else:
            from megascale_data_ext.runtime.autoscale_plan import per_source_plan

            plan = per_source_plan(cfg, loader_opts)
        plan.shadows = ft.shadow_loaders
        # by reference, kept here for as long as the actors may restart (`runtime.ray_actor.Held`)
        self._held = [Held.put(cfg, owner=topo.job), Held.put(plan, owner=topo.job)]
        self.planner = start_planner(self._held[0], topo, self._held[1], ft, ckpt)
        if state is None:  # nothing to restore first: constructor processes start beside the loaders'
            if warm_first:
                ray.get(self.planner.__ray_ready__.remote())  # its loaders asked for first (warm workers)
            self.constructors = start_constructors(cfg, topo, self.planner, ft, start_step=0, placement=placement,
                                                   held_config=self._held[0])

    def _await_actors(self, t0: float, state: dict | None, reshard: bool) -> None:
        """Wait for what `_launch_actors` asked for; restore `state`, then start the constructors."""
        cfg, topo, ft = self.config, self.topology, self.ft
        start_step = 0 if state is None else int(state["step"])
        loaders, shadows = ray.get([self.planner.loader_actors.remote(),  # surfaces source errors now
                                    self.planner.shadow_actors.remote()])
        self._phase("loaders up", t0, f" ({len(loaders)} loader actors" +
                    (f" + {len(shadows)} shadows" if shadows else "") + ", started by the planner)")
        if state is not None:
            ray.get(self.planner.load_state_dict.remote(state, reshard))
        self._phase("planner up", t0, f" (step {start_step}{', resharded' if reshard and state else ''})")
        first_plan = self.planner.plan_summary.remote(start_step)  # planned while the constructors start
        if state is not None:  # after the restore: a constructor asks for plans from its first call
            self.constructors = start_constructors(cfg, topo, self.planner, ft, start_step=start_step,
                                                   placement=self._placement_of_constructors,
                                                   held_config=self._held[0])
        ray.get(first_plan)
        self._phase("first plan", t0)
        ray.get([c.stats.remote() for c in self.constructors])
        self._phase("constructors up", t0, f" ({len(self.constructors)})")

    def _nodes(self) -> Any:
        from megascale_data_ext.runtime.placement import ClusterNodes

        return ClusterNodes.discover(memory_fraction=self.config.autoscale.node_memory_fraction)

    def _placement(self) -> Any:
        """Constructor sidecars on the trainer nodes (``placement.trainer_nodes``), else None."""
        pc = self.config.placement
        if not pc.trainer_nodes:
            return None
        from megascale_data_ext.runtime.placement import Placement

        return Placement(self._nodes(), pc.trainer_nodes, pc.ranks_per_node, soft=pc.soft)

    def loader_actors(self) -> list[Any]:
        """The live loader actors (the Planner's: one per source, or its groups and shards now)."""
        return ray.get(self.planner.loader_actors.remote()) if self.planner is not None else []

    def shadow_actors(self) -> list[Any]:
        """The shadow of each live loader actor, in `loader_actors` order (``shadow_loaders``)."""
        return ray.get(self.planner.shadow_actors.remote()) if self.planner is not None else []

    def plan_summary(self, step: int) -> dict:
        return ray.get(self.planner.plan_summary.remote(step))

    def state_dict(self, step: int | None = None) -> dict:
        """The Planner's state before `step` (default: its next unplanned step)."""
        return ray.get(self.planner.state_dict.remote(step))

    def load_state_dict(self, state: dict, *, reshard: bool = False) -> None:
        ray.get(self.planner.load_state_dict.remote(state, reshard))

    def _ask(self, handles: list[Any], method: str) -> list[Any]:
        """Call `method` on every actor, waiting out those Ray is restarting (fault tolerance);
        None for an actor that is dead for good (no restarts)."""
        return ask_all(handles, method, timeout_s=self.ft.recovery_timeout_s)

    def _actor_rows(self, timeout_s: float | None = None) -> list[tuple[dict[str, Any], Any]]:
        return actor_rows(self.planner, self.constructors, self.topology,
                          timeout_s=self.ft.recovery_timeout_s if timeout_s is None else timeout_s)

    def actors(self) -> list[dict[str, Any]]:
        """Every actor of the service (`runtime.actor_table.ActorRow`): role, state, pid, node, home,
        what it serves, restarts and actor id (stable across restarts), read from Ray's control
        store (it answers while an actor restarts)."""
        return [row for row, _ in self._actor_rows()]

    def move_home(self) -> list[str]:
        """Restart the actors running off a home node that is alive again (`placement.away_from_home`):
        Ray schedules each restart at its home. Returns the roles moved. A move is a restart, which
        the service survives like any other (nothing lost); without restarts it moves nothing."""
        return self._move(self._away()) if self.ft.restart else []

    def _move(self, away: dict[str, tuple[dict[str, Any], Any]], only: set[str] | None = None) -> list[str]:
        moved = []
        for actor_id, (row, handle) in away.items():
            if only is None or actor_id in only:
                ray.kill(handle, no_restart=False)
                moved.append(row["role"])
        if moved and self.progress is not None:
            self.progress(f"moved {len(moved)} actors back to their home nodes: {', '.join(moved)}")
        return moved

    def _away(self, timeout_s: float | None = None) -> dict[str, tuple[dict[str, Any], Any]]:
        from megascale_data_ext.runtime.placement import ClusterNodes, away_from_home

        placed = self._actor_rows(timeout_s)
        away = {row["actor_id"] for row in away_from_home([row for row, _ in placed], ClusterNodes.discover())}
        return {row["actor_id"]: (row, handle) for row, handle in placed if row["actor_id"] in away}

    def _watch_homes(self, every_s: float) -> None:
        """Every `every_s`, move home the actors seen away on two checks in a row (a node that just
        returned settles first). Runs in `_home_watch`; stopped by `stop()` before Ray is. A check
        waits at most `every_s` (≤ 5 s) for a restarting actor, so a stop is never held up longer."""
        seen: set[str] = set()
        while not self._stopping.wait(every_s):
            try:
                away = self._away(min(every_s, 5.0))
                due = set(away) & seen
                if due and self.ft.restart and not self._stopping.is_set():
                    self._move(away, due)
                seen = set(away) - seen
            except Exception:  # noqa: BLE001 - an actor restarting or a node leaving: ask again next time
                seen = set()

    def stats(self) -> dict:
        return {
            "loaders": self._ask(self.loader_actors(), "stats"),
            "shadows": self._ask(self.shadow_actors(), "stats"),
            "planner": self._ask([self.planner], "stats")[0],
            "constructors": self._ask(self.constructors, "stats"),
            "startup_seconds": self.startup_seconds,
            "phases": dict(self.phases),
        }

    def ray_calls(self) -> dict[str, int]:
        """The Ray calls the actors made to each other so far, by kind (`runtime.calls`), summed over
        the Planner, the live loaders (reclaimed ones' calls are gone with them) and the constructors."""
        from megascale_data_ext.runtime.calls import sum_calls

        actors = self.loader_actors() + self.shadow_actors() + [self.planner] + self.constructors
        return sum_calls(s.get("ray_calls") if s is not None else None for s in self._ask(actors, "stats"))

    def memory(self) -> dict[str, int]:
        """Resident bytes of the live primary loaders and of the shadows (the shadows' memory cost)."""
        return {"loaders_rss": sum(filter(None, self._ask(self.loader_actors(), "rss_bytes"))),
                "shadows_rss": sum(filter(None, self._ask(self.shadow_actors(), "rss_bytes")))}

    def _kill_actors(self) -> None:
        loaders: list[Any] = []
        if self.planner is not None:
            try:
                loaders = ray.get([self.planner.loader_actors.remote(), self.planner.shadow_actors.remote()],
                                  timeout=10)
                loaders = loaders[0] + loaders[1]
            except Exception:  # a planner that failed to start: its loaders died with it
                loaders = []
        for h in self.constructors + loaders:
            ray.kill(h, no_restart=True)
        # the loaders gone before the Planner: a loader's read-ahead still asking the Planner for plans
        # would otherwise log a retried task (`PlannerActor.loader_plans_ahead failed`) at every stop
        ray.wait([h.ready.remote() for h in loaders], num_returns=len(loaders), timeout=5.0)
        if self.planner is not None:
            ray.kill(self.planner, no_restart=True)
        if self._held:  # after the actors that could restart from them: ours and the Planner's
            Held.release_all(self.topology.job)
        self.constructors, self.planner, self._held = [], None, []

    def stop(self) -> None:
        self._stopping.set()
        if self._home_watch is not None:  # out of its Ray calls before the actors (and Ray) go
            self._home_watch.join()
            self._home_watch = None
        self._kill_actors()
        if self._owns_dir and self.checkpoint_dir is not None:
            shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
            self._owns_dir = False
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _check_namespace_free(namespace: str) -> None:
    """Refuse to start a second service in a namespace one already runs in (its actor names
    would collide), naming the key and the job holding it."""
    from megascale_data_ext.errors import ConfigError

    try:
        other = find_planner(namespace)
    except ValueError:  # no such actor: the namespace is free
        return
    try:
        job = ray.get(other.topology.remote(), timeout=10).job or "unnamed"
    except Exception:  # noqa: BLE001 - restarting or wedged: still holds the names
        job = "unknown (its planner does not answer)"
    raise ConfigError(f"`data.ray.namespace` {namespace!r} is in use by the running data service {job!r}: "
                      "give each job on a shared Ray cluster its own namespace, or stop that service first")
