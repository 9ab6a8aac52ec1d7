"""Speculator: per step, which running requests draft how many tokens, and what becomes of their drafts."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

from litellm_pipeline.engine.request import Request
from litellm_pipeline.telemetry import EventBus, SpeculationVerified

log = logging.getLogger(__name__)

# adaptive drafting weighs, per step, the tokens a draft is expected to add against what its rows cost on this
# machine, measured: a request's acceptance is a per-token probability ``a`` (kept / (kept + first misses), older
# verifications weighing _DECAY less each, a new request starting from the engine's recent rate as _PRIOR tokens);
# a draft of k tokens is expected to yield 1 + a + ... + a^k tokens (a request given no draft counts a miss); a
# step's cost is the moving average of the seconds of earlier steps with as many requests and verified rows,
# interpolated between those seen, plus the proposer's seconds for as many tokens asked (measured alike)
_PRIOR = 2.0
_DECAY = 0.9
# a step slower than the average moves it a little, a faster one a lot: a shared machine's noise only ever adds
# time. The first step of a shape (requests, rows) may pay for warming up (kernels, buffers, plans), and a shape
# judged too dear is not run again to correct it: its first time is held back, and the cheaper of its first two
# times starts its average
_SLOWER_WEIGHT = 0.1
_FASTER_WEIGHT = 0.5
# a draft must promise this much more throughput than the step without it (a loss weighs more than a missed gain)
_MARGIN = 1.03
# now and then a decision takes another k than the best (each in turn), so the costs and acceptances it decides on
# stay measured: every _EXPLORE_EVERY-th decision may, where what such tries cost beyond the best (as estimated)
# stays within _EXPLORE_SHARE of the measured step time
_EXPLORE_EVERY = 8
_EXPLORE_SHARE = 0.01
# the costs a decision reads are rebuilt from the measurements every this many steps (they drift slowly; reading
# them costs a few microseconds where a tiny model's step takes a hundred)
_REFRESH = 8
# a request that decided not to draft decides again after 1, 2, 4 ... output tokens, up to this many: where drafts
# do not pay, the decision itself costs next to nothing
_MAX_WAIT = 64


@dataclass(frozen=True)
class SpeculativeSettings:
    """conf/speculative, as plain values: ``method`` (a ``proposer`` registry name, or ``none``), ``k`` the most
    tokens drafted per step, ``adaptive``: draft only as many tokens as pay for themselves on this machine (measured
    step times against each request's acceptance; False: k every step)."""

    method: str = "none"
    k: int = 4
    adaptive: bool = True
    disable_by_batch_size: int | None = 2  # no drafts while more requests than this run (None: always draft)


@dataclass
class SpecState:
    """One request's drafting: the most tokens it may draft, and what its verifications kept."""

    k_max: int
    kept: float = 0.0  # decayed counts of drafted tokens kept and of first misses
    missed: float = 0.0
    resume_at: int = 0  # the output length at which it decides again (after a decision not to draft)
    wait: int = 1
    # a free proposer's draft made in a step the request did not draft (see Speculator.propose), and the output
    # length it was made at: the tokens generated since tell what a verification would have kept, for nothing
    shadow: list[int] | None = None
    shadow_at: int = 0
    shadow_seen: int = 0  # its tokens already learned
    probe: bool = True  # it still looks up at each decision: until a lookup found nothing or a shadow missed at once


class StepCosts:
    """Seconds per engine step of decodes and drafts alone, by (requests, rows): moving averages of the steps seen.
    A row count not seen is interpolated between its neighbours, or extrapolated along the last two seen (with one
    seen, as cheap as it: tried once, then known)."""

    def __init__(self) -> None:
        self._seen: dict[int, dict[int, float]] = {}
        self.seen = self.measured = 0  # (requests, rows) keys seen; observations

    def observe(self, n: int, rows: int, seconds: float) -> None:
        by_rows = self._seen.setdefault(n, {})
        old = by_rows.get(rows)
        self.measured += 1
        if old is None:
            self.seen += 1
            by_rows[rows] = seconds
        else:
            by_rows[rows] = old + (_SLOWER_WEIGHT if seconds > old else _FASTER_WEIGHT) * (seconds - old)

    def known(self, n: int, rows: int) -> bool:
        return rows in self._seen.get(n, ())

    def estimate(self, n: int, rows: int) -> float | None:
        by_rows = self._seen.get(n)
        if not by_rows:
            return None
        if rows in by_rows:
            return by_rows[rows]
        below = [r for r in by_rows if r < rows]
        above = [r for r in by_rows if r > rows]
        if below and above:
            lo, hi = max(below), min(above)
            return by_rows[lo] + (by_rows[hi] - by_rows[lo]) * (rows - lo) / (hi - lo)
        if not below:
            return by_rows[min(above)]
        below.sort()
        last = below[-1]
        if len(below) == 1:
            return by_rows[last]
        prev = below[-2]
        slope = max(0.0, (by_rows[last] - by_rows[prev]) / (last - prev))
        return by_rows[last] + slope * (rows - last)


def expected_tokens(k: int, a: float) -> float:
    """Tokens a step yields for a request drafting k tokens, each kept with probability a: 1 + a + ... + a^k."""
    return sum(a ** i for i in range(k + 1))


class Speculator:
    """Built by the config builder when ``speculative.method`` is not ``none``; the engine calls it under its lock.

    ``propose`` (before the scheduler runs) gives eligible running requests a ``draft``; ``fill`` (after the
    scheduler grew their KV for it) lets a proposer that drafts with the target's KV write the tokens;
    ``verified`` (in the postprocess) learns what verification kept."""

    def __init__(self, proposer, settings: SpeculativeSettings, max_model_len: int, bus: EventBus | None = None):
        self.proposer = proposer
        self.k = settings.k
        self.adaptive = settings.adaptive
        self.max_batch = settings.disable_by_batch_size
        self.max_model_len = max_model_len
        self.bus = bus if bus is not None else EventBus()
        self.costs = StepCosts()
        self.kept, self.missed = 1.0, 1.0  # the engine's recent acceptance, as decayed counts (no evidence: 1/2)
        self.failures = 0  # proposer calls that raised
        self._decisions = self._explored = 0
        self._explore_budget = 0.0  # seconds that tries of another k may still cost
        self._curves: dict[int, list[float]] = {}  # by requests in the step: see _curve
        self._stamp = (-1, 0)  # the costs' (row counts seen, measurements) when the curves were built
        self.draft_costs = StepCosts()  # the proposer's seconds per step (propose and fill), by tokens asked
        self._first: dict[tuple[bool, int, int], float] = {}  # a shape's first time, held back (see _record)
        # the current step: tokens asked of the proposer, tokens verified, the proposer's seconds
        self._asked = self._drafted = 0
        self._draft_s = 0.0
        self._measure = 0  # requests in the current step if its time counts (see observe)
        self._draft_price = getattr(proposer, "draft_price", None)  # a tier draft's Price per token
        self._fills = getattr(proposer, "fill", None)
        self._releases = getattr(proposer, "release", None)
        # a proposer that says its drafts cost next to nothing (``free = True``: a lookup, no model) is asked for the
        # requests that do not draft too, so their acceptance stays measured where drafting has stopped
        self._shadows = bool(getattr(proposer, "free", False)) and self._fills is None

    def _state(self, req: Request) -> SpecState:
        st = req.spec_state
        if st is None:
            asked = req.spec_tokens
            st = req.spec_state = SpecState(self.k if asked is None else min(asked, self.k))
            share = _PRIOR / (self.kept + self.missed)
            st.kept, st.missed = self.kept * share, self.missed * share
        return st

    def propose(self, running: Sequence[Request]) -> None:
        self._asked = self._drafted = 0
        self._draft_s = 0.0
        for r in running:
            if r.draft:  # proposed for a step it was not scheduled in
                r.draft = []
        self._measure = 0
        n = len(running)
        if self.max_batch is not None and n > self.max_batch:
            return  # a full batch reads the weights once for many tokens already: verification would cost more
        reqs, ks = [], []
        decoding = True
        for r in running:
            if r.num_computed + 1 != r.num_tokens:
                decoding = False
                continue  # mid-prompt
            if r.matcher is not None:
                continue  # constrained (its matcher sees one token at a time)
            st = self._state(r)
            n_out = len(r.output_ids)
            if st.shadow is not None and n_out > st.shadow_at:
                self._settle(r, st)
            if n_out < st.resume_at:
                continue  # it decided not to draft: it decides again at this output length
            # the step yields up to k + 1 tokens: none past max_tokens or the context
            k = min(st.k_max, r.params.max_tokens - n_out - 1, self.max_model_len - r.num_tokens - 1)
            if k > 0:
                reqs.append(r)
                ks.append(k)
        if reqs and self.adaptive:
            if decoding:  # a step of decodes (and drafts) alone, where something is decided: what it costs counts
                self._measure = n
            if self._shadows:  # requests still probing look first (and keep a shadow); the others decide as usual
                probe_r, probe_k, rest_r, rest_k = [], [], [], []
                for r, k in zip(reqs, ks):
                    if r.spec_state.probe:
                        probe_r.append(r)
                        probe_k.append(k)
                    else:
                        rest_r.append(r)
                        rest_k.append(k)
                if probe_r:
                    self._look_then_decide(n, probe_r, probe_k)
                if not rest_r:
                    return
                reqs, ks = rest_r, rest_k
            reqs, ks = self._worth(n, reqs, ks)
        if not reqs:
            return
        t0 = time.perf_counter()
        try:
            drafts = self.proposer.propose(reqs, ks)
        except Exception:  # drafts are optional: a failing proposer costs its speed-up, never a request
            self._failed("propose")
            return
        finally:
            self._draft_s += time.perf_counter() - t0
        self._asked = sum(ks)
        for r, k, d in zip(reqs, ks, drafts):
            if d:
                r.draft = list(d[:k])
            else:  # asked and given nothing: the step yields one token, as where the first drafted one misses
                self._learn(r, 0.0, 1.0)

    def _look_then_decide(self, n: int, reqs: list[Request], ks: list[int]) -> None:
        """A free proposer drafts for every deciding request first (one call); a request whose lookup found nothing
        counts a miss and waits, the others draft as much of theirs as pays; what is not drafted becomes the
        request's shadow (unless one is pending), so what it would have kept is learned for nothing."""
        try:  # its time stays in the step's: paid whatever is drafted, it is no cost of drafted tokens
            drafts = self.proposer.propose(reqs, ks)
        except Exception:
            self._failed("propose")
            return
        found, limits = [], []
        for r, k, d in zip(reqs, ks, drafts):
            if d:
                found.append((r, d))
                limits.append(min(k, len(d)))
            else:  # nothing found: a draft would have yielded the one token a step yields anyway
                self._learn(r, 0.0, 1.0)
                self._wait(r.spec_state, len(r.output_ids))
                r.spec_state.probe = False
        if not found:
            return
        picked, picked_ks = self._worth(n, [r for r, _ in found], limits)  # a subsequence of them, in order
        j = 0
        for r, d in found:
            st = r.spec_state
            if j < len(picked) and picked[j] is r:
                r.draft = list(d[: picked_ks[j]])
                st.shadow = None  # its verification tells what the shadow would
                j += 1
            elif st.shadow is None:
                st.shadow, st.shadow_at, st.shadow_seen = list(d), len(r.output_ids), 0

    def _settle(self, r: Request, st: SpecState) -> None:
        """The tokens generated since the request's shadow draft against the draft, learned as a verification of it
        would have been: each token it got right as it comes, the first miss (if any) once."""
        shadow, at = st.shadow, st.shadow_at + st.shadow_seen
        got = r.output_ids[at : st.shadow_at + len(shadow)]
        kept, miss = 0, False
        for d, t in zip(shadow[st.shadow_seen :], got):
            if d != t:
                miss = True
                break
            kept += 1
        st.shadow_seen += kept
        if miss or st.shadow_seen == len(shadow):
            st.shadow = None
        if kept or miss:
            self._learn(r, kept, 1.0 if miss else 0.0)
        if miss and not kept:  # wrong from its first token: this request stops looking up (and decides as others do)
            st.probe = False

    @staticmethod
    def _wait(st: SpecState, n_out: int) -> None:
        """Not drafting: decided again after 1, 2, 4 ... output tokens (up to _MAX_WAIT) while it stays so."""
        st.resume_at = n_out + st.wait
        st.wait = min(2 * st.wait, _MAX_WAIT)

    def _curve(self, n: int) -> list[float] | None:
        """What a step of ``n`` requests costs with 0, 1, 2 ... tokens asked (rows and proposer), grown on demand and
        rebuilt after _REFRESH measurements or a row count not seen before; None while no step of ``n`` was measured."""
        stamp = (self.costs.seen + self.draft_costs.seen, self.costs.measured + self.draft_costs.measured)
        if stamp[0] != self._stamp[0] or stamp[1] - self._stamp[1] >= _REFRESH:
            self._curves.clear()
            self._stamp = stamp
        curve = self._curves.get(n)
        if curve is None:
            base = self.costs.estimate(n, n)
            if base is None:
                return None
            curve = self._curves[n] = [base]
        return curve

    def _cost(self, n: int, curve: list[float], extra: int) -> float:
        while len(curve) <= extra:  # more rows never cost less than fewer, whatever the noise measured
            j = len(curve)
            curve.append(max(self.costs.estimate(n, n + j), curve[0]) + (self.draft_costs.estimate(0, j) or 0.0))
        return curve[extra]

    def _worth(self, n: int, reqs: list[Request], ks: list[int]) -> tuple[list[Request], list[int]]:
        """Each request's k (in order, given those before it) that maximizes the step's expected tokens per second
        under the measured costs; 0 unless it beats no draft by _MARGIN. No cost known yet for ``n`` requests: no
        drafts (this step measures it)."""
        curve = self._curve(n)
        if curve is None:
            return [], []
        tokens, asked = float(n), 0
        out_r, out_k = [], []
        for r, k_max in zip(reqs, ks):
            st = r.spec_state
            a = st.kept / (st.kept + st.missed)
            self._cost(n, curve, asked + k_max)  # the curve grown as far as this request may look
            best_k, best, best_gain = 0, tokens / curve[asked] * _MARGIN, 0.0
            gain, p = 0.0, 1.0  # a + ... + a^k
            for k in range(1, k_max + 1):
                p *= a
                gain += p
                rate = (tokens + gain) / curve[asked + k]
                if rate > best:
                    best_k, best, best_gain = k, rate, gain
            self._decisions += 1
            if self._decisions >= _EXPLORE_EVERY:  # each other k in turn, when the budget covers it
                self._decisions = 0
                other = (best_k + 1 + self._explored % k_max) % (k_max + 1)
                extra = self._cost(n, curve, asked + other) - self._cost(n, curve, asked + best_k)
                if extra <= self._explore_budget:
                    self._explore_budget -= max(extra, 0.0)
                    self._explored += 1
                    best_k, best_gain = other, expected_tokens(other, a) - 1
            if not best_k:
                self._wait(st, len(r.output_ids))
                continue
            st.wait = 1
            out_r.append(r)
            out_k.append(best_k)
            tokens += best_gain
            asked += best_k
        return out_r, out_k

    def observe(self, n: int, seconds: float) -> None:
        """The step ran ``n`` requests in ``seconds``. Where they were the decoding requests that ``propose`` decided
        for (no prompt chunk beside them), the time counts, the proposer's part apart: the rest is kept by the rows
        verified, the proposer's part by the tokens asked of it (a prompt lookup that found nothing verifies no
        rows but was asked; a draft model's work follows what it was asked)."""
        if n and n == self._measure:
            self._record(False, n, n + self._drafted, seconds - self._draft_s)
            if self._asked:
                self._record(True, 0, self._asked, self._draft_s)
        if self.adaptive:
            self._explore_budget = min(self._explore_budget + _EXPLORE_SHARE * seconds, 1.0)
        self._asked = self._drafted = 0
        self._draft_s = 0.0

    def _record(self, draft: bool, n: int, rows: int, seconds: float) -> None:
        """A measured step into its StepCosts; a shape's first time is held back until its second, and the cheaper
        of the two starts the average (until then the shape is estimated from its neighbours, so it runs again)."""
        costs = self.draft_costs if draft else self.costs
        key = (draft, n, rows)
        if costs.known(n, rows):
            costs.observe(n, rows, seconds)
        elif key in self._first:
            costs.observe(n, rows, min(seconds, self._first.pop(key)))
        else:
            self._first[key] = seconds

    def fill(self, schedule: Sequence[tuple[Request, int]]) -> bool:
        """The proposer's ``fill`` over the scheduled drafts (their KV grown); True if it ran (drafts may be
        shorter now)."""
        if self._fills is None:
            return False
        reqs = [r for r, _ in schedule if r.draft]
        if not reqs:
            return False
        t0 = time.perf_counter()
        try:
            self._fills(reqs)
        except Exception:
            self._failed("fill")
            for r in reqs:
                r.draft = []
        else:
            for r in reqs:
                if not r.draft:  # the draft ended at once (its first token ends the request): the step yields one
                    self._learn(r, 0.0, 1.0)  # token, as where the first drafted one misses
        self._draft_s += time.perf_counter() - t0
        return True

    def _failed(self, what: str) -> None:
        self.failures += 1
        if self.failures <= 3 or self.failures % 1000 == 0:  # said, not repeated every step
            log.exception("speculative decoding: proposer %s.%s raised (failure %d); this step runs without drafts",
                          type(self.proposer).__name__, what, self.failures)

    def _learn(self, req: Request, kept: float, missed: float) -> None:
        self.kept = self.kept * _DECAY + kept
        self.missed = self.missed * _DECAY + missed
        st = req.spec_state
        if st is not None:
            st.kept = st.kept * _DECAY + kept
            st.missed = st.missed * _DECAY + missed

    def release(self, req: Request) -> None:
        """The request ended: what the proposer keeps for it goes."""
        if self._releases is not None:
            self._releases(req)

    def verified(self, outcome: Sequence[tuple[Request, int, int]]) -> None:
        """``(request, drafted, accepted)`` per speculating request of the step."""
        per_pos = [0] * self.k
        drafted_total = accepted_total = 0
        draft_price = self._draft_price
        for req, drafted, accepted in outcome:
            req.num_draft_tokens += drafted
            req.num_accepted_tokens += accepted
            ts = req.tierset
            if ts is not None:  # what the rejected rows and the draft cost at list prices (reported, not charged)
                req.spec_monetary += ((drafted - accepted) * ts.price.output_1k
                                      + drafted * (draft_price.output_1k if draft_price is not None else 0.0)) / 1000
            drafted_total += drafted
            accepted_total += accepted
            for j in range(min(accepted, self.k)):
                per_pos[j] += 1
            self._drafted += drafted
            # the first miss ends what a draft can tell: kept tokens are successes, a miss (if any) one failure
            self._learn(req, accepted, 1.0 if accepted < drafted else 0.0)
        if self.bus.enabled and outcome:
            self.bus.publish(SpeculationVerified(len(outcome), drafted_total, accepted_total, tuple(per_pos)))
