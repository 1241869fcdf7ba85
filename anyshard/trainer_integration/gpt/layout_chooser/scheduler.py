"""The layout scheduler: which layout the running job should train under, and which data share
each data-parallel rank should take, from the cost model and the steps the job measures.

The training loop asks `Scheduler.decide` one question before every step and carries out the
answer: **keep** the layout, **trial** a candidate or **switch** to one (both through the live
relayout path, `train.relayout`: training steps go on, nothing is written or read), or
**rebalance** the data-parallel shares. After every step it reports what the step cost
(`Scheduler.observe`: the slowest rank's wall time, and each rank's own work and data rank: its
step less its waits for the others in collectives, `waits`, measured alike whatever makes a rank
slow).

The plan, with ``parallel.auto`` = ``start`` or ``online``:

1. measure the running layout for `Policy.trial_steps` steps (the first step under a layout warms
   it up and is not counted);
2. trial the top `Policy.trials` layouts the cost model, refined by what was measured so far,
   predicts faster than the running one by `Policy.min_gain`, while the saving it predicts over
   the steps left pays the switch;
3. settle on the fastest measured layout, switching only when the saving per step times the
   steps left exceeds the measured switch cost by `Policy.margin` (and the saving is at least
   `Policy.min_gain` of a step: a layout never flips back and forth on noise);
4. ``online`` only: every `Policy.window` steps compare the median step with the settled one;
   a drift of `Policy.drift` in two windows in a row re-plans (the old measurements describe
   another machine state and are dropped); and over the last two windows, the data ranks' own
   work calls for new shares of the same global batch when moving straight to the balance of
   what each rank was measured to do (`balance.propose`) saves the busiest rank more than
   `Policy.imbalance` of its work and more than `Policy.z` standard errors of the noise the
   steps themselves show. The next window judges the move: shares that made the busiest rank's
   own work longer beyond the measured noise go back (`balance.worse`). Once the slow rank's
   cause goes away, the ranks with the larger shares are the busier ones, and the shares go
   straight back to even (`balance.back_to_even`), judged the same way.

Every decision is identical on every rank: the inputs are the same gathered figures.

    >>> from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
    >>> from anyshard.trainer_integration.planning.step_cost import Rates
    >>> cfg = Config()
    >>> s = Scheduler(cfg, ParallelConfig(tp=2), Rates.nominal(), total_steps=100)
    >>> s.decide(0).action
    'keep'
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
from anyshard.trainer_integration.gpt.layout_chooser.balance import propose, worse
from anyshard.trainer_integration.gpt.layout_chooser.candidates import Choice, layout_text
from anyshard.trainer_integration.gpt.layout_chooser.costmodel import Refiner, predict, rank_layouts
from anyshard.trainer_integration.gpt.layout_chooser.memory import switch_memory
from anyshard.trainer_integration.gpt.layout_chooser.shares import shares_for, shares_move
from anyshard.trainer_integration.planning.step_cost import Rates, Table
from anyshard.trainer_integration.planning.topology import Topology

__all__ = ["Decision", "Policy", "Scheduler", "first_layout", "shares_for"]


def first_layout(
    cfg: Config,
    world: int,
    rates: Rates,
    *,
    memory_bytes: int | None = None,
    topology: Topology | None = None,
) -> Choice:
    """The layout a job starts under on ``world`` ranks when its configured degrees do not
    multiply to it: the one the cost model predicts fastest on ``topology``'s nodes (trials
    follow)."""
    table = rank_layouts(cfg, world, rates, memory_bytes=memory_bytes, topology=topology)
    if not table.rows:
        raise ValueError(
            f"no layout of {world} ranks fits the model and batch:\n  "
            + "\n  ".join(f"{name}: {why}" for name, why in table.rejected[:8])
        )
    best = table.rows[0]
    want = cfg.parallel
    reasons = (
        f"the configured layout {layout_text(want)} needs {want.world_size} ranks, {world} run",
        f"the cost model predicts {best.layout} fastest of {len(table.rows)} "
        f"({best.step_s * 1e3:.1f} ms a step, {best.dominant})",
    )
    return Choice(best.parallel, reasons, best.memory_bytes)


@dataclass(frozen=True)
class Policy:
    """The scheduler's settings (``parallel.auto_*`` in the trainer's config)."""

    trials: int = 2  # candidates trialled besides the running layout (K)
    trial_steps: int = 3  # steps measured per layout; the first step after a switch is extra
    margin: float = 0.25  # a switch must pay back its measured cost x (1 + margin)
    min_gain: float = 0.05  # and save at least this fraction of a step (hysteresis)
    drift: float = 0.25  # online: re-plan when the median step drifts this much
    window: int = 5  # online: steps per drift and balance check
    # online, data shares: a move must save at least this share of the busiest data rank's own
    # work per step, and more than `z` standard errors of the steps' measured noise
    imbalance: float = 0.10
    # new shares go back where the busiest rank's work grew by more than this and the noise
    noise: float = 0.03
    z: float = 3.0  # standard errors a measured difference must exceed to be acted on


@dataclass(frozen=True)
class Decision:
    """What the loop does before a step: keep, trial, switch or rebalance."""

    action: str
    parallel: ParallelConfig | None = None
    shares: tuple[int, ...] | None = None
    reason: str = ""
    slow: int | None = None  # a rebalance: the data rank it found busiest per sample

    def event(self, step: int) -> dict:
        """The decision as an events.jsonl record."""
        out: dict = {"event": f"auto_{self.action}", "step": step, "reason": self.reason}
        if self.parallel is not None:
            out["to"] = layout_text(self.parallel)
        if self.shares is not None:
            out["shares"] = list(self.shares)
        return out


@dataclass
class _Layout:
    parallel: ParallelConfig
    steps: list[float] = field(default_factory=list)  # measured, warm-up step left out
    warm: bool = False

    @property
    def median(self) -> float:
        return statistics.median(self.steps)


@dataclass
class _Measured:
    """What the job has measured: each layout's steps, the switches' costs, the model refined by
    the steps, and the straggler seen at the last re-plan."""

    refiner: Refiner
    layouts: dict[str, _Layout] = field(default_factory=dict)
    switch_costs: list[float] = field(default_factory=list)
    known: dict[str, float] = field(default_factory=dict)  # median steps before a straggler
    slow: float = 1.0  # the straggler's slowdown (1: none)


@dataclass
class _Phase:
    """Where the plan stands: measure -> trial -> settled (-> trial after a drift), and the
    layouts trialled since the last re-plan."""

    name: str = "measure"
    trialled: set[str] = field(default_factory=set)
    out_of_reach: set[str] = field(default_factory=set)  # predicted faster, no switch there fits


@dataclass
class _Window:
    """Online: the steps since the last check, and the settled reference they are checked
    against."""

    recent: list[float] = field(default_factory=list)  # steps since the last check
    busy: list[tuple[float, ...]] = field(default_factory=list)  # per data rank, since then
    skews: list[float] = field(default_factory=list)  # busiest rank over the median rank, per step
    reference: float | None = None  # the settled median step
    skew_ref: float | None = None  # the skews' median when the reference was taken
    drifted: int = 0  # windows in a row whose median drifted from the reference


@dataclass
class _Shares:
    """The data-parallel shares (None: even) and, online, what was measured under them."""

    current: tuple[int, ...] | None = None
    # each data rank's own work per step since the shares were set (the last two windows)
    steps: list[tuple[float, ...]] = field(default_factory=list)
    # after a move, until the next window judges it: the shares before it and their steps
    judging: tuple[tuple[int, ...] | None, list[tuple[float, ...]]] | None = None
    # the shares before the last move that stayed and their median own work (the lines'
    # second point, `balance.fit`)
    before: tuple[list[float], tuple[int, ...]] | None = None
    moved_off: int | None = None  # the data rank the last move took samples from
    promised: float = 0.0  # and the saving it predicted
    # after a move went back: its data rank and predicted saving (a like move must beat it)
    blocked: tuple[int | None, float] | None = None


class Scheduler:
    """Decides, before each step, whether the job keeps its layout, trials or switches to another,
    or rebalances its data shares (see the module's description)."""

    def __init__(
        self,
        cfg: Config,
        current: ParallelConfig,
        rates: Rates,
        *,
        total_steps: int,
        online: bool = False,
        policy: Policy | None = None,
        memory_bytes: int | None = None,
        topology: tuple[Topology, str] | None = None,
    ):
        """``topology``: the job's nodes and how they were found (`cluster.job_topology`, read
        once from the process groups at start-up); None: one node."""
        self.cfg = cfg
        self.rates = rates
        self.topology: Topology | None = topology[0] if topology else None
        source = topology[1] if topology else ""
        self.policy = policy or Policy()
        self.online = online
        self.total_steps = total_steps
        world = current.world_size
        self.table: Table = rank_layouts(
            cfg,
            world,
            rates,
            memory_bytes=memory_bytes,
            topology=self.topology,
            topology_source=source,
        )
        self.current = self._plain(current)
        self.measured = _Measured(Refiner(cfg, rates, self.topology))
        self.phase = _Phase()
        self.window = _Window()  # online
        self.share = _Shares()
        self.decisions: list[dict] = []

    @property
    def shares(self) -> tuple[int, ...] | None:
        """The data-parallel shares the loop carries out (None: even)."""
        return self.share.current

    @property
    def slow(self) -> float:
        """The straggler's slowdown seen at the last re-plan (1: none)."""
        return self.measured.slow

    @slow.setter
    def slow(self, value: float) -> None:
        self.measured.slow = value

    @staticmethod
    def _plain(p: ParallelConfig) -> ParallelConfig:
        return dataclasses.replace(p, relayout_at=None)

    def _entry(self, p: ParallelConfig) -> _Layout:
        return self.measured.layouts.setdefault(layout_text(p), _Layout(self._plain(p)))

    @property
    def switch_s(self) -> float:
        """The switch cost: the median measured one; before any, two predicted steps (a switch
        rebuilds the model and moves its whole state once, parameters, gradients and optimizer
        state: about what one step's collectives move under FSDP, on the same links)."""
        if self.measured.switch_costs:
            return statistics.median(self.measured.switch_costs)
        scales = self.measured.refiner.scales()
        return 2 * predict(self.cfg, self.current, self.rates, scales, self.topology).step_s

    def predicted(self, p: ParallelConfig) -> float:
        """``p``'s step, refined by the steps measured so far, under the straggler seen (if
        any): a layout whose data shares can move spreads the slow rank's lost speed over all
        data ranks, any other runs at the slow rank's pace."""
        known = self.measured.known.get(layout_text(p))  # measured before the straggler appeared
        scales = self.measured.refiner.scales()
        step = known or predict(self.cfg, p, self.rates, scales, self.topology).step_s
        return step * self.straggler_factor(p)

    def straggler_factor(self, p: ParallelConfig) -> float:
        """How much longer ``p``'s step gets under the straggler seen (1 without one).

        >>> from anyshard.trainer_integration.gpt.config import Config, ParallelConfig
        >>> from anyshard.trainer_integration.planning.step_cost import Rates
        >>> s = Scheduler(Config(), ParallelConfig(pp=2), Rates.nominal(), total_steps=9)
        >>> s.slow = 2.0
        >>> s.straggler_factor(ParallelConfig(pp=2)), s.straggler_factor(ParallelConfig(dp_shard=2))
        (2.0, 1.3333333333333333)
        """
        n = p.dp_replicate * p.dp_shard
        if self.slow <= 1.0 or not shares_move(p) or n < 2:
            return self.slow
        return n / ((n - 1) + 1 / self.slow)

    # -- what the loop reports -------------------------------------------------------------

    def observe(
        self,
        step_s: float,
        busy: Sequence[float] | None = None,
        data_ranks: Sequence[int] | None = None,
    ) -> None:
        """One step done under the current layout: ``step_s`` the slowest rank's wall time;
        ``busy`` each rank's own work (its step, less its waits for the others) and
        ``data_ranks`` each rank's data-parallel rank (both by global rank; for the balance
        check)."""
        entry = self._entry(self.current)
        if not entry.warm:  # the first step under a layout builds and warms it
            entry.warm = True
            return
        w = self.window
        if busy:  # how much the busiest rank outweighs the typical one of the others
            rest = sorted(busy)[:-1] or list(busy)
            w.skews.append(max(busy) / max(statistics.median(rest), 1e-9))
        if busy is not None and data_ranks is not None:
            per_data: dict[int, float] = {}
            for b, d in zip(busy, data_ranks, strict=True):
                per_data[d] = max(per_data.get(d, 0.0), b)  # a data rank's slowest member
            w.busy.append(tuple(per_data[d] for d in sorted(per_data)))
        if self.phase.name != "settled":
            entry.steps.append(step_s)
            if len(entry.steps) == self.policy.trial_steps:
                self.measured.refiner.add(self.current, entry.median)
            return
        w.recent.append(step_s)

    def switched(self, cost_s: float) -> None:
        """A switch (or trial) the loop carried out took ``cost_s`` seconds."""
        self.measured.switch_costs.append(cost_s)

    # -- the question ------------------------------------------------------------------------

    def decide(self, step: int) -> Decision:
        """What to do before step ``step`` (the loop's step counter)."""
        d = self._decide(step)
        if d.action != "keep" or d.reason:  # a decision, not a step of measuring or watching
            if d.parallel is not None:  # a new layout starts with even shares
                self.current, self.share = self._plain(d.parallel), _Shares()
                self.window.busy, self.window.skews = [], []
            if d.shares is not None:
                self.share.current = d.shares
            self.decisions.append(self._record(step, d))
        return d

    def _record(self, step: int, d: Decision) -> dict:
        out = d.event(step)
        out["candidates"] = [
            {
                "layout": name,
                "predicted_s": self.predicted(e.parallel),
                "measured_s": e.median if e.steps else None,
            }
            for name, e in self.measured.layouts.items()
        ]
        return out

    def _switch_fits(self, old: ParallelConfig, new: ParallelConfig) -> bool:
        """Whether switching from ``old`` to ``new`` stays within the memory budget: both
        layouts' state are held at once while it moves (`memory.switch_memory`)."""
        return switch_memory(self.cfg, old, new) <= self.table.budget_bytes

    def _over_budget(self, targets: Sequence[ParallelConfig]) -> str:
        """Why a switch to any of ``targets`` is out of reach (the most it would hold)."""
        need = max(switch_memory(self.cfg, self.current, p) for p in targets)
        return (
            f"would hold up to {need / 2**20:.0f} MiB a rank, over the budget of "
            f"{self.table.budget_bytes / 2**20:.0f} MiB"
        )

    def _remaining(self, step: int) -> int:
        return max(0, self.total_steps - step)

    def _median(self, p: ParallelConfig) -> float | None:
        e = self.measured.layouts.get(layout_text(p))
        return e.median if e is not None and len(e.steps) >= self.policy.trial_steps else None

    def _decide(self, step: int) -> Decision:
        if self.phase.name in ("measure", "trial"):
            return self._plan(step)
        if not self.online or len(self.window.recent) < self.policy.window:
            return Decision("keep")
        w = self.window
        recent, w.recent = statistics.median(w.recent), []
        busy, w.busy = w.busy, []
        rebalance = self._shares_online(busy)
        if rebalance is not None:
            return rebalance
        return self._drift(recent)

    # -- the phase machine: measure, trial, settle --------------------------------------------

    def _plan(self, step: int) -> Decision:
        """Measure the running layout, then trial the next candidate worth it, then settle."""
        here = self._median(self.current)
        entry = self._entry(self.current)
        if self.slow > 1 and self.shares is None and self.window.busy and len(entry.steps) == 1:
            # a layout trialled under a straggler is measured with its shares rebalanced
            rebalance, self.window.busy = self._rebalance(self.window.busy), []
            if rebalance is not None:
                entry.steps, entry.warm = [], False  # the next step warms the shares up
                return rebalance
        if here is None:  # measuring the running layout
            return Decision("keep")
        self.phase.name = "trial"
        candidate = self._next_trial(step)
        if candidate is not None:
            self.phase.trialled.add(layout_text(candidate))
            return Decision(
                "trial",
                candidate,
                reason=f"predicted {self.predicted(candidate) * 1e3:.1f} ms a step against "
                f"{here * 1e3:.1f} ms measured",
            )
        return self._settle(step)

    def _next_trial(self, step: int) -> ParallelConfig | None:
        """The next layout worth a trial: predicted faster than the best measured by the
        margin of hysteresis, and the saving it predicts over the steps left pays the switch
        (a trial that measures slower costs a switch back, paid only if the steps left pay it)."""
        pol, phase, layouts = self.policy, self.phase, self.measured.layouts
        if len(phase.trialled) >= pol.trials:
            return None
        best = min(e.median for e in layouts.values() if len(e.steps) >= pol.trial_steps)
        left = self._remaining(step) - pol.trial_steps - 1
        for row in self.table.rows:
            name = row.layout
            if name in phase.trialled or name in layouts:
                continue
            gain = best - self.predicted(row.parallel)
            if gain < pol.min_gain * best:
                continue
            # a trial switches there and, if it measures slower, back
            there = self._switch_fits(self.current, row.parallel)
            if not (there and self._switch_fits(row.parallel, self.current)):
                phase.out_of_reach.add(name)
                continue
            if gain * left > self.switch_s * (1 + pol.margin):
                return row.parallel
        return None

    def _settle(self, step: int) -> Decision:
        """Switch to the fastest measured layout if it pays; then watch (online)."""
        pol, out_of_reach = self.policy, self.phase.out_of_reach
        layouts = self.measured.layouts
        measured = {n: e for n, e in layouts.items() if len(e.steps) >= pol.trial_steps}
        best_name = min(measured, key=lambda n: measured[n].median)
        best, here = measured[best_name], measured[layout_text(self.current)]
        self.phase.name = "settled"
        w = self.window
        w.recent, w.busy, w.skews = [], [], []
        if best_name == layout_text(self.current):
            why = "the running layout is the fastest measured"
            if out_of_reach:
                targets = [r.parallel for r in self.table.rows if r.layout in out_of_reach]
                why += (
                    f"; {', '.join(sorted(out_of_reach))} predicted faster, but a switch "
                    + self._over_budget(targets)
                )
            return Decision("keep", reason=why)
        saving = here.median - best.median
        if not self._switch_fits(self.current, best.parallel):
            why = f"{best_name} is faster but switching to it " + self._over_budget([best.parallel])
            return Decision("keep", reason=why)
        pays = saving * self._remaining(step) > self.switch_s * (1 + pol.margin)
        if saving >= pol.min_gain * here.median and pays:
            return Decision(
                "switch",
                best.parallel,
                reason=f"{best.median * 1e3:.1f} ms a step measured against "
                f"{here.median * 1e3:.1f} ms; {self._remaining(step)} steps left pay the "
                f"{self.switch_s:.2f} s switch",
            )
        why = (
            "saves less than min_gain of a step (hysteresis)"
            if saving < pol.min_gain * here.median
            else "does not pay its switch"
        )
        return Decision("keep", reason=f"{best_name} is faster but {why}")

    # -- online: drift ------------------------------------------------------------------------

    def _drift(self, recent: float) -> Decision:
        """Compare a window's median step with the settled one: a drift of `Policy.drift` in
        two windows in a row re-plans (one window off may be a save or a neighbour's burst)."""
        w = self.window
        skew, w.skews = (statistics.median(w.skews) if w.skews else 1.0), []
        if w.reference is None:
            w.reference, w.skew_ref = recent, skew
            return Decision("keep")
        if abs(recent - w.reference) <= self.policy.drift * w.reference:
            w.drifted = 0
            return Decision("keep")
        w.drifted += 1
        if w.drifted < 2:  # one window off may be a save or a neighbour's burst: wait one more
            return Decision("keep")
        w.drifted = 0
        return self._replan(recent, skew)

    def _replan(self, recent: float, skew: float) -> Decision:
        """The machine changed under the job: what was measured before no longer holds. Where
        one rank slowed, the model refined so far still holds for the others; otherwise it is
        refined afresh from what the current layout measures now."""
        pol, m, w = self.policy, self.measured, self.window
        was = w.reference if w.reference is not None else recent  # set: `_drift` calls it
        slow = skew / (w.skew_ref or 1.0)
        again = _Layout(self.current, [recent] * pol.trial_steps, warm=True)
        before = {n: e.median for n, e in m.layouts.items() if len(e.steps) >= pol.trial_steps}
        m.layouts = {layout_text(self.current): again}
        if slow > 1 + pol.imbalance:  # one rank slowed: the model, refined so far, still holds
            m.known = {**m.known, **before} if m.slow == 1.0 else m.known
            m.slow = m.slow * slow
            why = f"rank skew grew {slow:.2f}x"
        else:  # the whole machine changed: refine from what the current layout measures now
            m.refiner = Refiner(self.cfg, self.rates, self.topology)
            m.refiner.add(self.current, recent)
            m.slow, m.known, why = 1.0, {}, "no one rank"
        self.phase = _Phase(name="trial")
        w.reference = None
        # the shares stay; what was measured under the ones before no longer holds
        self.share.judging, self.share.blocked, self.share.before = None, None, None
        return Decision(
            "keep",
            reason=f"re-plan: the step drifted from {was * 1e3:.1f} ms to {recent * 1e3:.1f} ms "
            f"({why})",
        )

    # -- online: data shares ------------------------------------------------------------------

    def _shares_online(self, busy: list[tuple[float, ...]]) -> Decision | None:
        """A window's data-rank own work: judge the last move if this window measured it
        (`_judge`), else move the shares where the last two windows call for it
        (`_rebalance`); the next window judges the move."""
        sh, pol = self.share, self.policy
        sh.steps = (sh.steps + busy)[-2 * pol.window :]
        if sh.judging is not None:
            return self._judge()
        if len(sh.steps) < 2 * pol.window:  # one window may be a neighbour's burst
            return None
        move = self._rebalance(sh.steps)
        if move is not None:
            sh.judging, sh.steps = (sh.current, sh.steps), []
            self.window.reference = None  # measured afresh under the new shares
        return move

    def _judge(self) -> Decision | None:
        """The window after a move: shares that made the busiest data rank's own work per step
        longer, beyond the bound the steps' noise sets (`balance.worse`, at least
        `Policy.noise`), go back; a like move must then promise more (`_rebalance`). Own work,
        not the step's wall time: what a share changes is each rank's work; the wall time also
        holds the waits for the others. A move that stays gives the lines their second point."""
        sh, pol = self.share, self.policy
        assert sh.judging is not None  # internal: `_shares_online` checks
        (before, steps), sh.judging = sh.judging, None
        if not steps or not sh.steps or len(steps[0]) != len(sh.steps[0]):
            return None
        now, was = [max(b) for b in sh.steps], [max(b) for b in steps]
        n = len(steps[0])
        old = before or tuple([self.cfg.train.global_batch // n] * n)
        bad, bound = worse(was, now, floor=pol.noise, z=pol.z)
        if not bad:
            sh.before = ([statistics.median(c) for c in zip(*steps, strict=True)], old)
            return None
        sh.blocked = (sh.moved_off, sh.promised)
        sh.steps = []
        self.window.reference = None
        return Decision(
            "rebalance",
            shares=old,
            reason=f"shares {list(sh.current or ())} measured {statistics.median(now) * 1e3:.1f} "
            f"ms of own work on the busiest data rank against {statistics.median(was) * 1e3:.1f} "
            f"ms before them, worse beyond the noise bound ({bound:.1%}): back",
        )

    def _rebalance(self, busy: list[tuple[float, ...]]) -> Decision | None:
        """Shares that balance the data ranks' measured own work (`balance.propose`: straight to
        the balance of each rank's fitted line, or to even shares where they are as good),
        where the saving predicted beats the floor `Policy.imbalance` and the measured noise;
        None otherwise, or where the last move that went back took from the same rank and this
        one promises no more than it did by the bound. Pipelines keep even shares (their
        microbatches split each rank's share); so do experts, whose ranks route tokens to each
        other."""
        p, pol, sh = self.current, self.policy, self.share
        if (
            not busy
            or not shares_move(p)
            or len(busy[0]) < 2
            or any(len(b) != len(busy[0]) for b in busy)
        ):
            return None
        n, gb = len(busy[0]), self.cfg.train.global_batch
        shares = self.shares or tuple([gb // n] * n)
        if sum(shares) != gb or len(shares) != n:
            return None
        move = propose(busy, shares, gb, floor=pol.imbalance, z=pol.z, before=sh.before)
        if move is None:
            return None
        if sh.blocked is not None and sh.blocked[0] == move.slow:
            if move.gain <= sh.blocked[1] + move.bound:
                return None
        sh.moved_off, sh.promised = move.slow, move.gain
        own = [statistics.median(c) for c in zip(*busy, strict=True)]
        mean = sum(own) / n
        where = "back to even, " if move.shares == tuple([gb // n] * n) else ""
        return Decision(
            "rebalance",
            shares=move.shares,
            reason=f"data rank {move.slow} works {own[move.slow] / mean:.2f}x the mean per step; "
            f"shares {where}{list(move.shares)}, are predicted to save {move.gain:.1%} of the "
            f"busiest rank's own work a step (bound {move.bound:.1%}: the floor, or {pol.z:g} "
            "standard errors of the steps' noise)",
            slow=move.slow,
        )
