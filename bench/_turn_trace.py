"""``bench/turns.py --trace``: what the slowest turns were made of, and what overlapped them.

A diagnostic, not a figure: it wraps a few of torpor's internals for the
length of one run (restored afterwards) and records timestamps on one clock
(``time.perf_counter``, the same on every thread):

* every turn: start, end, the event loop thread's CPU time and the process's
  context switches (voluntary and involuntary) during it;
* every group-commit batch: handed to the writer thread, run on it (start,
  end), resolved on the loop; its size;
* every WAL checkpoint, on the checkpointer's thread: start, end, mode, and
  the frames in the WAL / copied; every hold of the writer;
* every fold (compaction) and every model call; every cyclic GC collection.

At one conversation the batches are sequential, so each is assigned to the turn
during which it was handed over. The slowest 1% of turns are then split into
segments (user append, model call, answer append, and the gaps between) next
to the median turn, and counted by what overlapped them.
"""

from __future__ import annotations

import gc
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torpor.actors import turn_loop
from torpor.runtime.stats import percentile
from torpor.store.sqlite import checkpoint as checkpoint_module
from torpor.store.sqlite import writer as writer_module

clock = time.perf_counter


@dataclass
class Batch:
    posted: float
    ops: int = 0
    run_start: float = 0.0
    run_end: float = 0.0
    finished: float = 0.0
    indexed: bool = False  # this commit indexed the full-text backlog in bulk


@dataclass
class Turn:
    start: float
    end: float = 0.0
    cpu: float = 0.0  # the loop thread's CPU seconds
    vcsw: int = 0
    ivcsw: int = 0
    batches: list[Batch] = field(default_factory=list)
    model: list[float] = field(default_factory=list)


class Tracer:
    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.batches: list[Batch] = []
        self.checkpoints: list[tuple[float, float, str, int, int]] = []
        self.checkpoint_cpu: list[float] = []  # the checkpointer thread's CPU seconds, each
        self.holds: list[tuple[str, float]] = []
        self.folds: list[tuple[float, float, bool]] = []
        self.gcs: list[tuple[float, float, int]] = []
        self.models: list[float] = []
        self._undo: list[Callable[[], None]] = []
        self._gc_start = 0.0
        self._open: Turn | None = None
        self._usage: resource.struct_rusage | None = None
        self._cpu0 = 0.0

    # turns, from the benchmark's loop ---------------------------------------------

    def turn_start(self) -> None:
        self._usage = resource.getrusage(resource.RUSAGE_SELF)
        self._cpu0 = time.thread_time()
        self._open = Turn(clock())

    def turn_end(self) -> None:
        turn = self._open
        if turn is None or self._usage is None:
            return
        turn.end = clock()
        turn.cpu = time.thread_time() - self._cpu0
        usage = resource.getrusage(resource.RUSAGE_SELF)
        turn.vcsw = usage.ru_nvcsw - self._usage.ru_nvcsw
        turn.ivcsw = usage.ru_nivcsw - self._usage.ru_nivcsw
        self.turns.append(turn)
        self._open = None

    def model_called(self) -> None:
        self.models.append(clock())

    # installing the probes ----------------------------------------------------------

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def install(self) -> None:
        tracer = self
        writer_cls = writer_module.GroupCommitWriter
        commit, finish, hold, release = (writer_cls._commit, writer_cls._finish,
                                         writer_cls.hold, writer_cls.release)
        run_batch = writer_module.run_batch
        current: list[Batch] = []

        async def traced_commit(self: Any, loop: Any, batch: list[Any]) -> None:
            record = Batch(clock(), len(batch))
            tracer.batches.append(record)
            current.append(record)
            try:
                await commit(self, loop, batch)
            finally:
                current.remove(record)

        def traced_run_batch(*args: Any) -> Any:
            record = current[-1] if current else Batch(0.0)
            backlog = args[2]  # the search backlog: emptied by a batch that indexes it
            waiting = backlog.size[0]
            record.run_start = clock()
            try:
                return run_batch(*args)
            finally:
                record.run_end = clock()
                record.indexed = waiting > 0 and backlog.size[0] == 0

        def traced_finish(self: Any, *args: Any) -> None:
            if current:
                current[-1].finished = clock()
            finish(self, *args)

        def traced_hold(self: Any) -> None:
            tracer.holds.append(("hold", clock()))
            hold(self)

        def traced_release(self: Any) -> None:
            tracer.holds.append(("release", clock()))
            release(self)

        self._patch(writer_cls, "_commit", traced_commit)
        self._patch(writer_cls, "_finish", traced_finish)
        self._patch(writer_cls, "hold", traced_hold)
        self._patch(writer_cls, "release", traced_release)
        self._patch(writer_module, "run_batch", traced_run_batch)

        wal_checkpoint = checkpoint_module._wal_checkpoint

        def traced_checkpoint(conn: Any, mode: str) -> tuple[int, int, int]:
            t0, cpu0 = clock(), time.thread_time()
            result = wal_checkpoint(conn, mode)  # type: ignore[arg-type]
            tracer.checkpoints.append((t0, clock(), mode, result[1], result[2]))
            tracer.checkpoint_cpu.append(time.thread_time() - cpu0)
            return result

        self._patch(checkpoint_module, "_wal_checkpoint", traced_checkpoint)

        fold, build = turn_loop._fold, turn_loop.build_checkpoint
        folded: list[bool] = []

        async def traced_fold(agent: Any, host: Any, plan: Any) -> None:
            t0 = clock()
            folded.clear()
            await fold(agent, host, plan)
            if folded:
                tracer.folds.append((t0, clock(), True))

        def traced_build(*args: Any, **kwargs: Any) -> Any:
            folded.append(True)
            return build(*args, **kwargs)

        self._patch(turn_loop, "_fold", traced_fold)
        self._patch(turn_loop, "build_checkpoint", traced_build)

        def on_gc(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                tracer._gc_start = clock()
            else:
                tracer.gcs.append((tracer._gc_start, clock(), info["generation"]))

        gc.callbacks.append(on_gc)
        self._undo.append(lambda: gc.callbacks.remove(on_gc))

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    # the analysis -------------------------------------------------------------------

    def report(self, share: float = 0.01) -> dict[str, Any]:
        turns = self.turns
        if not turns:
            return {}
        batches = iter(sorted(self.batches, key=lambda b: b.posted))
        models = iter(sorted(self.models))
        _assign(turns, batches, lambda t, b: t.batches.append(b), lambda b: b.posted)
        _assign(turns, models, lambda t, m: t.model.append(m), lambda m: m)
        by_latency = sorted(turns, key=lambda t: t.end - t.start)
        count = max(1, round(len(turns) * share))
        slow = by_latency[-count:]
        threshold = slow[0].end - slow[0].start
        shapes: dict[int, int] = {}
        for t in turns:
            shapes[len(t.batches)] = shapes.get(len(t.batches), 0) + 1
        usual = max(shapes, key=lambda n: shapes[n])

        def segments(t: Turn) -> dict[str, float]:
            out: dict[str, float] = {}
            mark = t.start
            if len(t.batches) != usual:
                out["other_shape"] = t.end - t.start
                return out
            model = t.model[0] if t.model else None
            for i, b in enumerate(t.batches):
                if model is not None and mark <= model <= b.posted:
                    out["to_model"] = model - mark
                    out[f"model_to_b{i}"] = b.posted - model
                    model = None
                else:
                    out[f"b{i}_wait"] = b.posted - mark
                out[f"b{i}_hop"] = b.run_start - b.posted
                out[f"b{i}_run"] = b.run_end - b.run_start
                out[f"b{i}_back"] = b.finished - b.run_end
                mark = b.finished
            out["to_end"] = t.end - mark
            return out

        all_segments = [segments(t) for t in turns]
        slow_segments = [segments(t) for t in slow]
        names = sorted({k for s in all_segments for k in s}, key=_order)

        def median(rows: list[dict[str, float]], key: str) -> float | None:
            values = [r[key] for r in rows if key in r]
            return percentile(values, 50) if values else None

        breakdown = {
            key: {
                "median_turn_us": _us(median(all_segments, key)),
                "slow_turn_median_us": _us(median(slow_segments, key)),
                "slow_turn_max_us": _us(max((r[key] for r in slow_segments if key in r),
                                            default=None)),
            }
            for key in names
        }
        # What overlapped each slow turn.
        counts: dict[str, int] = {}
        rows = []
        for t in slow:
            tags = self._overlaps(t)
            for tag in tags or ["nothing"]:
                counts[tag] = counts.get(tag, 0) + 1
            seg = segments(t)
            worst = max(seg, key=lambda k: seg[k] - (median(all_segments, k) or 0))
            counts[f"worst segment: {worst}"] = counts.get(f"worst segment: {worst}", 0) + 1
            rows.append({
                "at_s": round(t.start - turns[0].start, 3),
                "ms": round((t.end - t.start) * 1000, 3),
                "loop_cpu_ms": round(t.cpu * 1000, 3),
                "ivcsw": t.ivcsw,
                "vcsw": t.vcsw,
                "batches": len(t.batches),
                "worst": worst,
                "worst_us": _us(seg[worst]),
                "overlaps": tags,
            })
        # Every turn by what overlapped it: how many, how many are slow, their latency.
        slow_ids = {id(t) for t in slow}
        groups: dict[str, list[Turn]] = {}
        for t in turns:
            key = " + ".join(tag for tag in self._overlaps(t) if tag != "preempted (ivcsw)")
            groups.setdefault(key or "nothing", []).append(t)
        by_overlap = {
            key: {
                "turns": len(group),
                "slow": sum(1 for t in group if id(t) in slow_ids),
                "p50_ms": _ms(percentile([t.end - t.start for t in group], 50)),
                "p99_ms": _ms(percentile([t.end - t.start for t in group], 99)),
                "loop_cpu_p50_ms": _ms(percentile([t.cpu for t in group], 50)),
            }
            for key, group in sorted(groups.items(), key=lambda kv: -len(kv[1]))
        }
        # Noise control: turns over 2x the median inside checkpoint runs, against the same
        # count in windows as long, 100-200 ms later, that overlap no checkpoint. On a busy
        # machine slow turns happen anyway; the difference is what checkpoints add.
        p50 = percentile([t.end - t.start for t in turns], 50) or 0.0
        spans = [(s_, e_) for s_, e_, *_ in self.checkpoints]

        def over_2x(a: float, b: float) -> int:
            return sum(1 for t in turns
                       if t.start < b and t.end > a and t.end - t.start > 2 * p50)

        inside = sum(over_2x(s_, e_) for s_, e_ in spans)
        control = [over_2x(s_ + d, e_ + d) for s_, e_ in spans for d in (0.1, 0.15, 0.2)
                   if not any(a < e_ + d and b > s_ + d for a, b in spans)]
        cpu_all = percentile([t.cpu for t in turns], 50)
        cpu_slow = percentile([t.cpu for t in slow], 50)
        return {
            "turns": len(turns),
            "slow_turns": count,
            "slow_threshold_ms": round(threshold * 1000, 3),
            "batches_per_turn": shapes,
            "checkpoints": _tally(m for _, _, m, _, _ in self.checkpoints),
            "checkpoint_ms_max": {
                mode: round(max((e - s for s, e, m, _, _ in self.checkpoints if m == mode),
                                default=0.0) * 1000, 3)
                for mode in {m for _, _, m, _, _ in self.checkpoints}
            },
            "checkpoint_ms_median": {
                mode: _ms(percentile([e - s for s, e, m, _, _ in self.checkpoints if m == mode],
                                     50))
                for mode in {m for _, _, m, _, _ in self.checkpoints}
            },
            "checkpoint_ms_total": round(sum(e - s for s, e in spans) * 1000, 1),
            "over_2x_p50_in_checkpoints": inside,
            "over_2x_p50_in_control_windows": (round(sum(control) / len(control) * len(spans), 1)
                                               if control else None),
            "folds": len(self.folds),
            "fold_ms_max": round(max((e - s for s, e, _ in self.folds), default=0.0) * 1000, 3),
            "gc": _tally(f"gen{g}" for _, _, g in self.gcs),
            "loop_cpu_us_median": _us(cpu_all),
            "loop_cpu_us_median_slow": _us(cpu_slow),
            "turns_with_ivcsw": sum(1 for t in turns if t.ivcsw),
            "slow_with_ivcsw": sum(1 for t in slow if t.ivcsw),
            "by_overlap": by_overlap,
            "overlap_counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])),
            "segments": breakdown,
            "slowest": sorted(rows, key=lambda r: -r["ms"])[:25],
        }

    def _overlaps(self, t: Turn) -> list[str]:
        tags = []

        def over(s: float, e: float) -> bool:
            return s < t.end and e > t.start

        for s, e, mode, _, _ in self.checkpoints:
            if over(s, e):
                tags.append(f"checkpoint {mode}")
        held = None
        for what, at in self.holds:
            if what == "hold":
                held = at
            elif held is not None:
                if over(held, at):
                    tags.append("writer held")
                held = None
        for s, e, _ in self.folds:
            if over(s, e):
                tags.append("fold")
        for s, e, g in self.gcs:
            if over(s, e):
                tags.append(f"gc gen{g}")
        if any(b.indexed for b in t.batches):
            tags.append("full-text backlog indexed")
        if t.ivcsw > 2:
            tags.append("preempted (ivcsw)")
        return sorted(set(tags))


def _assign(turns: list[Turn], items: Any, put: Callable[[Turn, Any], None],
            at: Callable[[Any], float]) -> None:
    item = next(items, None)
    for t in turns:
        while item is not None and at(item) < t.start:
            item = next(items, None)
        while item is not None and at(item) <= t.end:
            put(t, item)
            item = next(items, None)


def _order(key: str) -> tuple[int, str]:
    """Segments in the order a turn goes through them."""
    order = ["b0_wait", "b0_hop", "b0_run", "b0_back", "to_model", "model_to_b1", "b1_wait",
             "b1_hop", "b1_run", "b1_back", "b2_wait", "b2_hop", "b2_run", "b2_back", "to_end"]
    return (order.index(key), key) if key in order else (len(order), key)


def _tally(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e6, 1)
